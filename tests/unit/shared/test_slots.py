"""Decision slots (``shared_state.decision_slot_ms``): the pure wait, and replicas taking turns.

The wait (:func:`slot_wait`, :func:`rank_of`) by its properties; two routers sharing over a delayed
:class:`MemoryHub` in virtual time, two requests arriving at once, with and without slots (herding, then
not). The shell's wait: tests/unit/server/test_slot_wait.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from builders import CHAT_META
from hypothesis import given
from hypothesis import strategies as st
from sharing import P1, P2, chat, share, two_pair_router

from ext_proc.checks import ConfigError
from ext_proc.outcome import Routed
from ext_proc.router import Router
from ext_proc.shared.config import SharedStateConfig
from ext_proc.shared.runner import MemoryHub
from ext_proc.shared.slots import OPEN_SHARE, SNAP, rank_of, slot_wait
from sim.virtual import new_loop

CONFIG = SharedStateConfig(batch_seconds=0.001, sync_wait_seconds=0.0)

times = st.floats(0, 2e9, allow_nan=False)
slots = st.floats(0.001, 0.05)


@given(now=times, count=st.integers(1, 64), slot=slots, data=st.data())
def test_the_wait_is_under_a_cycle_and_ends_in_the_open_part_of_the_replicas_own_slot(
    now: float, count: int, slot: float, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, count - 1))
    wait = slot_wait(now, rank, count, slot)
    cycle = count * slot
    assert 0 <= wait < cycle + 1e-9
    if count == 1:
        assert wait == 0
        return
    past = (now + wait - rank * slot) % cycle  # where the wait ends, from the start of the own slot
    tolerance = max(1.0, now) * 1e-15  # float seconds since the epoch: ~2 µs at 2e9 s
    assert past < slot * OPEN_SHARE + tolerance or cycle - past < max(tolerance, SNAP)


@given(now=times, count=st.integers(2, 16), slot=slots)
def test_at_most_one_replica_decides_at_any_instant(now: float, count: int, slot: float) -> None:
    deciding = [rank for rank in range(count) if slot_wait(now, rank, count, slot) == 0]
    assert len(deciding) <= 1


@given(now=times, count=st.integers(1, 16), rank=st.integers(0, 15))
def test_slots_off_never_wait(now: float, count: int, rank: int) -> None:
    assert slot_wait(now, rank, count, 0.0) == 0.0
    assert slot_wait(now, rank, 1, 0.01) == 0.0


def test_the_wait_by_hand() -> None:
    # Four replicas, 10 ms slots: replica 1 decides in [10, 15) ms of every 40 ms.
    assert slot_wait(0.0, 1, 4, 0.01) == pytest.approx(0.01)
    assert slot_wait(0.012, 1, 4, 0.01) == 0.0
    assert slot_wait(0.0151, 1, 4, 0.01) == pytest.approx(0.0349)  # the guard half: the next cycle
    assert slot_wait(0.039, 1, 4, 0.01) == pytest.approx(0.011)


@given(names=st.sets(st.text(min_size=1, max_size=8), min_size=1, max_size=12))
def test_every_replica_ranks_itself_apart_and_all_agree_on_the_count(names: set[str]) -> None:
    ranks = [rank_of(name, names - {name}) for name in names]
    assert sorted(r for r, _ in ranks) == list(range(len(names)))
    assert {n for _, n in ranks} == {len(names)}
    assert rank_of("a", ["a", "b"]) == (0, 2)  # itself among its peers is not counted twice


@given(now=times, slot=slots)
def test_a_replica_that_counts_one_replica_more_than_its_peers_waits_at_most_its_own_cycle(
    now: float, slot: float
) -> None:
    """Membership in flux (a peer joined, not yet heard by all): late or overlapping, never stuck."""
    assert slot_wait(now, 2, 3, slot) < 3 * slot + 1e-9
    assert slot_wait(now, 2, 4, slot) < 4 * slot + 1e-9


def test_the_slot_is_checked_against_its_range() -> None:
    SharedStateConfig(decision_slot_ms=50).check()
    with pytest.raises(ConfigError, match=r"shared_state.decision_slot_ms: must be a number in \[0, 50\]"):
        SharedStateConfig(decision_slot_ms=51).check()
    with pytest.raises(ConfigError, match="decision_slot_ms"):
        SharedStateConfig(decision_slot_ms=-1).check()
    with pytest.raises(ConfigError, match=r"half a slot \(10 ms\) must exceed batch_seconds \(20 ms\)"):
        SharedStateConfig(decision_slot_ms=20, batch_seconds=0.02).check()
    SharedStateConfig(decision_slot_ms=5, batch_seconds=0.001).check()


def _simultaneous_prefills(slot_ms: float) -> tuple[list[str], list[float]]:
    """Two replicas sharing over a 2 ms hub in virtual time; each gets one long prompt at the same instant.

    The prefills they chose, and the seconds each request waited for its decision slot."""
    config = replace(CONFIG, decision_slot_ms=slot_ms)
    loop = new_loop()
    chosen: list[str] = []
    waits: list[float] = []

    async def run() -> None:
        hub = MemoryHub(0.002)
        routers = [two_pair_router(), two_pair_router()]
        shared = [share(r, hub, n, config, loop.time) for r, n in zip(routers, "ab", strict=True)]
        await asyncio.gather(*(s.start() for s in shared))
        await asyncio.sleep(1.0)  # each hears the other (heartbeats)

        async def one(router: Router) -> None:
            waits.append(await router.decision_turn())
            routed = router.route_body(chat(2000), CHAT_META)
            assert isinstance(routed, Routed) and routed.lease._prefill is not None
            chosen.append(routed.lease._prefill.address)

        await asyncio.gather(*(one(r) for r in routers))
        await asyncio.gather(*(s.stop() for s in shared))

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    return chosen, waits


def test_without_slots_two_replicas_deciding_at_once_herd_and_with_slots_they_do_not() -> None:
    """The same view at the same instant: both pick the same prefill. With 10 ms slots one decides
    first, its booking reaches the other (1 ms batch, 2 ms hub) before the other's slot: they split."""
    herded, no_waits = _simultaneous_prefills(0.0)
    assert herded[0] == herded[1] and no_waits == [0.0, 0.0]
    split, waits = _simultaneous_prefills(10.0)
    assert set(split) == {P1, P2}
    assert sorted(waits)[0] == 0.0 and 0 < sorted(waits)[1] < 2 * 0.010
