"""sim.report: the per-engine decode loads and their coefficient of variation, on hand-made records."""

from __future__ import annotations

import pytest

from sim.report import COLUMNS, better, decode_loads, load_cv, summarize
from sim.workload import Record, RequestPlan

PLAN = RequestPlan(0.0, 100, 10)


def record(engine: str | None, end_ms: float | None, remote_prefill_ms: float | None = None) -> Record:
    return Record(
        PLAN, ok=end_ms is not None, decode_engine=engine, end_ms=end_ms, remote_prefill_ms=remote_prefill_ms
    )


def test_loads_are_mean_requests_in_flight_over_relative_capacity() -> None:
    capacities = {"a": 200.0, "b": 100.0, "idle": 300.0}  # relative capacities 1, 0.5, 1.5
    records = [
        record("a", 3000.0, remote_prefill_ms=1000.0),  # 2 s of decode
        record("a", 2000.0),
        record("b", 1500.0, remote_prefill_ms=500.0),  # 1 s
        record("b", None),  # failed: not counted
        record("unknown", 9000.0),  # not a decode engine of this run: not counted
    ]
    loads = decode_loads(records, 10.0, capacities)
    assert loads == pytest.approx({"a": 0.4, "b": 0.2, "idle": 0.0})


def test_cv_is_zero_when_load_follows_capacity_and_none_without_load() -> None:
    loads = decode_loads([record("a", 4000.0), record("b", 2000.0)], 10.0, {"a": 200.0, "b": 100.0})
    assert loads == pytest.approx({"a": 0.3, "b": 0.3})
    assert load_cv(loads.values()) == pytest.approx(0.0)
    assert load_cv([1.0, 3.0]) == pytest.approx(0.5)  # population std 1, mean 2
    assert load_cv([]) is None and load_cv([0.0, 0.0]) is None
    assert decode_loads([record("a", 1.0)], 0.0, {"a": 1.0}) == {}


def test_summary_reports_the_loads_its_cv_is_computed_from() -> None:
    summary = summarize([record("a", 4000.0), record("b", 1000.0)], 10.0, {"a": 100.0, "b": 100.0})
    assert summary["decode_loads"] == pytest.approx({"a": 0.4, "b": 0.1})
    assert summary["decode_load_cv"] == pytest.approx(0.6)  # std 0.15 / mean 0.25


def test_the_table_says_which_way_each_column_is_better() -> None:
    assert better() == (
        "lower is better: errors, cross-group KV, dTTFT p50 ms, dTTFT p99 ms, TPOT p50 ms, decode load CV; "
        "higher is better: req/s, tok/s"
    )
    assert better([c for c in COLUMNS if c[0] in ("requests", "throughput_rps")]) == "higher is better: req/s"
