"""Matched blocks as the decision's hit arrays: what every prefix source hands the decision.

A source finds how many leading blocks of a prompt each endpoint holds (by address); :class:`HitArrays`
turns that into :class:`~ext_proc.affinity.Hits`, hit tokens per position of the candidate pools, as
the decision reads load. Pure.
"""

from __future__ import annotations

import numpy as np

from ext_proc.affinity import Hits, Pool
from ext_proc.affinity.model import E

_POSITIONS_KEPT = 8  # pools whose address → position map is kept (the registry's two, plus subsets)


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
