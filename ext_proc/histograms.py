"""Prometheus histograms and counters of the request path, at a bisection's or an addition's cost.

prometheus_client's ``Histogram.observe`` takes two locks and walks the buckets in Python: ~2 µs, and
the router observes four or five a request; its ``Counter.inc`` takes a lock: ~0.4 µs against ~0.1
for :meth:`Count.inc`, up to three a request. A :class:`LoopHistogram` or :class:`LoopCounter` keeps
plain counts per label set, written by the one thread that routes (the event loop), and exposes the
samples prometheus_client's ``Histogram`` or ``Counter`` does, in its order (label sets in the order of
their first use): a histogram's ``_bucket`` (cumulative, ``le`` last), ``_count``, ``_sum``, a counter's
``_total``; both ``_created`` too, unless ``PROMETHEUS_DISABLE_CREATED_SERIES`` says not to.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class Observations:
    """One label set's observations: per-bucket counts, their sum, when first used.

    ``counts[i]`` in the bucket of the ``i``-th upper bound (the first
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


Child = TypeVar("Child")


class _LoopMetric(Collector, Generic[Child]):
    """A metric of type ``kind`` named ``name`` (as exposed) with ``labelnames``: one child per label
    set, made by ``new_child`` on first use (:meth:`labels`); written from one thread only."""

    def __init__(
        self,
        name: str,
        documentation: str,
        kind: str,
        labelnames: Sequence[str],
        new_child: Callable[[], Child],
    ) -> None:
        self._name, self._documentation, self._kind = name, documentation, kind
        self._labelnames = tuple(labelnames)
        self._new_child = new_child
        self._children: dict[tuple[str, ...], Child] = {}

    def labels(self, *values: str) -> Child:
        """The child of the label set ``values`` (one per label name), started on first use."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._new_child()
        return child

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._documentation, self._kind)]

    def _series(self) -> list[tuple[list[tuple[str, str]], Child]]:
        """Each label set's labels (name, value) and child, in the order of their first use."""
        children = list(self._children.items())  # one step: the loop may add a label set meanwhile
        return [(list(zip(self._labelnames, values, strict=True)), child) for values, child in children]


class LoopHistogram(_LoopMetric[Observations]):
    """A Prometheus histogram observed from one thread, without locks.

    A histogram named ``name`` with ``labelnames``, of upper bounds ``buckets`` (+Inf added), on
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
        self._bounds = [float(b) for b in buckets]
        if self._bounds[-1] != math.inf:
            self._bounds.append(math.inf)
        super().__init__(name, documentation, "histogram", labelnames, partial(Observations, self._bounds))
        if not labelnames:
            self.labels()
        registry.register(self)

    def observe(self, amount: float) -> None:
        """Observe ``amount`` in a histogram without labels."""
        self._children[()].observe(amount)

    def collect(self) -> Iterable[Metric]:
        """The histogram's samples, per label set (prometheus_client's collector protocol)."""
        metric = Metric(self._name, self._documentation, "histogram")
        name = self._name
        for series, child in self._series():
            total = 0.0
            for bound, count in zip(self._bounds, list(child.counts), strict=True):
                total += count
                metric.add_sample(f"{name}_bucket", dict([*series, ("le", floatToGoString(bound))]), total)
            metric.add_sample(f"{name}_count", dict(series), total)
            metric.add_sample(f"{name}_sum", dict(series), child.sum)
            if prometheus_metrics._use_created:
                metric.add_sample(f"{name}_created", dict(series), child.created)
        return [metric]


class Count:
    """One label set's count and when it was first used.

    ``value``: the count; ``created``: when the label set was first used, seconds since the epoch."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0
        self.created = time.time()

    def inc(self) -> None:
        """Count one more."""
        self.value += 1


class LoopCounter(_LoopMetric[Count]):
    """A Prometheus counter counted from one thread, without locks.

    A counter named ``name`` (exposed without its ``_total``, as prometheus_client's ``Counter``
    does) with ``labelnames`` (at least one), on ``registry``; counted from one thread only
    (:meth:`labels`, then :meth:`Count.inc`)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], *, registry: CollectorRegistry
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, "counter", labelnames, Count)
        registry.register(self)

    def collect(self) -> Iterable[Metric]:
        """The counter's samples, per label set (prometheus_client's collector protocol)."""
        metric = Metric(self._name, self._documentation, "counter")
        name = self._name
        for series, child in self._series():
            metric.add_sample(f"{name}_total", dict(series), float(child.value))
            if prometheus_metrics._use_created:
                metric.add_sample(f"{name}_created", dict(series), child.created)
        return [metric]
