"""Smoke test of ``pd-extproc demo`` at a reduced size: structure and sanity, never timing."""

from __future__ import annotations

import json
import statistics

import pytest

from demo.cli import CV_NOTE
from ext_proc.cli import main
from sim.cluster import clusters
from sim.demo import CLUSTER, CPU_TIER_TOKENS, run_demo
from sim.experiment import measure
from sim.profiles import MEASURED_PROFILE, engines_of, load_profile
from sim.report import better
from sim.stack import StackError, start_stack
from sim.traces import SAMPLE, read_window
from sim.workload import trace_plans

TINY = trace_plans(read_window(SAMPLE, None, 0, 8), speed=4.0, max_output=4)
"""The sample's first 8 requests (2-27k-token prompts, above the PD threshold), 4x faster, 4 tokens out."""


async def test_demo_replays_the_trace_in_each_mode_and_strict_never_crosses_groups():
    results = await run_demo(TINY, modes=["off", "strict"], bonus=0.3)
    assert list(results) == ["off", "strict"]
    for summary in results.values():
        assert summary["requests"] == 8
        assert summary["errors"] == 0, summary["error_kinds"]
        assert summary["kv_transfers"] == 8  # every request went prefill -> decode
        assert summary["decode_ttft_p50_ms"] > 0 and summary["tpot_p50_ms"] > 0
        assert summary["throughput_rps"] > 0
        loads = list(summary["decode_loads"].values())
        assert len(loads) == 5  # one per decode engine of the demo cluster (rack-a 3, rack-b 2)
        assert min(loads) >= 0 and sum(loads) > 0
        assert summary["decode_load_cv"] == pytest.approx(statistics.pstdev(loads) / statistics.fmean(loads))
    assert results["strict"]["cross_group_share"] == 0.0


async def test_demo_runs_vllm_mooncake_on_mooncake_engines():
    (summary,) = (await run_demo(TINY[:6], modes=["strict"], bonus=0.3, handoff="vllm-mooncake")).values()
    assert summary["requests"] == 6 and summary["errors"] == 0, summary["error_kinds"]
    assert summary["kv_transfers"] == 6 and summary["cross_group_share"] == 0.0


def test_demo_cli_replays_a_window_writes_json_and_rejects_unknown_modes(tmp_path, capsys):
    out = tmp_path / "demo.json"
    argv = ["--start", "10", "--count", "4", "--speed", "10", "--max-output", "2", "--modes", "prefer"]
    assert main(["demo", *argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "prefer" in printed and "cross-group KV" in printed
    assert "4 requests per mode of mooncake_conversation_head.jsonl (requests 10-13" in printed
    assert "engines h200-llama-3-8b" in printed
    assert f"\n{better()}\n{CV_NOTE}\n" in printed
    assert json.loads(out.read_text())["prefer"]["requests"] == 4
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--modes", "sideways"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--count", "0"], "must be an integer >= 1"),
        (["--requests", "0"], "must be an integer >= 1"),
        (["--speed", "0"], "must be a number > 0"),
        (["--rate", "0"], "must be a number > 0"),
        (["--start", "-1"], "must be an integer >= 0"),
        (["--bonus", "1.5"], "must be a number in [0, 1]"),
        (["--profile", "h100-nothing"], "invalid choice"),
    ],
)
def test_demo_rejects_bad_sizes_with_a_usage_error(capsys, argv, phrase):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    assert phrase in capsys.readouterr().err


def test_the_demo_engines_run_the_measured_profile():
    large, small, kv = engines_of(MEASURED_PROFILE, CPU_TIER_TOKENS)
    stack = start_stack(clusters(large, small)[CLUSTER], large, kv)
    try:
        capacities = {(e.role, e.group): e.token_capacity for e in stack.cluster.engines}
    finally:
        stack.stop()
    hbm = load_profile(MEASURED_PROFILE).timing.kv_capacity_tokens  # ~840k tokens of an H200
    assert capacities == {
        ("prefill", "rack-a"): hbm,
        ("decode", "rack-a"): hbm,
        ("prefill", "rack-b"): hbm,
        ("decode", "rack-b"): hbm // 2,
    }


async def test_a_run_stops_naming_envoy_when_it_dies_mid_run():
    """Envoy killed after the first answer: the run ends with why, not with a row of failed requests."""
    large, small, kv = engines_of(MEASURED_PROFILE, CPU_TIER_TOKENS)
    stack = start_stack(clusters(large, small)[CLUSTER], large, kv)
    killed: list[int] = []

    def kill_envoy_once() -> None:
        gateway = stack.replicas[0].gateway
        if not killed and gateway is not None:
            gateway.process.kill()
            killed.append(gateway.process.pid)

    plans = trace_plans(read_window(SAMPLE, None, 0, 40), speed=2.0, max_output=4)  # ~5 s of arrivals
    try:
        with pytest.raises(StackError, match=r"^Envoy exited with code -9; the end of its log:"):
            await measure(stack, "prefer", plans, progress=kill_envoy_once, handoff="kv-transfer-params")
    finally:
        stack.stop()
    assert killed
