"""Smoke test of bench/trace_replay.py on a tiny window of the conversation trace's head (seconds):
every setting runs, the JSON and the plot are written, and bad input gives one line, no traceback."""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from sim.traces import SAMPLE

HEAD = SAMPLE  # 200 requests


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return importlib.import_module("bench.trace_replay")


def test_a_tiny_window_of_every_setting_writes_json_and_png(bench: ModuleType, tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = [str(HEAD), "--start", "10", "--count", "12", "--max-output", "16", "--speed", "4"]
    assert bench.main([*argv, "--cpu-tier", "100000", "--json", str(out), "--png", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["window"]["start"] == 10 and data["window"]["count"] == 12
    assert data["profile"] == "h200-llama-3-8b" and data["cpu_tier_tokens"] == 100000
    assert set(data["settings"]) == set(bench.SETTINGS) and "dynamo" in data["settings"]
    assert 0.0 <= data["bound"]["hit_rate"] <= 1.0
    shared = {name for name in bench.SETTINGS if name.endswith(" shared")}
    assert {"pair:auto+prefix x4 shared", "pair:auto+events x4 shared"} <= shared
    for name, row in data["settings"].items():
        assert row["requests"] == 12 and row["errors"] == 0
        assert (row["tokenize_us_p50"] > 0) == ("events" in name)  # the tokenizer's stand-in, timed apart
        if name in shared:  # the replicas told each other every booking, and nothing was dropped
            assert row["sync_kb_per_request"] > 0 and row["sync_dropped"] == 0
        else:
            assert "sync_kb_per_request" not in row
        assert row["hit_rate"] == pytest.approx(row["hbm_hit_rate"] + row["cpu_hit_rate"])
        assert row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert 0.0 <= row["cross_group_share"] <= 1.0 and row["throughput_rps"] > 0
    assert png.stat().st_size > 0


def test_shared_settings_run_once_per_sync_delay_on_spread_arrivals(
    bench: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    argv = [str(HEAD), "--count", "30", "--max-output", "8", "--spread", "--sync-delay-ms", "0,200"]
    settings = "pair:auto+prefix,pair:auto+prefix x2 shared"
    assert bench.main([*argv, "--settings", settings, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["spread"] and data["sync_delay_ms"] == [0, 200]
    names = ["pair:auto+prefix", "pair:auto+prefix x2 shared 0ms", "pair:auto+prefix x2 shared 200ms"]
    assert list(data["settings"]) == names
    assert all(data["settings"][n]["sync_dropped"] == 0 for n in names[1:])


def test_shared_replicas_see_each_others_bookings_after_the_sync_delay(bench: ModuleType) -> None:
    """Two replicas on the real seam: a booking of one is on the other's endpoint the sync delay (and the
    shipped batch delay) later, in virtual time, and leaves it when released."""
    from bench.prefix_peers import Endpoint
    from ext_proc.affinity import AutoModel
    from ext_proc.shared.config import SharedStateConfig
    from sim.virtual import new_loop

    endpoints = [Endpoint("p:1", "prefill", "g", 1e6), Endpoint("d:1", "decode", "g", 1e6)]
    replicas = bench.SHARED_SETTINGS["pair:auto+prefix x2 shared"](0.05)(endpoints, {}, AutoModel())
    assert isinstance(replicas, bench.SharedReplicas)
    a, b = (r.router.registry for r in replicas.routers)
    loop = new_loop()
    seen: list[int] = []

    async def run() -> None:
        await replicas.start()
        placed = replicas.routers[0].place({"model": "m", "prompt": "x" * 4000, "max_tokens": 4})
        for _ in range(6):
            seen.append(b.find("prefill", "p:1").peer_requests)  # type: ignore[union-attr]
            await asyncio.sleep(0.02)
        placed.release()
        await asyncio.sleep(0.1)
        seen.append(b.find("decode", "d:1").peer_requests)  # type: ignore[union-attr]
        await replicas.stop()

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    arrives = SharedStateConfig().batch_seconds + 0.05  # the batch delay, then the sync delay
    expected = [int(0.02 * i > arrives) for i in range(6)] + [0]  # sampled every 20 ms, then released
    assert 0 < sum(expected) < 6 and seen == expected
    assert a.find("prefill", "p:1").own_requests == 0  # type: ignore[union-attr]
    assert replicas.totals().dropped == {}


def test_the_cpu_tier_keeps_reuse_that_hbm_evicted(bench: ModuleType) -> None:
    """With a KV cache of a dozen prompts, more of the head's repeats hit, in the CPU tier."""
    requests = bench.read_window(HEAD, None, 0, 200)
    without, with_tier = (
        bench.run_setting(bench.Replay(requests, 4, 1.0, "demo", "legacy", tier, 150_000), "oracle")[1]
        for tier in (0, 2_000_000)
    )
    assert without["cpu_hit_rate"] == 0.0
    assert with_tier["cpu_hit_rate"] > 0.0 and with_tier["hit_rate"] > without["hit_rate"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--format", "sharegpt"], "--format: unknown trace format 'sharegpt'"),
        (["--start", "500"], "--start 500 --count 1200: the window runs past the end"),
        (  # before any window runs (none printed its progress)
            ["--start", "0,195", "--count", "10"],
            f"--start 195 --count 10: the window runs past the end of {HEAD}, which holds 200 requests "
            "(0-199)",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_option(
    bench: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert bench.main([str(HEAD), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_malformed_line_is_named(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(HEAD.read_text().splitlines()[0] + "\n{oops\n")
    assert bench.main([str(trace)]) == 2
    assert "t.jsonl:2: not a Mooncake trace line" in capsys.readouterr().err


def test_unknown_settings_and_clusters_exit_with_usage(bench: ModuleType) -> None:
    for argv in (["--settings", "vllm"], ["--cluster", "huge"], ["--profile", "h100"], ["--speed", "0"]):
        with pytest.raises(SystemExit) as exited:
            bench.main([str(HEAD), *argv])
        assert exited.value.code == 2


def test_several_windows_give_each_one_and_the_medians(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = [str(HEAD), "--start", "0,30,60", "--count", "6", "--max-output", "4", "--settings", "off,oracle"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [w["start"] for w in data["window"]] == [0, 30, 60]
    assert len(data["windows"]) == 3 and set(data["settings"]) == {"off", "oracle"}
    p90s = sorted(w["settings"]["off"]["ttft_p90_ms"] for w in data["windows"])
    assert data["settings"]["off"]["ttft_p90_ms"] == p90s[1]
