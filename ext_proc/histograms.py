"""Prometheus histograms of the request path, at a bisection's cost per observation.

prometheus_client's ``Histogram.observe`` takes two locks and walks the buckets in Python: ~2 µs, and
the router observes four or five a request. A :class:`LoopHistogram` keeps plain counts per label set,
written by the one thread that routes (the event loop), and exposes the samples prometheus_client's
``Histogram`` does, in its order: ``_bucket`` (cumulative, ``le`` last), ``_count``, ``_sum`` and, unless
``PROMETHEUS_DISABLE_CREATED_SERIES`` says not to, ``_created``.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class Observations:
    """One label set's observations: ``counts[i]`` in the bucket of the ``i``-th upper bound (the first
    one at or above the value), their ``sum``, and when the label set was first used (``created``,
    seconds since the epoch)."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count ``amount`` (a number, not NaN) in its bucket and add it to the sum."""
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class LoopHistogram(Collector):
    """A histogram named ``name`` with ``labelnames``, of upper bounds ``buckets`` (+Inf added), on
    ``registry``; observed from one thread only (:meth:`labels`, :meth:`observe`)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name, self._documentation, self._labelnames = name, documentation, tuple(labelnames)
        self._bounds = [float(b) for b in buckets]
        if self._bounds[-1] != math.inf:
            self._bounds.append(math.inf)
        self._children: dict[tuple[str, ...], Observations] = {}
        if not labelnames:
            self.labels()
        registry.register(self)

    def labels(self, *values: str) -> Observations:
        """The observations of the label set ``values`` (one per label name), started on first use."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = Observations(self._bounds)
        return child

    def observe(self, amount: float) -> None:
        """Observe ``amount`` in a histogram without labels."""
        self._children[()].observe(amount)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, "histogram")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self._name, self._documentation, "histogram")
        name = self._name
        for values, child in list(self._children.items()):
            series = list(zip(self._labelnames, values, strict=True))
            total = 0.0
            for bound, count in zip(self._bounds, list(child.counts), strict=True):
                total += count
                metric.add_sample(f"{name}_bucket", dict([*series, ("le", floatToGoString(bound))]), total)
            metric.add_sample(f"{name}_count", dict(series), total)
            metric.add_sample(f"{name}_sum", dict(series), child.sum)
            if prometheus_metrics._use_created:
                metric.add_sample(f"{name}_created", dict(series), child.created)
        return [metric]
