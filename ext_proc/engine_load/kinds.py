"""The load-signal seam: the :class:`LoadSignal` protocol and its kinds, one module each.

The load the decision reads is the local accounting (:mod:`ext_proc.load`: what this gateway placed,
always on) plus the offsets a load signal writes into the registry's load arrays. Today's one kind,
``engine-metrics`` (:class:`~ext_proc.engine_load.scraper.EngineScraper`), runs with
``engine_metrics.enabled``; the engine types it reads (``engine_metrics.engine``) are the table
:data:`~ext_proc.engine_load.names.NAMES`. A new kind is a module with its signal, and one line in
:data:`KINDS`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ext_proc.engine_load.scraper import EngineScraper

if TYPE_CHECKING:
    from ext_proc.engine_load.config import EngineMetricsConfig
    from ext_proc.metrics import Metrics
    from ext_proc.registry import EndpointState, Registry


class LoadSignalKind(enum.StrEnum):
    """The kinds of load signal beside the local accounting."""

    ENGINE_METRICS = "engine-metrics"


class LoadSignal(Protocol):
    """A load signal: writes each endpoint's load offset into the registry until cancelled.

    It writes the offsets into the registry's load arrays from :meth:`run` until cancelled, and
    describes what it knows of an endpoint (``/debug/endpoints``). Flow control reads its fresh samples
    (:meth:`fresh_samples`, again when ``version`` changed)."""

    version: int

    async def run(self) -> None: ...

    def fresh_samples(self) -> dict[str, list[tuple[float, float]]]: ...

    def describe(self, state: EndpointState) -> dict[str, object]: ...


class LoadSignalBuilder(Protocol):
    """Builds one kind of load signal over ``registry`` from its configuration section.

    ``sampled`` is told each engine's prefix-cache counters ``(address, queries, hits)`` (tokens since
    it started, ``None`` when unknown), for the router's prefix index."""

    def __call__(
        self,
        registry: Registry,
        config: EngineMetricsConfig,
        metrics: Metrics,
        sampled: Callable[[str, float | None, float | None], None],
    ) -> LoadSignal: ...


KINDS: dict[LoadSignalKind, LoadSignalBuilder] = {
    LoadSignalKind.ENGINE_METRICS: EngineScraper,  # the engines' own /metrics, scraped and blended
}
"""How to build each kind of load signal."""
