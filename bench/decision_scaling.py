"""How the routing decision's latency grows with the cluster: times ``ext_proc.affinity.choose``.

In-process micro-benchmark (not a test). For 8, 64, 512 and 4,096 endpoints (half prefill, half
decode) spread over 1, 4, 16 and 64 ``pdGroupID`` groups (combinations with more groups than
endpoints per role are skipped) and each affinity mode, without and with prefix-cache hits (``hits``:
every endpoint holds a random share of the prompt, the most work the decision does with them), it
times single ``choose`` calls with ``time.perf_counter_ns`` and reports the median and p99 in µs per
decision. Loads, capacities and
request costs are random but seeded, and rotate over a few snapshots so no single lucky layout is
measured. Each snapshot is a pair of :class:`~ext_proc.affinity.Pool` values built once, as the
registry keeps them (building is not timed). ``scan_floor_us`` is the median time of merely
computing ``u`` once per endpoint over the same endpoints as ``Candidate`` objects (two list
comprehensions): the floor any pure-Python decision over per-endpoint objects pays.

Usage (from the repository root)::

    python -m bench.decision_scaling [--quick] [--json FILE] [--png FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ext_proc.affinity import Candidate, Cost, Hits, Mode, Policy, Pool, choose

ENDPOINTS = (8, 64, 512, 4096)
GROUPS = (1, 4, 16, 64)
REPS = {8: 20_000, 64: 10_000, 512: 2_000, 4096: 400}
QUICK_REPS = {8: 50, 64: 50, 512: 10, 4096: 3}
SNAPSHOTS = 4  # load layouts cycled through per combination
CAPACITIES = (8192.0, 16384.0, 32768.0, 65536.0)


def make_pool(n_per_role: int, groups: int, rnd: random.Random, role: str) -> list[Candidate]:
    """``n_per_role`` endpoints round-robin over ``groups`` groups, 0-80 % loaded, 0-32 requests."""
    pool = []
    for i in range(n_per_role):
        cap = rnd.choice(CAPACITIES)
        pool.append(
            Candidate(
                address=f"10.{role}.{i // 250}.{i % 250}:8000",
                group=f"g{i % groups}",
                token_capacity=cap,
                active_tokens=rnd.randrange(int(cap * 0.8)),
                active_requests=rnd.randrange(33),
            )
        )
    return pool


def _percentile(sorted_ns: Sequence[int], q: float) -> float:
    return sorted_ns[round(q * (len(sorted_ns) - 1))] / 1000.0


def _time(call: Callable[[int], object], reps: int) -> list[int]:
    """``reps`` timings in ns of ``call(i)``, after a short warm-up, sorted."""
    for i in range(min(reps, 50)):
        call(i)
    gc.collect()
    clock = time.perf_counter_ns
    samples = []
    for i in range(reps):
        start = clock()
        call(i)
        samples.append(clock() - start)
    samples.sort()
    return samples


def run(quick: bool) -> list[dict[str, Any]]:
    """Time every (endpoints, groups, mode) combination; one result row per combination."""
    reps_for = QUICK_REPS if quick else REPS
    rows: list[dict[str, Any]] = []
    for endpoints in ENDPOINTS:
        half = endpoints // 2
        for groups in GROUPS:
            if groups > half:
                continue
            rnd = random.Random(endpoints * 1000 + groups)
            snapshots = [
                (make_pool(half, groups, rnd, "1"), make_pool(half, groups, rnd, "2"))
                for _ in range(SNAPSHOTS)
            ]
            pools = [(Pool.of(prefills), Pool.of(decodes)) for prefills, decodes in snapshots]
            costs, hit_sets = [], []
            for _ in range(64):
                prompt = rnd.randrange(100, 4000)
                costs.append(Cost(prefill_tokens=prompt, decode_tokens=prompt + rnd.randrange(64, 1024)))
                hit_sets.append(
                    Hits(
                        np.array([rnd.randrange(prompt + 1) for _ in range(half)], dtype=np.int64),
                        np.array([rnd.randrange(prompt + 1) for _ in range(half)], dtype=np.int64),
                    )
                )
            reps = reps_for[endpoints]

            def floor(i: int, snapshots: list = snapshots, costs: list = costs) -> object:
                prefills, decodes = snapshots[i % SNAPSHOTS]
                cost = costs[i % 64]
                pc, dc = cost.prefill_tokens, cost.decode_tokens
                return (
                    [(p.active_tokens + pc) / p.token_capacity for p in prefills],
                    [(d.active_tokens + dc) / d.token_capacity for d in decodes],
                )

            floor_samples = _time(floor, reps)
            for mode in Mode:
                policy = Policy(mode=mode, bonus=0.3, fallback_count=2, prefix_weight=0.1)
                for with_hits in (False, True):
                    hits = hit_sets if with_hits else [None] * 64

                    def decide(
                        i: int,
                        pools: list = pools,
                        costs: list = costs,
                        policy: Policy = policy,
                        hits: list = hits,
                    ) -> object:
                        prefills, decodes = pools[i % SNAPSHOTS]
                        return choose(costs[i % 64], prefills, decodes, policy, i, hits[i % 64])

                    samples = _time(decide, reps)
                    rows.append(
                        {
                            "endpoints": endpoints,
                            "prefills": half,
                            "decodes": half,
                            "groups": groups,
                            "mode": mode.value,
                            "hits": with_hits,
                            "reps": reps,
                            "median_us": _percentile(samples, 0.5),
                            "p99_us": _percentile(samples, 0.99),
                            "scan_floor_us": _percentile(floor_samples, 0.5),
                        }
                    )
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table, one line per row under a header."""
    header = f"{'endpoints':>9} {'groups':>6} {'mode':>7} {'hits':>5} {'median µs':>10} "
    header += f"{'p99 µs':>9} {'floor µs':>9} {'reps':>6}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['endpoints']:>9} {r['groups']:>6} {r['mode']:>7} {'yes' if r['hits'] else 'no':>5} "
            f"{r['median_us']:>10.1f} {r['p99_us']:>9.1f} {r['scan_floor_us']:>9.1f} {r['reps']:>6}"
        )
    return "\n".join(lines)


def write_png(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Median µs per decision against endpoints (log-log), one panel per mode, a line per group count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m.value for m in Mode]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), sharey=True)
    for ax, mode in zip(axes, modes, strict=True):
        for groups in GROUPS:
            pts = [
                (r["endpoints"], r["median_us"])
                for r in rows
                if r["mode"] == mode and r["groups"] == groups and not r["hits"]
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{groups} group(s)")
        floor = sorted(
            {(r["endpoints"], r["scan_floor_us"]) for r in rows if r["mode"] == mode and r["groups"] == 1}
        )
        ax.plot(*zip(*floor, strict=True), linestyle=":", color="grey", label="u-scan floor")
        ax.scatter([64, 4096], [40, 200], marker="x", color="red", label="target")
        ax.set(xscale="log", yscale="log", title=f"mode={mode}", xlabel="endpoints (half prefill)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median µs per decision")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the table (and write JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="few repetitions: a smoke run, not a measurement"
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--png", metavar="FILE", help="write a plot (needs matplotlib)")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    print(format_table(rows))
    if args.json:
        meta = {"python": sys.version.split()[0], "machine": platform.machine(), "quick": args.quick}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"meta": meta, "results": rows}, fh, indent=2)
    if args.png:
        write_png(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
