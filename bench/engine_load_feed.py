"""The engine load signal (``engine_metrics``) in virtual time: each replica scrapes the simulated engines.

:class:`PageScraper` is pd-extproc's own :class:`~ext_proc.engine_load.scraper.EngineScraper` (its
ticks, staleness, parsing and blend into the registry's load), whose page of an engine is that simulated
engine's ``/metrics`` page (:mod:`sim.metrics`, the page Benchmark 5's replicas scrape over HTTP),
rendered in process at the engines' virtual time: only the HTTP request is left out. Its configuration
is ``engine_metrics`` at its defaults (every 0.25 s, ``queue_weight`` 0), enabled.

:class:`Scraped` is a router (one replica or several) whose every replica runs such a scraper on its
own registry, as every gateway replica with ``engine_metrics.enabled`` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from bench.prefix_peers import Oracle, PdExtproc, Placed, Placing, Replicas
from ext_proc.engine_load.config import EngineMetricsConfig
from ext_proc.engine_load.scraper import EngineScraper
from ext_proc.metrics import Metrics
from ext_proc.registry import Registry
from sim.engine import Engine

ENGINE_METRICS = EngineMetricsConfig(enabled=True)
"""``engine_metrics``, enabled, every other key its default."""


class PageScraper(EngineScraper):
    """The engine load signal of one replica, reading the simulated engines' pages in process.

    It blends into ``registry``; ``engines`` by address; ``sampled`` is told each sample's prefix-cache
    counters, as the server tells its router."""

    def __init__(
        self,
        registry: Registry,
        engines: Mapping[str, Engine],
        metrics: Metrics,
        sampled: Callable[[str, float | None, float | None], None] | None = None,
    ) -> None:
        clock = next(iter(engines.values())).clock.now
        super().__init__(registry, ENGINE_METRICS, metrics, sampled, clock)
        self._engines = engines

    async def _fetch(self, url: str) -> bytes:
        """The simulated engine's page that ``url`` names (``http://ADDRESS/metrics``)."""
        address = url.removeprefix("http://").removesuffix(ENGINE_METRICS.path)
        return self._engines[address].metrics.render()


def scraper_of(replica: Placing, engines: Mapping[str, Engine]) -> PageScraper:
    """The engine load signal of one replica of ``engines``.

    On pd-extproc's router: its registry, metrics and prefix index (told the engines' prefix-cache
    counters); on the oracle: its registry. Other routers keep no registry to blend into
    (:class:`TypeError`)."""
    if isinstance(replica, PdExtproc):
        router = replica.router
        return PageScraper(router.registry, engines, router.metrics, replica.live.engine_sampled)
    if isinstance(replica, Oracle):
        return PageScraper(replica.registry, engines, Metrics(replica.registry.endpoints))
    raise TypeError(f"{type(replica).__name__} has no registry for the engine load signal")


class Scraped:
    """A router whose replicas blend the engines' load into their own.

    ``router`` places; ``scrapers`` (one a replica) blend while :meth:`run` runs."""

    def __init__(self, router: Placing, scrapers: Sequence[EngineScraper]) -> None:
        self._router = router
        self._scrapers = list(scrapers)

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body`` with the router, its view of load blended from the scrapes."""
        return self._router.place(body)

    @classmethod
    def of(cls, router: Placing, engines: Mapping[str, Engine]) -> Scraped:
        """``router`` (:class:`Replicas` or one replica) with a scraper of ``engines`` per replica."""
        replicas = router.routers if isinstance(router, Replicas) else [router]
        return cls(router, [scraper_of(r, engines) for r in replicas])

    async def run(self) -> None:
        """Scrape every engine each interval (virtual time) until cancelled."""
        await asyncio.gather(*(s.run() for s in self._scrapers))
