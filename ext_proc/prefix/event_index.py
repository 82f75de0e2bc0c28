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
adapter: requests name adapters by model, the events by the engine's id for it, which the gateway cannot
map; an adapter's request chains from its own seed instead: :mod:`ext_proc.prefix.event_source`),
``block_size`` (blocks of another size than the pool's, which the engines' events set:
:mod:`ext_proc.prefix.block_sizes`; such blocks could never match a request's chain), ``orphan`` (the
parent block is unknown: stored before this gateway listened, or missed), ``full`` (the endpoint already holds
``max_blocks`` blocks). No clock (``now`` is passed in, in seconds) and no I/O.

Cost: no Python int per block on a request's path. Each endpoint keeps the blocks it holds in an
open-addressing table (:mod:`~ext_proc.prefix.table`: our hash, its stored entries in any tier and in
the GPU tiers), so :meth:`EventIndex.match` is one compiled call per fresh endpoint, a probe per
leading block held and one more; a batch's changes are queued while its events are read and made in
one compiled call. The engine's hashes stay in a dict per endpoint (they may be bytes). The kernels
compile on their first call: :func:`warm` compiles them ahead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numba
import numpy as np

from ext_proc.prefix.block_sizes import BlockSizes
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, EventBatch
from ext_proc.prefix.ranks import endpoint_of
from ext_proc.prefix.table import EMPTY, MIN_SLOTS, empty, find, probe, rehash, remove, shift_of, slots_for

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
    """What one endpoint reported: its blocks and where its sequence stands.

    ``table`` (:mod:`~ext_proc.prefix.table`, three columns): per block held, our hash, its stored
    entries in all tiers (>= 1) and in the GPU tiers; ``held`` the blocks in it. A batch's changes to
    it are queued (:meth:`hold`, :meth:`release`) and made in one compiled call (:meth:`flush`)."""

    __slots__ = (
        "changes",
        "expected",
        "hashes",
        "heard",
        "held",
        "holds",
        "shift",
        "stored",
        "table",
        "tiers",
    )

    def __init__(self, now: float) -> None:
        self.expected: int | None = None  # the next sequence; None before the first batch (or a reset)
        self.heard = now  # when a batch (or the subscription) last came
        self.stored: dict[tuple[str, EngineHash], int] = {}  # (tier, engine hash) → our hash
        self.tiers: Counter[str] = Counter()  # tier → blocks held there
        self.table = empty(MIN_SLOTS, 3)
        self.shift = shift_of(MIN_SLOTS)
        self.held = 0
        self.hashes: list[int] = []  # the queued changes: our hashes,
        self.changes: list[int] = []  # what changes for each (``_HOLD`` or ``_RELEASE``, + ``_GPU``)
        self.holds = 0  # and how many of them are holds

    def hold(self, hashes: list[int], gpu: bool) -> None:
        """Queue one more stored entry of each of ``hashes`` (our hashes; in a GPU tier when ``gpu``)."""
        self.hashes += hashes
        self.changes += [_HOLD | (_GPU_TIER if gpu else 0)] * len(hashes)
        self.holds += len(hashes)

    def release(self, hashes: list[int], gpu: bool) -> None:
        """Queue one stored entry fewer of each of ``hashes`` (from a GPU tier when ``gpu``): a block
        with none left is no longer held."""
        self.hashes += hashes
        self.changes += [_RELEASE | (_GPU_TIER if gpu else 0)] * len(hashes)

    def flush(self) -> None:
        """Make the queued changes, in order; the table first grown to hold them (at most half full),
        and shrunk after when it is over sixteen times what it holds."""
        if not self.hashes:
            return
        if 2 * (self.held + self.holds) > len(self.table):
            self._resize(self.held + self.holds)
        hashes, changes = np.array(self.hashes, dtype=np.int64), np.array(self.changes, dtype=np.int64)
        self.held += _change(self.table, self.shift, hashes, changes)
        self.hashes, self.changes, self.holds = [], [], 0
        if len(self.table) > MIN_SLOTS and 16 * self.held < len(self.table):
            self._resize(self.held)

    def clear(self) -> None:
        """Hold nothing (the queued changes dropped too)."""
        self.stored.clear()
        self.tiers.clear()
        self.table = empty(MIN_SLOTS, 3)
        self.shift = shift_of(MIN_SLOTS)
        self.held = 0
        self.hashes, self.changes, self.holds = [], [], 0

    def depth(self, chain: np.ndarray, column: int) -> int:
        """How many leading blocks of ``chain`` are held (``column`` 1: in any tier; 2: in a GPU tier)."""
        return _depth(self.table, self.shift, chain, column) if self.held else 0

    def _resize(self, held: int) -> None:
        slots = slots_for(held)
        table = empty(slots, 3)
        self.shift = shift_of(slots)
        rehash(self.table, table, self.shift, 0)
        self.table = table


_HOLD, _RELEASE, _GPU_TIER = 0, 1, 2  # a queued change: one stored entry more or fewer, + in a GPU tier


@numba.njit(nogil=True)
def _change(table: np.ndarray, shift: int, hashes: np.ndarray, changes: np.ndarray) -> int:
    """Count one entry more (``_HOLD``) or fewer (``_RELEASE``: the block held) of each of ``hashes``, in
    the GPU column too where ``_GPU_TIER`` is set, in order: a block is added at its first entry and
    removed with its last (``table`` has room for every block added). The net blocks added."""
    net = 0
    for k in range(len(hashes)):
        h, change = hashes[k], changes[k]
        step = -1 if change & _RELEASE else 1
        i = probe(table, shift, h)
        if table[i, 1] == EMPTY:
            table[i, 0], table[i, 1], table[i, 2] = h, 0, 0
            net += 1
        table[i, 1] += step
        if change & _GPU_TIER:
            table[i, 2] += step
        if table[i, 1] == 0:
            remove(table, shift, i)
            net -= 1
    return net


@numba.njit(nogil=True)
def _depth(table: np.ndarray, shift: int, chain: np.ndarray, column: int) -> int:
    """How many leading blocks of ``chain`` ``table`` holds with a count above 0 in ``column``."""
    for depth in range(len(chain)):
        i = find(table, shift, chain[depth])
        if i < 0 or table[i, column] == 0:
            return depth
    return len(chain)


class EventIndex:
    """Per endpoint (``"ip:port"``), the blocks its engine reported, :attr:`block_tokens` tokens a block.

    ``block_tokens``: the block size until the engines' events give theirs (:attr:`sizes`);
    ``stale_after``: seconds without a batch after which an endpoint counts as holding nothing;
    ``max_blocks``: the most blocks kept per endpoint (a flood cannot grow the index without bound)."""

    def __init__(self, block_tokens: int, stale_after: float, max_blocks: int) -> None:
        self.sizes = BlockSizes(block_tokens)
        self.stale_after = stale_after
        self.max_blocks = max_blocks
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
            endpoint.clear()
            expected = endpoint.expected = None
            reset = "restart"
        if sequence != (0 if expected is None else expected):
            if replayable:
                return ReplayFrom(0 if expected is None else expected, reset)
            if expected is not None:
                endpoint.clear()
                reset = "gap"
        endpoint.expected = sequence + 1
        dropped: Counter[str] = Counter()
        for event in batch.events:
            if isinstance(event, BlockStored):
                reason = self._store(address, endpoint, event)
                if reason is not None:
                    dropped[reason] += 1
            elif isinstance(event, BlockRemoved):
                self._remove(endpoint, event)
            elif isinstance(event, AllBlocksCleared):
                endpoint.clear()
        endpoint.flush()
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
        stored = endpoint.stored
        room = self.max_blocks - len(stored)
        added: list[int] = []
        full = False
        for engine_hash, h in zip(event.block_hashes, ours, strict=True):
            key = (tier, engine_hash)
            if key in stored:
                continue
            if len(added) == room:
                full = True
                break
            stored[key] = h
            added.append(h)
        if added:
            endpoint.hold(added, tier in GPU_TIERS)
            endpoint.tiers[tier] += len(added)
        return "full" if full else None

    def _remove(self, endpoint: _Endpoint, event: BlockRemoved) -> None:
        tier = event.medium or DEFAULT_TIER
        released = []
        for engine_hash in event.block_hashes:
            h = endpoint.stored.pop((tier, engine_hash), None)
            if h is not None:  # else stored before this gateway listened, or dropped
                released.append(h)
        if released:
            endpoint.tiers[tier] -= len(released)
            endpoint.release(released, tier in GPU_TIERS)

    def reset(self, address: str) -> None:
        """Drop what ``address`` reported and where its sequence stood (e.g. a replay failed)."""
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            endpoint.clear()
            endpoint.expected = None

    def match(self, hashes: Sequence[int] | np.ndarray, now: float) -> dict[str, int]:
        """How many leading blocks of the chain ``hashes`` each fresh endpoint holds, in any tier.

        Only endpoints holding at least the first block are listed (each count >= 1). A chain is a 1-D
        int64 array (:func:`~ext_proc.prefix.blocks.block_hashes`) or a sequence of ints in int64's
        range."""
        depth: dict[str, int] = {}
        if not len(hashes):
            return depth
        chain = np.asarray(hashes, dtype=np.int64)
        for address, endpoint in self._endpoints.items():
            held = endpoint.depth(chain, _ALL) if now - endpoint.heard <= self.stale_after else 0
            if held:
                depth[address] = held
        return depth

    def match_gpu(
        self, hashes: Sequence[int] | np.ndarray, matched: Mapping[str, int]
    ) -> dict[str, int] | None:
        """Of ``matched`` (:meth:`match`), the leading blocks each endpoint holds in a GPU tier.

        ``None`` when every endpoint in ``matched`` holds all its matched blocks in GPU memory (no
        endpoint holds a block in another tier, or none of ``matched`` does)."""
        tiered = [a for a in matched if any(n and t not in GPU_TIERS for t, n in self._tiers(a).items())]
        if not tiered:
            return None
        chain = np.asarray(hashes, dtype=np.int64)
        gpu = {a: self._endpoints[a].depth(chain, _GPU) for a in tiered}
        return {a: gpu.get(a, n) for a, n in matched.items()}

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
        self._endpoints.pop(address, None)


_ALL, _GPU = 1, 2  # the columns of an ``_Endpoint``'s table: stored entries in all tiers, in the GPU tiers


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


def warm() -> None:
    """Compile the event index's kernels now rather than on a request.

    Numba compiles each kernel on its first call; here an index stores blocks in two tiers (growing a
    table), matches them in both, removes them (shrinking it) and clears."""
    index = EventIndex(1, 1.0, 100)
    gpu, cpu = (
        BlockStored(tuple(range(40)), None, tuple(range(40)), 1, None, tier) for tier in (None, "CPU")
    )
    index.apply("warm", EventBatch(0, 0.0, 0, (gpu, cpu)), 0.0, False)
    chain = block_hashes(range(40), 1, 40, ROOT)
    index.match_gpu(chain, index.match(chain, 0.0))
    removed = BlockRemoved(tuple(range(40)), None)
    index.apply("warm", EventBatch(1, 0.0, 0, (removed, AllBlocksCleared())), 0.0, False)
