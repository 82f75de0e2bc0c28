"""Gateway replicas: the same simulated cluster behind one gateway and behind two, with and without the
engine load signal.

One simulated cluster (the routing benchmark's reference scenario, ``two-equal-groups``) is started per
workload seed, and the same seeded streaming workload is sent, ``prefer`` at bonus 0.3, through:

* ``1-replica``: one Envoy + one pd-extproc (local accounting only), the baseline;
* ``2-replicas``: two Envoys, each with its own pd-extproc, the client spreading requests round robin
  over both, local accounting only: each router sees about half the load;
* ``2-replicas-scraped``: the same, both pd-extprocs scraping the engines' ``/metrics`` every
  ``--interval`` seconds (``engine_metrics``);
* ``1-replica-scraped``: one gateway with the engine load signal (does it cost a single gateway anything?).

Reported per setting: decode load CV, cross-group KV share, decode TTFT p50, errors; across seeds the
median [min-max] and the median of per-seed ratios to ``1-replica`` (to the first setting run when
``1-replica`` is not).

Restart: after the runs of the first seed, with requests flowing through replica 0, replica 1's
pd-extproc is restarted, and its ``/debug/endpoints`` is read every 5 ms from the moment it is ready:
how long until every endpoint has a fresh engine sample (in scrape intervals), and how its blended view
of the decodes compares with the running replica's at that moment.

Run: ``python bench/replicas.py [--seeds N] [--requests N] [--interval S] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

import aiohttp

from bench.common import write_json
from bench.routing_quality import FIRST_SEED, SCENARIOS, across_seeds
from ext_proc.engine_load.config import EngineMetricsConfig
from sim.experiment import measure
from sim.report import format_table
from sim.stack import Stack, start_stack
from sim.workload import plan_workload, run_workload

SCENARIO = "two-equal-groups"
BASE = "1-replica"
SETTINGS: dict[str, tuple[int, bool]] = {  # name: (replicas, engine metrics)
    BASE: (1, False),
    "2-replicas": (2, False),
    "2-replicas-scraped": (2, True),
    "1-replica-scraped": (1, True),
}
RESTART_AFTER = 3.0
"""Seconds of traffic through replica 0 before replica 1's pd-extproc restarts."""
RESTART_REQUESTS = 80
"""Requests (at 10 req/s) flowing through replica 0 around the restart: they must outlast it."""


async def _debug(session: aiohttp.ClientSession, admin_url: str) -> list[dict]:
    async with session.get(f"{admin_url}/debug/endpoints") as response:
        return [row for row in await response.json() if row["pickable"]]


def _decode_view(rows: list[dict]) -> float:
    """Blended tokens over the decodes of one replica's view."""
    return float(sum(row["blended_tokens"] for row in rows if row["role"] == "decode"))


async def measure_restart(stack: Stack, interval: float) -> dict:
    """Restart replica 1's pd-extproc under traffic through replica 0; see the module docstring."""
    plans = plan_workload(RESTART_REQUESTS, 10.0, SCENARIOS[SCENARIO].prompt_tokens, seed=99)
    traffic = asyncio.create_task(run_workload(stack.replicas[0].gateway.url, plans))  # type: ignore[union-attr]
    try:
        await asyncio.sleep(RESTART_AFTER)
        await stack.restart_router(1)
        ready = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            first = await _debug(session, stack.replicas[1].admin_url)
            rows = first
            while not all(row["engine"]["fresh"] for row in rows):
                await asyncio.sleep(0.005)
                rows = await _debug(session, stack.replicas[1].admin_url)
            recovered = time.perf_counter() - ready
            peer = await _debug(session, stack.replicas[0].admin_url)
    finally:
        records, _ = await traffic
    restarted, running = _decode_view(rows), _decode_view(peer)
    return {
        "interval_s": interval,
        "recovered_after_ready_s": recovered,
        "recovered_in_intervals": recovered / interval,
        "fresh_at_first_read": sum(row["engine"]["fresh"] for row in first),
        "endpoints": len(rows),
        "restarted_decode_tokens": restarted,
        "running_replica_decode_tokens": running,
        "view_ratio": restarted / running if running else None,
        "traffic_errors": sum(not r.ok for r in records),
    }


async def run_seed(
    seed: int, requests: int, interval: float, settings: list[str], restart: bool
) -> tuple[dict[str, dict], dict | None]:
    """Every setting on one cluster with one workload seed; the restart measurement if asked."""
    scenario = SCENARIOS[SCENARIO]
    plans = plan_workload(requests, scenario.rate, scenario.prompt_tokens, seed=seed)
    stack = start_stack(scenario.engines)
    results: dict[str, dict] = {}
    recovery = None
    try:
        for name in settings:
            replicas, scraped = SETTINGS[name]
            metrics = interval if scraped else None
            results[name] = await measure(
                stack, "prefer", plans, 0.3, replicas=replicas, engine_metrics=metrics
            )
            print(f"  seed {seed} {name}: done", file=sys.stderr, flush=True)
        if restart:
            await stack.route_with("prefer", 0.3, replicas=2, engine_metrics=interval)
            recovery = await measure_restart(stack, interval)
    finally:
        stack.stop()
    return results, recovery


COLUMNS = (
    ("decode_load_cv", "decode load CV", ".3f"),
    ("cross_group_share", "cross-group KV", ".1%"),
    ("decode_ttft_p50_ms", "dTTFT p50 ms", ".1f"),
)


def format_summary(stats: dict[str, dict], seeds: int, base: str) -> str:
    """Medians [min-max] over seeds and the median per-seed ratio of load CV to setting ``base``'s."""
    head = (
        f"{'setting':<22}"
        + "".join(f"{title:>26}" for _, title, _ in COLUMNS)
        + f"{'CV/' + base:>22}{'errors':>8}"
    )
    lines = [f"across {seeds} workload seeds: median [min-max]", head, "-" * len(head)]
    for name, row in stats.items():
        cells = []
        for key, _, fmt in COLUMNS:
            v = row[key]
            cells.append("n/a" if v is None else f"{v['median']:{fmt}} [{v['min']:{fmt}}-{v['max']:{fmt}}]")
        ratio = row[f"decode_load_cv_vs_{base}"]
        lines.append(
            f"{name:<22}"
            + "".join(f"{c:>26}" for c in cells)
            + f"{'n/a' if ratio is None else f'{ratio:.2f}x':>22}{row['errors']:>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds (default 3)")
    parser.add_argument(
        "--requests",
        type=int,
        default=SCENARIOS[SCENARIO].requests,
        help="requests per run (default %(default)s)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=EngineMetricsConfig.interval_seconds,
        help="engine_metrics.interval_seconds (default %(default)s)",
    )
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help="comma-separated subset of the settings"
    )
    parser.add_argument("--no-restart", action="store_true", help="skip the restart measurement")
    parser.add_argument("--json", help="write all results as JSON")
    args = parser.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    if args.seeds < 1 or args.requests < 1:
        parser.error("--seeds and --requests must be at least 1")
    restart = not args.no_restart
    if restart and "2-replicas-scraped" not in settings:
        parser.error("the restart measurement needs the 2-replicas-scraped setting (or --no-restart)")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))
    runs: dict[int, dict[str, dict]] = {}
    recovery = None
    for seed in seeds:
        runs[seed], measured = asyncio.run(
            run_seed(seed, args.requests, args.interval, settings, restart and seed == seeds[0])
        )
        recovery = recovery or measured
        print(f"\n{SCENARIO}, prefer@0.3 (workload seed {seed})")
        print(format_table(runs[seed]))
    base = BASE if BASE in settings else settings[0]
    stats = across_seeds(runs, base=base)
    print("\n" + format_summary(stats, len(seeds), base))
    if recovery is not None:
        print(
            f"\nrestart: every endpoint fresh {recovery['recovered_after_ready_s'] * 1e3:.0f} ms after ready "
            f"({recovery['recovered_in_intervals']:.1f} scrape intervals of {args.interval:g} s; "
            f"{recovery['fresh_at_first_read']}/{recovery['endpoints']} fresh at the first read); "
            f"its decode view / the running replica's: {recovery['view_ratio']}"
        )
    output = {
        "scenario": SCENARIO,
        "interval_s": args.interval,
        "seeds": seeds,
        "runs": runs,
        "across_seeds": stats,
        "restart": recovery,
        "settings": {
            name: {"replicas": SETTINGS[name][0], "engine_metrics": SETTINGS[name][1]} for name in settings
        },
    }
    write_json(args.json, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
