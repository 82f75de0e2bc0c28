"""bench/trace_replay.py's pure arithmetic on its rows: the targets' verdicts and the medians over
windows (the replays themselves run in tests/e2e/test_bench_trace_replay.py)."""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return importlib.import_module("bench.trace_replay")


def _row(p90: float, dttft: float, cross: float, cv: float, hit: float) -> dict:
    return {
        "ttft_p90_ms": p90,
        "dttft_p99_ms": dttft,
        "cross_group_share": cross,
        "decode_load_cv": cv,
        "hit_rate": hit,
    }


def test_verdicts_judge_the_best_setting_against_the_best_peer(bench: ModuleType) -> None:
    rows = {
        "off": _row(1000, 900, 0.4, 0.10, 0.09),
        "pair:auto+prefix": _row(700, 100, 0.01, 0.11, 0.20),
        "sglang": _row(900, 1000, 0.4, 0.3, 0.21),
        "dynamo": _row(950, 500, 0.3, 0.2, 0.22),
        "oracle": _row(690, 100, 0.0, 0.11, 0.23),
        "oracle x4 scraped": _row(600, 100, 0.0, 0.11, 0.23),  # the oracle's replicas: never "ours"
    }
    judged = {v["target"]: v for v in bench.verdicts(rows, 0.25)}
    best = "pair:auto+prefix"
    assert all(t.startswith(f"{best}: ") for t in judged)
    p90 = judged[f"{best}: TTFT p90 / best peer's (sglang) <= 0.8"]
    assert p90["value"] == pytest.approx(700 / 900) and p90["met"]
    dttft = judged[f"{best}: decode TTFT p99 / best peer's (dynamo) <= 0.25"]
    assert dttft["value"] == pytest.approx(0.2) and dttft["met"]
    assert judged[f"{best}: cross-group share <= 2%"]["met"]
    assert judged[f"{best}: decode load CV / off's <= 1.2"]["value"] == pytest.approx(1.1)
    gap = judged[f"{best}: hit rate - oracle's >= -2 points"]
    assert gap["value"] == pytest.approx(-0.03) and not gap["met"]
    share = judged[f"{best}: hit rate / the window's reuse bound >= 0.7"]
    assert share["value"] == pytest.approx(0.8) and share["met"]


def test_medians_are_per_setting_and_metric_over_the_windows_leaving_none_out(bench: ModuleType) -> None:
    runs = [
        {"off": {"ttft_p90_ms": 300.0, "errors": 0, "dttft_p99_ms": None, "name": "a"}},
        {"off": {"ttft_p90_ms": 100.0, "errors": 2, "dttft_p99_ms": 40.0, "name": "b"}},
        {"off": {"ttft_p90_ms": 200.0, "errors": 1, "dttft_p99_ms": 20.0, "name": "c"}},
    ]
    assert bench.medians(runs) == {"off": {"ttft_p90_ms": 200.0, "errors": 1, "dttft_p99_ms": 30.0}}
    assert bench.medians([{"off": {"dttft_p99_ms": None}}]) == {"off": {"dttft_p99_ms": None}}


def test_each_shared_setting_runs_once_per_delay_and_decision_slot(bench: ModuleType) -> None:
    shared = "pair:auto+prefix x4 shared"
    assert bench.runs_of(["pair:auto+prefix", shared], [2.0], [0.0, 10.0]) == [
        ("pair:auto+prefix", "pair:auto+prefix", 0.002, 0.0),
        (f"{shared} slot 0ms", shared, 0.002, 0.0),
        (f"{shared} slot 10ms", shared, 0.002, 10.0),
    ]
    assert bench.runs_of([shared], [0.0, 20.0]) == [
        (f"{shared} 0ms", shared, 0.0, 0.0),
        (f"{shared} 20ms", shared, 0.02, 0.0),
    ]
    assert bench.runs_of([shared], [2.0], [5.0]) == [(f"{shared} slot 5ms", shared, 0.002, 5.0)]
    parse = bench._milliseconds("--decision-slot-ms", 50)
    assert parse("0, 5,10") == [0.0, 5.0, 10.0]
    with pytest.raises(argparse.ArgumentTypeError, match=r"must name values in \[0, 50\] ms"):
        parse("60")
    with pytest.raises(argparse.ArgumentTypeError, match="--decision-slot-ms must be milliseconds"):
        parse("x")
