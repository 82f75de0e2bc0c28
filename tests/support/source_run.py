"""Run a Kubernetes API discovery source in a test: what it published, its availability, its metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ext_proc.endpoints import ClusterEndpoints
from ext_proc.metrics import Metrics


class Run:
    """A running source (``label``: its metrics' ``source`` label)."""

    def __init__(self, source: Any, label: str, metrics: Metrics) -> None:
        self.source, self.label, self.metrics = source, label, metrics
        self.published: list[list[ClusterEndpoints]] = []
        self.available: list[bool] = []

    def view(self) -> dict[str, list[str]]:
        """The last published view: cluster name → addresses."""
        return {c.cluster_name: [e.address for e in c.endpoints] for c in self.published[-1]}

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def errors(self, reason: str) -> float:
        return self.sample("pd_extproc_discovery_errors_total", source=self.label, reason=reason) or 0.0

    def synced(self) -> float | None:
        return self.sample("pd_extproc_discovery_last_sync_timestamp_seconds", source=self.label)


Build = Callable[[Callable[[list[ClusterEndpoints]], None], Callable[[bool], None], Metrics], Awaitable[Any]]
"""Makes the source from its ``publish`` and ``available`` callbacks and its metrics."""


@contextlib.asynccontextmanager
async def running(build: Build, label: str) -> AsyncIterator[Run]:
    """The source ``build`` makes, running until the block ends."""
    metrics = Metrics(lambda: ())
    run: Run | None = None

    def publish(clusters: list[ClusterEndpoints]) -> None:
        assert run is not None
        run.published.append(clusters)

    def available(now: bool) -> None:
        assert run is not None
        run.available.append(now)

    run = Run(await build(publish, available, metrics), label, metrics)
    task = asyncio.create_task(run.source.run())
    try:
        yield run
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
