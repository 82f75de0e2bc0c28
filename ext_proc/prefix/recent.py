"""The placements of the last seconds: what the engines hold before their events say so (pure).

An engine reports a block only after it stored it: a prompt placed a few milliseconds ago is computing
still, and a second request sharing it would not meet it if the index knew only the events. So the
chains this gateway placed in the last ``seconds`` are kept per endpoint and looked up beside the
events, as the approximate index looks up all of its placements. No clock (``now`` is passed in, in
seconds) and no I/O.

Cost: no Python work per block. Placements are numbered in order (their serials); per endpoint an
open-addressing table (:mod:`~ext_proc.prefix.table`) keeps each block placed there with the serial of
its latest placement. Expiry moves a floor up past the serials of the placements older than
``seconds`` (a queue of one entry a placement): a block is held while its serial is at or above the
floor, and the expired entries are dropped only when a table is rebuilt to make room, so
:meth:`RecentPlacements.record` is one compiled call (a table insertion a block) and
:meth:`RecentPlacements.match` one a endpoint (a table probe per leading block held, and one more).
An endpoint whose latest placement expired is forgotten at once. The kernels compile on their first
call: :func:`warm` compiles them ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numba
import numpy as np

from ext_proc.prefix.ranks import endpoint_of
from ext_proc.prefix.table import MIN_SLOTS, empty, find, put, rehash, shift_of, slots_for


class _Stamps:
    """One endpoint's recently placed blocks: ``table`` (hash, serial of its latest placement), the
    slots used (expired blocks included) and the serial of the endpoint's latest placement."""

    __slots__ = ("latest", "shift", "table", "used")

    def __init__(self) -> None:
        self.table = empty(MIN_SLOTS, 2)
        self.shift = shift_of(MIN_SLOTS)
        self.used = 0
        self.latest = -1

    def record(self, chain: np.ndarray, serial: int, floor: int) -> None:
        """Stamp the blocks of ``chain`` with ``serial``; the table first rebuilt with the blocks of
        serials from ``floor`` on alone when it would be more than half full."""
        if 2 * (self.used + len(chain)) > len(self.table):
            live = _live(self.table, floor)
            slots = slots_for(live + len(chain))
            table = empty(slots, 2)
            self.shift = shift_of(slots)
            self.used = rehash(self.table, table, self.shift, floor)
            self.table = table
        self.used += _stamp(self.table, self.shift, chain, serial)
        self.latest = serial


@numba.njit(nogil=True)
def _stamp(table: np.ndarray, shift: int, chain: np.ndarray, serial: int) -> int:
    """Stamp every hash of ``chain`` with ``serial`` (added where absent); how many were added."""
    added = 0
    for h in chain:
        if put(table, shift, h, serial):
            added += 1
    return added


@numba.njit(nogil=True)
def _live(table: np.ndarray, floor: int) -> int:
    """The blocks of ``table`` stamped at ``floor`` or later."""
    count = 0
    for i in range(len(table)):
        if table[i, 1] >= floor:
            count += 1
    return count


@numba.njit(nogil=True)
def _depth(table: np.ndarray, shift: int, chain: np.ndarray, floor: int) -> int:
    """How many leading blocks of ``chain`` are in ``table`` stamped at ``floor`` or later."""
    for depth in range(len(chain)):
        i = find(table, shift, chain[depth])
        if i < 0 or table[i, 1] < floor:
            return depth
    return len(chain)


class RecentPlacements:
    """The chains placed on each endpoint in the last ``seconds``.

    An endpoint is ``"ip:port"``, or one data-parallel rank of it.

    A chain is a 1-D int64 array (:func:`~ext_proc.prefix.blocks.block_hashes`) or a sequence of ints in
    int64's range."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._placed: deque[tuple[float, int]] = deque()  # (when, serial) of each placement, oldest first
        self._serial = 0  # the next placement's
        self._floor = 0  # the oldest serial not expired
        self._stamps: dict[str, _Stamps] = {}  # address → its recent blocks

    def record(self, hashes: Sequence[int] | np.ndarray, address: str, now: float) -> None:
        """``hashes`` were placed on ``address`` at ``now``."""
        self.expire(now)
        if self.seconds <= 0 or not len(hashes):
            return
        stamps = self._stamps.get(address)
        if stamps is None:
            stamps = self._stamps[address] = _Stamps()
        stamps.record(np.asarray(hashes, dtype=np.int64), self._serial, self._floor)
        self._placed.append((now, self._serial))
        self._serial += 1

    def match(self, hashes: Sequence[int] | np.ndarray, now: float) -> dict[str, int]:
        """How many leading blocks of ``hashes`` each endpoint was given in the last ``seconds``.

        Only endpoints given at least the first block are listed (each count >= 1)."""
        self.expire(now)
        depth: dict[str, int] = {}
        if not self._stamps or not len(hashes):
            return depth
        chain, floor = np.asarray(hashes, dtype=np.int64), self._floor
        for address, stamps in self._stamps.items():
            held = _depth(stamps.table, stamps.shift, chain, floor)
            if held:
                depth[address] = held
        return depth

    def expire(self, now: float) -> None:
        """Forget the placements older than ``seconds`` at ``now`` (and the endpoints left with none)."""
        placed, horizon = self._placed, now - self.seconds
        if not placed or placed[0][0] >= horizon:
            return
        while placed and placed[0][0] < horizon:
            placed.popleft()
        self._floor = placed[0][1] if placed else self._serial
        for address in [a for a, s in self._stamps.items() if s.latest < self._floor]:
            del self._stamps[address]

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget every endpoint not in ``addresses`` (each of its data-parallel ranks)."""
        keep = set(addresses)
        for address in [a for a in self._stamps if endpoint_of(a) not in keep]:
            del self._stamps[address]


def warm() -> None:
    """Compile the recent placements' kernels now rather than on a request.

    Numba compiles each kernel on its first call; here placements record, match, expire and fill a table
    until it is rebuilt."""
    recent = RecentPlacements(1.0)
    for n in range(3):
        recent.record(np.arange(n * 8, n * 8 + 8, dtype=np.int64), "warm", float(n))
    recent.match(np.arange(8, dtype=np.int64), 2.0)
