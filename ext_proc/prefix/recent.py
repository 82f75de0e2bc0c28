"""The placements of the last seconds: what the engines hold before their events say so (pure).

An engine reports a block only after it stored it: a prompt placed a few milliseconds ago is computing
still, and a second request sharing it would not meet it if the index knew only the events. So the
chains this gateway placed in the last ``seconds`` are kept per endpoint and looked up beside the
events, as the approximate index looks up all of its placements. No clock (``now`` is passed in, in
seconds) and no I/O.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

from ext_proc.prefix.index import Holders
from ext_proc.prefix.ranks import endpoint_of


class RecentPlacements:
    """The chains placed on each endpoint (``"ip:port"``, or one data-parallel rank of it) in the last
    ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.holders = Holders()
        self._placed: deque[tuple[float, str, Sequence[int]]] = deque()  # oldest first
        self._refs: dict[str, Counter[int]] = {}  # address → its recent blocks, counted per placement

    def record(self, hashes: Sequence[int], address: str, now: float) -> None:
        """``hashes`` were placed on ``address`` at ``now``."""
        self.expire(now)
        if self.seconds <= 0 or not len(hashes):
            return
        slot = self.holders.slot(address)
        refs = self._refs.setdefault(address, Counter())
        for h in hashes:
            refs[h] += 1
            if refs[h] == 1:
                self.holders.add(slot, h)
        self._placed.append((now, address, hashes))

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """How many leading blocks of ``hashes`` each endpoint was given in the last ``seconds``."""
        self.expire(now)
        return self.holders.match(hashes)

    def expire(self, now: float) -> None:
        """Forget the placements older than ``seconds`` at ``now``."""
        placed, horizon = self._placed, now - self.seconds
        while placed and placed[0][0] < horizon:
            _, address, hashes = placed.popleft()
            self._forget(address, hashes)

    def _forget(self, address: str, hashes: Iterable[int]) -> None:
        refs = self._refs[address]
        slot = self.holders.slot(address)
        for h in hashes:
            refs[h] -= 1
            if not refs[h]:
                del refs[h]
                self.holders.remove(slot, h)
        if not refs:
            del self._refs[address]
            self.holders.release(address)

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget every endpoint not in ``addresses`` (each of its data-parallel ranks)."""
        keep = set(addresses)
        self._placed = deque(p for p in self._placed if endpoint_of(p[1]) in keep)
        for address in [a for a in self._refs if endpoint_of(a) not in keep]:
            slot = self.holders.slot(address)
            for h in self._refs.pop(address):
                self.holders.remove(slot, h)
            self.holders.release(address)
