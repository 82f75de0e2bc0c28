"""``bench/trace_replay.py --stack`` on a tiny window of the conversation trace's head: the real Envoy,
``pd-extproc serve`` and simulated engines over HTTP; structure and errors, never timing."""

from __future__ import annotations

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


def test_the_stack_replays_a_window_with_no_errors(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "stack.json"
    argv = ["--stack", "--count", "6", "--max-output", "4", "--speed", "4"]
    assert (
        bench.main([str(HEAD), *argv, "--settings", "pair:prefer,pair:auto+prefix", "--json", str(out)]) == 0
    )
    data = json.loads(out.read_text())
    assert set(data["settings"]) == {"pair:prefer", "pair:auto+prefix"} and data["verdicts"] == []
    for row in data["settings"].values():
        assert row["requests"] == 6 and row["errors"] == 0, row["error_kinds"]
        assert row["kv_transfers"] == 6 and row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
    assert data["settings"]["pair:prefer"]["cross_group_share"] == 0.0


def test_settings_of_virtual_time_only_are_refused_with_stack(bench: ModuleType) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.main([str(HEAD), "--stack", "--settings", "pair:auto,sglang"])
    assert exited.value.code == 2
