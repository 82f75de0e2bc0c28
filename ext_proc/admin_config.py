"""The ``admin`` section: what the admin HTTP endpoint serves.

A leaf (no HTTP server): :mod:`ext_proc.config` reads it; :mod:`ext_proc.admin` serves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdminConfig:
    """The admin HTTP endpoint on ``metrics_listen`` (the ``admin`` section).

    ``debug_endpoints``: serve ``/debug/endpoints`` (every endpoint's address, health and live
    load), ``/debug/shared`` and ``/debug/explain`` (the decision a request would get now, and why);
    ``False`` answers them 404. ``/metrics`` and ``/healthz`` are always served.
    """

    debug_endpoints: bool = True
