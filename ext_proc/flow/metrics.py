"""Flow control's Prometheus metrics, on the server's registry.

Every label value is a configured priority or a fixed outcome, never a fairness id or an objective a
client sent."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ext_proc.histograms import LoopHistogram

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Seconds: a request's wait in the queue, from none to the longest ``max_queue_seconds`` one allows."""
OUTCOMES = ("dispatched", "shed", "queue_full", "displaced", "timeout", "cancelled")
"""How a request left flow control (``pd_extproc_flow_requests_total``'s ``outcome``)."""


class _QueueCollector(Collector):
    def __init__(self, lengths: Callable[[], dict[int, int]], flows: Callable[[], dict[int, int]]) -> None:
        self._lengths = lengths
        self._flows = flows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queued = GaugeMetricFamily(
            "pd_extproc_flow_queued_requests",
            "Requests waiting in flow control's queue, by band (the objective's configured priority)",
            labels=["priority"],
        )
        flows = GaugeMetricFamily(
            "pd_extproc_flow_queued_flows",
            "Fairness flows with a request waiting, by band (at most flow_control.max_flows + 1)",
            labels=["priority"],
        )
        for priority, count in self._lengths().items():
            queued.add_metric([str(priority)], count)
        for priority, count in self._flows().items():
            flows.add_metric([str(priority)], count)
        yield queued
        yield flows


class FlowMetrics:
    """Counts and waits of flow control by band; the queue's lengths are read at scrape time."""

    def __init__(self, registry: CollectorRegistry, priorities: list[int]) -> None:
        self._registry = registry
        self._requests = Counter(
            "pd_extproc_flow_requests_total",
            "Requests flow control let through (dispatched: at once or after waiting) or answered instead "
            "(shed, queue_full, displaced, timeout) or lost while waiting (cancelled), by band",
            ["priority", "outcome"],
            registry=registry,
        )
        self._wait = LoopHistogram(
            "pd_extproc_flow_wait_seconds",
            "Seconds a dispatched request waited in flow control's queue (0: it went at once), by band",
            ["priority"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self._unknown = Counter(
            "pd_extproc_flow_unknown_objectives_total",
            "Requests naming an objective flow_control.objectives lacks (given the default objective's band)",
            registry=registry,
        )
        self._overflowed = Counter(
            "pd_extproc_flow_overflowed_total",
            "Requests queued in their band's shared flow: it already tracked flow_control.max_flows others",
            registry=registry,
        )
        self._children = {
            (priority, outcome): self._requests.labels(str(priority), outcome)
            for priority in priorities
            for outcome in OUTCOMES
        }
        self._waits = {priority: self._wait.labels(str(priority)) for priority in priorities}

    def watch(self, lengths: Callable[[], dict[int, int]], flows: Callable[[], dict[int, int]]) -> None:
        """Expose the queue's ``lengths()`` and ``flows()`` per band, read at scrape time."""
        self._registry.register(_QueueCollector(lengths, flows))

    def left(self, priority: int, outcome: str) -> None:
        """Count one request of band ``priority`` leaving with ``outcome`` (of :data:`OUTCOMES`)."""
        self._children[priority, outcome].inc()

    def dispatched(self, priority: int, waited: float) -> None:
        """Count one request of band ``priority`` dispatched after ``waited`` seconds."""
        self._children[priority, "dispatched"].inc()
        self._waits[priority].observe(waited)

    def outcomes(self) -> dict[int, dict[str, int]]:
        """Requests counted so far per band and outcome (``pd_extproc_flow_requests_total``)."""
        counts: dict[int, dict[str, int]] = {}
        for family in self._requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    band = counts.setdefault(int(sample.labels["priority"]), {})
                    band[sample.labels["outcome"]] = int(sample.value)
        return counts

    def unknown_objective(self) -> None:
        """Count one request naming an unknown objective."""
        self._unknown.inc()

    def overflowed(self) -> None:
        """Count one request queued in its band's shared flow."""
        self._overflowed.inc()
