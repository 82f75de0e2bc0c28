"""Shared pieces of the benchmark scripts: subprocesses, latency summaries, JSON/PNG output."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from sim.report import percentile


def summary_ms(seconds: list[float]) -> dict[str, float]:
    """p50/p99 (nearest rank) and mean in milliseconds of durations in seconds; ``nan`` without any."""
    if not seconds:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan")}
    return {
        "p50_ms": percentile(seconds, 0.5) * 1e3,
        "p99_ms": percentile(seconds, 0.99) * 1e3,
        "mean_ms": statistics.fmean(seconds) * 1e3,
    }


def spawn_python(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python ARGS`` with stdout piped (its first line is read by :func:`first_line`)."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        text=True,
    )


def first_line(process: subprocess.Popen) -> str:
    """The first stdout line of ``process`` (e.g. the port a backend bound)."""
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"subprocess {process.args} printed nothing (exit code {process.poll()})")
    return line


def cpu_seconds(pid: int) -> float:
    """User + system CPU time consumed so far by process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_json(path: str | None, payload: object) -> None:
    """Write ``payload`` as indented JSON when ``path`` is given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2), encoding="utf-8")
