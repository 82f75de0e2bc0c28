"""LoopHistogram exposes the samples prometheus_client's Histogram does for the same observations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ext_proc.histograms import LoopHistogram

BUCKETS = (0, 16, 1e-5, 2e-5, 0.5, 1.0, 5.0)
values = st.sampled_from([*BUCKETS, 0.0, -1.0, 1e9, 2e-5 + 1e-12]) | st.floats(-10, 1e6, allow_nan=False)


def exposition(kind: type, labelled: bool, observed: list[tuple[str, float]]) -> list[str]:
    """The text exposition of one histogram of ``kind`` after ``observed``, ``_created`` values dropped."""
    registry = CollectorRegistry()
    buckets = sorted(set(BUCKETS))
    labels = ["locality", "role"] if labelled else []
    histogram = kind("pd_test_seconds", "what it measures", labels, buckets=buckets, registry=registry)
    for label, value in observed:
        (histogram.labels(label, "x") if labelled else histogram).observe(value)
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if "_created" in line and "#" not in line else line for line in lines]


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
