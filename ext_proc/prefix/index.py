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

Cost, per prompt rather than per block in Python: each endpoint numbers the blocks it was given in
the order they were touched (positions; a chain tail first), maps each held block to its last position
plus its depth (the same value for every block of one recording: one ``dict.update`` a prompt), and
keeps, per position, the hash touched there and whether the block was touched again since
(superseded). Eviction is a floor moved up over as many held positions as it drops (``bytearray.count``
skips the superseded ones) and one C loop deleting those blocks; touching a held head again marks its
old positions superseded a slice per recording it came from. So :meth:`PrefixIndex.record` is one
insertion and, later, one deletion a block, both in C, plus O(log blocks) Python steps; the positions
kept are trimmed (or numbered again) when they outgrow twice the blocks held. The order is the
per-block LRU's: least recently touched first, a recording's tail before its head. Because a chain is
touched tail first and evicted in that order, the blocks an endpoint holds of any chain are a prefix
of it, so :meth:`PrefixIndex.match` finds each endpoint's depth by binary search: O(endpoints x log
blocks). (The event-fed index and the recent placements keep per-block holder sets instead:
:class:`Holders`.)

Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from operator import add, sub

import numpy as np

from ext_proc.affinity import Hits, Pool
from ext_proc.affinity.model import E

_POSITIONS_KEPT = 8  # pools whose address → position map is kept (the registry's two, plus subsets)


class Holders:
    """Per block hash, the endpoints holding it, as the bits of an int: one bit (slot) per endpoint.

    Endpoints are keyed by ``"ip:port"`` address and take the lowest free slot; a released slot is
    reused. :meth:`match` walks a chain once, AND-ing the holder sets, and stops where no endpoint holds
    the prefix any more: O(matched blocks + endpoints that matched)."""

    def __init__(self) -> None:
        self._bits: dict[int, int] = {}  # block hash → bit set of the slots holding it
        self._slots: dict[str, int] = {}  # address → slot (its bit)
        self._addresses: dict[int, str] = {}  # slot → address
        self._free: list[int] = []  # slots of released endpoints, for reuse

    def slot(self, address: str) -> int:
        """The slot of ``address``, given the lowest free one when it has none."""
        slot = self._slots.get(address)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[address] = slot
            self._addresses[slot] = address
        return slot

    def find(self, address: str) -> int | None:
        """The slot of ``address``; ``None`` when it has none."""
        return self._slots.get(address)

    def release(self, address: str) -> None:
        """Free the slot of ``address`` for reuse; the caller removed its hashes first."""
        slot = self._slots.pop(address)
        del self._addresses[slot]
        self._free.append(slot)

    def add(self, slot: int, h: int) -> None:
        """The endpoint of ``slot`` holds block ``h``."""
        self._bits[h] = self._bits.get(h, 0) | (1 << slot)

    def remove(self, slot: int, h: int) -> None:
        """The endpoint of ``slot`` no longer holds block ``h``."""
        rest = self._bits.get(h, 0) & ~(1 << slot)
        if rest:
            self._bits[h] = rest
        else:
            self._bits.pop(h, None)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """How many leading blocks of the chain ``hashes`` each endpoint holds, by address.

        Only endpoints holding at least the first block are listed (each count >= 1). ``hashes`` as
        Python ints (a chain's ``tolist()``) is fastest; its int64 array gives the same answer."""
        holders = self._bits
        alive = holders.get(hashes[0], 0) if len(hashes) else 0
        depth: dict[str, int] = {}
        i = 1
        while alive:
            if i == len(hashes):
                self._note(alive, i, depth)
                break
            held = alive & holders.get(hashes[i], 0)
            if held != alive:
                self._note(alive & ~held, i, depth)
                alive = held
            i += 1
        return depth

    def _note(self, bits: int, blocks: int, depth: dict[str, int]) -> None:
        while bits:
            low = bits & -bits
            depth[self._addresses[low.bit_length() - 1]] = blocks
            bits ^= low

    @property
    def addresses(self) -> list[str]:
        """The endpoints that have a slot."""
        return list(self._slots)


class HitArrays:
    """Matched blocks per address as the decision's :class:`Hits`: hit tokens per pool position.

    Keeps the address → position map of the last few pools (the registry's two, plus subsets)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._positions: dict[int, tuple[Pool, dict[str, int]]] = {}

    def hits(
        self,
        matched: dict[str, int],
        prefills: Pool[E],
        decodes: Pool[E],
        prompt_tokens: int,
        gpu: dict[str, int] | None = None,
    ) -> Hits | None:
        """``matched`` (blocks by address) as hit tokens per pool position, each at most ``prompt_tokens``.

        ``gpu`` (``None``: all of it): the leading blocks of ``matched`` each address holds in GPU
        memory; the rest of its hit is a CPU-tier hit (:class:`Hits` ``prefill_cpu``, ``decode_cpu``).
        ``None`` when no endpoint of either pool holds anything (the decision then does without)."""
        if not matched:
            return None
        arrays = []
        found = False
        for pool in (prefills, decodes):
            tokens = np.zeros(pool.size, dtype=np.int64)
            cpu = None if gpu is None else np.zeros(pool.size, dtype=np.int64)
            positions = self._positions_of(pool)
            for address, blocks in matched.items():
                position = positions.get(address)
                if position is not None:
                    hit = tokens[position] = min(blocks * self.block_tokens, prompt_tokens)
                    found = True
                    if cpu is not None and gpu is not None:
                        cpu[position] = hit - min(gpu.get(address, 0) * self.block_tokens, hit)
            arrays.append((tokens, cpu))
        if not found:
            return None
        (prefill, prefill_cpu), (decode, decode_cpu) = arrays
        return Hits(prefill, decode, prefill_cpu, decode_cpu)

    def _positions_of(self, pool: Pool[E]) -> dict[str, int]:
        kept = self._positions.get(id(pool))
        if kept is not None and kept[0] is pool:
            return kept[1]
        positions = {e.address: i for i, e in enumerate(pool.endpoints)}
        if len(self._positions) >= _POSITIONS_KEPT:
            self._positions.pop(next(iter(self._positions)))
        self._positions[id(pool)] = (pool, positions)
        return positions


class _Lru:
    """One endpoint's blocks in the order they were touched, as positions in that order.

    Positions number the blocks touched, one after another (a recording's tail first); ``order`` and
    ``superseded`` cover those from ``base`` on. Positions below ``floor`` are evicted; a position is
    superseded (1) once its block was touched again, at a later one. A held block maps to its last
    position plus its depth in its chain (for every block of one recording, its head's position: one
    value a recording, and a chain's held blocks are runs of equal values). Eviction moves ``floor``
    up over as many held positions as it drops (``bytearray.count`` skips the superseded ones) and
    deletes those blocks, all in C loops. Once the positions kept outgrow twice the blocks held, the
    evicted ones are dropped, or, when superseded ones are most of the rest, the held blocks are
    numbered again from 0 in the same order."""

    __slots__ = ("base", "floor", "live", "order", "positions", "superseded")

    def __init__(self) -> None:
        self.positions: dict[int, int] = {}  # held block hash → its last position + its depth
        self.order: list[int] = []  # the block hash touched at each position from ``base`` on
        self.superseded = bytearray()  # per position from ``base`` on: 1 once its block was touched again
        self.base = 0  # the position of ``order[0]``
        self.floor = 0  # the first position not evicted
        self.live = 0  # blocks held: the positions from ``floor`` on that are not superseded

    def depth(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain ``hashes`` are held (they are a prefix: binary search)."""
        held = self.positions
        if not hashes or hashes[0] not in held:
            return 0
        return _last_true(lambda blocks: hashes[blocks - 1] in held, 1, len(hashes))

    def touch(self, hashes: Sequence[int]) -> None:
        """Touch the chain ``hashes`` tail first: its head becomes the most recently used block."""
        held = self.depth(hashes)
        if held:
            self._supersede(hashes, held)
        self.live += len(hashes) - held
        top = self.base + len(self.order)
        self.positions.update(zip(hashes, repeat(top + len(hashes) - 1)))
        self.order += reversed(hashes)
        self.superseded += bytes(len(hashes))

    def _supersede(self, hashes: Sequence[int], held: int) -> None:
        """Mark the last positions of the ``held`` leading blocks of ``hashes`` superseded: a slice per
        run of blocks last touched by one recording (equal values, found by binary search)."""
        positions, superseded, base = self.positions, self.superseded, self.base
        depth = 0
        while depth < held:
            value = positions.get(hashes[depth])
            if value is None:  # (a hash met twice in one chain: the prefix is not all held)
                depth += 1
                continue
            end = _last_true(lambda n, value=value: positions.get(hashes[n - 1]) == value, depth + 1, held)
            superseded[value - end + 1 - base : value - depth + 1 - base] = b"\x01" * (end - depth)
            depth = end

    def evict(self, keep: int) -> None:
        """Drop the least recently touched blocks until at most ``keep`` are held."""
        excess = self.live - keep
        if excess > 0:
            start = end = self.floor - self.base
            skipped = excess  # positions to pass: the held ones to drop, then the superseded among them
            while skipped and end < len(self.order):
                end, skipped = end + skipped, self.superseded.count(1, end, end + skipped)
            end = min(end, len(self.order))
            dropped = compress(self.order[start:end], self.superseded[start:end].translate(_NOT))
            _consume(map(self.positions.pop, dropped, repeat(None)))
            self.floor = self.base + end
            self.live = keep
        if len(self.order) > 2 * self.live + 64:
            self._compact()

    def _compact(self) -> None:
        start = self.floor - self.base
        if self.superseded.count(1, start) <= self.live:  # what is left is at most twice the blocks held
            del self.order[:start], self.superseded[:start]
            self.base = self.floor
            return
        kept = self.superseded[start:].translate(_NOT)
        held = list(compress(self.order[start:], kept))
        old = list(compress(range(self.floor, self.base + len(self.order)), kept))
        depths = map(sub, map(self.positions.get, held, old), old)
        self.positions = dict(zip(held, map(add, depths, range(len(held))), strict=True))
        self.order, self.superseded = held, bytearray(len(held))
        self.base = self.floor = 0
        self.live = len(held)


def _last_true(holds: Callable[[int], bool], low: int, high: int) -> int:
    """The largest ``n`` in ``[low, high]`` with ``holds(n)``, for ``holds`` true up to some ``n`` and
    false after, and true at ``low``: binary search."""
    while low < high:
        middle = (low + high + 1) // 2
        if holds(middle):
            low = middle
        else:
            high = middle - 1
    return low


_NOT = bytes([1, 0]) + bytes(254)  # a bytes.translate table: 0 → 1, 1 → 0


def _consume(items: Iterable[object]) -> None:
    deque(items, maxlen=0)


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

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """How many leading blocks of the chain ``hashes`` each endpoint holds, by address (>= 1 each)."""
        depth: dict[str, int] = {}
        if not hashes:
            return depth
        for address, lru in self._lrus.items():
            held = lru.depth(hashes)
            if held:
                depth[address] = held
        return depth

    def record(self, hashes: Sequence[int], address: str, capacity_tokens: float) -> None:
        """``address`` now holds the chain ``hashes``, its head the most recently used block of all.

        It keeps at most ``capacity_tokens * scale / block_tokens`` blocks (at least one), evicting its
        least recently used."""
        self._lru(address).touch(hashes)
        self._evict(address, capacity_tokens)

    def _evict(self, address: str, capacity_tokens: float) -> None:
        lru = self._lrus[address]
        keep = max(1, int(capacity_tokens * self._scales[address] / self.block_tokens))
        lru.evict(keep)

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
        self._lru(address)
        self._scales[address] = scale
        self._evict(address, capacity_tokens)

    def blocks(self, address: str) -> int:
        """How many blocks ``address`` is estimated to hold."""
        lru = self._lrus.get(address)
        return 0 if lru is None else lru.live

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget every endpoint not in ``addresses`` (it left discovery)."""
        keep = set(addresses)
        for address in [a for a in self._lrus if a not in keep]:
            del self._lrus[address], self._scales[address]

    @property
    def addresses(self) -> list[str]:
        """The endpoints the index holds blocks of (or has corrected)."""
        return list(self._lrus)
