"""Decision slots over a real nats-server: two replicas given a request at the same instant take turns.

Two routers share their state over :class:`NatsBus` (the private nats-server ``serve --workers``
starts) on the wall clock. Without slots both place their request on the same view, on the same
prefill; with slots one decides in its slot, its booking reaches the other over NATS before the
other's slot, and the other picks the other prefill. The slots are long (500 ms, beyond the
configuration's bound) so that a loaded machine's delivery time fits in half of one.
"""

from __future__ import annotations

import asyncio

import pytest
from builders import CHAT_META
from sharing import P1, P2, chat, two_pair_router

from ext_proc.outcome import Routed
from ext_proc.router import Router
from ext_proc.shared.config import NatsConfig, SharedStateConfig
from ext_proc.shared.kinds import BusState
from ext_proc.shared.nats_bus import NatsBus
from ext_proc.shared.replica import ReplicaState
from ext_proc.workers import find_nats_server, start_private_nats


async def _prefills(slot_ms: float) -> list[str]:
    """The prefills two sharing replicas pick for one long prompt each, given at the same instant."""
    binary = find_nats_server()
    assert binary is not None
    nats = start_private_nats(binary)
    config = SharedStateConfig(
        nats=NatsConfig(url=nats.url, token=nats.token), sync_wait_seconds=0.0, decision_slot_ms=slot_ms
    )
    routers = [two_pair_router(), two_pair_router()]
    shared = []
    for router, name in zip(routers, ("a", "b"), strict=True):
        replica = ReplicaState(
            router.registry, lambda: None, router.metrics, config.peer_timeout_seconds, name
        )
        bus = NatsBus(config.nats, name, router.metrics.shared_connection, replica.drop)
        shared.append(BusState("nats", replica, bus, config, router.metrics))
        router.live.shared = shared[-1]
    try:
        await asyncio.gather(*(s.start() for s in shared))
        for _ in range(500):  # each has heard the other (its first full batch)
            if all(s.replica.peers.peers for s in shared):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the replicas never heard each other")

        async def one(router: Router) -> str:
            await router.decision_turn()
            routed = router.route_body(chat(2000), CHAT_META)
            assert isinstance(routed, Routed) and routed.lease._prefill is not None
            return routed.lease._prefill.address

        return list(await asyncio.gather(*(one(r) for r in routers)))
    finally:
        await asyncio.gather(*(s.stop() for s in shared))
        nats.stop()


@pytest.mark.parametrize(("slot_ms", "split"), [(0.0, False), (500.0, True)])
async def test_two_replicas_deciding_at_once_herd_without_slots_and_split_with_them(
    slot_ms: float, split: bool
) -> None:
    chosen = await _prefills(slot_ms)
    assert (set(chosen) == {P1, P2}) is split
