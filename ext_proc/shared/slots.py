"""Decision slots: replicas sharing their state take turns to decide (pure).

Replicas that decide at the same instant see the same view and send requests to the same place
(herding: docs/benchmarks.md §12). With ``shared_state.decision_slot_ms`` on, time (each replica's wall
clock, seconds since the epoch) is cut into slots of ``slot`` seconds; among ``count`` live replicas (this
one and the peers it hears from), the one of rank ``rank`` (its place in their sorted names) decides
in the slots whose number modulo ``count`` is ``rank``, and only in the first half of each: the second
half is left for its last bookings to reach the peers (its batch, the bus, the clocks' skew) before the
next replica's slot starts. A request arriving outside its replica's open half waits for the next one.

Its wait is at most ``count * slot`` (one cycle) and is computed once: a replica that counts a different
number of replicas than its peers for a moment (one joined or left) decides late or at the same time as
another one, never later than a cycle.
"""

from __future__ import annotations

from collections.abc import Iterable

OPEN_SHARE = 0.5
"""The share of its slot in which a replica decides (the rest carries its bookings to its peers)."""


SNAP = 1e-9
"""A wait shorter than this (a slot starting now, up to the rounding of the modulo) is none."""


def rank_of(name: str, peers: Iterable[str]) -> tuple[int, int]:
    """Replica ``name``'s rank among itself and ``peers`` (sorted by name), and how many they are."""
    names = sorted({name, *peers})
    return names.index(name), len(names)


def slot_wait(now: float, rank: int, count: int, slot: float) -> float:
    """Seconds replica ``rank`` of ``count`` waits before it decides at ``now``; 0.0: decide now.

    ``now`` and ``slot`` in seconds (``slot`` 0 or a single replica: never waits). The wait ends at the
    start of the replica's next slot; within the open half of its own slot it is 0. Always below
    ``count * slot``."""
    if slot <= 0 or count <= 1:
        return 0.0
    cycle = slot * count
    start = (rank % count) * slot
    past = (now - start) % cycle  # seconds since this replica's slot last started
    wait = cycle - past
    if past < slot * OPEN_SHARE or wait < SNAP:
        return 0.0
    return wait
