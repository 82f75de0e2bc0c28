"""Handoff protocols and the decode-only threshold: what the gateway's prefill leg costs, and when to skip it.

1. **Handoff comparison.** One simulated cluster (the ``demo`` cluster of :func:`sim.cluster.clusters` on
   the ``legacy`` profile, no prefix caching: rack-a 2 prefill + 3 large decodes, rack-b 1 prefill + 2
   smaller, slower decodes), one seeded streaming chat workload (OpenAI SDK, prompts 512-4,096 tokens,
   as the demo's before it replayed a trace), affinity ``prefer``, sent through the real Envoy
   and pd-extproc once per handoff: ``sidecar`` (the decode's sidecar calls the prefill),
   ``kv-transfer-params`` with the prefill leg through Envoy's prefill-leg listener, the same with the
   leg sent straight to the engine (``-direct``), and ``sglang-bootstrap`` (both legs at once). Client
   TTFT is the headline: it is the one latency every handoff defines the same way (the simulator's
   decode TTFT subtracts only the sidecar's prefill call). The paired differences (same workload) say
   what the gateway's prefill leg adds over the sidecar, and what the Envoy hop on that leg costs.
2. **Threshold sweep** (``routing.pd_threshold_tokens``): a short-to-medium prompt workload (uniform
   16-2,048 tokens) with ``kv-transfer-params`` via Envoy, for several thresholds and "decode-only"
   (a threshold above every prompt). Prompts below the threshold are prefilled on the decode engine,
   which saves the leg, the KV transfer and a decode step (the local prefill's step emits the first
   token) but stalls the other sequences' decode steps (TPOT). The recommendation is the threshold of
   lowest mean TTFT (:func:`recommend` says why not the p50) whose TPOT p99 stays within
   ``--tpot-tolerance`` of threshold 0's (everything disaggregated).

``--seeds N`` repeats both parts with N workload seeds (run order reversed on every other seed, so a
drift of the shared machine does not always favour the same run); differences and ratios are taken
per seed (paired) and their medians reported.

``--kv-connector mooncake`` runs the engines as vLLM's upstream MooncakeConnector and compares
``kv-transfer-params`` (which gets no params back from such a prefill) with ``vllm-mooncake``.

Run: ``python -m bench.handoff [--requests N] [--rate R] [--seeds N] [--kv-connector nixl|mooncake]
[--handoffs A,B] [--skip-sweep] [--json F] [--png F]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.common import write_json
from sim.cluster import clusters
from sim.config import KV_CONNECTORS, KvConfig
from sim.experiment import measure
from sim.profiles import load_profile, smaller
from sim.report import format_table
from sim.stack import Stack, start_stack
from sim.workload import RequestPlan, plan_workload

FIRST_SEED = 7  # --seeds N uses workload seeds FIRST_SEED .. FIRST_SEED + N - 1
MODE, BONUS = "prefer", 0.3
LEGACY = load_profile("legacy").timing
CLUSTER = clusters(LEGACY, smaller(LEGACY))["demo"]
"""rack-a 2 prefill + 3 large decodes, rack-b 1 prefill + 2 small decodes, on the simulator's chosen costs."""
PROMPT_TOKENS = (512, 4096)
"""Prompt lengths of the handoff comparison (tokens, uniform): chat with history / RAG sized."""
SWEEP_PROMPT_TOKENS = (16, 2048)
"""Prompt lengths of the sweep workload (tokens, uniform): chat turns, short to medium."""
SWEEP_THRESHOLDS = (0, 64, 128, 256, 512, 1024)
DECODE_ONLY = "decode-only"
DECODE_ONLY_THRESHOLD = 1 << 20
"""A ``pd_threshold_tokens`` above every prompt of any workload here (and above max_model_len)."""
TARGET_ADDED_MS = 3.0
"""Target (ms): client TTFT p50 the gateway's prefill leg (kv-transfer-params via Envoy) adds over sidecar."""


@dataclass(frozen=True)
class HandoffRun:
    """One run of the comparison: pd-extproc's ``handoff.mode`` and whether prefill legs go through Envoy."""

    handoff: str
    via_envoy: bool = True


RUNS = {
    "sidecar": HandoffRun("sidecar"),
    "kv-transfer-params": HandoffRun("kv-transfer-params"),
    "kv-transfer-params-direct": HandoffRun("kv-transfer-params", via_envoy=False),
    "sglang-bootstrap": HandoffRun("sglang-bootstrap"),
    "vllm-mooncake": HandoffRun("vllm-mooncake"),
}
DEFAULT_HANDOFFS = {
    "nixl": ["sidecar", "kv-transfer-params", "kv-transfer-params-direct", "sglang-bootstrap"],
    "mooncake": ["kv-transfer-params", "vllm-mooncake"],
}
"""The runs ``--handoffs`` defaults to, by the engines' ``--kv-connector``: over vLLM's upstream
MooncakeConnector, kv-transfer-params gets no params back (every prompt prefilled twice) and
vllm-mooncake is the handoff those engines speak."""
DIFFERENCES = {
    "kv_minus_sidecar_ttft_p50_ms": ("kv-transfer-params", "sidecar", "ttft_p50_ms"),
    "envoy_minus_direct_ttft_p50_ms": ("kv-transfer-params", "kv-transfer-params-direct", "ttft_p50_ms"),
    "sglang_minus_sidecar_ttft_p50_ms": ("sglang-bootstrap", "sidecar", "ttft_p50_ms"),
    "kv_minus_mooncake_ttft_p50_ms": ("kv-transfer-params", "vllm-mooncake", "ttft_p50_ms"),
}
"""Paired differences (ms): name → (run, minus run, summary key); skipped when either run is left out."""
PAIRED = {
    "ttft_mean_minus_0_ms": ("ttft_mean_ms", False),
    "ttft_p50_minus_0_ms": ("ttft_p50_ms", False),
    "tpot_p99_vs_0": ("tpot_p99_ms", True),
}
"""Sweep values paired with threshold 0 of the same seed: name → (summary key, ratio (else difference))."""
SWEEP_METRICS = (
    "ttft_mean_ms",
    "disaggregated_share",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "throughput_rps",
)

HANDOFF_COLUMNS = (
    ("requests", "requests", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("cross_group_share", "cross-group KV", "{:.1%}"),
    ("disaggregated_share", "KV pulled", "{:.1%}"),
    ("prefill_legs", "gateway legs", "{:.0f}"),
)
SWEEP_COLUMNS = (
    ("requests", "requests", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("disaggregated_share", "disaggregated", "{:.1%}"),
    ("ttft_mean_ms", "TTFT mean ms", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.2f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.2f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("prefill_legs", "gateway legs", "{:.0f}"),
)


def threshold_of(label: str) -> int:
    """The ``pd_threshold_tokens`` of a sweep label (a number, or :data:`DECODE_ONLY`)."""
    return DECODE_ONLY_THRESHOLD if label == DECODE_ONLY else int(label)


SWEEP_LABELS = (*(str(t) for t in SWEEP_THRESHOLDS), DECODE_ONLY)


async def prefill_legs(stack: Stack) -> int:
    """Prefill legs the running pd-extproc has sent since it started.

    ``pd_extproc_prefill_leg_total`` over every outcome; the warm-up's legs included."""
    async with aiohttp.ClientSession() as http, http.get(f"{stack.admin_url}/metrics") as resp:
        text = await resp.text()
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "pd_extproc_prefill_leg_total"
        )
    )


async def run_one(stack: Stack, plans: list[RequestPlan], run: HandoffRun, threshold: int = 0) -> dict:
    """Measure one handoff/threshold setting; the summary gains the prefill legs and disaggregated share.

    Measured by :func:`~sim.experiment.measure` (affinity :data:`MODE`); the summary gains ``prefill_legs``
    (router's count, warm-up included) and ``disaggregated_share`` (of the served requests, the share whose
    decode pulled a KV cache: simulator ground truth)."""
    summary = await measure(
        stack, MODE, plans, BONUS, handoff=run.handoff, via_envoy=run.via_envoy, pd_threshold_tokens=threshold
    )
    summary["prefill_legs"] = await prefill_legs(stack)
    served = summary["requests"] - summary["errors"]
    summary["disaggregated_share"] = summary["kv_transfers"] / served if served else None
    summary["pd_threshold_tokens"] = threshold
    return summary


def _ordered(names: list[str], seed_index: int) -> list[str]:
    """``names`` in order on even seed indexes, reversed on odd ones (drift cancels over seeds)."""
    return names if seed_index % 2 == 0 else names[::-1]


async def run_seed(
    stack: Stack,
    handoffs: list[str],
    requests: int,
    rate: float,
    seed: int,
    seed_index: int,
    sweep: bool,
    progress: Callable[[str], None],
) -> tuple[dict[str, dict], dict[str, dict]]:
    """The handoff comparison and (``sweep``) the threshold sweep of one workload seed on ``stack``."""
    plans = plan_workload(requests, rate, PROMPT_TOKENS, seed=seed)
    compared: dict[str, dict] = {}
    for name in _ordered(handoffs, seed_index):
        compared[name] = await run_one(stack, plans, RUNS[name])
        progress(f"seed {seed} handoff {name}: TTFT p50 {compared[name]['ttft_p50_ms']} ms")
    compared = {name: compared[name] for name in handoffs}
    swept: dict[str, dict] = {}
    if sweep:
        sweep_plans = plan_workload(requests, rate, SWEEP_PROMPT_TOKENS, seed=seed)
        for label in _ordered(list(SWEEP_LABELS), seed_index):
            swept[label] = await run_one(stack, sweep_plans, RUNS["kv-transfer-params"], threshold_of(label))
            progress(f"seed {seed} threshold {label}: TTFT p50 {swept[label]['ttft_p50_ms']} ms")
        swept = {label: swept[label] for label in SWEEP_LABELS}
    return compared, swept


def differences(compared: dict[str, dict]) -> dict[str, float | None]:
    """Each :data:`DIFFERENCES` entry whose two runs are in ``compared`` (``None`` if a value is missing)."""
    out: dict[str, float | None] = {}
    for name, (run, base, key) in DIFFERENCES.items():
        if run in compared and base in compared:
            mine, theirs = compared[run][key], compared[base][key]
            out[name] = None if mine is None or theirs is None else mine - theirs
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def across_seeds(per_seed: list[dict[str, float | None]]) -> dict[str, dict[str, float] | None]:
    """Per key present in every seed: median/min/max over seeds of its non-``None`` values."""
    keys = [k for k in per_seed[0] if all(k in seed for seed in per_seed)]
    return {k: _spread([v for seed in per_seed if (v := seed[k]) is not None]) for k in keys}


def _medians(runs: list[dict], keys: tuple[str, ...]) -> dict:
    """Total ``requests`` and ``errors`` over ``runs``, and the median of each of ``keys`` (``None``
    values skipped; ``None`` when there are none)."""
    row: dict = {"requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs)}
    for key in keys:
        spread = _spread([v for r in runs if (v := r[key]) is not None])
        row[key] = spread["median"] if spread else None
    return row


def handoffs_across_seeds(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Per handoff run: the :func:`_medians` over seeds of the comparison table's metrics."""
    keys = tuple(k for k, _, _ in HANDOFF_COLUMNS if k not in ("requests", "errors"))
    return {name: _medians([seed[name] for seed in runs], keys) for name in runs[0]}


def sweep_across_seeds(sweeps: list[dict[str, dict]]) -> dict[str, dict]:
    """Per threshold label: the medians over seeds of the sweep's metrics and paired values.

    The :func:`_medians` over seeds of :data:`SWEEP_METRICS`, and the medians of the per-seed (paired, against
    threshold 0 of the same seed) :data:`PAIRED` values: ``tpot_p99_vs_0`` (ratio of TPOT p99s),
    ``ttft_mean_minus_0_ms`` and ``ttft_p50_minus_0_ms`` (differences), ``None`` where never known."""
    out: dict[str, dict] = {}
    for label in sweeps[0]:
        row = _medians([s[label] for s in sweeps], SWEEP_METRICS)
        for name, (key, ratio) in PAIRED.items():
            values = [
                mine / base if ratio else mine - base
                for s in sweeps
                if (mine := s[label][key]) is not None
                and (base := s["0"][key]) is not None
                and (base or not ratio)
            ]
            row[name] = statistics.median(values) if values else None
        out[label] = row
    return out


def recommend(sweep: dict[str, dict], tolerance: float) -> dict:
    """The threshold label of lowest mean TTFT within the TPOT tolerance, with its numbers.

    Within the tolerance: ``tpot_p99_vs_0`` at most ``1 + tolerance`` (threshold 0 always qualifies);
    ``sweep`` as from :func:`sweep_across_seeds`. The mean, not the p50: a threshold moves only the prompts
    below it, which are the fastest ones, so the p50 hardly sees their gain until the threshold passes the
    median prompt, while it does see the stalls their local prefills cause the others."""
    allowed = [label for label, row in sweep.items() if label == "0" or row["tpot_p99_vs_0"] <= 1 + tolerance]
    best = min(allowed, key=lambda label: sweep[label]["ttft_mean_ms"])
    return {
        "label": best,
        "pd_threshold_tokens": threshold_of(best),
        "tolerance": tolerance,
        **{key: sweep[best][key] for key in PAIRED},
        "excluded": [label for label in sweep if label not in allowed],
    }


def _ms(value: dict[str, float] | None, seeds: int) -> str:
    if value is None:
        return "n/a"
    if seeds == 1:
        return f"{value['median']:+.2f} ms"
    return f"{value['median']:+.2f} ms [{value['min']:+.2f} .. {value['max']:+.2f}]"


def format_differences(stats: dict[str, dict[str, float] | None], seeds: int) -> str:
    """The paired differences, median over seeds with [min .. max] when there are several."""
    title = "paired differences, client TTFT p50" + (
        f" (median of {seeds} per-seed differences [min .. max])" if seeds > 1 else ""
    )
    lines = [title]
    for name, value in stats.items():
        run, base, _ = DIFFERENCES[name]
        lines.append(f"  {run} minus {base}: {_ms(value, seeds)}")
    added = stats.get("kv_minus_sidecar_ttft_p50_ms")
    if added is not None:
        verdict = "met" if added["median"] <= TARGET_ADDED_MS else "not met"
        lines.append(
            f"  target: kv-transfer-params via Envoy adds <= {TARGET_ADDED_MS:g} ms over sidecar: {verdict}"
        )
    return "\n".join(lines)


def format_sweep(sweep: dict[str, dict], recommendation: dict, seeds: int) -> str:
    """The sweep (medians over seeds) with the paired columns, then the recommendation."""
    columns = (
        *SWEEP_COLUMNS[:-1],
        ("ttft_mean_minus_0_ms", "TTFT mean - thr 0", "{:+.1f}"),
        ("ttft_p50_minus_0_ms", "TTFT p50 - thr 0", "{:+.1f}"),
        ("tpot_p99_vs_0", "TPOT p99 / thr 0", "{:.3f}"),
    )
    title = "threshold sweep" + (
        f", medians over {seeds} seeds (paired columns: medians of per-seed values)" if seeds > 1 else ""
    )
    tolerance = recommendation["tolerance"]
    lines = [
        title,
        format_table(sweep, columns),
        f"recommended pd_threshold_tokens: {recommendation['label']} "
        f"(lowest mean TTFT with TPOT p99 within {tolerance:.0%} of threshold 0's: "
        f"TTFT mean {recommendation['ttft_mean_minus_0_ms']:+.1f} ms, "
        f"p50 {recommendation['ttft_p50_minus_0_ms']:+.1f} ms, "
        f"TPOT p99 x{recommendation['tpot_p99_vs_0']:.3f}; "
        f"excluded for TPOT: {', '.join(recommendation['excluded']) or 'none'})",
    ]
    return "\n".join(lines)


def _plot(compared: dict[str, dict], sweep: dict[str, dict] | None, path: str) -> None:
    """Left: client TTFT p50/p99 per handoff; right (with a sweep): TTFT and TPOT against the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 6, 4.4), squeeze=False)
    left = axes[0][0]
    names = list(compared)
    xs = range(len(names))
    left.bar([x - 0.2 for x in xs], [compared[n]["ttft_p50_ms"] or 0 for n in names], 0.4, label="TTFT p50")
    left.bar([x + 0.2 for x in xs], [compared[n]["ttft_p99_ms"] or 0 for n in names], 0.4, label="TTFT p99")
    left.set_xticks(list(xs), [n.replace("-params", "\n-params") for n in names], fontsize=8)
    left.set_ylabel("client TTFT (ms)")
    left.set_title(f"handoffs, affinity {MODE}, prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens")
    left.grid(axis="y", alpha=0.3)
    left.legend()
    if sweep:
        right = axes[0][1]
        labels = list(sweep)
        xs = range(len(labels))
        ttft = (
            ("ttft_mean_ms", "o:", "TTFT mean"),
            ("ttft_p50_ms", "o-", "TTFT p50"),
            ("ttft_p99_ms", "o--", "TTFT p99"),
        )
        for key, style, name in ttft:
            right.plot(xs, [sweep[label][key] for label in labels], style, color="tab:red", label=name)
        right.set_ylabel("client TTFT (ms)", color="tab:red")
        twin = right.twinx()
        for key, style, name in (("tpot_p50_ms", "s-", "TPOT p50"), ("tpot_p99_ms", "s--", "TPOT p99")):
            twin.plot(xs, [sweep[label][key] for label in labels], style, color="tab:blue", label=name)
        twin.set_ylabel("TPOT (ms)", color="tab:blue")
        right.set_xticks(list(xs), labels, fontsize=8)
        right.set_xlabel("pd_threshold_tokens (prompts below it are prefilled on the decode)")
        right.set_title(
            f"kv-transfer-params via Envoy, prompts {SWEEP_PROMPT_TOKENS[0]}-{SWEEP_PROMPT_TOKENS[1]}"
        )
        right.grid(alpha=0.3)
        lines = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        right.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="center left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _handoffs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"choose a comma-separated subset of {','.join(RUNS)}")
    return names


def _positive(kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


async def run_all(
    handoffs: list[str], requests: int, rate: float, seeds: list[int], sweep: bool, kv_connector: str = "nixl"
) -> tuple[dict[int, dict[str, dict]], dict[int, dict[str, dict]]]:
    """Every seed's comparison and sweep on one cluster whose engines run ``kv_connector``.

    Returns (per-seed comparisons, per-seed sweeps)."""
    compared: dict[int, dict[str, dict]] = {}
    swept: dict[int, dict[str, dict]] = {}
    stack = start_stack(CLUSTER, kv=KvConfig(kv_connector=kv_connector))
    try:
        for index, seed in enumerate(seeds):
            compared[seed], swept[seed] = await run_seed(
                stack,
                handoffs,
                requests,
                rate,
                seed,
                index,
                sweep,
                lambda line: print(line, file=sys.stderr, flush=True),
            )
    finally:
        stack.stop()
    return compared, swept


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the tables (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--requests", type=_positive(int), default=300, help="requests per run (default %(default)s)"
    )
    parser.add_argument(
        "--rate", type=_positive(float), default=10.0, help="arrivals, req/s (default %(default)s)"
    )
    parser.add_argument(
        "--seeds", type=_positive(int), default=1, help="workload seeds (default %(default)s)"
    )
    parser.add_argument(
        "--handoffs",
        type=_handoffs,
        help=f"comma-separated subset of {','.join(RUNS)} (default by --kv-connector: {DEFAULT_HANDOFFS})",
    )
    parser.add_argument(
        "--kv-connector",
        choices=KV_CONNECTORS,
        default="nixl",
        help="the simulated engines' vLLM connector (default %(default)s)",
    )
    parser.add_argument("--skip-sweep", action="store_true", help="skip the pd_threshold_tokens sweep")
    parser.add_argument(
        "--tpot-tolerance",
        type=float,
        default=0.02,
        help="TPOT p99 increase over threshold 0 a recommended threshold may cost (default %(default)s)",
    )
    parser.add_argument("--json", help="write all results as JSON")
    parser.add_argument("--png", help="write the TTFT-per-handoff and sweep plot (needs matplotlib)")
    args = parser.parse_args(argv)
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))
    handoffs = args.handoffs or DEFAULT_HANDOFFS[args.kv_connector]
    compared, swept = asyncio.run(
        run_all(handoffs, args.requests, args.rate, seeds, not args.skip_sweep, args.kv_connector)
    )
    output: dict = {
        "cluster": "demo (legacy profile): rack-a 2P + 3 large D, rack-b 1P + 2 small D",
        "kv_connector": args.kv_connector,
        "workload": {"requests": args.requests, "rate_rps": args.rate, "prompt_tokens": PROMPT_TOKENS},
        "affinity": {"mode": MODE, "bonus": BONUS},
        "seeds": seeds,
        "handoffs": compared,
        "differences": {seed: differences(compared[seed]) for seed in seeds},
    }
    for seed in seeds:
        print(
            f"\nhandoffs, workload seed {seed}: {args.requests} streaming requests at {args.rate:g} req/s, "
            f"prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, affinity {MODE}@{BONUS:g}"
        )
        print(format_table(compared[seed], HANDOFF_COLUMNS))
    output["handoffs_across_seeds"] = handoffs_across_seeds([compared[seed] for seed in seeds])
    if len(seeds) > 1:
        print(f"\nhandoffs, medians over {len(seeds)} seeds (requests and errors: totals)")
        print(format_table(output["handoffs_across_seeds"], HANDOFF_COLUMNS))
    output["differences_across_seeds"] = across_seeds(list(output["differences"].values()))
    print("\n" + format_differences(output["differences_across_seeds"], len(seeds)))
    sweep_stats = None
    if not args.skip_sweep:
        for seed in seeds:
            print(
                f"\nthreshold sweep, workload seed {seed}: kv-transfer-params via Envoy, "
                f"prompts {SWEEP_PROMPT_TOKENS[0]}-{SWEEP_PROMPT_TOKENS[1]} tokens"
            )
            print(format_table(swept[seed], SWEEP_COLUMNS))
        sweep_stats = sweep_across_seeds([swept[seed] for seed in seeds])
        recommendation = recommend(sweep_stats, args.tpot_tolerance)
        output.update(
            sweep_prompt_tokens=SWEEP_PROMPT_TOKENS,
            sweep=swept,
            sweep_across_seeds=sweep_stats,
            recommendation=recommendation,
        )
        print("\n" + format_sweep(sweep_stats, recommendation, len(seeds)))
    write_json(args.json, output)
    if args.png:
        _plot(output["handoffs_across_seeds"], sweep_stats, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
