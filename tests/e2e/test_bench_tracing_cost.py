"""Smoke test of bench/tracing_cost.py at a reduced size (never timing): both levels run, every ratio-1 span
reaches the collector, and the JSON holds each configuration's numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_three_configurations_run_and_every_span_arrives(tmp_path: Path) -> None:
    out = tmp_path / "tracing.json"
    command = [
        sys.executable,
        "-m",
        "bench.tracing_cost",
        "--rounds",
        "1",
        "--batch",
        "20",
        "--json",
        str(out),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "spans at ratio 1: 80 sent, 80 received" in result.stdout
    data = json.loads(out.read_text())
    for level in ("stream", "server"):
        assert set(data[level]["median_cpu_us_per_request"]) == {"off", "ratio_0", "ratio_1"}
        assert data[level]["cpu_ratio_to_off"]["off"] == 1.0
