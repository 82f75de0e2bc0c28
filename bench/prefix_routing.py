"""Prefix-cache aware pair routing: pd-extproc against its own past, two peers' rules and an oracle.

A discrete-event run of the simulator (:mod:`sim.virtual`): the simulated engines (continuous
batching, vLLM-style prefix caching, KV transfers on a shared cross-group link) run in virtual time,
every request is placed by one router (:mod:`bench.prefix_peers`), prefilled on its prefill engine,
its KV cache pulled by its decode engine (only the blocks the decode lacks), decoded. No HTTP, no
Envoy and no wall clock: a run takes as long as its Python work, and the same inputs give the same
numbers (seeds vary the workloads only). The gateway's own latency is not in these numbers (the
routing benchmark and ``bench/overhead.py`` measure it); the router is timed per request.

Clusters: ``demo`` (rack-a 2 prefills + 3 large decodes, rack-b 1 prefill + 2 small decodes) and
``three-group`` (g1 and g2 each 2 prefills + 3 large decodes; ``trap`` 2 prefills and 1 small decode).
Every engine caches prefixes; its costs are a profile's (:mod:`sim.profiles`, ``legacy`` by default;
small decodes: half the KV cache and batch, a third longer fixed decode step). Workloads
(:mod:`bench.prefix_workloads`): A (shared system prompts), B (multi-turn), D (low reuse). Settings:
``off``, ``prefer``, ``strict``, ``auto`` as before the pair choice (prefill first); ``pair:*`` the pair
choice; ``+prefix`` with the prefix index (``x2``: two gateway replicas, requests alternating, each with
its own index and accounting; ``x4``: four); ``pair:auto+events`` the same on the ``kv-events`` source
(the engines' KV-cache events, fed in process through the wire encoding and the gateway's decoder,
:mod:`bench.kv_event_feed`; ``x2``, ``x4``: that many replicas, each subscribed to every engine, requests
round robin); ``sglang``, ``llm-d`` the peers' rules; ``oracle`` the pair choice told the engines' true
caches (``x4``: four such replicas, each with its own load accounting). Suffixes: `` scraped`` (on
``pair:auto+prefix`` and ``pair:auto+events``, one, two or four replicas, and on ``oracle`` and
``oracle x4``): every replica with the engine load signal, ``engine_metrics`` at its defaults, each
simulated engine's ``/metrics`` page read and blended in process at virtual time
(:mod:`bench.engine_load_feed`); `` norecent`` (on ``pair:auto+events`` and its ``x4``): the
``kv-events`` source without its overlay of each replica's own recent placements
(``affinity.prefix.kv_events.recent_seconds`` 0); `` shared`` (on ``pair:auto+prefix`` and
``pair:auto+events`` ``x2`` and ``x4``): the replicas share their bookings and placements over the real
``shared_state`` seam, 2 ms apart (:mod:`bench.shared_replicas`; the trace replay sets the delay).

Reported per run: engine-truth prefix hit rate (prompt tokens the prefill found cached), decode-side
hit rate (tokens the decode did not pull), TTFT p50/p90/p99 (arrival to first decoded token),
decode TTFT p99 (prefill done to first decoded token), TPOT p99, prefill tokens computed (millions),
cross-group KV bytes and share, decode load CV, router µs per request (the tokenizer's apart:
``Record``). With several seeds: medians of per-seed ratios, and the issue's targets (:func:`verdicts`).

Run: ``python -m bench.prefix_routing [--quick] [--seeds N] [--clusters a,b] [--workloads A,B,D]
[--settings s,t] [--profile NAME] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from bench.common import write_json
from bench.engine_load_feed import Scraped
from bench.kv_event_feed import EVENTS as EVENTS_PREFIX
from bench.kv_event_feed import EventReplica, KvEventFeed
from bench.prefix_peers import (
    Endpoint,
    LlmdScorer,
    Oracle,
    PdExtproc,
    Placed,
    PrefillFirst,
    Replicas,
    SGLangCacheAware,
)
from bench.prefix_workloads import Conversation, low_reuse, messages, multi_turn, shared_prompts
from bench.shared_replicas import DEFAULT_SYNC_DELAY_SECONDS, SHARING, SharedReplicas
from ext_proc.affinity import AutoModel, Mode, Policy
from ext_proc.prefix.blocks import prompt_content
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.request import describe
from sim.cluster import EngineSpec, clusters
from sim.config import DEFAULT_MODEL, KvConfig, TimingConfig
from sim.engine import Engine, Hold
from sim.prefix import PromptBlocks
from sim.profiles import DEFAULT_PROFILE, engines_of, profile_names
from sim.protocol import token_text
from sim.report import format_table, load_cv, percentile
from sim.virtual import VirtualClock, build_cluster, new_loop

FIRST_SEED = 41  # seeds never used by the other benchmarks


CLUSTERS = clusters(*engines_of(DEFAULT_PROFILE)[:2])


@dataclass(frozen=True)
class Workload:
    """A workload and its size: ``plan(seed, quick)`` gives its conversations."""

    description: str
    plan: Callable[[int, bool], list[Conversation]]


WORKLOADS = {
    "A": Workload(
        "shared system prompts: 120 tenants (Zipf 0.5), 4-6k-token prefixes, 20-200-token questions, "
        "14 req/s",
        lambda seed, quick: shared_prompts(seed, 12 if quick else 1200, 14.0),
    ),
    "B": Workload(
        "multi-turn chat: conversations at 1.2/s, 1-2k-token system prompt, 3-6 turns, 2 s think time",
        lambda seed, quick: multi_turn(seed, 3 if quick else 80, 1.2),
    ),
    "D": Workload(
        "low reuse: unique 512-4,096-token prompts at 10 req/s",
        lambda seed, quick: low_reuse(seed, 12 if quick else 300, 10.0),
    ),
}


def auto_model(specs: Sequence[EngineSpec], timing: TimingConfig, kv: KvConfig) -> AutoModel:
    """``affinity.auto`` told the simulated fabric ``kv`` and the engines' costs.

    The wait scale: one decode step at half batch of the median decode engine (``timing`` where a spec has
    none); the prefill cost: ``timing``'s per-token cost."""
    steps = sorted(
        (s.timing or timing).decode_ms((s.timing or timing).max_batch // 2)
        for s in specs
        if s.role == "decode"
    )
    return AutoModel(
        kv.kv_bytes_per_token,
        kv.same_group_gbps,
        kv.cross_group_gbps,
        kv.kv_base_latency_ms,
        statistics.median(steps),
        timing.prefill_per_token_ms,
    )


PREFIX = PrefixSettings()
NEW = "pair:auto+prefix"
"""The setting the targets judge: the pair choice of ``auto`` with the prefix index."""
EVENTS = "pair:auto+events"
"""The pair choice of ``auto`` with the prefix index on the ``kv-events`` source."""
WEIGHT = 0.1  # affinity.prefix.weight's default
Router = Callable[[list[Endpoint], dict[str, Engine], AutoModel], object]


def _policy(mode: Mode, model: AutoModel, weight: float = 0.0) -> Policy:
    return Policy(mode, 0.3, 0, model, weight)


NO_RECENT = replace(EVENTS_PREFIX, kv_events=replace(EVENTS_PREFIX.kv_events, recent_seconds=0.0))
"""The ``kv-events`` source without its overlay of each replica's own recent placements."""


def _event_routers(
    count: int,
    endpoints: list[Endpoint],
    engines: dict[str, Engine],
    model: AutoModel,
    prefix: PrefixSettings = EVENTS_PREFIX,
) -> list[EventReplica]:
    """``count`` replicas on the ``kv-events`` source (``prefix``), each fed every engine's events."""
    feed = KvEventFeed(engines)
    policy = _policy(Mode.AUTO, model, WEIGHT)
    return [EventReplica(endpoints, policy, feed, prefix) for _ in range(count)]


def _event_replicas(
    count: int,
    endpoints: list[Endpoint],
    engines: dict[str, Engine],
    model: AutoModel,
    prefix: PrefixSettings = EVENTS_PREFIX,
) -> Replicas:
    """``count`` replicas on the ``kv-events`` source (``prefix``), requests round robin."""
    return Replicas(_event_routers(count, endpoints, engines, model, prefix))


def _approximate_routers(count: int, endpoints: list[Endpoint], model: AutoModel) -> list[PdExtproc]:
    """``count`` replicas on the ``approximate`` source."""
    return [PdExtproc(endpoints, _policy(Mode.AUTO, model, WEIGHT), PREFIX) for _ in range(count)]


SETTINGS: dict[str, Router] = {
    **{m.value: (lambda mode: lambda e, _, a: PrefillFirst(e, _policy(mode, a)))(m) for m in Mode},
    **{
        f"pair:{m.value}": (lambda mode: lambda e, _, a: PdExtproc(e, _policy(mode, a), None))(m)
        for m in (Mode.PREFER, Mode.STRICT, Mode.AUTO)
    },
    **{
        f"pair:{m.value}+prefix": (
            lambda mode: lambda e, _, a: PdExtproc(e, _policy(mode, a, WEIGHT), PREFIX)
        )(m)
        for m in (Mode.PREFER, Mode.AUTO)
    },
    f"{NEW} x2": lambda e, _, a: Replicas(_approximate_routers(2, e, a)),
    f"{NEW} x4": lambda e, _, a: Replicas(_approximate_routers(4, e, a)),
    **{f"{EVENTS}{'' if n == 1 else f' x{n}'}": partial(_event_replicas, n) for n in (1, 2, 4)},
    **{
        f"{EVENTS}{'' if n == 1 else f' x{n}'} norecent": partial(_event_replicas, n, prefix=NO_RECENT)
        for n in (1, 4)
    },
    "sglang": lambda e, _, a: SGLangCacheAware(e),
    "llm-d": lambda e, engines, a: LlmdScorer(e, engines),
    "oracle": lambda e, engines, a: Oracle(e, _policy(Mode.AUTO, a), engines),
    "oracle x4": lambda e, engines, a: Replicas(
        [Oracle(e, _policy(Mode.AUTO, a), engines) for _ in range(4)]
    ),
}
SCRAPED = " scraped"
"""The suffix of a setting whose every replica has the engine load signal (:mod:`bench.engine_load_feed`)."""
SETTINGS |= {
    f"{name}{SCRAPED}": (
        lambda router_of: lambda e, engines, a: Scraped.of(router_of(e, engines, a), engines)
    )(SETTINGS[name])
    for name in (NEW, f"{NEW} x2", f"{NEW} x4", EVENTS, f"{EVENTS} x2", f"{EVENTS} x4", "oracle", "oracle x4")
}
SLOT_BATCH_SECONDS = 0.001
"""``shared_state.batch_seconds`` of replicas with decision slots (the 20 ms default outlasts a half slot)."""
SHARED = " shared"
"""The suffix of a setting whose replicas share their state over the real seam
(:mod:`bench.shared_replicas`)."""


def _shared(count: int, source: str) -> Callable[[float], Router]:
    """The router maker of ``count`` replicas on ``source`` (``NEW`` or ``EVENTS``) sharing their state
    over the seam with a sync delay given in seconds (and decision slots of ``slot_ms``, 0: off; with
    slots, batches of :data:`SLOT_BATCH_SECONDS`, whose half slot must exceed them)."""

    def of(delay: float, slot_ms: float = 0.0) -> Router:
        slotted = replace(SHARING, decision_slot_ms=slot_ms, batch_seconds=SLOT_BATCH_SECONDS)
        config = slotted if slot_ms else SHARING

        def router(endpoints: list[Endpoint], engines: dict[str, Engine], model: AutoModel) -> SharedReplicas:
            if source == EVENTS:
                return SharedReplicas(_event_routers(count, endpoints, engines, model), delay, config)
            return SharedReplicas(_approximate_routers(count, endpoints, model), delay, config)

        return router

    return of


SHARED_SETTINGS: dict[str, Callable[[float, float], Router]] = {
    f"{source} x{n}{SHARED}": _shared(n, source) for source in (NEW, EVENTS) for n in (2, 4)
}
"""The ` shared` settings, each given its sync delay (seconds) and decision slot (ms; 0: off)."""
SETTINGS |= {name: of(DEFAULT_SYNC_DELAY_SECONDS, 0.0) for name, of in SHARED_SETTINGS.items()}
TODAY = ("off", "prefer", "strict", "auto")


@dataclass
class Record:
    """One request as the engines served it.

    Times in model seconds, counts in tokens (``prefill_hit``: the prompt tokens its prefill found cached,
    ``prefill_cpu_hit`` of them in the CPU tier).

    ``router_us``: the wall µs its router took to place it (the benchmark's JSON encoding of the body
    included), less ``tokenize_us``: those of the gateway tokenizer's stand-in (the ``kv-events``
    replicas put the prompt in token ids first, :mod:`bench.kv_event_feed`; 0 elsewhere)."""

    arrival: float
    prompt: int
    prefill_hit: int
    prefill_cpu_hit: int
    decode_hit: int
    cross: bool
    decode: str
    decode_start: float
    first_token: float
    prefill_done: float
    end: float
    generated: int
    router_us: float
    tokenize_us: float


async def _serve(
    body: dict[str, object],
    router: object,
    engines: dict[str, Engine],
    clock: VirtualClock,
    out: list[Record],
) -> int:
    """Place, prefill, pull and decode one request; record it; return the tokens it generated.

    Shared replicas place it on the next in turn once its decision slot came (the arrival is before)."""
    info = describe(body, 256)
    content = prompt_content(body)
    assert content
    arrival = clock.now()
    placing = await router.next_in_turn() if isinstance(router, SharedReplicas) else router
    started = time.perf_counter()
    placed: Placed = placing.place(body)  # type: ignore[attr-defined]
    router_us = (time.perf_counter() - started - placed.tokenize_s) * 1e6
    prefill, decode = engines[placed.prefill], engines[placed.decode]
    blocks = PromptBlocks(content, prefill.config.timing.block_size)
    hold = Hold(
        f"bench-{id(body)}", prefill.config.kv.kv_lease_s
    )  # released by the pull below, never renewed
    first = prefill.submit(info.prompt_tokens, 1, 1, prefix=blocks, hold=hold)
    await prefill.wait_done(first)
    placed.release_prefill()

    async def pull(tokens: int):  # type: ignore[no-untyped-def]
        try:
            return await decode.kv.pull(prefill.address, tokens)
        finally:
            prefill.release_kv(first)

    budget = info.output_budget
    seq = decode.submit(info.prompt_tokens, budget, budget, pull, prefix=blocks)
    await decode.wait_done(seq)
    placed.release()
    assert seq.admitted_at is not None and seq.first_token_at is not None and seq.finished_at is not None
    out.append(
        Record(
            arrival,
            info.prompt_tokens,
            first.cached_tokens,
            first.cpu_tokens,
            seq.cached_tokens,
            seq.transfer.kind == "cross_group",
            decode.address,
            seq.arrival,
            seq.first_token_at,
            first.finished_at or arrival,
            seq.finished_at,
            seq.generated,
            router_us,
            placed.tokenize_s * 1e6,
        )
    )
    return seq.generated


Serve = Callable[[dict[str, object]], Awaitable[int]]
"""Place and serve one chat request on the cluster, recording it; returns the tokens it generated."""


async def run_cluster(
    specs: list[EngineSpec],
    router_of: Router,
    timing: TimingConfig,
    kv: KvConfig,
    drive: Callable[[Serve, VirtualClock], Awaitable[None]],
) -> tuple[list[Record], dict[str, float]]:
    """Serve ``drive``'s requests on the cluster of ``specs`` in virtual time; the records and KV capacities.

    Start the cluster of ``specs`` (``timing`` where a spec has none) in virtual time with the router
    ``router_of`` makes, let ``drive`` send its requests through ``serve``, stop the cluster; return
    the records and the decode engines' KV capacities by address. Run it on a :func:`new_loop`."""
    engines = build_cluster(specs, timing, kv)
    by_address = {e.address: e for e in engines}
    endpoints = [
        Endpoint(e.address, e.config.role, e.config.group, float(e.config.timing.kv_capacity_tokens))
        for e in engines
    ]
    router = router_of(endpoints, by_address, auto_model(specs, timing, kv))
    clock = engines[0].clock
    assert isinstance(clock, VirtualClock)
    for engine in engines:
        await engine.start()
    scrapes = asyncio.get_running_loop().create_task(router.run()) if isinstance(router, Scraped) else None
    if isinstance(router, SharedReplicas):
        await router.start()
    records: list[Record] = []

    def serve(body: dict[str, object]) -> Awaitable[int]:
        return _serve(body, router, by_address, clock, records)

    await drive(serve, clock)
    if isinstance(router, SharedReplicas):
        await router.stop()
    if scrapes is not None:
        scrapes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scrapes
    capacities = {
        e.address: float(e.config.timing.kv_capacity_tokens) for e in engines if e.config.role == "decode"
    }
    for engine in engines:
        await engine.stop()
    return records, capacities


def conversations(plan: list[Conversation]) -> Callable[[Serve, VirtualClock], Awaitable[None]]:
    """A ``drive`` of :func:`run_cluster` sending ``plan``'s conversations, turn after turn."""

    async def converse(serve: Serve, clock: VirtualClock, conversation: Conversation) -> None:
        await clock.sleep(conversation.start - clock.now())
        replies: list[str] = []
        for i, turn in enumerate(conversation.turns):
            await clock.sleep(turn.think_s)
            body = {
                "model": DEFAULT_MODEL,
                "messages": messages(conversation, i, replies),
                "max_tokens": turn.max_tokens,
            }
            replies.append(token_text(0, await serve(body)))

    async def drive(serve: Serve, clock: VirtualClock) -> None:
        await asyncio.gather(*(converse(serve, clock, c) for c in plan))

    return drive


def summarize(records: list[Record], capacities: dict[str, float], kv_bytes_per_token: int) -> dict:
    """The numbers of one run (see the module docstring); times in ms, bytes in GB."""
    start, end = min(r.arrival for r in records), max(r.end for r in records)
    duration = end - start
    busy = dict.fromkeys(capacities, 0.0)
    for r in records:
        busy[r.decode] += r.end - r.decode_start
    mean_capacity = statistics.fmean(capacities.values())
    loads = [busy[a] / duration / (capacities[a] / mean_capacity) for a in capacities]
    prompt = sum(r.prompt for r in records)
    ttft = [(r.first_token - r.arrival) * 1e3 for r in records]
    dttft = [(r.first_token - r.prefill_done) * 1e3 for r in records]
    tpot = [(r.end - r.first_token) * 1e3 / (r.generated - 1) for r in records if r.generated > 1]
    pulled_cross = sum(r.prompt - r.decode_hit for r in records if r.cross)
    return {
        "requests": len(records),
        "hit_rate": sum(r.prefill_hit for r in records) / prompt,
        "cpu_hit_rate": sum(r.prefill_cpu_hit for r in records) / prompt,
        "decode_hit_rate": sum(r.decode_hit for r in records) / prompt,
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p90_ms": percentile(ttft, 0.9),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "dttft_p99_ms": percentile(dttft, 0.99),
        "tpot_p99_ms": percentile(tpot, 0.99),
        "prefill_mtokens": sum(r.prompt - r.prefill_hit for r in records) / 1e6,
        "cross_group_share": sum(r.cross for r in records) / len(records),
        "cross_group_gb": pulled_cross * kv_bytes_per_token / 1e9,
        "decode_load_cv": load_cv(loads),
        "router_us_p50": percentile([r.router_us for r in records], 0.5),
        "tokenize_us_p50": percentile([r.tokenize_us for r in records], 0.5),
        "duration_s": duration,
    }


def run_one(
    cluster: str, workload: str, setting: str, seed: int, quick: bool, profile: str = DEFAULT_PROFILE
) -> dict:
    """One setting on one cluster and workload seed, in virtual time on a fresh event loop.

    The engines run ``profile``."""
    large, small, kv = engines_of(profile)
    plan = WORKLOADS[workload].plan(seed, quick)
    loop = new_loop()
    try:
        records, capacities = loop.run_until_complete(
            run_cluster(clusters(large, small)[cluster], SETTINGS[setting], large, kv, conversations(plan))
        )
    finally:
        loop.close()
    return summarize(records, capacities, kv.kv_bytes_per_token)


METRICS = (
    ("hit_rate", "hit", "{:.1%}"),
    ("decode_hit_rate", "D hit", "{:.1%}"),
    ("ttft_p50_ms", "TTFT p50", "{:.0f}"),
    ("ttft_p90_ms", "p90", "{:.0f}"),
    ("ttft_p99_ms", "p99", "{:.0f}"),
    ("dttft_p99_ms", "dTTFT p99", "{:.0f}"),
    ("tpot_p99_ms", "TPOT p99", "{:.1f}"),
    ("prefill_mtokens", "prefill Mtok", "{:.2f}"),
    ("cross_group_share", "cross", "{:.1%}"),
    ("cross_group_gb", "cross GB", "{:.1f}"),
    ("decode_load_cv", "load CV", "{:.3f}"),
    ("router_us_p50", "router µs", "{:.0f}"),
)


def medians(runs: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """Per setting, each metric's median over the seeds."""
    settings = next(iter(runs.values()))
    return {
        s: {k: statistics.median(runs[seed][s][k] for seed in runs) for k, _, _ in METRICS} for s in settings
    }


def ratio(runs: dict[int, dict[str, dict]], setting: str, base: str, key: str) -> float:
    """The median over seeds of ``setting``'s ``key`` over ``base``'s in the same seed (paired)."""
    return statistics.median(runs[seed][setting][key] / runs[seed][base][key] for seed in runs)


def verdicts(results: dict[str, dict[str, dict[int, dict[str, dict]]]]) -> list[dict]:
    """The issue's targets, each with its value and whether it is met (ratios: medians of per-seed ratios).

    A: ``pair:auto+prefix``'s hit rate within 5 points of the oracle's, and its TTFT p90 at most 0.5x
    the best of today's modes (the one of least median p90); demo cluster, workload D: ``pair:prefer``'s
    decode load CV at most 1.2x off's, cross-group share at most 5%, dTTFT p99 at most today's prefer's;
    D: ``pair:auto+prefix``'s TTFT p50 and p90 within 2% of today's ``auto``; A and B: its TTFT p90 below
    both peers'. Only what ``results`` holds is judged.
    """
    out = []

    def add(target: str, value: float, met: bool) -> None:
        out.append({"target": target, "value": value, "met": met})

    for cluster, workloads in results.items():
        for workload, runs in workloads.items():
            have = set(next(iter(runs.values())))
            where = f"{cluster}/{workload}"
            if workload == "A" and {NEW, "oracle"} <= have:
                gap = statistics.median(
                    runs[s][NEW]["hit_rate"] - runs[s]["oracle"]["hit_rate"] for s in runs
                )
                add(f"{where}: {NEW} hit rate - oracle's >= -5 points", gap, gap >= -0.05)
            today = [t for t in TODAY if t in have]
            if workload == "A" and NEW in have and today:
                best = min(today, key=lambda t: statistics.median(runs[s][t]["ttft_p90_ms"] for s in runs))
                value = ratio(runs, NEW, best, "ttft_p90_ms")
                add(f"{where}: {NEW} TTFT p90 / best of today's ({best}) <= 0.5", value, value <= 0.5)
            if cluster == "demo" and workload == "D" and {"pair:prefer", "off", "prefer"} <= have:
                cv = ratio(runs, "pair:prefer", "off", "decode_load_cv")
                add(f"{where}: pair:prefer decode load CV / off's <= 1.2", cv, cv <= 1.2)
                cross = statistics.median(runs[s]["pair:prefer"]["cross_group_share"] for s in runs)
                add(f"{where}: pair:prefer cross-group share <= 5%", cross, cross <= 0.05)
                p99 = ratio(runs, "pair:prefer", "prefer", "dttft_p99_ms")
                add(f"{where}: pair:prefer dTTFT p99 / today's prefer <= 1", p99, p99 <= 1.0)
            if workload == "D" and {NEW, "auto"} <= have:
                for key in ("ttft_p50_ms", "ttft_p90_ms"):
                    value = ratio(runs, NEW, "auto", key)
                    add(f"{where}: {NEW} {key[:-3]} / today's auto <= 1.02", value, value <= 1.02)
            if workload in ("A", "B") and NEW in have:
                for peer in ("sglang", "llm-d"):
                    if peer in have:
                        value = ratio(runs, NEW, peer, "ttft_p90_ms")
                        add(f"{where}: {NEW} TTFT p90 / {peer}'s < 1", value, value < 1.0)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the tables (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a dozen requests per run: a smoke run")
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds (default 3)")
    parser.add_argument("--clusters", default=",".join(CLUSTERS), help="comma-separated subset")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset")
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        choices=profile_names(),
        help="engine profile (default %(default)s: the numbers below were measured on it)",
    )
    parser.add_argument("--json", help="write every run and the verdicts as JSON")
    args = parser.parse_args(argv)
    chosen = {}
    for name, known in (("clusters", CLUSTERS), ("workloads", WORKLOADS), ("settings", SETTINGS)):
        chosen[name] = [n for n in getattr(args, name).split(",") if n]
        unknown = [n for n in chosen[name] if n not in known]
        if unknown:
            parser.error(f"unknown {name} {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))
    results: dict[str, dict[str, dict[int, dict[str, dict]]]] = {}
    for cluster in chosen["clusters"]:
        for workload in chosen["workloads"]:
            runs: dict[int, dict[str, dict]] = {}
            for seed in seeds:
                runs[seed] = {}
                for setting in chosen["settings"]:
                    started = time.perf_counter()
                    runs[seed][setting] = run_one(cluster, workload, setting, seed, args.quick, args.profile)
                    took = time.perf_counter() - started
                    print(
                        f"  {cluster} {workload} seed {seed} {setting}: {took:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
            results.setdefault(cluster, {})[workload] = runs
            print(f"\n{cluster} / {workload}: {WORKLOADS[workload].description}")
            print(f"medians over seeds {seeds[0]}-{seeds[-1]}")
            print(format_table(medians(runs), METRICS))
    judged = verdicts(results)
    if judged:
        print("\ntargets (medians of per-seed ratios):")
        for v in judged:
            print(f"  {'met    ' if v['met'] else 'NOT met'}  {v['target']}: {v['value']:.3f}")
    write_json(args.json, {"seeds": seeds, "results": results, "verdicts": judged})
    return 0


if __name__ == "__main__":
    sys.exit(main())
