"""bench/flow_control.py's pure arithmetic: the targets' verdicts from its phases' rows, the Poisson
arrivals it sends, and its table (the phases themselves need the simulated cluster: run the script)."""

from __future__ import annotations

import random

from bench import flow_control


def _row(rps: float, p99: float) -> dict:
    return {
        "sent": 10,
        "ok": 10,
        "statuses": {"200": 10},
        "completions_per_s": rps,
        "ttft": {"p50_ms": p99 / 2, "p99_ms": p99, "mean_ms": p99 / 2},
        "ttft_samples": 10,
    }


def _phases(with_p99: float, batch_rps: float, a: float, b: float) -> dict:
    return {
        "capacity": {"batch": _row(50.0, 100.0)},
        "alone": {"interactive": _row(10.0, 40.0)},
        "with r=0": {"interactive": _row(10.0, with_p99), "batch": _row(batch_rps, 80.0)},
        "without": {"interactive": _row(4.0, 4000.0), "batch": _row(45.0, 4000.0)},
        "fair": {"a": _row(a, 900.0), "b": _row(b, 900.0)},
    }


def test_every_target_met_and_each_one_missed():
    met = flow_control.verdict(_phases(52.0, 36.0, 26.0, 24.0), 50.0, "with r=0")
    assert met["interactive_ttft_p99_with_vs_alone"] == 1.3
    assert met["interactive_ttft_p50_with_vs_alone"] == 1.3
    assert met["interactive_ttft_p99_without_vs_alone"] == 100.0
    assert met["batch_of_what_is_left"] == 0.9  # 36 of the 50 - 10 the interactive tenant left
    assert met["fair_share_a"] == 0.52
    assert all(met["targets_met"].values())
    missed = flow_control.verdict(_phases(53.0, 35.0, 28.0, 22.0), 50.0, "with r=0")["targets_met"]
    assert missed == {"ttft_within_1.3x": False, "batch_at_least_90pct": False, "shares_within_10pct": False}


def test_arrivals_are_poisson_at_the_rate_within_the_phase():
    times = flow_control._poisson(random.Random(1), 50.0, 100.0)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 100.0
    assert 4700 < len(times) < 5300


def test_the_report_lists_every_phase_and_tenant():
    result = {"capacity_rps": 50.0, "phases": _phases(52.0, 36.0, 26.0, 24.0), "verdicts": {"r=0": {}}}
    text = flow_control.report(result)
    assert "pool capacity C = 50.0 completions/s" in text
    for phase, tenant in [("capacity", "batch"), ("with r=0", "interactive"), ("fair", "b")]:
        assert any(line.startswith(f"{phase:<11}{tenant:<13}") for line in text.splitlines())
