"""Fault campaign: each fault against the real Envoy, pd-extproc as a process and simulated engines.

Every scenario starts its own stack (:mod:`fault_rig`), warms it up, sends a fixed number of streaming
chat requests at a fixed rate while the fault happens, then checks, against the scenario's
expectation: the outcomes the clients saw (each must be in the scenario's allowed set; a 500 or a
non-JSON error never is), hung clients (no byte for the longer of Envoy's idle timeout and ext_proc
message timeout plus a margin: :func:`fault_rig.idle_read_timeout`), the load pd-extproc still counts
10 s after the last client ended (must be zero), pd-extproc alive (unless the scenario kills it), one
line per request in Envoy's access log, and every address pd-extproc named or Envoy connected to in
the set of engines discovered when the request was decided (:func:`fault_rig.names_outside`). RSS and
open file descriptors of pd-extproc are reported before and after; the soak (:mod:`soak`) checks their
growth.

Run: ``python -m bench.faults [--quick] [--scenarios a,b] [--json FILE]`` (exit code 1 if any fails).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass

from bench.common import write_json
from bench.fault_rig import Measured, new_rig, run_load, table_row, until_ok, usage
from bench.fault_scenarios import RATE, SCENARIOS, Scenario
from bench.soak import run_soak


@dataclass(frozen=True)
class Size:
    """How much load a scenario sends: ``requests`` at ``rate`` per second."""

    requests: int
    rate: float


FULL, QUICK = Size(100, RATE), Size(40, RATE)


async def run_scenario(scenario: Scenario, size: Size) -> dict:
    """Run one scenario on a fresh rig; its row of the table (see :func:`verdict`)."""
    rig = new_rig(scenario.router_args)
    async with contextlib.AsyncExitStack() as cleanup:
        cleanup.callback(rig.stop)
        rate = min(size.rate, size.requests / scenario.min_seconds) if scenario.min_seconds else size.rate
        duration = size.requests / rate
        plan = await scenario.setup(rig, cleanup, duration)
        if rig.router is None:
            await rig.start_router()
        await rig.start_gateway()
        await until_ok(rig.url, scenario.body())
        assert rig.router is not None
        before = await usage(rig.router.pid)
        outcomes = await run_load(rig.url, size.requests, rate, scenario.body, plan.faults)
        alive = rig.router.poll() is None  # (a scenario may have restarted it: the new one)
        load = await rig.settle() if alive else None
        after = await usage(rig.router.pid) if alive else {"rss": None, "fds": None}
        lines, outside = await rig.named_outside(size.requests)
        extra = await plan.check() if alive and plan.check else None
    return verdict(scenario, Measured(outcomes, load, before, after, lines, outside), extra)


def verdict(scenario: Scenario, run: Measured, extra: str | None) -> dict:
    """The scenario's row of the fault table, with the campaign's common expectation applied.

    The row is :func:`fault_rig.table_row`'s, also failed when no request was served, more than
    ``max_failed_share`` were not, or the scenario's final check said ``extra``."""
    served = sum(o.label == "200" for o in run.outcomes)
    failures = [] if served else ["no request served"]
    failed = len(run.outcomes) - served
    if failed > scenario.max_failed_share * len(run.outcomes):
        failures.append(
            f"{failed} of {len(run.outcomes)} not served (at most {scenario.max_failed_share:.0%})"
        )
    if extra:
        failures.append(extra)
    return table_row(scenario.name, scenario.expectation, scenario.allowed, run, failures)


def _cell(value: object, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def format_rows(rows: list[dict]) -> str:
    """The table, then each scenario's expectation and (if it failed) why."""
    head = (
        f"{'scenario':24}{'req':>6}{'hung':>5}{'load left':>11}{'RSS MiB':>14}{'fds':>9}{'outside':>8}"
        f"{'s':>5}  verdict"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        load = f"{_cell(row['load_left_requests'], '{}')}/{_cell(row['load_left_tokens'], '{:g}')}"
        rss = f"{_cell(row['rss_mib_before'], '{:.0f}')}->{_cell(row['rss_mib_after'], '{:.0f}')}"
        fds = f"{_cell(row['fds_before'], '{}')}->{_cell(row['fds_after'], '{}')}"
        lines.append(
            f"{row['scenario']:24}{row['requests']:>6}{row['hung']:>5}{load:>11}{rss:>14}{fds:>9}"
            f"{row['outside_discovered']:>8}{row['seconds']:>5.0f}  {'PASS' if row['passed'] else 'FAIL'}"
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
        started = time.monotonic()
        if name == "soak":
            row = await run_soak(quick=quick, requests=soak_requests)
        else:
            row = await run_scenario(SCENARIOS[name], QUICK if quick else FULL)
        rows.append({**row, "seconds": time.monotonic() - started})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the fault campaign from the command line ``argv``; 0 when every row passed."""
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
