"""Routing quality: the three numbers users judge a PD router by, per scenario and setting.

For each named scenario a simulated cluster is started once and the same seeded streaming
workload is sent through the real Envoy with pd-extproc in ``off``, ``prefer`` (several bonus
values), ``strict`` and ``auto``, and through plain Envoy round robin (no ext_proc) as the baseline.
``auto`` is told the fabric the simulator simulates (:func:`auto_keys`); ``auto:bw10x`` believes the
cross-group link 10x faster than it is (a mis-configured router).
Reported per run: cross-group KV transfer share, decode TTFT p50/p99, TPOT p50, decode load CV,
throughput, errors. A bonus sweep on ``one-hot-group`` (where keeping transfers in-group and
balancing decodes really pull apart) gives the trade-off curve users need to choose ``bonus``.

``--seeds N`` repeats every scenario with N different workload seeds (arrivals and lengths) and adds,
per setting, the median and range over seeds and the median of the per-seed ratios to ``off``
(paired: both ran the same workload), so one lucky workload cannot carry a conclusion, and a verdict of
``auto`` against issue 11's targets (:func:`verdicts`).

Run: ``python -m bench.routing_quality [--quick] [--seeds N] [--scenarios a,b] [--settings s,t]
[--json FILE] [--png FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.common import write_json
from sim.cluster import EngineSpec
from sim.config import KvConfig, TimingConfig
from sim.experiment import BASELINE, Disruption, measure
from sim.profiles import smaller
from sim.report import format_table
from sim.stack import Stack, start_stack
from sim.workload import RequestPlan, plan_workload

SWEEP_BONUSES = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 1.0)
SWEEP_SCENARIO = "one-hot-group"
PREFER_BONUSES = (0.05, 0.3)
FIRST_SEED = 7  # the workload seed of a single-seed run; --seeds N uses FIRST_SEED .. FIRST_SEED + N - 1
ACROSS_SEEDS = (
    "cross_group_share",
    "decode_ttft_p50_ms",
    "decode_ttft_p99_ms",
    "tpot_p50_ms",
    "decode_load_cv",
    "throughput_rps",
)
RATIO_TO_OFF = ("decode_ttft_p50_ms", "decode_ttft_p99_ms", "tpot_p50_ms", "decode_load_cv", "throughput_rps")
AUTO, MISCONFIGURED = "auto", "auto:bw10x"
"""``auto`` told the simulated fabric; and told a cross-group bandwidth 10x the real one."""
SETTINGS = ("off", *(f"prefer@{b}" for b in PREFER_BONUSES), "strict", AUTO, BASELINE)
"""A scenario's settings unless it names others."""
BIG = TimingConfig()
"""A large decode engine (the simulator's defaults, the ``legacy`` profile)."""
SMALL = smaller(BIG)
"""A smaller, slower decode engine: half the KV cache and batch, 16 ms decode steps."""
SATURATED = replace(BIG, max_batch=4, decode_step_per_seq_ms=3.0, kv_capacity_tokens=16384)
"""A decode whose batch fills at the benchmark's rates: 4 sequences, 3 ms more per step for each (a
full batch steps in 24 ms, twice an empty one's), and a KV cache (16k tokens, what pd-extproc sees as
its capacity) of about 4 requests."""


def _engines(group: str, prefills: int, decodes: int, timing: TimingConfig = BIG) -> list[EngineSpec]:
    return [EngineSpec("prefill", group) for _ in range(prefills)] + [
        EngineSpec("decode", group, timing=timing) for _ in range(decodes)
    ]


async def _lose_a_decode(stack: Stack) -> None:
    """A decode of group ``a`` dies; discovery removes it from EDS one second later."""
    victim = next(e.address for e in stack.cluster.engines if e.role == "decode" and e.group == "a")
    await stack.kill_engine(victim)
    await asyncio.sleep(1.0)
    stack.remove_from_eds(victim)


@dataclass(frozen=True)
class Scenario:
    """A cluster shape and a workload; ``requests``/``rate`` are the full-size values."""

    name: str
    description: str
    engines: list[EngineSpec]
    requests: int = 160
    rate: float = 10.0
    burst: int = 1
    prompt_tokens: tuple[int, int] = (1024, 6144)
    output_tokens: tuple[int, int] = (16, 96)
    disruption: Callable[[float], Disruption] | None = None
    settings: tuple[str, ...] = SETTINGS
    kv: KvConfig = field(default_factory=KvConfig)

    def plans(self, quick: bool, seed: int = FIRST_SEED) -> list[RequestPlan]:
        """The scenario's seeded workload: 10 requests when ``quick``."""
        requests = 10 if quick else self.requests
        return plan_workload(
            requests, self.rate, self.prompt_tokens, self.output_tokens, seed=seed, burst=self.burst
        )


def auto_keys(scenario: Scenario, bandwidth_error: float = 1.0) -> dict[str, object]:
    """pd-extproc's ``affinity.auto`` configuration for ``scenario``.

    The simulator's KV model, the cross-group bandwidth times ``bandwidth_error`` (capped at the in-group
    one, as the config requires), and as the wait scale one decode step at half batch of the median decode
    engine."""
    kv = scenario.kv
    steps = sorted(
        (e.timing or BIG).decode_ms((e.timing or BIG).max_batch // 2)
        for e in scenario.engines
        if e.role == "decode"
    )
    auto = {
        "kv_bytes_per_token": kv.kv_bytes_per_token,
        "same_group_gbps": kv.same_group_gbps,
        "cross_group_gbps": min(kv.cross_group_gbps * bandwidth_error, kv.same_group_gbps),
        "base_latency_ms": kv.kv_base_latency_ms,
        "wait_scale_ms": statistics.median(steps),
    }
    return {"affinity": {"auto": auto}}


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "two-equal-groups",
            "reference: a and b each 2 prefill + 3 decode, same shapes",
            _engines("a", 2, 3) + _engines("b", 2, 3),
            requests=400,  # the targets are judged here: a longer run steadies the load CV
        ),
        Scenario(
            "unequal-groups",
            "a: 2P + 4 large D; b: 1P + 2 small, slower D",
            _engines("a", 2, 4) + _engines("b", 1, 2, SMALL),
        ),
        Scenario(
            "one-hot-group",
            "a: 3P + 2D (prefill-heavy, its decodes run hot); b: 1P + 4D",
            _engines("a", 3, 2) + _engines("b", 1, 4),
        ),
        Scenario(
            "decode-loss",
            "two equal groups; a decode of a dies at 40% of the run, leaves EDS 1 s later",
            _engines("a", 2, 3) + _engines("b", 2, 3),
            disruption=lambda duration: Disruption(0.4 * duration, _lose_a_decode),
        ),
        Scenario(
            "bursty",
            "two equal groups; arrivals in bursts of 8",
            _engines("a", 2, 3) + _engines("b", 2, 3),
            burst=8,
        ),
        Scenario(
            "long-context",
            "two equal groups; 16k-30k-token prompts at 2 req/s (a cross-group transfer takes ~0.3 s)",
            _engines("a", 2, 3) + _engines("b", 2, 3),
            requests=80,
            rate=2.0,
            prompt_tokens=(16384, 30720),
            settings=(*SETTINGS, MISCONFIGURED),
        ),
        Scenario(
            "fast-fabric",
            "two equal groups; the cross-group link as fast as a group's own (100 GB/s)",
            _engines("a", 2, 3) + _engines("b", 2, 3),
            kv=KvConfig(cross_group_gbps=100.0),
        ),
        Scenario(
            "saturated",
            "two equal groups of small decodes (batch 4, 16k-token KV) whose batches fill at 6 req/s",
            _engines("a", 2, 3, SATURATED) + _engines("b", 2, 3, SATURATED),
            rate=6.0,
            output_tokens=(48, 144),
            settings=(*SETTINGS, MISCONFIGURED),
        ),
    )
}


def _mode_and_bonus(setting: str) -> tuple[str, float]:
    mode, _, bonus = setting.partition("@")
    return mode.partition(":")[0], float(bonus) if bonus else 0.3


def _config(scenario: Scenario, setting: str) -> dict[str, object] | None:
    """The configuration file of ``setting``: ``auto``'s fabric (see :data:`MISCONFIGURED`), else none."""
    if _mode_and_bonus(setting)[0] != AUTO:
        return None
    return auto_keys(scenario, 10.0 if setting == MISCONFIGURED else 1.0)


async def run_scenario(
    scenario: Scenario, quick: bool, sweep: bool, seed: int = FIRST_SEED
) -> dict[str, dict]:
    """Every setting of one scenario (plus the bonus sweep if asked) on one cluster, one workload seed."""
    plans = scenario.plans(quick, seed)
    duration = plans[-1].at
    stack = start_stack(scenario.engines, kv=scenario.kv)
    results: dict[str, dict] = {}
    try:
        settings = list(scenario.settings)
        if sweep:
            settings += [f"prefer@{b}" for b in SWEEP_BONUSES if f"prefer@{b}" not in settings]
        for setting in settings:
            mode, bonus = _mode_and_bonus(setting)
            disruption = scenario.disruption(duration) if scenario.disruption else None
            if disruption is not None and results:  # each run loses a decode: start from a whole cluster
                stack.stop()
                stack = start_stack(scenario.engines, kv=scenario.kv)
            config = _config(scenario, setting)
            results[setting] = await measure(stack, mode, plans, bonus, disruption=disruption, config=config)
            print(f"  {scenario.name} {setting}: done", file=sys.stderr, flush=True)
    finally:
        stack.stop()
    return results


def across_seeds(runs: dict[int, dict[str, dict]], base: str = "off") -> dict[str, dict]:
    """Per setting run in every seed: medians over seeds, paired ratios to ``base`` and total errors.

    Each :data:`ACROSS_SEEDS` metric's median/min/max over seeds (``None`` values skipped), the median over
    seeds of each :data:`RATIO_TO_OFF` metric divided by setting ``base``'s in the same seed
    (``<metric>_vs_<base>``; only where both are known and the base's is non-zero), and total errors."""
    settings = [s for s in next(iter(runs.values())) if all(s in run for run in runs.values())]
    stats: dict[str, dict] = {}
    for setting in settings:
        row: dict = {"errors": sum(runs[seed][setting]["errors"] for seed in runs)}
        for key in ACROSS_SEEDS:
            values = [v for seed in runs if (v := runs[seed][setting][key]) is not None]
            row[key] = (
                {"median": statistics.median(values), "min": min(values), "max": max(values)}
                if values
                else None
            )
        for key in RATIO_TO_OFF:
            row[f"{key}_vs_{base}"] = paired_ratio(runs, setting, base, key)
        stats[setting] = row
    return stats


def paired_ratio(runs: dict[int, dict[str, dict]], setting: str, base: str, key: str) -> float | None:
    """The median over seeds of ``setting``'s ``key`` divided by ``base``'s in the same seed.

    Paired (the same workload), over the seeds where both ran and are known and ``base``'s is non-zero."""
    ratios = [
        mine / theirs
        for run in runs.values()
        if setting in run
        and base in run
        and (mine := run[setting][key]) is not None
        and (theirs := run[base][key])
    ]
    return statistics.median(ratios) if ratios else None


def _spread(value: dict | None, fmt: str) -> str:
    return "n/a" if value is None else f"{value['median']:{fmt}} [{value['min']:{fmt}}-{value['max']:{fmt}}]"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_across_seeds(stats: dict[str, dict], seeds: int) -> str:
    """A fixed-width table of :func:`across_seeds`: medians with [min-max], and ratios to off."""
    head = (
        f"{'run':<16}{'cross-group KV':>24}{'decode load CV':>26}"
        f"{'dTTFT p50/off':>15}{'p99/off':>9}{'TPOT/off':>10}"
        f"{'load CV/off':>13}{'req/s/off':>11}{'errors':>8}"
    )
    title = f"across {seeds} workload seeds: median [min-max]; ratios are medians of per-seed ratios"
    lines = [title, head, "-" * len(head)]
    for setting, row in stats.items():
        lines.append(
            f"{setting:<16}{_spread(row['cross_group_share'], '.1%'):>24}"
            f"{_spread(row['decode_load_cv'], '.3f'):>26}{_ratio(row['decode_ttft_p50_ms_vs_off']):>15}"
            f"{_ratio(row['decode_ttft_p99_ms_vs_off']):>9}{_ratio(row['tpot_p50_ms_vs_off']):>10}"
            f"{_ratio(row['decode_load_cv_vs_off']):>13}{_ratio(row['throughput_rps_vs_off']):>11}"
            f"{row['errors']:>8}"
        )
    return "\n".join(lines)


TOLERANCE = 0.05
"""Issue 11's targets: auto's dTTFT within 5% of the best fixed bonus's, TPOT within 5% of off's."""
MIN_THROUGHPUT = 0.98
"""... and at least 98% of off's throughput."""
FAST_FABRIC = "fast-fabric"


def _median(stats: dict[str, dict], setting: str, key: str) -> float | None:
    value = stats[setting][key]
    return None if value is None else value["median"]


def verdict(scenario: str, runs: dict[int, dict[str, dict]]) -> dict | None:
    """``auto`` against issue 11's targets over the seeds of ``runs``.

    ``runs``: seed → setting → summary. ``None`` without ``auto``, ``off`` and a ``prefer`` bonus in every
    seed.

    Every ratio is paired (:func:`paired_ratio`: the median over seeds of per-seed ratios): auto's
    dTTFT p50 and p99 to the best fixed bonus's (the ``prefer@b`` with the lowest median over seeds,
    per percentile), TPOT p50 and throughput to off's; in ``fast-fabric`` also the decode load CV and
    dTTFT p50/p99 to off's. ``met`` maps each target to whether it holds.
    """
    stats = across_seeds(runs)
    bonuses = [s for s in stats if s.startswith("prefer@")]
    if AUTO not in stats or "off" not in stats or not bonuses:
        return None

    def ratio(key: str, base: str | None = None) -> tuple[float | None, str]:
        if base is None:  # the best fixed bonus
            known = [(m, b) for b in bonuses if (m := _median(stats, b, key)) is not None]
            base = min(known)[1] if known else bonuses[0]
        return paired_ratio(runs, AUTO, base, key), base

    ratios = {
        "dttft_p50_vs_best_bonus": ratio("decode_ttft_p50_ms"),
        "dttft_p99_vs_best_bonus": ratio("decode_ttft_p99_ms"),
        "tpot_p50_vs_off": ratio("tpot_p50_ms", "off"),
        "throughput_vs_off": ratio("throughput_rps", "off"),
    }
    if scenario == FAST_FABRIC:
        ratios |= {
            "load_cv_vs_off": ratio("decode_load_cv", "off"),
            "dttft_p50_vs_off": ratio("decode_ttft_p50_ms", "off"),
            "dttft_p99_vs_off": ratio("decode_ttft_p99_ms", "off"),
        }
    met = {}
    for key, (value, _) in ratios.items():
        if key == "throughput_vs_off":
            met[key] = value is not None and value >= MIN_THROUGHPUT
        elif key.endswith("_vs_off") and scenario == FAST_FABRIC and key != "tpot_p50_vs_off":
            met[key] = value is not None and abs(value - 1.0) <= TOLERANCE
        else:
            met[key] = value is not None and value <= 1.0 + TOLERANCE
    return {
        "cross_group_share": _median(stats, AUTO, "cross_group_share"),
        "ratios": {key: value for key, (value, _) in ratios.items()},
        "best_bonus": {key: base for key, (_, base) in ratios.items() if key.endswith("best_bonus")},
        "met": met,
    }


def format_verdicts(verdicts: dict[str, dict]) -> str:
    """One row per scenario: auto's cross-group share, each target's ratio and whether it is met."""
    head = (
        f"{'scenario':<18}{'auto cross':>11}{'p50/best':>10}{'p99/best':>10}{'TPOT/off':>10}"
        f"{'req/s/off':>11}{'CV/off':>8}{'p50/off':>9}{'p99/off':>9}  verdict"
    )
    lines = [
        "auto vs issue 11's targets (medians of per-seed ratios; best = the prefer bonus of lowest median)",
        head,
        "-" * len(head),
    ]
    for name, row in verdicts.items():
        r = row["ratios"]
        cells = [
            _ratio(r.get(k))
            for k in (
                "dttft_p50_vs_best_bonus",
                "dttft_p99_vs_best_bonus",
                "tpot_p50_vs_off",
                "throughput_vs_off",
            )
        ]
        fast = [
            _ratio(r[k]) if k in r else "-"
            for k in ("load_cv_vs_off", "dttft_p50_vs_off", "dttft_p99_vs_off")
        ]
        missed = [k for k, ok in row["met"].items() if not ok]
        cross = "n/a" if row["cross_group_share"] is None else f"{row['cross_group_share']:.1%}"
        lines.append(
            f"{name:<18}{cross:>11}{cells[0]:>10}{cells[1]:>10}{cells[2]:>10}{cells[3]:>11}"
            f"{fast[0]:>8}{fast[1]:>9}{fast[2]:>9}  "
            + ("all met" if not missed else "missed: " + ", ".join(missed))
        )
    return "\n".join(lines)


def _plot(sweep: dict[str, dict], path: str, medians: dict[str, dict[str, dict]] | None = None) -> None:
    """Three panels: cross-group share and load CV against bonus; the trade-off curve itself, with
    ``auto``'s point; and, from ``medians`` (scenario → setting → :func:`across_seeds` row), every
    scenario's fixed settings and ``auto`` on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted((_mode_and_bonus(k)[1], v) for k, v in sweep.items() if k.startswith("prefer@"))
    bonuses = [b for b, _ in points]
    cross = [100 * (v["cross_group_share"] or 0.0) for _, v in points]
    cv = [v["decode_load_cv"] for _, v in points]
    fig, (left, right, every) = plt.subplots(1, 3, figsize=(16.5, 4.6))
    left.plot(bonuses, cross, "o-", color="tab:red", label="cross-group KV transfers (%)")
    left.set_xscale("symlog", linthresh=0.005)
    left.set_xticks(bonuses, [f"{b:g}" for b in bonuses], fontsize=8)
    left.minorticks_off()
    left.set_xlabel("bonus")
    left.set_ylabel("cross-group KV transfers (%)", color="tab:red")
    twin = left.twinx()
    twin.plot(bonuses, cv, "s--", color="tab:blue", label="decode load CV")
    twin.set_ylabel("decode load CV (lower = better balanced)", color="tab:blue")
    left.set_title(f"{SWEEP_SCENARIO}: prefer, bonus sweep")
    left.grid(alpha=0.3)
    right.plot(cv, cross, "o-", color="tab:purple", label="prefer")
    for bonus, x, y in zip(bonuses, cv, cross, strict=True):
        right.annotate(f"{bonus:g}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for name, marker in (("off", "s"), ("strict", "^"), (AUTO, "*")):  # round robin: no disaggregation
        if name in sweep:
            right.plot(
                sweep[name]["decode_load_cv"],
                100 * sweep[name]["cross_group_share"],
                marker,
                markersize=14 if name == AUTO else 7,
                label=name,
            )
    right.set_xlabel("decode load CV (lower = better balanced)")
    right.set_ylabel("cross-group KV transfers (%)")
    right.set_title("the trade-off (labels: bonus)")
    right.grid(alpha=0.3)
    right.legend()
    markers = {
        "off": "s",
        "prefer@0.05": "v",
        "prefer@0.3": "o",
        "strict": "^",
        AUTO: "*",
        MISCONFIGURED: "x",
    }
    for index, (scenario, rows) in enumerate((medians or {}).items()):
        color = f"C{index}"
        for setting, marker in markers.items():
            row = rows.get(setting)
            if row is None or row["decode_load_cv"] is None or row["cross_group_share"] is None:
                continue
            size = 14 if setting == AUTO else 7
            x, y = row["decode_load_cv"]["median"], 100 * row["cross_group_share"]["median"]
            every.plot(
                x, y, marker, color=color, markersize=size, label=scenario if setting == AUTO else None
            )
    every.set_xscale("log")
    every.set_xlabel("decode load CV (median over seeds, log)")
    every.set_ylabel("cross-group KV transfers (%)")
    every.set_title("every scenario: ★ auto, ■ off, ▼ 0.05, ● 0.3, ▲ strict, x bw10x", fontsize=9)
    every.grid(alpha=0.3)
    every.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the tables (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="10 requests per run: a smoke run, not a measurement"
    )
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of the scenarios"
    )
    parser.add_argument(
        "--seeds", type=int, default=1, help="workload seeds per scenario (default 1); > 1 adds medians"
    )
    parser.add_argument(
        "--settings", help="comma-separated subset of each scenario's settings to run (default: all of them)"
    )
    parser.add_argument("--no-sweep", action="store_true", help=f"skip the bonus sweep on {SWEEP_SCENARIO}")
    parser.add_argument("--json", help="write all results as JSON")
    parser.add_argument(
        "--png", help=f"write the bonus trade-off plot of {SWEEP_SCENARIO} (needs matplotlib)"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))
    output: dict = {"seeds": seeds, "scenarios": {}}
    chosen = None if args.settings is None else [s for s in args.settings.split(",") if s]
    for name in names:
        scenario = SCENARIOS[name]
        if chosen is not None:
            scenario = replace(scenario, settings=tuple(s for s in scenario.settings if s in chosen))
        sweep = name == SWEEP_SCENARIO and not args.no_sweep
        runs: dict[int, dict[str, dict]] = {}
        for seed in seeds:
            runs[seed] = asyncio.run(run_scenario(scenario, args.quick, sweep and seed == seeds[0], seed))
            print(f"\n{name} (workload seed {seed}): {scenario.description}")
            print(format_table(runs[seed]))
        entry: dict = {"description": scenario.description, "runs": runs}
        if len(seeds) > 1:
            entry["across_seeds"] = across_seeds(runs)
            print(f"\n{name}: " + format_across_seeds(entry["across_seeds"], len(seeds)))
        if (judged := verdict(name, runs)) is not None:
            entry["verdict"] = judged
        output["scenarios"][name] = entry
    verdicts = {n: e["verdict"] for n, e in output["scenarios"].items() if "verdict" in e}
    if verdicts:
        print("\n" + format_verdicts(verdicts))
    write_json(args.json, output)
    if args.png and SWEEP_SCENARIO in output["scenarios"]:
        medians = {n: across_seeds(e["runs"]) for n, e in output["scenarios"].items()}
        _plot(output["scenarios"][SWEEP_SCENARIO]["runs"][seeds[0]], args.png, medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())
