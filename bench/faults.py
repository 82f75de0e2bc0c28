"""Fault campaign: each fault against the real Envoy, pd-extproc as a process and simulated engines.

Every scenario starts its own stack (:mod:`fault_rig`), warms it up, sends a fixed number of streaming
chat requests at a fixed rate while the fault happens, then checks, against the scenario's
expectation: the outcomes the clients saw (each must be in the scenario's allowed set; a 500 or a
non-JSON error never is), hung clients (no byte for the longer of Envoy's idle timeout and ext_proc
message timeout plus a margin: :func:`fault_rig.idle_read_timeout`), the load pd-extproc still counts
10 s after the last client ended (must be zero), pd-extproc alive (unless the scenario kills it), and
every address pd-extproc named or Envoy connected to inside the set of discovered engines (Envoy's
access log). RSS and open file descriptors of pd-extproc are reported before and after; the soak
(:mod:`soak`) checks their growth.

Run: ``python bench/faults.py [--quick] [--scenarios a,b] [--json FILE]`` (exit code 1 if any fails).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import rss_mib, write_json
from fault_rig import Outcome, new_rig, open_fds, run_load, until_ok
from fault_scenarios import SCENARIOS, Scenario
from soak import run_soak


@dataclass(frozen=True)
class Size:
    """How much load a scenario sends: ``requests`` at ``rate`` per second."""

    requests: int
    rate: float


FULL, QUICK = Size(100, 25.0), Size(40, 25.0)


async def run_scenario(scenario: Scenario, size: Size) -> dict:
    """Run one scenario on a fresh rig; its row of the table (see :func:`verdict`)."""
    rig = new_rig(scenario.router_args)
    async with contextlib.AsyncExitStack() as cleanup:
        cleanup.callback(rig.stop)
        duration = size.requests / size.rate
        plan = await scenario.setup(rig, cleanup, duration)
        if rig.router is None:
            await rig.start_router()
        await rig.start_gateway()
        await until_ok(rig.url, scenario.body())
        assert rig.router is not None
        pid = rig.router.pid
        before = {"rss": rss_mib(pid), "fds": await open_fds(pid)}
        outcomes = await run_load(rig.url, size.requests, size.rate, scenario.body, plan.faults)
        alive = rig.router.poll() is None
        load = await rig.settle() if alive else None
        pid = rig.router.pid  # a scenario may have restarted it
        after = {"rss": rss_mib(pid), "fds": await open_fds(pid)} if alive else {"rss": None, "fds": None}
        lines, outside = await rig.named_outside(size.requests)
        extra = await plan.check() if alive and plan.check else None
    return verdict(scenario, outcomes, load, before, after, lines, outside, extra)


def verdict(
    scenario: Scenario,
    outcomes: list[Outcome],
    load: tuple[int, float] | None,
    before: dict,
    after: dict,
    lines: int,
    outside: int,
    extra: str | None,
) -> dict:
    """The row: counts and measurements, ``passed`` and the ``failures`` (empty when it passed)."""
    counts = Counter(o.label for o in outcomes)
    failures = [f"{n} x {label}" for label, n in counts.items() if label not in scenario.allowed]
    if load is None:
        failures.append("pd-extproc exited")
    elif load != (0, 0):
        failures.append(f"load left {load[0]} requests / {load[1]:g} tokens")
    if outside:
        failures.append(f"{outside} access-log lines name an address outside the discovered set")
    if not counts["200"]:
        failures.append("no request served")
    failed = len(outcomes) - counts["200"]
    if failed > scenario.max_failed_share * len(outcomes):
        failures.append(f"{failed} of {len(outcomes)} not served (at most {scenario.max_failed_share:.0%})")
    if extra:
        failures.append(extra)
    return {
        "scenario": scenario.name,
        "expectation": scenario.expectation,
        "requests": len(outcomes),
        "outcomes": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
        "hung": counts["hung"],
        "load_left_requests": None if load is None else load[0],
        "load_left_tokens": None if load is None else load[1],
        "rss_mib_before": before["rss"],
        "rss_mib_after": after["rss"],
        "fds_before": before["fds"],
        "fds_after": after["fds"],
        "access_log_lines": lines,
        "outside_discovered": outside,
        "passed": not failures,
        "failures": failures,
    }


def _cell(value: object, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def format_rows(rows: list[dict]) -> str:
    """The table, then each scenario's expectation and (if it failed) why."""
    head = (
        f"{'scenario':24}{'req':>5}{'hung':>5}{'load left':>11}{'RSS MiB':>14}{'fds':>9}{'outside':>8}"
        "  verdict"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        load = f"{_cell(row['load_left_requests'], '{}')}/{_cell(row['load_left_tokens'], '{:g}')}"
        rss = f"{_cell(row['rss_mib_before'], '{:.0f}')}->{_cell(row['rss_mib_after'], '{:.0f}')}"
        fds = f"{_cell(row['fds_before'], '{}')}->{_cell(row['fds_after'], '{}')}"
        lines.append(
            f"{row['scenario']:24}{row['requests']:>5}{row['hung']:>5}{load:>11}{rss:>14}{fds:>9}"
            f"{row['outside_discovered']:>8}  {'PASS' if row['passed'] else 'FAIL'}"
        )
        outcomes = ", ".join(f"{label} x{n}" for label, n in row["outcomes"].items())
        lines.append(f"{'':24}outcomes: {outcomes}")
    lines.append("")
    for row in rows:
        lines.append(f"{row['scenario']}: {row['expectation']}")
        for failure in row["failures"]:
            lines.append(f"    FAIL: {failure}")
    return "\n".join(lines)


async def run_all(names: list[str], quick: bool, soak_requests: int | None) -> list[dict]:
    """Every named scenario in order (``soak`` runs :func:`soak.run_soak`), printing each row's progress."""
    rows = []
    for name in names:
        print(f"... {name}", file=sys.stderr, flush=True)
        if name == "soak":
            rows.append(await run_soak(quick=quick, requests=soak_requests))
        else:
            rows.append(await run_scenario(SCENARIOS[name], QUICK if quick else FULL))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per scenario, a shorter soak")
    parser.add_argument(
        "--scenarios",
        default=",".join([*SCENARIOS, "soak"]),
        help=f"comma-separated, in order, of: {', '.join([*SCENARIOS, 'soak'])}",
    )
    parser.add_argument(
        "--soak-requests", type=int, help="measured soak requests (default 10000, quick 1000)"
    )
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = sorted(set(names) - {*SCENARIOS, "soak"})
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    rows = asyncio.run(run_all(names, args.quick, args.soak_requests))
    print(format_rows(rows))
    write_json(args.json, rows)
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
