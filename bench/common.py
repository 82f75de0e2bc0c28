"""Shared pieces of the benchmark scripts: subprocesses, latency summaries, closed loops, JSON output."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from sim.gateway import Gateway, free_port, render_bootstrap, start_gateway
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


async def timed_post(session: aiohttp.ClientSession, url: str, body: dict | bytes) -> float:
    """Seconds one POST of ``body`` to ``url`` took to be answered in full.

    ``body``: a JSON object, or its encoding. ``RuntimeError`` unless the answer is a 200."""
    started = time.perf_counter()
    sent = {"json": body} if isinstance(body, dict) else {"data": body, "headers": _JSON}
    async with session.post(url, **sent) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
    return time.perf_counter() - started


_JSON = {"Content-Type": "application/json"}


async def closed_loop(
    send: Callable[[int], Awaitable[object]], concurrency: int, seconds: float
) -> tuple[int, int, float]:
    """Run ``concurrency`` closed-loop clients for ``seconds``: (completed, failed, seconds elapsed).

    Each client awaits ``send(n)`` back to back (``n``: the requests sent so far); a request failed
    on ``RuntimeError`` or ``aiohttp.ClientError``."""
    done = errors = 0
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done, errors
        while time.perf_counter() < deadline:
            try:
                await send(done + errors)
                done += 1
            except (RuntimeError, aiohttp.ClientError):
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done, errors, time.perf_counter() - started


async def start_envoy(
    eds: list[str], extproc_port: int | None, *, fail_open: bool = False, full_duplex: bool = False
) -> Gateway:
    """Start Envoy from the shipped bootstrap on free loopback ports, one worker thread.

    - its clusters are read from the EDS files ``eds`` (prefill, decode);
    - ``extproc_port`` ``None``: without the ext_proc filter;
    - the other options: :func:`sim.gateway.render_bootstrap`'s."""
    listen, admin = free_port(), free_port()
    bootstrap = render_bootstrap(
        listen_port=listen,
        admin_port=admin,
        extproc_port=extproc_port,
        decode_eds_path=eds[1],
        prefill_eds_path=eds[0],
        prefill_leg_port=free_port(),
        fail_open=fail_open,
        full_duplex=full_duplex,
    )
    return await start_gateway(bootstrap, listen, admin, concurrency=1)


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
