"""Two models behind one gateway on the demo cluster: routed apart, one's flood sparing the other.

Two models behind one gateway on the demo cluster: no request on a wrong engine, and one model's flood
leaves the other's TTFT alone.

The demo's simulated cluster (:func:`sim.cluster.clusters` ``demo``, engines of the measured profile,
each pdGroup's in a child process of its own; pd-extproc and the real Envoy as their own processes,
``prefer``, the demo's ``kv-transfer-params`` handoff) serves two models: ``alpha`` on pdGroup
``rack-a`` (2 prefills, 3 large decodes), ``beta`` on ``rack-b`` (1 prefill, 2 small decodes). Each
engine refuses the other model's requests with vLLM's 404 (:attr:`sim.cluster.EngineSpec.model`) and
EDS declares each endpoint's model. ``beta`` (the victim) sends a steady stream, first alone, then
while ``alpha`` floods its engines at about three times their capacity (from a client process of its
own); each request's engines (the simulator's response headers) are checked against its model's. The
same two phases run on a fresh cluster with the models undeclared and the engines serving any model
(pd-extproc before routing by model: the flood spreads over every engine) for contrast.

Run: ``python -m bench.two_models [--quick] [--json FILE]``; prints a table and the verdict (the victim's
TTFT p90 with the flood within 10% of alone, no request on a wrong engine, no error), exit code 1 if
it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from sim.cluster import EngineSpec, clusters
from sim.cluster_process import ClusterProcess, EngineInfo, spawn_cluster, write_cluster_eds
from sim.config import KvConfig, TimingConfig
from sim.experiment import WARMUP
from sim.profiles import MEASURED_PROFILE, engines_of
from sim.report import percentile
from sim.stack import Stack
from sim.workload import WORDS, Record, RequestPlan, plan_workload, run_workload

MODEL_OF_GROUP = {"rack-a": "alpha", "rack-b": "beta"}
VICTIM, FLOOD = "beta", "alpha"
HANDOFF = "kv-transfer-params"
TOLERANCE = 0.10
"""The victim's TTFT p90 with the flood may be at most this much above its TTFT p90 alone."""


@dataclass(frozen=True)
class Size:
    """The workloads' sizes: the victim's and the flood's requests and rates.

    The workloads: the victim's ``victim`` requests at ``victim_rps``; the flood's ``flood`` requests at
    ``flood_rps`` (long prompts, short answers: it saturates its prefills, not the client's CPU)."""

    victim: int
    victim_rps: float
    flood: int
    flood_rps: float


FULL, QUICK = Size(60, 2.0, 400, 20.0), Size(40, 2.0, 300, 20.0)
TIME_SCALE = 2.0
"""Wall seconds per model second (the engines' ``time_scale``; arrivals are slowed alike and TTFTs
reported in model ms): the two shared cores' scheduling jitter, the same in wall ms at any scale, then
weighs half as much against the engines' times."""
FLOOD_PROMPTS = (6144, 14848)
"""The flood's prompt lengths (tokens, uniform): 10.5k on average, about 0.32 s of prefill each on the
profile, so 20 a second ask about three times what ``rack-a``'s two prefills compute."""


def distinct(plans: list[RequestPlan], seed: int, scale: float) -> list[RequestPlan]:
    """``plans`` with a prompt of its own each, sent ``scale`` times later.

    ``plans`` with a prompt of its own each (random words: no prefix-cache hit makes one cheap), sent
    ``scale`` times later (model time to wall time)."""
    rng = random.Random(seed)
    return [
        replace(
            p,
            at=p.at * scale,
            prompt=" ".join(rng.choice(WORDS) for _ in range(p.prompt_tokens * 4 // 6))[
                : p.prompt_tokens * 4
            ],
        )
        for p in plans
    ]


def victim_plans(size: Size, seed: int, scale: float) -> list[RequestPlan]:
    """The victim's steady stream: Poisson at ``victim_rps``, the same arrivals in both phases.

    The victim's steady stream: Poisson at ``victim_rps``, prompts 256-2,048, answers 16-64 tokens; the
    same arrivals and lengths in both phases, other texts (``seed``: no phase finds the other's cached)."""
    return distinct(plan_workload(size.victim, size.victim_rps, (256, 2048), (16, 64), seed=11), seed, scale)


def flood_plans(size: Size, scale: float) -> list[RequestPlan]:
    """The flood: Poisson at ``flood_rps``, :data:`FLOOD_PROMPTS` prompts, answers 2-6 tokens."""
    return distinct(plan_workload(size.flood, size.flood_rps, FLOOD_PROMPTS, (2, 6), seed=12), 12, scale)


def summary(records: list[Record], model: str, serving: dict[str, set[str]], scale: float) -> dict:
    """One model's numbers in one phase: requests, errors, TTFT and remote prefill percentiles.

    One model's numbers in one phase: requests, errors, TTFT p50/p90/p99 (model ms: wall ms over
    ``scale``), the remote prefill's p90 as the decode engines report it (model ms: queue and compute at
    the prefill, without the gateway's and the client's share of the TTFT), and the requests whose
    decode or prefill engine is not in ``model``'s group (``serving``: engines by model)."""
    ttfts = [r.ttft_ms / scale for r in records if r.ttft_ms is not None]
    prefills = [r.remote_prefill_ms for r in records if r.remote_prefill_ms is not None]
    wrong = 0
    for r in records:
        engines = {e for e in (r.decode_engine, r.prefill_engine) if e is not None}
        if engines - serving[model]:
            wrong += 1
    errors = [r.error for r in records if not r.ok]
    return {
        "model": model,
        "requests": len(records),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p90_ms": percentile(ttfts, 0.9),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "engine_prefill_p90_ms": percentile(prefills, 0.9),
        "on_other_models_engines": wrong,
    }


def flood_from(urls: list[str], plans: list[RequestPlan]) -> tuple[list[Record], float]:
    """Send the flood, in a process of its own.

    Send the flood (run in a process of its own: its 20 streams a second are not the victim's
    client's CPU)."""
    return asyncio.run(run_workload(urls, plans, FLOOD))


@dataclass
class Clusters:
    """Several simulated clusters as one, each model's engines in a process of their own.

    Several simulated clusters as one (:class:`sim.stack.Cluster`): each model's engines in a process
    of their own, as on GPUs of their own (in one process, the flood's engine loops would slow the
    victim's: an artefact of the simulator on a small machine, not of routing)."""

    parts: list[ClusterProcess]

    @property
    def engines(self) -> list[EngineInfo]:
        """Every part's engines."""
        return [e for part in self.parts for e in part.engines]

    def stop_engine(self, address: str) -> None:
        """Kill one engine like a crashed node."""
        for part in self.parts:
            if any(e.address == address for e in part.engines):
                part.stop_engine(address)

    def stop(self) -> None:
        """Stop every part."""
        for part in self.parts:
            part.stop()


def start_split_stack(specs: list[EngineSpec], timing: TimingConfig, kv: KvConfig) -> Stack:
    """A stack whose engines run one process per pdGroup (:class:`Clusters`), one EDS file pair for all."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-two-models-"))
    prefill_eds, decode_eds = workdir / "prefill.json", workdir / "decode.json"
    groups = list(dict.fromkeys(s.group for s in specs))
    parts = []
    try:
        for group in groups:
            mine = [s for s in specs if s.group == group]
            parts.append(spawn_cluster(mine, prefill_eds, decode_eds, timing, kv))
    except RuntimeError:
        Clusters(parts).stop()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    cluster = Clusters(parts)
    write_cluster_eds(cluster.engines, prefill_eds, decode_eds)
    return Stack(cluster, workdir, prefill_eds, decode_eds)


def engines_by_model(stack: Stack) -> dict[str, set[str]]:
    """The engines of each model's group (by address)."""
    serving: dict[str, set[str]] = {model: set() for model in MODEL_OF_GROUP.values()}
    for engine in stack.cluster.engines:
        serving[MODEL_OF_GROUP[engine.group]].add(engine.address)
    return serving


async def setting(declared: bool, size: Size, scale: float) -> dict:
    """Both phases on a fresh demo cluster, the models declared or not.

    Both phases on a fresh demo cluster: the models declared (and the engines strict), or not; the
    engines' ``time_scale`` is ``scale``."""
    large, small, kv = engines_of(MEASURED_PROFILE)
    large, small = replace(large, time_scale=scale), replace(small, time_scale=scale)
    specs = clusters(large, small)["demo"]
    if declared:
        specs = [replace(s, model=MODEL_OF_GROUP[s.group]) for s in specs]
    stack = await asyncio.to_thread(start_split_stack, specs, large, kv)
    try:
        await stack.route_with("prefer", handoff=HANDOFF)
        serving = engines_by_model(stack)
        for model in MODEL_OF_GROUP.values():  # cold connections would penalise the first phase
            await run_workload(stack.urls, WARMUP, model)
        alone, _ = await run_workload(stack.urls, victim_plans(size, 11, scale), VICTIM)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as flooder:
            flooding = asyncio.get_running_loop().run_in_executor(
                flooder, flood_from, stack.urls, flood_plans(size, scale)
            )
            (victim, _), (flood, flood_s) = await asyncio.gather(
                run_workload(stack.urls, victim_plans(size, 13, scale), VICTIM), flooding
            )
    finally:
        await asyncio.to_thread(stack.stop)
    flooded = summary(flood, FLOOD, serving, scale)
    flooded["throughput_rps"] = round(sum(r.ok for r in flood) / (flood_s / scale), 2)
    return {
        "models_declared": declared,
        "alone": summary(alone, VICTIM, serving, scale),
        "with_flood": summary(victim, VICTIM, serving, scale),
        "flood": flooded,
    }


def ratio(result: dict) -> float | None:
    """The victim's TTFT p90 with the flood over alone."""
    alone, flooded = result["alone"]["ttft_p90_ms"], result["with_flood"]["ttft_p90_ms"]
    return None if not alone or flooded is None else flooded / alone


def table(results: list[dict]) -> str:
    """The phases as a table."""
    head = (
        f"{'models':<11}{'phase':<12}{'model':<7}{'requests':>9}{'errors':>8}{'TTFT p50 ms':>13}"
        f"{'TTFT p90 ms':>13}{'TTFT p99 ms':>13}{'prefill p90 ms':>16}{'on other model engines':>24}"
    )
    lines = [head, "-" * len(head)]
    for result in results:
        name = "declared" if result["models_declared"] else "undeclared"
        for phase in ("alone", "with_flood", "flood"):
            row = result[phase]
            cells = [row[f"ttft_{q}_ms"] for q in ("p50", "p90", "p99")]
            text = "".join(f"{'-' if c is None else f'{c:.1f}':>13}" for c in cells)
            prefill = row["engine_prefill_p90_ms"]
            text += f"{'-' if prefill is None else f'{prefill:.1f}':>16}"
            lines.append(
                f"{name:<11}{phase:<12}{row['model']:<7}{row['requests']:>9}{row['errors']:>8}{text}"
                f"{row['on_other_models_engines']:>24}"
            )
        lines.append(f"{'':<11}victim TTFT p90 with the flood / alone: {ratio(result) or 0:.3f}")
    return "\n".join(lines)


def verdict(declared: dict) -> tuple[bool, str]:
    """Whether routing by model held, and the victim's TTFT p90 with the flood stayed near alone.

    Whether routing by model held: no error and no request on a wrong engine in any phase, and the
    victim's TTFT p90 with the flood within :data:`TOLERANCE` of alone."""
    phases = [declared[p] for p in ("alone", "with_flood", "flood")]
    wrong = sum(p["on_other_models_engines"] for p in phases)
    errors = sum(p["errors"] for p in phases)
    within = (ratio(declared) or float("inf")) <= 1 + TOLERANCE
    ok = wrong == 0 and errors == 0 and within
    return ok, (
        f"{'PASS' if ok else 'FAIL'}: requests on a wrong engine {wrong}, errors {errors}, victim TTFT p90 "
        f"with the flood {ratio(declared) or 0:.3f}x alone (at most {1 + TOLERANCE:.2f}x)"
    )


async def main_async(args: argparse.Namespace) -> int:
    """Run both settings with the parsed options ``args``; print the table and verdict; 0 when it held."""
    size, scale = QUICK if args.quick else FULL, args.time_scale
    print(
        f"demo cluster: {VICTIM} on rack-b (1P + 2 small D), {FLOOD} on rack-a (2P + 3 large D), "
        f"{MEASURED_PROFILE}, prefer, {HANDOFF}; victim {size.victim} requests at {size.victim_rps}/s, "
        f"flood {size.flood} at {size.flood_rps}/s (model time; time_scale {scale}: TTFTs in model ms)"
    )
    results = [await setting(True, size, scale), await setting(False, size, scale)]
    print(table(results))
    ok, line = verdict(results[0])
    print(line)
    if args.json is not None:
        document = {
            "size": size.__dict__,
            "time_scale": scale,
            "results": results,
            "verdict": line,
            "pass": ok,
        }
        args.json.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; 0 when the verdict held."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the victim's and the flood's requests")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--time-scale", type=float, default=TIME_SCALE, help=f"wall seconds per model second ({TIME_SCALE})"
    )
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
