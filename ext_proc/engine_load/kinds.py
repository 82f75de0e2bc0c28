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

    It writes the offsets into the registry's load arrays from :meth:`run` until cancelled, describes
    what it knows of an endpoint (``/debug/endpoints``) and tells the requests each engine with a fresh
    sample reports waiting, by address (the autoscaling signals). Flow control reads its fresh samples
    (:meth:`fresh_samples`, again when ``version`` changed)."""

    version: int

    async def run(self) -> None:
        """Write each endpoint's load offset into the registry's load arrays, until cancelled."""
        ...

    def describe(self, state: EndpointState) -> dict[str, object]:
        """What it knows of ``state``'s endpoint, as JSON values (``/debug/endpoints``)."""
        ...

    def waiting(self) -> dict[str, float]:
        """The requests each engine with a fresh sample reported waiting, by address."""
        ...

    def fresh_samples(self) -> dict[str, list[tuple[float, float]]]:
        """``(waiting, kv_usage)`` of every pickable engine with a fresh sample, per role."""
        ...


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
