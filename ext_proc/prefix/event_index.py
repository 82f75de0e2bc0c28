"""The event-fed prefix index: the blocks each engine reported holding, per tier (pure).

Fed by the engines' KV-cache events (:mod:`ext_proc.prefix.kv_events`), one :class:`EventBatch` at a
time per endpoint. A stored block is keyed by our own chained hash of its token ids
(:func:`~ext_proc.prefix.blocks.block_hashes` over token ids, the chain started at :data:`ROOT` for a
prompt's first block and at the parent's hash otherwise), so a request given as token ids is looked up
by the same chain; the engine's hash, which depends on its settings and seed, is kept only to find a
stored block's parent and to apply removals. Blocks are held per tier (the event's ``medium``;
``None`` is :data:`DEFAULT_TIER`).

Per endpoint the batches' sequence is tracked: the next one expected is applied; a gap, or a first
batch that is not the engine's first, is answered :class:`ReplayFrom` when a replay can be asked
(the batch is not applied: the caller replays from there, then goes on), else the endpoint's entries
are dropped and the batch applied from a clean slate; a sequence that goes backwards is an engine
restart: its entries are dropped first. ``AllBlocksCleared`` empties the endpoint. An endpoint heard
from last more than ``stale_after`` seconds ago is stale: :meth:`EventIndex.match` leaves it out.

Events not applied are counted by reason in :attr:`Applied.dropped`: ``lora`` (blocks of a LoRA
adapter: requests name adapters by model, not by the engine's id), ``block_size`` (not the index's
``block_tokens``: such blocks could never match a request's chain), ``orphan`` (the parent block is
unknown: stored before this gateway listened, or missed), ``full`` (the endpoint already holds
``max_blocks`` blocks). No clock (``now`` is passed in, in seconds) and no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.index import Holders
from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, EventBatch

ROOT = 0
"""The chain's start for a prompt's first block, in the events and in a request's token chain."""
DEFAULT_TIER = "GPU"
"""The tier of a block whose event names no ``medium`` (vLLM's own name for its GPU memory)."""


class Applied(NamedTuple):
    """A batch was applied.

    ``dropped``: events left out, by reason (module docstring); ``reset``: why the endpoint's entries
    were dropped first (``"restart"``, ``"gap"``), ``None`` when they were not."""

    dropped: Counter[str]
    reset: str | None


class ReplayFrom(NamedTuple):
    """A batch was not applied: ask the engine's replay socket for the batches from ``sequence`` on."""

    sequence: int


class _Endpoint:
    """What one endpoint reported: its blocks and where its sequence stands."""

    __slots__ = ("expected", "heard", "refs", "stored", "tiers")

    def __init__(self, now: float) -> None:
        self.expected: int | None = None  # the next sequence; None before the first batch (or a reset)
        self.heard = now  # when a batch (or the subscription) last came
        self.stored: dict[tuple[str, EngineHash], int] = {}  # (tier, engine hash) → our hash
        self.refs: dict[int, int] = {}  # our hash → its stored entries, all tiers
        self.tiers: Counter[str] = Counter()  # tier → blocks held there


class EventIndex:
    """Per endpoint (``"ip:port"``), the blocks its engine reported, ``block_tokens`` tokens a block.

    ``stale_after``: seconds without a batch after which an endpoint counts as holding nothing;
    ``max_blocks``: the most blocks kept per endpoint (a flood cannot grow the index without bound)."""

    def __init__(self, block_tokens: int, stale_after: float, max_blocks: int) -> None:
        self.block_tokens = block_tokens
        self.stale_after = stale_after
        self.max_blocks = max_blocks
        self.holders = Holders()
        self._endpoints: dict[str, _Endpoint] = {}

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
                return ReplayFrom(0 if expected is None else expected)
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
        if event.block_size != self.block_tokens:
            return "block_size"
        tier = event.medium or DEFAULT_TIER
        start = ROOT
        if event.parent_block_hash is not None:
            parent = _find(endpoint, tier, event.parent_block_hash)
            if parent is None:
                return "orphan"
            start = parent
        ours = block_hashes(event.token_ids, event.block_size, len(event.block_hashes), start)
        slot, stored, refs, add = self.holders.slot(address), endpoint.stored, endpoint.refs, self.holders.add
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
            held = refs.get(h, 0)
            refs[h] = held + 1
            if not held:
                add(slot, h)
        endpoint.tiers[tier] += added
        return None

    def _remove(self, address: str, endpoint: _Endpoint, event: BlockRemoved) -> None:
        tier = event.medium or DEFAULT_TIER
        slot = self.holders.find(address)
        for engine_hash in event.block_hashes:
            h = endpoint.stored.pop((tier, engine_hash), None)
            if h is None:  # stored before this gateway listened, or dropped
                continue
            endpoint.tiers[tier] -= 1
            held = endpoint.refs[h] - 1
            if held:
                endpoint.refs[h] = held
            else:
                del endpoint.refs[h]
                if slot is not None:
                    self.holders.remove(slot, h)

    def _clear(self, address: str, endpoint: _Endpoint) -> None:
        slot = self.holders.find(address)
        if slot is not None:
            for h in endpoint.refs:
                self.holders.remove(slot, h)
            self.holders.release(address)
        endpoint.stored.clear()
        endpoint.refs.clear()
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
        """Forget every endpoint not in ``addresses`` (it left discovery)."""
        keep = set(addresses)
        for address in [a for a in self._endpoints if a not in keep]:
            self._clear(address, self._endpoints.pop(address))


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
