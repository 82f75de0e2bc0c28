"""The router-side prefix index: which prompt blocks each engine is estimated to hold.

An approximation of every engine's prefix cache built from this gateway's own placements alone: when a
request is placed, its prompt's block hashes (:mod:`ext_proc.prefix.blocks`) are recorded on the
chosen prefill (which computes them) and on the chosen decode (which receives them), each an LRU of
block hashes sized from the endpoint's KV capacity (``token_capacity / block_tokens`` blocks, times a
self-correction ``scale`` in (0, 1]). A later prompt's hit at an endpoint is the number of its leading
blocks that endpoint holds, times ``block_tokens``.

Why an LRU and in which order: vLLM keeps a finished request's blocks as cached free blocks and
evicts free blocks least recently used first; it frees a request's blocks tail first, so a prompt's
head outlives its tail. :meth:`PrefixIndex.record` touches a prompt's blocks tail first for the same
reason, so the LRU evicts a prompt from its tail and a shared head stays.

Cost: the per-block work is compiled (numba kernels over numpy arrays, one call a recording or a
match per endpoint). Each endpoint numbers the blocks it was given in the order they were touched
(positions; a chain tail first) and keeps, in an open-addressing hash table, each held block's stamp:
the last position it was touched at. Eviction moves a floor up over the oldest positions, deleting a
position's block only where its stamp is that position (elsewhere the block was touched again later),
until at most ``keep`` blocks are held. So :meth:`PrefixIndex.record` is one table insertion and, later,
one deletion a block; the positions are kept in a ring, and the held blocks are numbered again (in the
same order) only when blocks touched again fill it with positions no longer theirs, or more blocks are
held. The order is the per-block LRU's: least recently touched first, a recording's tail before its
head. Because a chain is touched tail first and evicted in that order, the blocks an endpoint holds of
any chain are a prefix of it, so :meth:`PrefixIndex.match` finds each endpoint's depth by binary
search: O(endpoints x log blocks). The kernels compile on their first call; :func:`warm` compiles them
all ahead. (The event-fed index and the recent placements keep such tables too, without the order:
:mod:`~ext_proc.prefix.table` holds the kernels all three share.)

A chain is a 1-D int64 numpy array (what :func:`~ext_proc.prefix.blocks.block_hashes` returns) or a
sequence of Python ints in int64's range.

Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numba
import numpy as np

from ext_proc.prefix.hits import HitArrays
from ext_proc.prefix.table import (
    MIN_SLOTS,
    empty,
    find,
    power_of_two,
    put,
    rehash,
    remove,
    shift_of,
)


class _Lru:
    """One endpoint's blocks in the order they were touched, in numpy arrays the kernels below update.

    Positions number the blocks touched, one after another (a recording's tail first). ``table`` is an
    open-addressing hash table of the held blocks (``(slots, 2)`` int64, slots a power of two, at most
    half full, linear probing, deletion by backward shift): per slot a block hash and its stamp, the
    position it was last touched at, or ``EMPTY`` (-1: stamps are >= 0, so every hash value can be
    held). ``order`` is a ring (a power of two long) of the hash touched at each position from ``floor``
    on, position ``p`` at ``p % len(order)``; ``state`` is ``[top, floor, live, shift]``: the next
    position, the first position not evicted, the blocks held, and the table's ``64 - log2(slots)``.
    Eviction moves ``floor`` up, deleting a position's block where its stamp is that position
    (elsewhere it was touched again later). When the ring has no room for a recording (blocks touched
    again left too many such positions, or more blocks are held), the held blocks are numbered again
    from 0 in the same order into a ring of twice what they and the recording need; the table is
    rebuilt at twice the blocks it must hold when it would be more than half full, or over eight times
    that (a lower scale or capacity)."""

    __slots__ = ("order", "state", "table")

    def __init__(self) -> None:
        self.table = empty(MIN_SLOTS, 2)
        self.order = np.empty(_MIN_POSITIONS, dtype=np.int64)
        self.state = np.array([0, 0, 0, shift_of(MIN_SLOTS)], dtype=np.int64)

    @property
    def live(self) -> int:
        """The blocks held."""
        return int(self.state[_LIVE])

    def depth(self, chain: np.ndarray) -> int:
        """How many leading blocks of ``chain`` are held."""
        return _depth(self.table, self.state, chain)

    def record(self, chain: np.ndarray, keep: int) -> None:
        """Touch ``chain`` tail first (its head becomes the most recently used block), then hold at
        most ``keep`` blocks, evicting the least recently touched."""
        while not _record(self.table, self.order, self.state, chain, keep):
            self._fit(len(chain), keep)

    def held(self) -> np.ndarray:
        """The blocks held, most recently touched first (recording them as one chain keeps their order)."""
        return _held(self.table, self.order, self.state)[::-1].copy()

    def evict(self, keep: int) -> None:
        """Drop the least recently touched blocks until at most ``keep`` are held."""
        _evict(self.table, self.order, self.state, keep)
        self._fit(0, keep)

    def _fit(self, count: int, keep: int) -> None:
        """Make room for a recording of ``count`` blocks (none: shrink the table to what is held)."""
        state = self.state
        live = int(state[_LIVE])
        if state[_TOP] - state[_FLOOR] + count > len(self.order):
            order = np.empty(max(_MIN_POSITIONS, power_of_two(2 * (live + count))), dtype=np.int64)
            _renumber(self.table, self.order, order, state)
            self.order = order
        if not _fits(len(self.table), live, count, keep):
            slots = max(MIN_SLOTS, power_of_two(2 * _held_at_most(live, count, keep)))
            table = empty(slots, 2)
            rehash(self.table, table, shift_of(slots), 0)
            self.table = table
            state[_SHIFT] = shift_of(slots)


_TOP, _FLOOR, _LIVE, _SHIFT = range(4)  # the fields of an ``_Lru``'s ``state``
_MIN_POSITIONS = 16


@numba.njit(nogil=True)
def _held_at_most(live: int, count: int, keep: int) -> int:
    """The most blocks held while ``count`` are recorded, ``live`` held before, keeping ``keep``: eviction
    to ``keep`` comes first, and then follows each new block (one over ``keep`` at most)."""
    return max(live, min(live + count, keep + 1))


@numba.njit(nogil=True)
def _fits(slots: int, live: int, count: int, keep: int) -> bool:
    """Whether a table of ``slots`` is at most half full while ``count`` blocks are recorded, and not
    over eight times the size that needs (beyond the smallest)."""
    need = _held_at_most(live, count, keep)
    return 2 * need <= slots and (slots <= MIN_SLOTS or slots <= 8 * need)


@numba.njit(nogil=True)
def _drop(table: np.ndarray, order: np.ndarray, shift: int, floor: int, live: int, keep: int) -> tuple:
    """Move ``floor`` up until at most ``keep`` blocks are held, deleting each passed position's block
    where that position is its stamp; the new ``(floor, live)``."""
    while live > keep:
        i = find(table, shift, order[floor & (len(order) - 1)])
        if table[i, 1] == floor:
            remove(table, shift, i)
            live -= 1
        floor += 1
    return floor, live


@numba.njit(nogil=True)
def _evict(table: np.ndarray, order: np.ndarray, state: np.ndarray, keep: int) -> None:
    """Drop the least recently touched blocks until at most ``keep`` are held."""
    state[_FLOOR], state[_LIVE] = _drop(table, order, state[_SHIFT], state[_FLOOR], state[_LIVE], keep)


@numba.njit(nogil=True)
def _record(table: np.ndarray, order: np.ndarray, state: np.ndarray, chain: np.ndarray, keep: int) -> bool:
    """Touch ``chain`` tail first at the next positions, holding at most ``keep`` blocks; ``False``
    (and nothing done) when ``order`` or ``table`` must first be fitted to it (``_Lru._fit``)."""
    top, floor, live, shift = state[_TOP], state[_FLOOR], state[_LIVE], state[_SHIFT]
    if top - floor + len(chain) > len(order) or not _fits(len(table), live, len(chain), keep):
        return False
    floor, live = _drop(table, order, shift, floor, live, keep)
    for j in range(len(chain) - 1, -1, -1):
        if put(table, shift, chain[j], top):
            live += 1
            floor, live = _drop(table, order, shift, floor, live, keep)
        order[top & (len(order) - 1)] = chain[j]
        top += 1
    state[_TOP], state[_FLOOR], state[_LIVE] = top, floor, live
    return True


@numba.njit(nogil=True)
def _depth(table: np.ndarray, state: np.ndarray, chain: np.ndarray) -> int:
    """How many leading blocks of ``chain`` are held: they are a prefix (binary search)."""
    shift = state[_SHIFT]
    if len(chain) == 0 or find(table, shift, chain[0]) < 0:
        return 0
    low, high = 1, len(chain)
    while low < high:
        middle = (low + high + 1) // 2
        if find(table, shift, chain[middle - 1]) >= 0:
            low = middle
        else:
            high = middle - 1
    return low


@numba.njit(nogil=True)
def _renumber(table: np.ndarray, old: np.ndarray, new: np.ndarray, state: np.ndarray) -> None:
    """Number the held blocks again from 0, in their order, into ``new`` (and their stamps)."""
    shift, mask, top = state[_SHIFT], len(old) - 1, 0
    for position in range(state[_FLOOR], state[_TOP]):
        i = find(table, shift, old[position & mask])
        if table[i, 1] == position:
            new[top] = old[position & mask]
            table[i, 1] = top
            top += 1
    state[_TOP], state[_FLOOR] = top, 0


@numba.njit(nogil=True)
def _held(table: np.ndarray, order: np.ndarray, state: np.ndarray) -> np.ndarray:
    """The held blocks in the order they were last touched, least recently first."""
    shift, mask = state[_SHIFT], len(order) - 1
    held = np.empty(state[_LIVE], dtype=np.int64)
    n = 0
    for position in range(state[_FLOOR], state[_TOP]):
        h = order[position & mask]
        if table[find(table, shift, h), 1] == position:
            held[n] = h
            n += 1
    return held


class PrefixIndex:
    """Per endpoint, an LRU of the block hashes placed there; ``block_tokens`` tokens a block.

    Endpoints are keyed by ``"ip:port"`` address: one engine, whatever roles it serves. The chains
    recorded and matched are :func:`~ext_proc.prefix.blocks.block_hashes` chains (a block's hash
    stands for every block before it)."""

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self.hit_arrays = HitArrays(block_tokens)
        self._lrus: dict[str, _Lru] = {}  # address → its blocks
        self._scales: dict[str, float] = {}  # address → self-correction factor of its capacity

    def match(self, hashes: Sequence[int] | np.ndarray) -> dict[str, int]:
        """How many leading blocks of the chain ``hashes`` each endpoint holds, by address (>= 1 each)."""
        depth: dict[str, int] = {}
        chain = np.asarray(hashes, dtype=np.int64)
        if not len(chain):
            return depth
        for address, lru in self._lrus.items():
            held = lru.depth(chain)
            if held:
                depth[address] = held
        return depth

    def record(self, hashes: Sequence[int] | np.ndarray, address: str, capacity_tokens: float) -> None:
        """``address`` now holds the chain ``hashes``, its head the most recently used block of all.

        It keeps at most ``capacity_tokens * scale / block_tokens`` blocks (at least one), evicting its
        least recently used."""
        lru = self._lru(address)
        lru.record(np.asarray(hashes, dtype=np.int64), self._keep(address, capacity_tokens))

    def _keep(self, address: str, capacity_tokens: float) -> int:
        """The blocks ``address`` keeps (at least one; at most 2^62, within the kernels' int64)."""
        return min(max(1, int(capacity_tokens * self._scales[address] / self.block_tokens)), 1 << 62)

    def _lru(self, address: str) -> _Lru:
        lru = self._lrus.get(address)
        if lru is None:
            lru = self._lrus[address] = _Lru()
            self._scales[address] = 1.0
        return lru

    def scale(self, address: str) -> float:
        """The self-correction factor of ``address``'s capacity (1.0 for an endpoint never corrected)."""
        return self._scales.get(address, 1.0)

    def set_scale(self, address: str, scale: float, capacity_tokens: float) -> None:
        """Keep ``scale`` (in (0, 1]) of ``address``'s capacity from now on, evicting down to it."""
        lru = self._lru(address)
        self._scales[address] = scale
        lru.evict(self._keep(address, capacity_tokens))

    def blocks(self, address: str) -> int:
        """How many blocks ``address`` is estimated to hold."""
        lru = self._lrus.get(address)
        return 0 if lru is None else lru.live

    def held(self, address: str) -> np.ndarray:
        """The blocks ``address`` is estimated to hold, most recently used first (empty: none)."""
        lru = self._lrus.get(address)
        return np.empty(0, np.int64) if lru is None else lru.held()

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget every endpoint not in ``addresses`` (it left discovery)."""
        keep = set(addresses)
        for address in [a for a in self._lrus if a not in keep]:
            del self._lrus[address], self._scales[address]

    @property
    def addresses(self) -> list[str]:
        """The endpoints the index holds blocks of (or has corrected)."""
        return list(self._lrus)


def warm() -> None:
    """Compile the index's kernels now rather than on a request.

    Numba compiles each kernel on its first call; here a tiny index records (growing its table and
    numbering its positions again), matches, and shrinks its capacity."""
    index = PrefixIndex(1)
    chain = np.arange(40, dtype=np.int64)
    index.record(chain, "warm", 64)
    index.record(chain[:8], "warm", 64)
    index.match(chain)
    index.held("warm")
    index.set_scale("warm", 0.1, 64)
