"""The ``envoy_health`` section: where and how often Envoy's admin is polled, and its check.

A leaf (no HTTP client): :mod:`ext_proc.config` reads it; :mod:`ext_proc.envoy_health` polls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ext_proc.checks import ConfigError, check_url_port, in_range


@dataclass(frozen=True)
class EnvoyHealthConfig:
    """The ``envoy_health`` section: Envoy's own view of endpoint health, from its polled admin.

    See docs/operations.md "Decode ejection". Envoy's admin ``/clusters`` is polled.

    ``admin_url``: the base URL of the admin of the Envoy this server answers (``""``: off; the chart
    sets ``http://127.0.0.1:9901``, its Envoy's loopback admin in the same pod). Every
    ``interval_seconds`` one GET bounded by ``timeout_seconds``; a host Envoy marks as failed (outlier
    ejection, active health check, EDS unhealthy) is left out of the candidates until Envoy takes it back.
    """

    admin_url: str = ""
    interval_seconds: float = 1.0
    timeout_seconds: float = 1.0

    def check(self) -> None:
        """Raise :class:`ConfigError` for a key out of range or a bad ``admin_url``.

        The error names the first key out of range, or an ``admin_url`` that is not a base URL."""
        key = "envoy_health"
        if self.admin_url and not re.fullmatch(r"https?://[^\s/]+", self.admin_url):
            raise ConfigError(
                f"{key}.admin_url: {self.admin_url!r} is not a base URL such as http://127.0.0.1:9901 "
                "(empty: off)"
            )
        check_url_port(f"{key}.admin_url", self.admin_url)
        in_range(f"{key}.interval_seconds", self.interval_seconds, 0.05, 60)
        in_range(f"{key}.timeout_seconds", self.timeout_seconds, 0, 60, low_open=True)
