"""Smoke tests of the routing-quality and overhead benchmarks at reduced sizes (never timing)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import load_bench

routing = load_bench("routing_quality")


@pytest.mark.parametrize("name", ["unequal-groups", "one-hot-group", "decode-loss", "bursty"])
async def test_each_scenario_runs_and_strict_keeps_transfers_in_group(name):
    scenario = dataclasses.replace(routing.SCENARIOS[name], settings=("prefer@0.3", "strict"))
    results = await routing.run_scenario(scenario, quick=True, sweep=False)
    assert list(results) == ["prefer@0.3", "strict"]
    for summary in results.values():
        assert summary["requests"] == 10
        if name == "decode-loss":  # requests in flight on the dead node fail; nothing else does
            assert summary["errors"] < summary["requests"] // 2
        else:
            assert summary["errors"] == 0, summary["error_kinds"]
    assert results["strict"]["cross_group_share"] == 0.0


def test_reference_scenario_end_to_end_writes_json(tmp_path):
    out = tmp_path / "routing.json"
    assert routing.main(["--quick", "--scenarios", "two-equal-groups", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["two-equal-groups"]
    assert set(results) == {"off", "prefer@0.05", "prefer@0.3", "strict", "round-robin"}
    assert results["round-robin"]["cross_group_share"] is None  # no disaggregation without ext_proc
    assert results["strict"]["cross_group_share"] == 0.0


def test_trade_off_plot_is_drawn_from_a_sweep(tmp_path):
    summary = {"cross_group_share": 0.25, "decode_load_cv": 0.1}
    sweep = {f"prefer@{b}": summary for b in routing.SWEEP_BONUSES} | {"off": summary, "strict": summary}
    png = tmp_path / "tradeoff.png"
    routing._plot(sweep, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_unknown_scenario_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        routing.main(["--scenarios", "nope"])
    assert exit_info.value.code == 2


def test_overhead_benchmark_reports_both_gateways(tmp_path):
    overhead = load_bench("overhead")
    out = tmp_path / "overhead.json"
    argv = ["--requests", "8", "--concurrency", "1,4", "--throughput-seconds", "0.5", "--streams", "20"]
    assert overhead.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for concurrency in ("1", "4"):
        row = result["latency"][concurrency]
        for gateway in ("without_filter", "bare_ext_proc", "pd_extproc"):
            assert row[gateway]["p50_ms"] > 0
        # Sampled per batch in 10 ms /proc ticks: a handful of requests may round to zero.
        assert row["pd_extproc_cpu_us_per_request"] >= 0
    assert result["max_throughput"]["pd_extproc"]["errors"] == 0
    assert result["max_throughput"]["pd_extproc"]["cpu_us_per_request"] > 0
    assert result["in_flight"]["in_flight_seen"] == result["in_flight"]["ok"] == 20
    assert result["in_flight"]["load_left_after"] == 0
