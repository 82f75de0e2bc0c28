"""Smoke test of bench/prefix_source_cost.py on a few requests of the conversation trace's head."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from sim.traces import SAMPLE


def test_both_sources_are_timed_call_by_call_and_the_events_applied_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = importlib.import_module("bench.prefix_source_cost")
    out = tmp_path / "cost.json"
    argv = [str(SAMPLE), "--start", "0", "--count", "12", "--warmup", "4", "--json", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    for source in ("approximate", "kv-events"):
        row = data[source]
        assert all(row[f"{call}_p50_us"] > 0 for call in [*bench.CALLS, "total"])
    assert data["apply"]["total_p50_us"] > 0
    assert "kv-events / approximate" in capsys.readouterr().out
