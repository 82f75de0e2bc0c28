"""What each prefix source costs the router per request, in process: ``approximate`` against ``kv-events``.

A trace window's prompts (:mod:`sim.traces`, as ``bench/trace_replay.py`` writes them: chat text, the
simulator's token ids for ``kv-events``) go, one after the other at their trace times, to both sources
of :mod:`ext_proc.prefix`, each as the router calls it (``lookup_prompt``, ``placed``): the
``approximate`` source on the prompt's text, the ``kv-events`` source on its token ids as the gateway
tokenizer hands them over (an array; the tokenizer's own cost is ``bench/tokenize_cost.py``'s). Both
are told the same placements: the prefill and the decode of the demo cluster's shape (rack-a 2
prefills + 3 decodes, rack-b 1 + 2) that the ``kv-events`` lookup credits with the most blocks, ties
(and no hit) to the least recently placed, as a prefix-seeking router would. Each endpoint is an engine
cache of the simulator (:class:`sim.prefix.BlockCache`: the profile's KV capacity, half for the small
decodes, and ``--cpu-tier`` tokens of CPU tier), which caches every placed prompt at once and reports
its KV-cache events to the ``kv-events`` source's index (``apply``, timed apart: it runs on the
subscribers' tasks, not in the request's routing). The sources' order alternates request by request,
so the machine's noise falls on both alike.

Reported per source: wall µs per request (p50, mean) of each call and of the two together, and the
``kv-events`` event application µs per request; ``--json`` writes them. The sources run whatever
``ext_proc`` is first on ``PYTHONPATH``: run this file in two trees (``PYTHONPATH=TREE``) for a
change's before and after.

Run: ``python -m bench.prefix_source_cost TRACE [--start N] [--count N] [--cpu-tier TOKENS]
[--profile NAME] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from array import array
from functools import partial
from pathlib import Path

from bench.common import write_json
from ext_proc.affinity import Candidate, Decision, Locality, Pool
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kinds import KINDS, PrefixSource
from ext_proc.prefix.kv_events import Event, EventBatch
from ext_proc.prefix.settings import PrefixSettings, PrefixSourceKind
from sim.cluster import clusters
from sim.config import DEFAULT_MODEL
from sim.prefix import BlockCache, PromptBlocks, token_ids
from sim.profiles import MEASURED_PROFILE, engines_of
from sim.report import percentile
from sim.traces import prompt_text, read_window

CALLS = ("lookup_prompt", "placed")
"""The router's calls of a prefix source per request, timed one by one."""
ROLES = ("prefill", "decode")


class Engine:
    """One endpoint: its role, its candidate entry for the pools and its simulated cache."""

    def __init__(self, role: str, candidate: Candidate, cache: BlockCache) -> None:
        self.role = role
        self.candidate = candidate
        self.cache = cache
        self.placed = 0.0  # when a request was last placed here (ties go to the least recent)

    def serve(self, text: str, prompt_tokens: int) -> None:
        """Prefill ``text`` at once, reporting the cache's events as it goes.

        Its cached blocks are taken (CPU-tier ones loaded), the rest computed, all cached and freed."""
        cache = self.cache
        hashes = PromptBlocks(text, cache.block_size).hashes
        hit = cache.lookup(hashes, prompt_tokens)
        loaded = hashes[hit : hit + cache.lookup_cpu(hashes, prompt_tokens, hit)]
        fresh = -(-prompt_tokens // cache.block_size) - hit
        if cache.fits(hashes[:hit], fresh):  # else larger than the cache: nothing cached
            holding = cache.take(hashes[:hit], fresh, prompt_tokens, loaded)
            cache.cache(holding, hashes, text)
            cache.release(holding)


def cluster(cpu_tier: int, profile: str) -> dict[str, Engine]:
    """The demo cluster's engines of ``profile`` (each with ``cpu_tier`` tokens of CPU tier), by address."""
    large, small, _ = engines_of(profile, cpu_tier)
    engines: dict[str, Engine] = {}
    for n, spec in enumerate(clusters(large, small)["demo"]):
        timing = spec.timing or large
        address = f"10.0.0.{n}:8000"
        cache = BlockCache(timing.kv_capacity_blocks, timing.block_size, timing.cpu_kv_capacity_blocks)
        candidate = Candidate(address, spec.group, float(timing.kv_capacity_tokens), 0, 0)
        engines[address] = Engine(spec.role, candidate, cache)
    return engines


class Sink:
    """The sources' prediction sink: discards what they report."""

    def prefix_predicted(self, role: str, address: str, placed: int, hit: int) -> None:
        """Nothing kept."""

    def prefix_engine(self, address: str, queries: float, hits: float, scale: float) -> None:
        """Nothing kept."""


def run(
    trace: Path, start: int, count: int, cpu_tier: int, profile: str, warmup: int
) -> dict[str, dict[str, float]]:
    """Time both prefix sources over the window: per source, p50 and mean µs per call.

    The window is the module docstring's; the first ``warmup`` requests untimed. Per source, per call and
    ``total`` (and ``apply`` for ``kv-events``): ``{"<name>_p50_us", "<name>_mean_us"}``."""
    now = [0.0]
    sources: dict[str, PrefixSource] = {
        kind.value: KINDS[kind](PrefixSettings(source=kind.value), Sink()) for kind in PrefixSourceKind
    }
    events = sources[PrefixSourceKind.KV_EVENTS.value]
    assert isinstance(events, KvEventSource)
    events.clock = lambda: now[0]
    engines = cluster(cpu_tier, profile)
    sequences = dict.fromkeys(engines, 0)
    applied = [0.0]  # the current request's event application, seconds

    def report(address: str, batch: list[Event]) -> None:
        started = time.perf_counter()
        events.index.apply(address, EventBatch(sequences[address], now[0], 0, tuple(batch)), now[0], False)
        applied[0] += time.perf_counter() - started
        sequences[address] += 1

    for address, engine in engines.items():
        engine.cache.events = partial(report, address)
    prefills, decodes = (Pool.of([e.candidate for e in engines.values() if e.role == r]) for r in ROLES)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in [*sources, "apply"]}
    for n, request in enumerate(read_window(trace, None, start, count + warmup)):
        now[0] = request.arrival_s
        text = prompt_text(request, n)
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": text}]}
        given = {PrefixSourceKind.KV_EVENTS.value: array("Q", token_ids(text))}
        tokens = request.prompt_tokens
        order = list(sources) if n % 2 else list(sources)[::-1]
        lookups, spent = {}, {}
        for name in order:
            source = sources[name]
            started = time.perf_counter()
            found = source.lookup_prompt(body, given.get(name), prefills, decodes, tokens)
            spent[name] = [time.perf_counter() - started]
            assert found is not None, "every trace prompt has a block"
            lookups[name] = found
        matched = lookups[PrefixSourceKind.KV_EVENTS.value].matched
        pair = [
            max(pool.endpoints, key=lambda c: (matched.get(c.address, 0), -engines[c.address].placed))
            for pool in (prefills, decodes)
        ]
        decision = Decision(pair[0], pair[1], (), Locality.SAME_GROUP)
        for name in order:
            started = time.perf_counter()
            sources[name].placed(lookups[name], decision, tokens)
            spent[name].append(time.perf_counter() - started)
        applied[0] = 0.0
        for candidate in pair:
            engines[candidate.address].placed = now[0]
            engines[candidate.address].serve(text, tokens)
        if n >= warmup:
            for name, seconds in spent.items():
                for call, value in zip(CALLS, seconds, strict=True):
                    times[name].setdefault(call, []).append(value)
                times[name].setdefault("total", []).append(sum(seconds))
            times["apply"].setdefault("total", []).append(applied[0])
    out: dict[str, dict[str, float]] = {}
    for name, timed in times.items():
        out[name] = {
            f"{call}_{stat}_us": value * 1e6
            for call, values in timed.items()
            for stat, value in (("p50", percentile(values, 0.5)), ("mean", statistics.fmean(values)))
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the numbers (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, help="the trace file (Mooncake JSON lines or the Azure CSV)")
    parser.add_argument("--start", type=int, default=3000, help="first request (default %(default)s)")
    parser.add_argument("--count", type=int, default=600, help="requests (default %(default)s)")
    parser.add_argument(
        "--cpu-tier", type=int, default=2_000_000, help="CPU KV tier per engine, tokens (default %(default)s)"
    )
    parser.add_argument("--profile", default=MEASURED_PROFILE, help="engine profile (default %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=20, help="requests placed first, untimed (default %(default)s)"
    )
    parser.add_argument("--json", help="write the numbers as JSON")
    args = parser.parse_args(argv)
    rows = run(args.trace, args.start, args.count, args.cpu_tier, args.profile, args.warmup)
    names = [*CALLS, "total"]
    print(f"{'µs a request':14s}" + "".join(f"{n + ' p50':>14s}{'mean':>8s}" for n in names))
    for source, row in rows.items():
        cells = [
            f"{row[f'{n}_p50_us']:14.0f}{row[f'{n}_mean_us']:8.0f}" if f"{n}_p50_us" in row else " " * 22
            for n in names
        ]
        print(f"{source:14s}" + "".join(cells))
    events, approximate = rows[PrefixSourceKind.KV_EVENTS.value], rows[PrefixSourceKind.APPROXIMATE.value]
    p50, mean = (events[f"total_{s}_us"] / approximate[f"total_{s}_us"] for s in ("p50", "mean"))
    print(f"kv-events / approximate, the calls together: p50 {p50:.2f}x, mean {mean:.2f}x")
    write_json(args.json, {"trace": str(args.trace), "start": args.start, "count": args.count, **rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
