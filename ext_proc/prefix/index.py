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

Cost: one dictionary holds, per block hash, the set of endpoints holding it as the bits of an int, so
:meth:`PrefixIndex.match` walks the prompt's chain once, AND-ing the holder sets, and stops where no
endpoint holds the prefix any more: O(matched blocks + endpoints that matched), independent of the
number of endpoints otherwise. :meth:`PrefixIndex.record` is O(blocks) per endpoint recorded.

Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

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

        Only endpoints holding at least the first block are listed (each count >= 1)."""
        holders = self._bits
        alive = holders.get(hashes[0], 0) if hashes else 0
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


class PrefixIndex:
    """Per endpoint, an LRU of the block hashes placed there; ``block_tokens`` tokens a block.

    Endpoints are keyed by ``"ip:port"`` address: one engine, whatever roles it serves."""

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self.holders = Holders()
        self.hit_arrays = HitArrays(block_tokens)
        self._lrus: dict[int, OrderedDict[int, None]] = {}  # slot → its blocks, least recent first
        self._scales: dict[int, float] = {}  # slot → self-correction factor of its capacity

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """How many leading blocks of the chain ``hashes`` each endpoint holds, by address (>= 1 each)."""
        return self.holders.match(hashes)

    def record(self, hashes: Sequence[int], address: str, capacity_tokens: float) -> None:
        """``address`` now holds the chain ``hashes``, its head the most recently used block of all.

        It keeps at most ``capacity_tokens * scale / block_tokens`` blocks (at least one), evicting its
        least recently used."""
        slot = self._slot(address)
        lru = self._lrus[slot]
        holders = self.holders
        for h in reversed(hashes):  # tail first: the head ends the most recent
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders.add(slot, h)
        self._evict(slot, self._capacity(slot, capacity_tokens))

    def _capacity(self, slot: int, capacity_tokens: float) -> int:
        return max(1, int(capacity_tokens * self._scales[slot] / self.block_tokens))

    def _evict(self, slot: int, keep: int) -> None:
        lru, holders = self._lrus[slot], self.holders
        while len(lru) > keep:
            h, _ = lru.popitem(last=False)
            holders.remove(slot, h)

    def _slot(self, address: str) -> int:
        slot = self.holders.slot(address)
        if slot not in self._lrus:
            self._lrus[slot] = OrderedDict()
            self._scales[slot] = 1.0
        return slot

    def scale(self, address: str) -> float:
        """The self-correction factor of ``address``'s capacity (1.0 for an endpoint never corrected)."""
        slot = self.holders.find(address)
        return 1.0 if slot is None else self._scales[slot]

    def set_scale(self, address: str, scale: float, capacity_tokens: float) -> None:
        """Keep ``scale`` (in (0, 1]) of ``address``'s capacity from now on, evicting down to it."""
        slot = self._slot(address)
        self._scales[slot] = scale
        self._evict(slot, self._capacity(slot, capacity_tokens))

    def blocks(self, address: str) -> int:
        """How many blocks ``address`` is estimated to hold."""
        slot = self.holders.find(address)
        return 0 if slot is None else len(self._lrus[slot])

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget every endpoint not in ``addresses`` (it left discovery; its slot is reused)."""
        keep = set(addresses)
        for address in [a for a in self.holders.addresses if a not in keep]:
            slot = self.holders.slot(address)
            self._evict(slot, 0)
            del self._lrus[slot], self._scales[slot]
            self.holders.release(address)

    @property
    def addresses(self) -> list[str]:
        """The endpoints the index holds blocks of (or has corrected)."""
        return self.holders.addresses
