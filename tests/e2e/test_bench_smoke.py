"""Smoke tests of the routing-quality and overhead benchmarks at reduced sizes (never timing)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench import handoff as handoff_bench
from bench import overhead
from bench import replicas as replicas_bench
from bench import routing_quality as routing
from ext_proc.config import load_config


@pytest.mark.parametrize("name", ["unequal-groups", "one-hot-group", "decode-loss", "bursty", "long-context"])
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
    output = json.loads(out.read_text())
    assert output["seeds"] == [routing.FIRST_SEED]
    results = output["scenarios"]["two-equal-groups"]["runs"][str(routing.FIRST_SEED)]
    assert "across_seeds" not in output["scenarios"]["two-equal-groups"]
    assert set(results) == {"off", "prefer@0.05", "prefer@0.3", "strict", "auto", "round-robin"}
    assert results["auto"]["errors"] == 0
    assert output["scenarios"]["two-equal-groups"]["verdict"]["best_bonus"]
    assert results["round-robin"]["cross_group_share"] is None  # no disaggregation without ext_proc
    assert results["strict"]["cross_group_share"] == 0.0


async def test_auto_runs_with_the_simulated_fabric_and_a_misconfigured_one():
    scenario = dataclasses.replace(routing.SCENARIOS["saturated"], settings=("auto", "auto:bw10x"))
    results = await routing.run_scenario(scenario, quick=True, sweep=False)
    assert list(results) == ["auto", "auto:bw10x"]
    assert all(r["errors"] == 0 and r["requests"] == 10 for r in results.values())


def test_the_router_is_told_the_simulated_fabric():
    scenario = routing.SCENARIOS["long-context"]
    auto = routing.auto_keys(scenario)["affinity"]["auto"]
    kv = scenario.kv
    assert (auto["kv_bytes_per_token"], auto["same_group_gbps"]) == (
        kv.kv_bytes_per_token,
        kv.same_group_gbps,
    )
    assert (auto["cross_group_gbps"], auto["base_latency_ms"]) == (kv.cross_group_gbps, kv.kv_base_latency_ms)
    assert auto["wait_scale_ms"] == pytest.approx(12.0 + 0.1 * 32)  # one step at half batch: 32 of 64
    wrong = routing._config(scenario, "auto:bw10x")["affinity"]["auto"]
    assert wrong["cross_group_gbps"] == 10 * kv.cross_group_gbps
    fast = routing.auto_keys(routing.SCENARIOS["fast-fabric"], 10.0)["affinity"]["auto"]
    assert fast["cross_group_gbps"] == fast["same_group_gbps"]  # capped: the config requires cross <= same
    assert routing._config(scenario, "prefer@0.3") is None
    loaded = load_config(overrides={f"affinity.auto.{k}": v for k, v in auto.items()}, environ={})
    assert loaded.affinity.auto.bytes_per_token() == kv.kv_bytes_per_token


def _row(p50: float, p99: float, tpot: float = 13.0, rps: float = 10.0, cv: float = 0.1) -> dict:
    """A run's summary with the keys the across-seeds statistics and the verdict read."""
    return {
        "decode_ttft_p50_ms": p50,
        "decode_ttft_p99_ms": p99,
        "tpot_p50_ms": tpot,
        "throughput_rps": rps,
        "decode_load_cv": cv,
        "cross_group_share": 0.1,
        "errors": 0,
    }


def test_verdict_compares_auto_with_the_best_bonus_per_percentile_and_with_off():
    runs = {
        7: {
            "off": _row(60, 200),
            "prefer@0.05": _row(40, 100),
            "prefer@0.3": _row(42, 80),
            "auto": _row(41, 85, tpot=13.5, rps=9.7),
        }
    }
    judged = routing.verdict("one-hot-group", runs)
    assert judged["best_bonus"] == {
        "dttft_p50_vs_best_bonus": "prefer@0.05",
        "dttft_p99_vs_best_bonus": "prefer@0.3",
    }
    assert judged["ratios"]["dttft_p50_vs_best_bonus"] == pytest.approx(41 / 40)
    assert judged["ratios"]["dttft_p99_vs_best_bonus"] == pytest.approx(85 / 80)
    assert judged["met"] == {
        "dttft_p50_vs_best_bonus": True,
        "dttft_p99_vs_best_bonus": False,  # 1.0625
        "tpot_p50_vs_off": True,  # 1.038
        "throughput_vs_off": False,  # 0.97
    }
    table = routing.format_verdicts({"one-hot-group": judged})
    assert "missed: dttft_p99_vs_best_bonus, throughput_vs_off" in table and "10.0%" in table
    assert routing.verdict("x", {7: {"off": _row(1, 1), "auto": _row(1, 1)}}) is None  # no bonus


def test_verdict_ratios_are_paired_by_seed():
    # Seed 8's workload is twice as slow for everyone: per-seed ratios see auto 10% behind off in
    # both seeds, where the ratio of the medians (55 / 45) would not.
    runs = {
        7: {"off": _row(30, 90), "prefer@0.3": _row(30, 90), "auto": _row(33, 99)},
        8: {"off": _row(60, 180), "prefer@0.3": _row(60, 180), "auto": _row(66, 198)},
    }
    judged = routing.verdict("fast-fabric", runs)
    assert judged["ratios"]["dttft_p50_vs_off"] == pytest.approx(1.1)
    assert judged["ratios"]["dttft_p99_vs_best_bonus"] == pytest.approx(1.1)
    assert not judged["met"]["dttft_p50_vs_off"] and judged["met"]["load_cv_vs_off"]


def test_fast_fabric_verdict_wants_auto_within_five_percent_of_off_both_ways():
    runs = {7: {"off": _row(40, 100, cv=0.10), "prefer@0.3": _row(50, 120), "auto": _row(39, 94, cv=0.09)}}
    met = routing.verdict("fast-fabric", runs)["met"]
    assert met["dttft_p50_vs_off"] and not met["dttft_p99_vs_off"] and not met["load_cv_vs_off"]
    assert "all met" in routing.format_verdicts({"x": routing.verdict("x", runs)})


def test_trade_off_plot_is_drawn_from_a_sweep(tmp_path):
    summary = {"cross_group_share": 0.25, "decode_load_cv": 0.1}
    sweep = {f"prefer@{b}": summary for b in routing.SWEEP_BONUSES} | {"off": summary, "strict": summary}
    sweep |= {"auto": summary}
    png = tmp_path / "tradeoff.png"
    medians = {
        "a": routing.across_seeds({7: {"off": _row(1, 1), "auto": _row(1, 1)}}),
        "b": routing.across_seeds({7: {"strict": _row(1, 1)}}),
    }
    routing._plot(sweep, str(png), medians)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _summary(cross: float | None, ttft: float, cv: float, rps: float, errors: int = 0) -> dict:
    return {
        "cross_group_share": cross,
        "decode_ttft_p50_ms": ttft,
        "decode_ttft_p99_ms": 3 * ttft,
        "tpot_p50_ms": 13.0,
        "decode_load_cv": cv,
        "throughput_rps": rps,
        "errors": errors,
    }


def test_across_seeds_takes_medians_and_paired_ratios_to_off():
    runs = {
        7: {"off": _summary(0.5, 100.0, 0.10, 10.0), "prefer@0.3": _summary(0.0, 60.0, 0.20, 10.0, 1)},
        8: {"off": _summary(0.4, 50.0, 0.20, 8.0), "prefer@0.3": _summary(0.1, 40.0, 0.10, 8.0)},
        9: {
            "off": _summary(0.6, 80.0, 0.05, 9.0),
            "prefer@0.3": _summary(0.0, 72.0, 0.05, 9.9),
            "prefer@1.0": _summary(0.0, 70.0, 0.3, 9.0),  # a sweep point of one seed only: left out
        },
    }
    stats = routing.across_seeds(runs)
    assert list(stats) == ["off", "prefer@0.3"]
    prefer = stats["prefer@0.3"]
    assert prefer["cross_group_share"] == {"median": 0.0, "min": 0.0, "max": 0.1}
    assert prefer["decode_ttft_p50_ms_vs_off"] == pytest.approx(0.8)  # median of 0.6, 0.8, 0.9
    assert prefer["decode_ttft_p99_ms_vs_off"] == pytest.approx(0.8)
    assert prefer["decode_load_cv_vs_off"] == pytest.approx(1.0)  # median of 2.0, 0.5, 1.0
    assert prefer["throughput_rps_vs_off"] == pytest.approx(1.0)
    assert prefer["errors"] == 1 and stats["off"]["errors"] == 0
    assert stats["off"]["decode_load_cv_vs_off"] == pytest.approx(1.0)
    table = routing.format_across_seeds(stats, 3)
    assert "0.0% [0.0%-10.0%]" in table and "0.80x" in table


def test_round_robin_has_no_cross_group_share_across_seeds():
    runs = {
        seed: {"off": _summary(0.5, 1.0, 0.1, 1.0), "round-robin": _summary(None, 2.0, 0.1, 1.0)}
        for seed in (7, 8)
    }
    stats = routing.across_seeds(runs)
    assert stats["round-robin"]["cross_group_share"] is None
    assert stats["round-robin"]["decode_ttft_p50_ms_vs_off"] == pytest.approx(2.0)
    assert "n/a" in routing.format_across_seeds(stats, 2)


def test_zero_seeds_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        routing.main(["--seeds", "0"])
    assert exit_info.value.code == 2


def test_unknown_scenario_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        routing.main(["--scenarios", "nope"])
    assert exit_info.value.code == 2


def test_overhead_benchmark_reports_both_gateways(tmp_path):
    out = tmp_path / "overhead.json"
    argv = ["--requests", "8", "--concurrency", "1,4", "--throughput-seconds", "0.5", "--streams", "20"]
    argv += ["--body-requests", "3"]
    assert overhead.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for concurrency in ("1", "4"):
        row = result["latency"][concurrency]
        for gateway in ("without_filter", "bare_ext_proc", "pd_extproc"):
            assert row[gateway]["p50_ms"] > 0
        # Sampled per batch in 10 ms /proc ticks, so a handful of requests may round to zero; but no
        # routed chat request costs 100 ms of router CPU (a unit slip or the wrong process would).
        assert 0 <= row["pd_extproc_cpu_us_per_request"] <= 100_000
    for size in ("1KB", "64KB", "1MB"):
        row = result["body_modes"][size]
        for gateway in ("without_filter", "bare_buffered", "bare_full_duplex", "buffered", "full_duplex"):
            assert row[gateway]["p50_ms"] > 0
        assert "fds_over_buffered_added_p50" in row and "bare_fds_over_buffered_added_p50" in row
    throughput = result["max_throughput"]["pd_extproc"]
    assert throughput["errors"] == 0 and throughput["requests_per_s"] > 0
    # Over the whole window (many requests, tick granularity negligible): tens of µs to tens of ms.
    assert 20 <= throughput["cpu_us_per_request"] <= 50_000
    assert result["in_flight"]["in_flight_seen"] == result["in_flight"]["ok"] == 20
    assert result["in_flight"]["load_left_after"] == 0


def test_handoff_benchmark_end_to_end(tmp_path, monkeypatch):
    """Two handoffs and three sweep points with a handful of requests: every request is served, the
    differences are the per-run numbers subtracted, decode-only sends no prefill leg at all."""
    monkeypatch.setattr(handoff_bench, "SWEEP_LABELS", ("0", "512", handoff_bench.DECODE_ONLY))
    out, png = tmp_path / "handoff.json", tmp_path / "handoff.png"
    argv = ["--requests", "6", "--handoffs", "sidecar,kv-transfer-params"]
    assert handoff_bench.main([*argv, "--json", str(out), "--png", str(png)]) == 0
    output = json.loads(out.read_text())
    seed = str(handoff_bench.FIRST_SEED)
    runs, sweep = output["handoffs"][seed], output["sweep"][seed]
    assert list(runs) == ["sidecar", "kv-transfer-params"]
    assert list(sweep) == ["0", "512", handoff_bench.DECODE_ONLY]
    for summary in [*runs.values(), *sweep.values()]:
        assert summary["requests"] == 6 and summary["errors"] == 0, summary["error_kinds"]
        assert summary["ttft_p50_ms"] > 0 and summary["ttft_p99_ms"] >= summary["ttft_p50_ms"]
    # The sidecar calls the prefill itself; the gateway sends one leg per request (and warm-up request).
    assert runs["sidecar"]["prefill_legs"] == 0
    assert runs["kv-transfer-params"]["prefill_legs"] >= 6
    for summary in (runs["sidecar"], runs["kv-transfer-params"], sweep["0"]):
        assert summary["disaggregated_share"] == 1.0  # every decode pulled a prefilled KV cache
    decode_only = sweep[handoff_bench.DECODE_ONLY]
    assert decode_only["prefill_legs"] == 0 and decode_only["kv_transfers"] == 0
    assert decode_only["disaggregated_share"] == 0.0
    differences = output["differences"][seed]
    assert set(differences) == {"kv_minus_sidecar_ttft_p50_ms"}  # the other pairs lack a run
    expected = runs["kv-transfer-params"]["ttft_p50_ms"] - runs["sidecar"]["ttft_p50_ms"]
    assert differences["kv_minus_sidecar_ttft_p50_ms"] == pytest.approx(expected)
    across = output["differences_across_seeds"]["kv_minus_sidecar_ttft_p50_ms"]
    assert across["median"] == across["min"] == across["max"] == pytest.approx(expected)
    assert output["sweep_across_seeds"]["0"]["tpot_p99_vs_0"] == pytest.approx(1.0)
    assert output["recommendation"]["label"] in handoff_bench.SWEEP_LABELS
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_handoff_benchmark_over_mooncake_engines_shows_the_second_prefill(tmp_path):
    """Engines running vLLM's upstream MooncakeConnector: kv-transfer-params gets no params back, so
    no decode pulls (each prompt is prefilled twice); vllm-mooncake pulls every one."""
    out = tmp_path / "mooncake.json"
    assert (
        handoff_bench.main(
            ["--requests", "6", "--kv-connector", "mooncake", "--skip-sweep", "--json", str(out)]
        )
        == 0
    )
    output = json.loads(out.read_text())
    runs = output["handoffs"][str(handoff_bench.FIRST_SEED)]
    assert output["kv_connector"] == "mooncake" and list(runs) == ["kv-transfer-params", "vllm-mooncake"]
    for summary in runs.values():
        assert summary["requests"] == 6 and summary["errors"] == 0, summary["error_kinds"]
    assert runs["kv-transfer-params"]["disaggregated_share"] == 0.0
    assert runs["vllm-mooncake"]["disaggregated_share"] == 1.0


def _sweep_point(ttft: float, tpot_p99: float) -> dict:
    return {
        "requests": 10,
        "errors": 0,
        "disaggregated_share": 1.0,
        "ttft_mean_ms": ttft,
        "ttft_p50_ms": ttft + 1,
        "ttft_p99_ms": 2 * ttft,
        "tpot_p50_ms": 13.0,
        "tpot_p99_ms": tpot_p99,
        "throughput_rps": 10.0,
    }


def test_threshold_recommendation_respects_the_tpot_tolerance():
    sweeps = [
        {"0": _sweep_point(100, 20.0), "256": _sweep_point(90, 20.6), "decode-only": _sweep_point(70, 24.0)},
        {"0": _sweep_point(80, 10.0), "256": _sweep_point(76, 10.0), "decode-only": _sweep_point(60, 12.0)},
        {"0": _sweep_point(90, 10.0), "256": _sweep_point(88, 10.4), "decode-only": _sweep_point(95, 10.0)},
    ]
    stats = handoff_bench.sweep_across_seeds(sweeps)
    assert stats["256"]["tpot_p99_vs_0"] == pytest.approx(1.03)  # median of 1.03, 1.0, 1.04
    assert stats["256"]["ttft_mean_minus_0_ms"] == pytest.approx(-4.0)  # median of -10, -4, -2
    assert stats["256"]["ttft_p50_minus_0_ms"] == pytest.approx(-4.0)
    assert stats["decode-only"]["tpot_p99_vs_0"] == pytest.approx(1.2)
    assert stats["decode-only"]["ttft_mean_ms"] == pytest.approx(70.0) and stats["0"]["requests"] == 30
    chosen = handoff_bench.recommend(stats, tolerance=0.05)
    assert chosen["label"] == "256" and chosen["pd_threshold_tokens"] == 256
    assert chosen["excluded"] == ["decode-only"] and chosen["ttft_mean_minus_0_ms"] == pytest.approx(-4.0)
    assert handoff_bench.recommend(stats, tolerance=0.25)["label"] == "decode-only"
    assert handoff_bench.recommend(stats, tolerance=0.01)["label"] == "0"
    assert handoff_bench.threshold_of("decode-only") > 32768


def test_replicas_benchmark_end_to_end(tmp_path, monkeypatch):
    """One and two gateway replicas (a pair scraping the engines, a pair sharing over a private
    nats-server) with a handful of requests, and a restarted replica: every request is served, the
    sharing pair heard each other, and the restarted replica's view is fresh."""
    monkeypatch.setattr(replicas_bench, "RESTART_AFTER", 0.5)
    monkeypatch.setattr(replicas_bench, "RESTART_REQUESTS", 30)
    out = tmp_path / "replicas.json"
    argv = [
        "--seeds",
        "1",
        "--requests",
        "6",
        "--settings",
        "1-replica,2-replicas-scraped,2-replicas-shared",
        "--json",
        str(out),
    ]
    assert replicas_bench.main(argv) == 0
    output = json.loads(out.read_text())
    runs = output["runs"][str(routing.FIRST_SEED)]
    assert list(runs) == ["1-replica", "2-replicas-scraped", "2-replicas-shared"]
    assert [len(view["peers"]) for view in runs["2-replicas-shared"]["shared"]] == [1, 1]
    for summary in runs.values():
        assert summary["requests"] == 6 and summary["errors"] == 0, summary["error_kinds"]
    stats = output["across_seeds"]
    assert stats["1-replica"]["decode_load_cv_vs_1-replica"] == pytest.approx(1.0)
    restart = output["restart"]
    assert restart["endpoints"] == 10 and restart["traffic_errors"] == 0
    assert restart["recovered_after_ready_s"] >= 0 and restart["restarted_decode_tokens"] >= 0
    assert output["settings"]["2-replicas-scraped"] == {
        "replicas": 2,
        "engine_metrics": True,
        "shared": False,
        "slot_ms": 0.0,
    }
    assert output["across_seeds"]["2-replicas-shared"]["ttft_p90_ms_vs_1-replica"] is not None


def test_replicas_benchmark_on_the_demo_workload_runs_each_setting_on_a_fresh_cluster(tmp_path):
    """The demo's cluster and trace (its first requests only here): one replica, and two sharing."""
    out = tmp_path / "replicas.json"
    settings = "1-replica,2-replicas-shared"
    argv = ["--workload", "demo", "--seeds", "1", "--requests", "4", "--settings", settings]
    argv += ["--json", str(out)]
    assert replicas_bench.main(argv) == 0
    output = json.loads(out.read_text())
    runs = output["runs"][str(routing.FIRST_SEED)]
    assert list(runs) == ["1-replica", "2-replicas-shared"] and output["restart"] is None
    for summary in runs.values():
        assert summary["requests"] == 4 and summary["errors"] == 0, summary["error_kinds"]
    assert all(view["connected"] for view in runs["2-replicas-shared"]["shared"])


def test_replicas_benchmark_refuses_unknown_settings_and_a_restart_without_scraping():
    for argv in (
        ["--settings", "3-replicas"],
        ["--settings", "1-replica"],
        ["--workload", "demo", "--requests", "201"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            replicas_bench.main(argv)
        assert exit_info.value.code == 2
