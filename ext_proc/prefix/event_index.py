"""The event-fed prefix index: the blocks each engine reported holding, per tier (pure).

Fed by the engines' KV-cache events (:mod:`ext_proc.prefix.kv_events`), one :class:`EventBatch` at a
time per endpoint (per publisher, strictly: each data-parallel rank of an engine is indexed apart, under
the name :func:`~ext_proc.prefix.ranks.publisher` gives it; "endpoint" and "address" below mean that).
A stored block is keyed by our own chained hash of its token ids
(:func:`~ext_proc.prefix.blocks.block_hashes` over token ids, the chain started at :data:`ROOT` for a
prompt's first block and at the parent's hash otherwise), so a request given as token ids is looked up
by the same chain; the engine's hash, which depends on its settings and seed, is kept only to find a
stored block's parent and to apply removals. Blocks are held per tier (the event's ``medium``;
``None`` is :data:`DEFAULT_TIER`); a block held in none of the :data:`GPU_TIERS` is held in a CPU tier
(:meth:`EventIndex.match_gpu` tells the two apart).

Per endpoint the batches' sequence is tracked: the next one expected is applied; a gap, or a first
batch that is not the engine's first, is answered :class:`ReplayFrom` when a replay can be asked
(the batch is not applied: the caller replays from there, then goes on), else the endpoint's entries
are dropped and the batch applied from a clean slate; a sequence that goes backwards is an engine
restart: its entries are dropped first. ``AllBlocksCleared`` empties the endpoint. An endpoint heard
from last more than ``stale_after`` seconds ago is stale: :meth:`EventIndex.match` leaves it out.

Events not applied are counted by reason in :attr:`Applied.dropped`: ``lora`` (blocks of a LoRA
adapter: requests name adapters by model, not by the engine's id), ``block_size`` (blocks of another
size than the pool's, which the engines' events set: :mod:`ext_proc.prefix.block_sizes`; such blocks
could never match a request's chain), ``orphan`` (the parent block is
unknown: stored before this gateway listened, or missed), ``full`` (the endpoint already holds
``max_blocks`` blocks). No clock (``now`` is passed in, in seconds) and no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from ext_proc.prefix.block_sizes import BlockSizes
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.index import Holders
from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, EventBatch
from ext_proc.prefix.ranks import endpoint_of

ROOT = 0
"""The chain's start for a prompt's first block, in the events and in a request's token chain."""
DEFAULT_TIER = "GPU"
"""The tier of a block whose event names no ``medium`` (vLLM's own name for its GPU memory)."""
GPU_TIERS = frozenset({DEFAULT_TIER, "HBM"})
"""The tiers in GPU memory; a block held only in another (``CPU``, ``DISK``, …) must be loaded first."""


class Applied(NamedTuple):
    """A batch was applied.

    ``dropped``: events left out, by reason (module docstring); ``reset``: why the endpoint's entries
    were dropped first (``"restart"``, ``"gap"``), ``None`` when they were not."""

    dropped: Counter[str]
    reset: str | None


class ReplayFrom(NamedTuple):
    """A batch was not applied: ask the engine's replay socket for the batches from ``sequence`` on.

    ``reset``: ``"restart"`` when the endpoint's entries were dropped first (the sequence went back),
    else ``None``."""

    sequence: int
    reset: str | None = None


class _Endpoint:
    """What one endpoint reported: its blocks and where its sequence stands."""

    __slots__ = ("expected", "gpu_refs", "heard", "refs", "stored", "tiers")

    def __init__(self, now: float) -> None:
        self.expected: int | None = None  # the next sequence; None before the first batch (or a reset)
        self.heard = now  # when a batch (or the subscription) last came
        self.stored: dict[tuple[str, EngineHash], int] = {}  # (tier, engine hash) → our hash
        self.refs: dict[int, int] = {}  # our hash → its stored entries, all tiers
        self.gpu_refs: dict[int, int] = {}  # our hash → its stored entries in the GPU tiers
        self.tiers: Counter[str] = Counter()  # tier → blocks held there


class EventIndex:
    """Per endpoint (``"ip:port"``), the blocks its engine reported, :attr:`block_tokens` tokens a block.

    ``block_tokens``: the block size until the engines' events give theirs (:attr:`sizes`);
    ``stale_after``: seconds without a batch after which an endpoint counts as holding nothing;
    ``max_blocks``: the most blocks kept per endpoint (a flood cannot grow the index without bound)."""

    def __init__(self, block_tokens: int, stale_after: float, max_blocks: int) -> None:
        self.sizes = BlockSizes(block_tokens)
        self.stale_after = stale_after
        self.max_blocks = max_blocks
        self.holders = Holders()
        self.gpu_holders = Holders()  # the same, GPU tiers only
        self._endpoints: dict[str, _Endpoint] = {}

    @property
    def block_tokens(self) -> int:
        """Tokens a block: the pool's block size, which a request's chain is hashed at."""
        return self.sizes.tokens

    def watch(self, address: str, now: float) -> None:
        """Listening to ``address`` starts: its staleness bound runs from ``now`` until it publishes."""
        if address not in self._endpoints:
            self._endpoints[address] = _Endpoint(now)

    def expected(self, address: str) -> int | None:
        """The next sequence expected from ``address`` (``None``: none yet, or since a reset)."""
        endpoint = self._endpoints.get(address)
        return None if endpoint is None else endpoint.expected

    def apply(self, address: str, batch: EventBatch, now: float, replayable: bool) -> Applied | ReplayFrom:
        """Take ``batch`` from ``address`` (``replayable``: its replay socket may be asked)."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            endpoint = self._endpoints[address] = _Endpoint(now)
        endpoint.heard = now
        sequence, expected, reset = batch.sequence, endpoint.expected, None
        if expected is not None and sequence < expected:
            self._clear(address, endpoint)
            expected = endpoint.expected = None
            reset = "restart"
        if sequence != (0 if expected is None else expected):
            if replayable:
                return ReplayFrom(0 if expected is None else expected, reset)
            if expected is not None:
                self._clear(address, endpoint)
                reset = "gap"
        endpoint.expected = sequence + 1
        dropped: Counter[str] = Counter()
        for event in batch.events:
            if isinstance(event, BlockStored):
                reason = self._store(address, endpoint, event)
                if reason is not None:
                    dropped[reason] += 1
            elif isinstance(event, BlockRemoved):
                self._remove(address, endpoint, event)
            elif isinstance(event, AllBlocksCleared):
                self._clear(address, endpoint)
        return Applied(dropped, reset)

    def _store(self, address: str, endpoint: _Endpoint, event: BlockStored) -> str | None:
        if event.lora_id is not None:
            return "lora"
        if not self.sizes.usable(address, event.block_size):
            return "block_size"
        tier = event.medium or DEFAULT_TIER
        start = ROOT
        if event.parent_block_hash is not None:
            parent = _find(endpoint, tier, event.parent_block_hash)
            if parent is None:
                return "orphan"
            start = parent
        ours = block_hashes(event.token_ids, event.block_size, len(event.block_hashes), start).tolist()
        holders, stored, refs = self.holders, endpoint.stored, endpoint.refs
        slot = holders.slot(address)
        gpu = tier in GPU_TIERS
        gpu_slot = self.gpu_holders.slot(address) if gpu else 0
        room = self.max_blocks - len(stored)
        added = 0
        for engine_hash, h in zip(event.block_hashes, ours, strict=True):
            key = (tier, engine_hash)
            if key in stored:
                continue
            if added == room:
                endpoint.tiers[tier] += added
                return "full"
            stored[key] = h
            added += 1
            _hold(refs, holders, slot, h)
            if gpu:
                _hold(endpoint.gpu_refs, self.gpu_holders, gpu_slot, h)
        endpoint.tiers[tier] += added
        return None

    def _remove(self, address: str, endpoint: _Endpoint, event: BlockRemoved) -> None:
        tier = event.medium or DEFAULT_TIER
        slot = self.holders.find(address)
        gpu_slot = self.gpu_holders.find(address) if tier in GPU_TIERS else None
        for engine_hash in event.block_hashes:
            h = endpoint.stored.pop((tier, engine_hash), None)
            if h is None:  # stored before this gateway listened, or dropped
                continue
            endpoint.tiers[tier] -= 1
            _release(endpoint.refs, self.holders, slot, h)
            if gpu_slot is not None:
                _release(endpoint.gpu_refs, self.gpu_holders, gpu_slot, h)

    def _clear(self, address: str, endpoint: _Endpoint) -> None:
        for holders, refs in ((self.holders, endpoint.refs), (self.gpu_holders, endpoint.gpu_refs)):
            slot = holders.find(address)
            if slot is not None:
                for h in refs:
                    holders.remove(slot, h)
                holders.release(address)
            refs.clear()
        endpoint.stored.clear()
        endpoint.tiers.clear()

    def reset(self, address: str) -> None:
        """Drop what ``address`` reported and where its sequence stood (e.g. a replay failed)."""
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            self._clear(address, endpoint)
            endpoint.expected = None

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """How many leading blocks of the chain ``hashes`` each fresh endpoint holds, in any tier."""
        matched = self.holders.match(hashes)
        for address in [a for a in matched if self.is_stale(a, now)]:
            del matched[address]
        return matched

    def match_gpu(self, hashes: Sequence[int], matched: Mapping[str, int]) -> dict[str, int] | None:
        """Of ``matched`` (:meth:`match`), the leading blocks each endpoint holds in a GPU tier.

        ``None`` when every endpoint in ``matched`` holds all its matched blocks in GPU memory (no
        endpoint holds a block in another tier, or none of ``matched`` does)."""
        tiered = [a for a in matched if any(n and t not in GPU_TIERS for t, n in self._tiers(a).items())]
        if not tiered:
            return None
        gpu = self.gpu_holders.match(hashes)
        return {a: gpu.get(a, 0) if a in tiered else n for a, n in matched.items()}

    def _tiers(self, address: str) -> Counter[str]:
        endpoint = self._endpoints.get(address)
        return Counter() if endpoint is None else endpoint.tiers

    def is_stale(self, address: str, now: float) -> bool:
        """``address`` has not published for more than ``stale_after`` seconds (or is not watched)."""
        endpoint = self._endpoints.get(address)
        return endpoint is None or now - endpoint.heard > self.stale_after

    def stale(self, now: float) -> list[str]:
        """The watched endpoints that are stale at ``now``."""
        return [a for a in self._endpoints if self.is_stale(a, now)]

    def blocks(self) -> dict[str, dict[str, int]]:
        """Blocks held per endpoint and tier (endpoints with none listed with no tier)."""
        return {a: {t: n for t, n in e.tiers.items() if n} for a, e in self._endpoints.items()}

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget every endpoint not in ``addresses`` (it left discovery), each of its ranks."""
        keep = set(addresses)
        for address in [a for a in self._endpoints if endpoint_of(a) not in keep]:
            self.forget(address)

    def forget(self, address: str) -> None:
        """Forget the publisher ``address`` (an endpoint, or a rank it no longer has)."""
        self.sizes.forget(address)
        endpoint = self._endpoints.pop(address, None)
        if endpoint is not None:
            self._clear(address, endpoint)


def _hold(refs: dict[int, int], holders: Holders, slot: int, h: int) -> None:
    """One more stored entry of ``h`` at the endpoint of ``slot``: it holds ``h`` from the first."""
    held = refs.get(h, 0)
    refs[h] = held + 1
    if not held:
        holders.add(slot, h)


def _release(refs: dict[int, int], holders: Holders, slot: int | None, h: int) -> None:
    """One stored entry of ``h`` fewer: the endpoint of ``slot`` no longer holds ``h`` after the last."""
    held = refs[h] - 1
    if held:
        refs[h] = held
    else:
        del refs[h]
        if slot is not None:
            holders.remove(slot, h)


def _find(endpoint: _Endpoint, tier: str, engine_hash: EngineHash) -> int | None:
    """Our hash of the block ``engine_hash`` at ``endpoint``: in ``tier`` first, else in any tier."""
    h = endpoint.stored.get((tier, engine_hash))
    if h is not None:
        return h
    for other in endpoint.tiers:
        h = endpoint.stored.get((other, engine_hash))
        if h is not None:
            return h
    return None
