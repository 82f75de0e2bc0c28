"""The routers the prefix-routing benchmark compares, each placing one chat request on a (prefill, decode).

* :class:`PdExtproc`: pd-extproc's own :class:`~ext_proc.router.Router`, the code that ships (body
  parse, prompt hashing, prefix lookup, the pair decision, the record, the charges), with or without
  the prefix index.
* :class:`Replicas`: several independent routers (gateway replicas: each its own load accounting and
  prefix index), requests taking turns among them.
* :class:`PrefillFirst`: the decision before the pair choice, emulated with today's library: the
  prefill of least utilisation (as ``off`` ranks prefills), then the mode's decode for that prefill
  alone (a one-prefill pool), no prefix index; ``strict`` only among prefills whose group has decodes.
* :class:`Oracle`: the pair choice of ``auto`` told every engine's *true* cache hit for the prompt,
  read from the simulated engines' caches (the CPU tier's blocks included): the best the index could do.
* :class:`SGLangCacheAware`: SGLang's model gateway's ``cache_aware`` policy, per role and
  independently (its PD mode picks prefill and decode by its policy each, knowing no groups): if the
  router's in-flight request counts are imbalanced (``max - min > 64`` and ``max > 1.5 * min``), the
  least loaded; else, in an approximate prefix tree of the text sent to each worker, the best match if
  it covers more than 0.3 of the text, else the worker whose tree is smallest. The tree is emulated by
  16-character chained blocks, never evicted (its default size limit, 2^26 characters, is far beyond
  these runs).
* :class:`LlmdScorer`: llm-d's scheduler profile ``prefix-cache-scorer`` x2 + ``queue-scorer`` x1,
  decode first, then prefill: the prefix score is the share of the prompt's 64-character blocks (16
  tokens at 4 characters; at most 256 blocks) an endpoint holds in the plugin's LRU (31,250 blocks per
  endpoint, its default), recorded on both endpoints; the queue score is ``(max - q) / (max - min)``
  over the candidates' waiting requests (1 when all equal), read from the engines live (llm-d reads
  scraped metrics, so this is kinder to it); the highest total wins, ties rotated.
* :class:`DynamoKvRouter`: NVIDIA Dynamo's KV router cost per role, independently (knowing no groups):
  ``overlap_score_weight`` (1.0, its default) x the prefill blocks a worker would have (its active
  prefill tokens plus the prompt's tokens it lacks, in KV blocks) + its decode blocks (the KV blocks
  of its active requests plus this one's); the least wins, ties rotated. The overlap is the engine's
  true cache (both tiers: Dynamo learns it from the engines' KV events); the active tokens and blocks
  are the router's own accounting, a prefill's released when its prefill ends, a decode's at the end.

Every router gets the cluster's endpoints (address, role, group, KV capacity) and charges and releases
its own load accounting: the prefill's when its prefill ends (the prefill leg returned), the decode's
when the request ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from ext_proc.affinity import Cost, Decision, Hits, Mode, Policy, Pool, choose
from ext_proc.endpoints import ClusterEndpoints, EndpointSpec
from ext_proc.live import LiveParts
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.outcome import HandoffJob, Placement, RequestMeta, Routed, RoutingInstructions
from ext_proc.prefix.blocks import block_hashes, prompt_content
from ext_proc.prefix.index import PrefixIndex
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.registry import EndpointState, Registry
from ext_proc.request import describe
from ext_proc.router import BodyRequest, Router, RouterSettings
from sim.engine import Engine
from sim.prefix import PromptBlocks

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
DEFAULT_MAX_TOKENS = 256


class Endpoint(NamedTuple):
    """One engine as discovery would list it."""

    address: str
    role: str
    group: str
    capacity: float


class Placed(NamedTuple):
    """Where a request goes, and how its charges are released (prefill's first, then all).

    ``tokenize_s``: the seconds of the placement that were the gateway tokenizer's work (the
    simulator's stand-in for it), which the gateway does on its worker thread before it routes: the
    benchmarks time it apart from the router."""

    prefill: str
    decode: str
    release_prefill: Callable[[], None]
    release: Callable[[], None]
    tokenize_s: float = 0.0


def registry_of(endpoints: Sequence[Endpoint]) -> Registry:
    """A registry holding ``endpoints``, all healthy (what discovery would give pd-extproc)."""
    registry = Registry("prefill", "decode", 100_000.0)

    def cluster(role: str) -> ClusterEndpoints:
        specs = [
            EndpointSpec(e.address, e.group, e.capacity, True, "HEALTHY") for e in endpoints if e.role == role
        ]
        return ClusterEndpoints(role, tuple(specs), "bench")

    registry.update([cluster("prefill"), cluster("decode")])
    return registry


def _placed(decision: Decision[EndpointState], lease: Lease) -> Placed:
    assert decision.prefill is not None, "the benchmark disaggregates every request"
    return Placed(decision.prefill.address, decision.decode.address, lease.release_prefill, lease.release)


class _Capture:
    """A handoff that answers at once and keeps the placement (the benchmark moves the KV itself)."""

    last: Placement | None = None
    pins_ranks = False  # the simulated engines have one data-parallel rank each

    def hand_off(self, job: HandoffJob, placement: Placement, router: object) -> Routed:
        self.last = placement
        return Routed(RoutingInstructions((), (), ()), placement.lease)

    async def close(self) -> None:
        """Nothing to stop."""


class PdExtproc:
    """pd-extproc's router (see the module docstring); ``prefix`` ``None``: without the prefix index."""

    def __init__(self, endpoints: Sequence[Endpoint], policy: Policy, prefix: PrefixSettings | None) -> None:
        registry = registry_of(endpoints)
        self._handoff = _Capture()
        metrics = Metrics(registry.endpoints)
        self.live = LiveParts(prefix, metrics)
        self.router = Router(
            RouterSettings(DEFAULT_MAX_TOKENS),
            registry=registry,
            policy=policy,
            handoff=self._handoff,
            metrics=metrics,
            live=self.live,
        )

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body``: a chat request, or a completions one (a ``prompt``)."""
        path = CHAT_PATH if "messages" in body else COMPLETIONS_PATH
        return self.place_raw(json.dumps(body).encode(), path)

    def place_raw(self, raw: bytes, path: str = CHAT_PATH, tokens: Sequence[int] | None = None) -> Placed:
        """Place the request whose JSON body is ``raw`` (as Envoy hands it to pd-extproc) at ``path``.

        ``tokens``: its prompt's token ids as the gateway tokenizer hands them to the router (``None``:
        routed on the body alone, as without a tokenizer)."""
        request = self.router.read(raw, RequestMeta(path=path))
        assert isinstance(request, BodyRequest), request
        outcome = self.router.route(request, None, tokens)
        assert isinstance(outcome, Routed) and self._handoff.last is not None, outcome
        return _placed(self._handoff.last.decision, self._handoff.last.lease)


class Placing(Protocol):
    """A router: places one request."""

    def place(self, body: dict[str, object]) -> Placed:
        """Where ``body`` goes, and how its charges are released."""


class Replicas:
    """Requests take turns among ``routers`` (gateway replicas that share nothing but the engines)."""

    def __init__(self, routers: Sequence[Placing]) -> None:
        self.routers = list(routers)
        self._turn = 0

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body`` with the next router in turn."""
        self._turn += 1
        return self.routers[self._turn % len(self.routers)].place(body)


def _cost(body: dict[str, object]) -> Cost:
    info = describe(body, DEFAULT_MAX_TOKENS)
    return Cost(info.prompt_tokens, info.prompt_tokens + info.output_budget)


class PrefillFirst:
    """Today's decision, prefill first (see the module docstring)."""

    def __init__(self, endpoints: Sequence[Endpoint], policy: Policy) -> None:
        self._registry = registry_of(endpoints)
        self._policy = policy
        self._ticket = 0

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body`` prefill first, as today's decision does."""
        cost, registry = _cost(body), self._registry
        self._ticket += 1
        prefills, decodes = registry.prefill_pool, registry.decode_pool
        if self._policy.mode is Mode.STRICT:
            served = set(decodes.members)
            prefills = prefills.only({e.address for e in prefills.endpoints if e.group in served})
        first = choose(cost, prefills, decodes, Policy(Mode.OFF, fallback_count=0), self._ticket)
        assert isinstance(first, Decision) and first.prefill is not None
        alone = prefills.only({first.prefill.address})
        decision = choose(cost, alone, decodes, self._policy, self._ticket)
        assert isinstance(decision, Decision)
        return _placed(
            decision, Lease(decision.prefill, cost.prefill_tokens, decision.decode, cost.decode_tokens)
        )


def cached_tokens(engine: Engine, blocks: PromptBlocks, prompt: int) -> int:
    """Prompt tokens ``engine`` holds cached for ``blocks`` (its KV cache, then its CPU tier)."""
    cache = engine.scheduler.cache
    hbm = cache.lookup(blocks.hashes, prompt)
    return (hbm + cache.lookup_cpu(blocks.hashes, prompt, hbm)) * cache.block_size


class Oracle:
    """``auto`` told the true hits (see the module docstring); ``engines`` by address."""

    def __init__(self, endpoints: Sequence[Endpoint], policy: Policy, engines: dict[str, Engine]) -> None:
        self.registry = registry_of(endpoints)
        self._policy = policy
        self._engines = engines
        self._ticket = 0

    def _hits(self, pool: Pool[EndpointState], blocks: PromptBlocks, prompt: int) -> np.ndarray:
        hits = [cached_tokens(self._engines[e.address], blocks, prompt) for e in pool.endpoints]
        return np.array(hits, dtype=np.int64)

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body`` with ``auto``, told the engines' true prefix hits."""
        cost, registry = _cost(body), self.registry
        self._ticket += 1
        content = prompt_content(body)
        assert content, "every benchmark request has a prompt"
        blocks = PromptBlocks(content, 16)
        prefills, decodes = registry.prefill_pool, registry.decode_pool
        prompt = cost.prefill_tokens
        hits = Hits(self._hits(prefills, blocks, prompt), self._hits(decodes, blocks, prompt))
        decision = choose(cost, prefills, decodes, self._policy, self._ticket, hits)
        assert isinstance(decision, Decision) and decision.prefill is not None
        charge = prompt - int(hits.prefill[prefills.endpoints.index(decision.prefill)])
        return _placed(decision, Lease(decision.prefill, charge, decision.decode, cost.decode_tokens))


@dataclass
class _Worker:
    address: str
    inflight: int = 0
    tree: set[int] | None = None


def _text(body: dict[str, object]) -> str:
    content = prompt_content(body)
    assert isinstance(content, str)
    return content


class SGLangCacheAware:
    """SGLang's ``cache_aware`` policy per role (see the module docstring)."""

    CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5
    CHUNK = 16  # characters a block of the emulated prefix tree

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self._roles = {
            role: [_Worker(e.address, tree=set()) for e in endpoints if e.role == role]
            for role in ("prefill", "decode")
        }

    def _pick(self, workers: list[_Worker], hashes: list[int], chars: int) -> _Worker:
        loads = [w.inflight for w in workers]
        if max(loads) - min(loads) > self.BALANCE_ABS and max(loads) > self.BALANCE_REL * min(loads):
            return workers[loads.index(min(loads))]
        matched = []
        for w in workers:
            tree, n = w.tree, 0
            assert tree is not None
            while n < len(hashes) and hashes[n] in tree:
                n += 1
            matched.append(n)
        best = max(matched)
        if chars and best * self.CHUNK / chars > self.CACHE_THRESHOLD:
            return workers[matched.index(best)]
        sizes = [len(w.tree or ()) for w in workers]
        return workers[sizes.index(min(sizes))]

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body`` by SGLang's ``cache_aware`` policy, once per role."""
        text = _text(body)
        hashes = block_hashes(text, self.CHUNK // 4, 1 << 30).tolist()  # kept in the workers' sets
        prefill = self._pick(self._roles["prefill"], hashes, len(text))
        decode = self._pick(self._roles["decode"], hashes, len(text))
        for worker in (prefill, decode):
            assert worker.tree is not None
            worker.tree.update(hashes)
            worker.inflight += 1
        charges = _Inflight(prefill, decode)
        return Placed(prefill.address, decode.address, charges.release_prefill, charges.release)


class _Inflight:
    """The in-flight counts one request holds on its two workers; each released at most once."""

    def __init__(self, prefill: _Worker, decode: _Worker) -> None:
        self._prefill: _Worker | None = prefill
        self._decode: _Worker | None = decode

    def release_prefill(self) -> None:
        if self._prefill is not None:
            self._prefill.inflight -= 1
            self._prefill = None

    def release(self) -> None:
        self.release_prefill()
        if self._decode is not None:
            self._decode.inflight -= 1
            self._decode = None


class LlmdScorer:
    """llm-d's prefix x2 + queue x1 scoring, decode first (see the module docstring)."""

    PREFIX_WEIGHT, QUEUE_WEIGHT = 2.0, 1.0
    BLOCK_TOKENS, MAX_BLOCKS, LRU_BLOCKS = 16, 256, 31_250

    def __init__(self, endpoints: Sequence[Endpoint], engines: dict[str, Engine]) -> None:
        self._roles = {
            role: [e.address for e in endpoints if e.role == role] for role in ("prefill", "decode")
        }
        self._engines = engines
        self._index = PrefixIndex(self.BLOCK_TOKENS)
        self._ticket = 0

    def _pick(self, addresses: list[str], hashes: list[int]) -> str:
        matched = self._index.match(hashes) if hashes else {}
        queues = [self._engines[a].scheduler.num_waiting for a in addresses]
        low, high = min(queues), max(queues)
        scores = []
        for address, queue in zip(addresses, queues, strict=True):
            prefix = matched.get(address, 0) / len(hashes) if hashes else 0.0
            waiting = 1.0 if high == low else (high - queue) / (high - low)
            scores.append(self.PREFIX_WEIGHT * prefix + self.QUEUE_WEIGHT * waiting)
        best = max(scores)
        tied = [a for a, s in zip(addresses, scores, strict=True) if s == best]
        return tied[self._ticket % len(tied)]

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body`` by llm-d's scores, decode first."""
        self._ticket += 1
        hashes = block_hashes(_text(body), self.BLOCK_TOKENS, self.MAX_BLOCKS).tolist()
        decode = self._pick(self._roles["decode"], hashes)
        prefill = self._pick(self._roles["prefill"], hashes)
        for address in (decode, prefill):
            if hashes:
                self._index.record(hashes, address, self.LRU_BLOCKS * self.BLOCK_TOKENS)
        return Placed(prefill, decode, lambda: None, lambda: None)


class DynamoKvRouter:
    """NVIDIA Dynamo's KV router cost per role (see the module docstring)."""

    OVERLAP_SCORE_WEIGHT = 1.0

    def __init__(self, endpoints: Sequence[Endpoint], engines: dict[str, Engine]) -> None:
        self._roles = {
            role: [e.address for e in endpoints if e.role == role] for role in ("prefill", "decode")
        }
        self._engines = engines
        self._prefill_tokens = {e.address: 0 for e in endpoints}
        self._blocks = {e.address: 0 for e in endpoints}
        self._ticket = 0

    def _pick(self, role: str, blocks: PromptBlocks, cost: Cost) -> tuple[str, int, int]:
        """The worker of least cost; with the prefill tokens and KV blocks this request adds to it."""
        size = blocks.block_size
        request_blocks = -(-cost.decode_tokens // size)
        best: list[tuple[str, int]] = []
        least = float("inf")
        for address in self._roles[role]:
            new = cost.prefill_tokens - cached_tokens(self._engines[address], blocks, cost.prefill_tokens)
            prefill_blocks = (self._prefill_tokens[address] + new) / size
            total = self.OVERLAP_SCORE_WEIGHT * prefill_blocks + self._blocks[address] + request_blocks
            if total < least:
                least, best = total, [(address, new)]
            elif total == least:
                best.append((address, new))
        address, new = best[self._ticket % len(best)]
        return address, new, request_blocks

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body`` by Dynamo's KV router cost, once per role."""
        self._ticket += 1
        blocks = PromptBlocks(_text(body), 16)
        cost = _cost(body)
        prefill, new, prefill_blocks = self._pick("prefill", blocks, cost)
        decode, _, decode_blocks = self._pick("decode", blocks, cost)
        self._prefill_tokens[prefill] += new
        self._blocks[prefill] += prefill_blocks
        self._blocks[decode] += decode_blocks
        charges = {"prefill": True, "decode": True}

        def release_prefill() -> None:
            if charges.pop("prefill", False):
                self._prefill_tokens[prefill] -= new
                self._blocks[prefill] -= prefill_blocks

        def release() -> None:
            release_prefill()
            if charges.pop("decode", False):
                self._blocks[decode] -= decode_blocks

        return Placed(prefill, decode, release_prefill, release)
