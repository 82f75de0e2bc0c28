"""The ``engine_metrics`` section: the engine load signal's scrapes, and their checks.

See docs/configuration.md."""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.checks import ConfigError, in_range
from ext_proc.engine_load.names import EngineKind
from ext_proc.request import MAX_OUTPUT_BUDGET

MIN_SCRAPE_INTERVAL = 0.01
"""Lower bound of ``engine_metrics.interval_seconds`` (seconds)."""


@dataclass(frozen=True)
class EngineMetricsConfig:
    """The ``engine_metrics`` section: the engine load signal's scrape settings.

    The signal (docs/routing.md "Engine load signal") is every pickable engine's Prometheus page,
    scraped and blended into the load the decision reads.

    ``enabled``: scrape at all (off: local accounting alone, as before the section existed).
    ``interval_seconds``: time between scrapes of one engine. ``timeout_seconds``: bound of one
    scrape. ``stale_after_intervals``: a sample older than this many intervals counts as unknown
    (local accounting alone). ``engine``: the engines' metric names (``auto``: vLLM's, which the
    simulator uses, or SGLang's, whichever the page has). ``path`` and ``port`` (0: the endpoint's
    ``metrics_port`` metadata, else its serving port) locate the page; ``max_bytes`` caps what is read
    of it. ``queue_weight`` scales the queue term; ``queued_request_tokens`` is what one queued request
    counts (tokens) when the gateway has no request in flight to take the mean of.
    ``models_interval_seconds``: how often each engine's ``GET /v1/models`` (on its serving port) is
    asked which models it serves (vLLM: the base model and its adapters, with their ``parent``), for the
    endpoints that declare none (0: never; docs/routing.md "Routing by model").
    """

    enabled: bool = False
    interval_seconds: float = 0.25
    timeout_seconds: float = 1.0
    stale_after_intervals: int = 4
    engine: EngineKind = EngineKind.AUTO
    path: str = "/metrics"
    port: int = 0
    max_bytes: int = 4 * 1024 * 1024
    queue_weight: float = 0.0
    queued_request_tokens: int = 2048
    models_interval_seconds: float = 0.0

    @property
    def stale_after_seconds(self) -> float:
        """Age (seconds) beyond which a sample counts as unknown."""
        return self.stale_after_intervals * self.interval_seconds

    def check(self) -> None:
        """Raise :class:`ConfigError` for a key out of range or a bad ``path``.

        The error names the first key out of range, or a ``path`` that is not an absolute URL path."""
        key = "engine_metrics"
        in_range(f"{key}.interval_seconds", self.interval_seconds, MIN_SCRAPE_INTERVAL, 60)
        in_range(f"{key}.timeout_seconds", self.timeout_seconds, 0, 60, low_open=True)
        in_range(f"{key}.stale_after_intervals", self.stale_after_intervals, 1, 1000, kind="an integer")
        if not self.path.startswith("/") or any(c.isspace() for c in self.path):
            raise ConfigError(
                f"{key}.path: {self.path!r} is not allowed; use an absolute URL path such as /metrics"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"{key}.port: must be 0 (metadata or serving port) or a port in 1..65535")
        in_range(f"{key}.max_bytes", self.max_bytes, 1024, 256 * 1024 * 1024, kind="an integer")
        in_range(f"{key}.queue_weight", self.queue_weight, 0, 100)
        in_range(f"{key}.models_interval_seconds", self.models_interval_seconds, 0, 3600)
        in_range(
            f"{key}.queued_request_tokens",
            self.queued_request_tokens,
            0,
            MAX_OUTPUT_BUDGET,
            kind="an integer",
        )
