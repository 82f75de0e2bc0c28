"""The ``xds`` section: pd-extproc as Envoy's EDS server, and its check (docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.checks import in_range

MAX_NO_ENVOY_DELAY = 60.0
"""Upper bound of ``xds.no_envoy_delay_seconds`` (seconds)."""


@dataclass(frozen=True)
class XdsConfig:
    """pd-extproc as Envoy's EDS server (see docs/deploy/envoy.md "EDS from pd-extproc").

    ``serve_eds``: serve the prefill and decode clusters' endpoints over ADS on the gRPC port
    (``listen``), for ``envoy/envoy-ads.yaml``; an endpoint becomes pickable only once every
    subscribed Envoy has ACKed a version holding it healthy. ``no_envoy_delay_seconds``: while no
    Envoy subscribes to its cluster, it becomes pickable this long after it was published instead.
    """

    serve_eds: bool = False
    no_envoy_delay_seconds: float = 2.0

    def check(self) -> None:
        """Raise :class:`~ext_proc.checks.ConfigError` when ``no_envoy_delay_seconds`` is out of range."""
        in_range("xds.no_envoy_delay_seconds", self.no_envoy_delay_seconds, 0, MAX_NO_ENVOY_DELAY)
