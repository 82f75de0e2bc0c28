"""Smoke test of bench/decision_scaling.py: it runs and reports well-formed rows (never timing)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return importlib.import_module("bench.decision_scaling")


@pytest.fixture(scope="module")
def rows(bench: ModuleType) -> list[dict]:
    return bench.run(quick=True)


def test_quick_run_covers_every_valid_combination(rows: list[dict]) -> None:
    combos = {(r["endpoints"], r["groups"], r["mode"], r["hits"]) for r in rows}
    expected = {
        (n, g, m, h)
        for n in (8, 64, 512, 4096)
        for g in (1, 4, 16, 64)
        if g <= n // 2
        for m in ("off", "prefer", "strict", "auto")
        for h in (False, True)
    }
    assert combos == expected
    assert len(rows) == len(expected)


def test_rows_are_well_formed(rows: list[dict]) -> None:
    for r in rows:
        assert r["prefills"] + r["decodes"] == r["endpoints"]
        assert r["reps"] > 0
        for field in ("median_us", "p99_us", "scan_floor_us"):
            assert isinstance(r[field], float) and r[field] > 0
        assert r["p99_us"] >= r["median_us"]


def test_main_writes_json_and_png(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert bench.main(["--quick", "--json", str(out_json), "--png", str(out_png)]) == 0
    data = json.loads(out_json.read_text())
    assert data["meta"]["quick"] is True
    assert {r["mode"] for r in data["results"]} == {"off", "prefer", "strict", "auto"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "median" in capsys.readouterr().out
