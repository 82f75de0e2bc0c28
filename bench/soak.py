"""Soak: many streaming requests through the real Envoy and pd-extproc, some clients aborting.

The clients that abort do so at random points; the backends are fast (``bench/fast_backend.py``: one chunk at
once, the stream held open ``x-hold-ms``, then ``[DONE]``).

A warm-up (unmeasured for growth) comes first; then pd-extproc's RSS and open file descriptors are
read with no request in flight, the measured requests run, the load drains, and they are read again.
Expectation: every client that did not abort gets a complete 200; pd-extproc's load back to zero
requests and tokens; RSS growth below :data:`MAX_RSS_GROWTH`; no more file descriptors than before.

Run alone: ``python -m bench.soak [--requests N]``; ``bench/faults.py`` runs it as its ``soak`` row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys

import aiohttp

from bench.common import first_line, spawn_python
from bench.fault_rig import Measured, Outcome, chat_body, new_rig, request, table_row, until_ok, usage
from sim.cluster_process import EngineInfo
from sim.gateway import terminate

REQUESTS, QUICK_REQUESTS = 10_000, 1_000
WARMUP = 1_000
CONCURRENCY = 48
ABORT_SHARE = 0.2
HOLD_MS = (0, 40)
"""Each stream is held open a uniform number of milliseconds in this range."""
MAX_RSS_GROWTH = 0.10


async def _client(session: aiohttp.ClientSession, url: str, rng: random.Random) -> Outcome:
    """One streaming request; with probability :data:`ABORT_SHARE` the client gives up at a uniform
    random moment between sending and the end of the hold (before the answer, mid-stream or at its end)."""
    hold = rng.uniform(*HOLD_MS)
    call = request(session, url, chat_body(max_tokens=8, prompt_words=20), {"x-hold-ms": f"{hold:.1f}"})
    if rng.random() >= ABORT_SHARE:
        return await call
    try:
        return await asyncio.wait_for(call, timeout=rng.uniform(0, hold + 5) / 1000)
    except TimeoutError:
        return Outcome("aborted", 0.0)


async def _drive(url: str, requests: int, rng: random.Random) -> list[Outcome]:
    """Send ``requests`` at :data:`CONCURRENCY` at a time; every outcome."""
    pending = iter(range(requests))
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            for _ in pending:
                outcomes.append(await _client(session, f"{url}/v1/chat/completions", rng))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outcomes


async def run_soak(quick: bool = False, requests: int | None = None, seed: int = 9) -> dict:
    """The soak as one row of the fault table, with ``rss_growth`` and ``fd_growth`` added.

    The row has ``bench/faults.py``'s :func:`verdict` keys; ``rss_growth`` is a fraction."""
    requests = requests or (QUICK_REQUESTS if quick else REQUESTS)
    rng = random.Random(seed)
    rig = new_rig()
    backends = [spawn_python(["-m", "bench.fast_backend"]) for _ in range(3)]
    try:
        ports = [first_line(b) for b in backends]
        infos = [
            EngineInfo(f"127.0.0.1:{port}", role, "a", 1 << 20)
            for port, role in zip(ports, ("prefill", "decode", "decode"), strict=True)
        ]
        rig.write_eds(infos)
        await rig.start_router()
        await rig.start_gateway()
        await until_ok(rig.url, chat_body(max_tokens=8))
        warm = await _drive(rig.url, QUICK_REQUESTS // 10 if quick else WARMUP, rng)
        assert rig.router is not None
        await rig.settle()
        before = await usage(rig.router.pid)
        outcomes = await _drive(rig.url, requests, rng)
        load = await rig.settle()
        after = await usage(rig.router.pid)
        lines, outside = await rig.named_outside(requests + len(warm))
    finally:
        rig.stop()
        terminate(*backends)
    return soak_verdict(Measured(outcomes, load, before, after, lines, outside))


def soak_verdict(run: Measured) -> dict:
    """The soak's row of the fault table, also failed on RSS or file-descriptor growth.

    The row is :func:`fault_rig.table_row`'s with ``rss_growth`` (fraction); failed on RSS growth of
    :data:`MAX_RSS_GROWTH` or more, or more file descriptors after than before."""
    assert run.after["rss"] is not None and run.after["fds"] is not None
    growth = run.after["rss"] / run.before["rss"] - 1
    failures = []
    if growth >= MAX_RSS_GROWTH:
        failures.append(f"RSS grew {growth:.1%} (limit {MAX_RSS_GROWTH:.0%})")
    if run.after["fds"] > run.before["fds"]:
        failures.append(f"file descriptors grew {run.before['fds']:.0f} -> {run.after['fds']:.0f}")
    expectation = (
        f"{len(run.outcomes)} streaming requests after a warm-up, {ABORT_SHARE:.0%} of the clients "
        "aborting at random points: the others get a complete 200, load back to 0, RSS growth < "
        f"{MAX_RSS_GROWTH:.0%}, no file-descriptor growth"
    )
    return {
        **table_row("soak", expectation, frozenset({"200", "aborted"}), run, failures),
        "rss_growth": growth,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the soak from the command line ``argv``; 0 when its row passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=REQUESTS, help="measured requests")
    args = parser.parse_args(argv)
    row = asyncio.run(run_soak(requests=args.requests))
    for key, value in row.items():
        print(f"{key}: {value}")
    return 0 if row["passed"] else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
