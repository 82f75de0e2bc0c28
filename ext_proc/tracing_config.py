"""The ``tracing`` section: OpenTelemetry spans exported over OTLP (gRPC).

A leaf (no SDK, no gRPC): :mod:`ext_proc.config` reads it; :mod:`ext_proc.tracing` traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from ext_proc.checks import ConfigError, check_url_port, in_range


@dataclass(frozen=True)
class TracingConfig:
    """The ``tracing`` section: OpenTelemetry spans exported over OTLP (gRPC).

    ``otlp_endpoint``: the collector's OTLP gRPC address, ``http://host:4317`` (``https://``: TLS);
    ``""`` (the default): tracing off, nothing built, nothing sent. ``sampling_ratio`` in [0, 1]: the
    share of requests without a sampled caller that are recorded. ``service_name``: the spans'
    ``service.name``. Read at start (a change needs a restart).
    """

    otlp_endpoint: str = ""
    sampling_ratio: float = 1.0
    service_name: str = "pd-extproc"

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first key out of range."""
        endpoint = self.otlp_endpoint
        if endpoint:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(
                    f"tracing.otlp_endpoint: {endpoint!r} is not allowed; use http://host:port "
                    "(https:// for TLS), or an empty string: off"
                )
            check_url_port("tracing.otlp_endpoint", endpoint)
        in_range("tracing.sampling_ratio", self.sampling_ratio, 0.0, 1.0)
        if not self.service_name:
            raise ConfigError("tracing.service_name: must not be empty")
