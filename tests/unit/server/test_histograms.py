"""LoopHistogram and LoopCounter expose the samples prometheus_client's Histogram and Counter do."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from ext_proc.histograms import LoopCounter, LoopHistogram

BUCKETS = (0, 16, 1e-5, 2e-5, 0.5, 1.0, 5.0)
values = st.sampled_from([*BUCKETS, 0.0, -1.0, 1e9, 2e-5 + 1e-12]) | st.floats(-10, 1e6, allow_nan=False)


def without_created(registry: CollectorRegistry) -> list[str]:
    """The text exposition of ``registry``, ``_created`` values dropped."""
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if "_created" in line and "#" not in line else line for line in lines]


def exposition(kind: type, labelled: bool, observed: list[tuple[str, float]]) -> list[str]:
    """The text exposition of one histogram of ``kind`` after ``observed``, ``_created`` values dropped."""
    registry = CollectorRegistry()
    buckets = sorted(set(BUCKETS))
    labels = ["locality", "role"] if labelled else []
    histogram = kind("pd_test_seconds", "what it measures", labels, buckets=buckets, registry=registry)
    for label, value in observed:
        (histogram.labels(label, "x") if labelled else histogram).observe(value)
    return without_created(registry)


@settings(deadline=None)
@given(st.booleans(), st.lists(st.tuples(st.sampled_from(["same_group", "cross_group"]), values)))
def test_the_samples_are_prometheus_clients(labelled: bool, observed: list[tuple[str, float]]) -> None:
    assert exposition(LoopHistogram, labelled, observed) == exposition(Histogram, labelled, observed)


def test_a_label_set_is_exposed_from_its_first_use_and_the_sum_adds_in_order() -> None:
    registry = CollectorRegistry()
    histogram = LoopHistogram("pd_test_seconds", "doc", ["role"], buckets=(1.0,), registry=registry)
    assert registry.get_sample_value("pd_test_seconds_count", {"role": "p"}) is None
    histogram.labels("p")
    assert registry.get_sample_value("pd_test_seconds_count", {"role": "p"}) == 0.0
    for value in (0.1, 0.2, 3.0):
        histogram.labels("p").observe(value)
    assert registry.get_sample_value("pd_test_seconds_bucket", {"role": "p", "le": "1.0"}) == 2.0
    assert registry.get_sample_value("pd_test_seconds_sum", {"role": "p"}) == 0.0 + 0.1 + 0.2 + 3.0


def counter_exposition(kind: type, counted: list[tuple[str, str]]) -> list[str]:
    """The text exposition of one counter of ``kind`` after ``counted``, ``_created`` values dropped."""
    registry = CollectorRegistry()
    counter = kind("pd_test_total", "what it counts", ["mode", "locality"], registry=registry)
    for labels in counted:
        counter.labels(*labels).inc()
    return without_created(registry)


@given(
    st.lists(st.tuples(st.sampled_from(["auto", "prefer"]), st.sampled_from(["same_group", "cross_group"])))
)
def test_the_counter_samples_are_prometheus_clients(counted: list[tuple[str, str]]) -> None:
    assert counter_exposition(LoopCounter, counted) == counter_exposition(Counter, counted)


def test_a_counted_label_set_is_exposed_from_its_first_use_with_its_creation_time() -> None:
    registry = CollectorRegistry()
    before = time.time()
    counter = LoopCounter("pd_test_total", "doc", ["outcome"], registry=registry)
    assert registry.get_sample_value("pd_test_total", {"outcome": "ok"}) is None
    counter.labels("ok")
    assert registry.get_sample_value("pd_test_total", {"outcome": "ok"}) == 0.0
    for _ in range(3):
        counter.labels("ok").inc()
    assert registry.get_sample_value("pd_test_total", {"outcome": "ok"}) == 3.0
    assert before <= registry.get_sample_value("pd_test_created", {"outcome": "ok"}) <= time.time()
