"""Replicas sharing their bookings and placements over an in-process bus: the real seam (registry watch,
:class:`ReplicaState`, :class:`SharedRunner`) with :class:`MemoryHub` in place of NATS (the NATS kind is
tested against a real nats-server in tests/e2e)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from builders import CHAT_META, endpoint, make_router

from ext_proc.endpoints import ClusterEndpoints
from ext_proc.outcome import Routed
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kv_events import BlockStored, EventBatch
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.router import Router
from ext_proc.shared import wire
from ext_proc.shared.config import SharedStateConfig
from ext_proc.shared.kinds import BusState
from ext_proc.shared.replica import ReplicaState
from ext_proc.shared.runner import MemoryHub
from sim.virtual import new_loop

P1, P2 = "10.0.0.1:8000", "10.0.0.2:8000"
D1, D2 = "10.0.1.1:8000", "10.0.1.2:8000"
CONFIG = SharedStateConfig(
    heartbeat_seconds=0.05, peer_timeout_seconds=0.2, batch_seconds=0.0, sync_wait_seconds=0.3
)


def _router() -> Router:
    return make_router(
        [endpoint(P1, "g1"), endpoint(P2, "g2")],
        [endpoint(D1, "g1"), endpoint(D2, "g2")],
        prefix=PrefixSettings(),
        prefix_weight=0.5,
    )


def _share(router: Router, hub: MemoryHub, name: str, config: SharedStateConfig = CONFIG) -> BusState:
    replica = ReplicaState(
        router.registry, lambda: router.live.prefix, router.metrics, config.peer_timeout_seconds, name
    )
    shared = BusState("memory", replica, hub.bus(), config, router.metrics)
    router.live.shared = shared
    return shared


def _body(words: int, seed: int = 0) -> bytes:
    text = " ".join(f"w{(seed * 31 + i) % 997}" for i in range(words))
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 10}
    ).encode()


def _route(router: Router, body: bytes) -> Routed:
    routed = router.route_body(body, CHAT_META)
    assert isinstance(routed, Routed), routed
    return routed


async def _turns(count: int = 3) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def _peer(router: Router, role: str, address: str) -> tuple[int, int]:
    state = router.registry.find(role, address)
    assert state is not None
    return state.peer_tokens, state.peer_requests


async def test_a_booking_and_its_release_reach_the_peer_and_its_decision() -> None:
    hub = MemoryHub()
    a, b = _router(), _router()
    shared = [_share(a, hub, "a"), _share(b, hub, "b")]
    await asyncio.gather(*(s.start() for s in shared))
    routed = _route(a, _body(400))
    decision = routed.lease
    prefill, decode = decision._prefill, decision.decode
    assert prefill is not None and decode is not None
    await _turns()
    assert _peer(b, "decode", decode.address) == (decode.own_tokens, 1)
    assert _peer(b, "prefill", prefill.address) == (prefill.own_tokens, 1)
    assert _peer(a, "decode", decode.address) == (0, 0)  # its own charge is not a peer's
    other = next(d for d in b.registry.decodes if d.address != decode.address)
    assert b.registry.find("decode", decode.address).active_requests == 1  # type: ignore[union-attr]
    assert other.active_requests == 0
    routed.lease.release()
    await _turns()
    assert _peer(b, "decode", decode.address) == (0, 0) and _peer(b, "prefill", prefill.address) == (0, 0)
    await asyncio.gather(*(s.stop() for s in shared))


async def test_the_peer_learns_placements_and_routes_the_same_prompt_to_their_holder() -> None:
    hub = MemoryHub()
    a, b = _router(), _router()
    shared = [_share(a, hub, "a"), _share(b, hub, "b")]
    await asyncio.gather(*(s.start() for s in shared))
    body = _body(800, seed=3)
    first = _route(a, body)
    first.lease.release()
    await _turns()
    chain = b.live.prefix.chain(json.loads(body))  # type: ignore[union-attr]
    held = b.live.prefix.index.match(chain)  # type: ignore[union-attr]
    placed = {first.lease._prefill.address if first.lease._prefill else None}
    assert held and set(held) >= placed - {None}
    second = _route(b, body)
    assert second.lease.decode is not None
    assert {second.lease.decode.address} <= set(held)
    await asyncio.gather(*(s.stop() for s in shared))


async def test_a_replica_that_starts_learns_its_peers_bookings_and_index_before_serving() -> None:
    hub = MemoryHub()
    a = _router()
    shared_a = _share(a, hub, "a")
    await shared_a.start()
    body = _body(800, seed=5)
    held = _route(a, body)  # in flight
    c = _router()
    shared_c = _share(c, hub, "c")
    await shared_c.start()
    assert shared_c.runner.synced
    decode = held.lease.decode
    assert decode is not None
    assert _peer(c, "decode", decode.address) == (decode.own_tokens, 1)
    chain = c.live.prefix.chain(json.loads(body))  # type: ignore[union-attr]
    assert a.live.prefix.index.match(chain) == c.live.prefix.index.match(chain)  # type: ignore[union-attr]
    await asyncio.gather(shared_a.stop(), shared_c.stop())


async def test_a_peer_that_vanishes_has_its_bookings_dropped_after_the_timeout() -> None:
    hub = MemoryHub()
    a, b = _router(), _router()
    shared_a, shared_b = _share(a, hub, "a"), _share(b, hub, "b")
    await asyncio.gather(shared_a.start(), shared_b.start())
    routed = _route(a, _body(300))
    await _turns()
    decode = routed.lease.decode
    assert decode is not None and _peer(b, "decode", decode.address)[1] == 1
    assert shared_a.runner._beat is not None
    shared_a.runner._beat.cancel()  # killed: no release, no heartbeat, nothing more
    shared_a.runner.bus.connected = False  # type: ignore[misc]
    await asyncio.sleep(CONFIG.peer_timeout_seconds + 3 * CONFIG.heartbeat_seconds)
    assert _peer(b, "decode", decode.address) == (0, 0)
    assert b.live.shared.describe()["peers"] == {}
    await shared_b.stop()


async def test_garbage_and_echoes_are_dropped_and_counted_never_applied() -> None:
    hub = MemoryHub()
    a = _router()
    shared = _share(a, hub, "a")
    await shared.start()
    replica = shared.replica
    for payload in (b"junk", b"PDXS\x02\x01", b"PDXS\x01\x01\x93"):
        replica.receive(payload)
    replica.receive(replica.batch(full=True))  # its own, echoed
    assert all(s.peer_tokens == 0 and s.peer_requests == 0 for s in a.registry.endpoints())
    text = a.metrics.registry.get_sample_value
    assert text("pd_extproc_shared_messages_dropped_total", {"reason": "garbled"}) == 1
    assert text("pd_extproc_shared_messages_dropped_total", {"reason": "version"}) == 1
    assert text("pd_extproc_shared_messages_dropped_total", {"reason": "malformed"}) == 1
    await shared.stop()


async def test_loads_on_an_endpoint_discovery_has_not_brought_yet_apply_once_it_is_known() -> None:
    hub = MemoryHub()
    a = _router()
    b = make_router([endpoint(P1, "g1")], [endpoint(D1, "g1")], prefix=PrefixSettings())
    shared = [_share(a, hub, "a"), _share(b, hub, "b")]
    await asyncio.gather(*(s.start() for s in shared))
    held = [_route(a, _body(200, seed=i)) for i in range(6)]
    await _turns()
    on_d2 = sum(1 for r in held if r.lease.decode is not None and r.lease.decode.address == D2)
    assert on_d2, "the decision spreads six requests over both decodes"
    assert b.registry.find("decode", D2) is None
    b.registry.update(
        [
            ClusterEndpoints("prefill", (endpoint(P1, "g1"), endpoint(P2, "g2")), "p"),
            ClusterEndpoints("decode", (endpoint(D1, "g1"), endpoint(D2, "g2")), "d"),
        ]
    )
    await asyncio.sleep(2 * CONFIG.heartbeat_seconds)  # the next heartbeat applies what was kept
    assert _peer(b, "decode", D2)[1] == on_d2
    await asyncio.gather(*(s.stop() for s in shared))


def test_an_index_snapshot_learned_back_holds_the_same_blocks_in_the_same_order() -> None:
    a, b = _router(), _router()
    for seed in range(4):
        _route(a, _body(600, seed)).lease.release()
    for name, capacity, held in a.live.prefix.snapshot():  # type: ignore[union-attr]
        b.live.prefix.learned(held, [(name, capacity)])  # type: ignore[union-attr]
    for address in a.live.prefix.index.addresses:  # type: ignore[union-attr]
        assert np.array_equal(a.live.prefix.index.held(address), b.live.prefix.index.held(address))  # type: ignore[union-attr]


def test_the_fingerprint_is_the_hashing_in_force_the_block_size_the_engines_events_gave() -> None:
    """A ``kv-events`` replica hashes prompts at the block size its engines' events give: its peers take
    its chains only while they hash at the same."""
    router = make_router(
        [endpoint(P1, "g1")], [endpoint(D1, "g1")], prefix=PrefixSettings(source="kv-events")
    )
    replica = ReplicaState(router.registry, lambda: router.live.prefix, router.metrics, 1.0, "a")
    assert replica.fingerprint() == wire.fingerprint("kv-events", 16, 2048)  # block_tokens, until events
    source = router.live.prefix
    assert isinstance(source, KvEventSource)
    stored = BlockStored((1,), None, (7,) * 128, 128, None, None)
    source.index.apply(P1, EventBatch(0, 0.0, 0, (stored,)), 0.0, replayable=False)
    assert replica.fingerprint() == wire.fingerprint("kv-events", 128, 2048)


async def test_garbage_on_the_inbox_is_no_sync_answer() -> None:
    """A message on a starting replica's inbox that is dropped (NATS's own "no responders" status, a
    stray publisher) must not mark it synced nor end its wait for its peers' state early."""
    hub = MemoryHub()
    a = _router()
    shared = _share(a, hub, "a")
    await shared.start()
    runner = shared.runner
    assert not runner.synced  # no peer answered: there is none
    runner._answer(b"", "")
    runner._answer(wire.encode_sync_request(wire.SyncRequest("b")), "")
    assert not runner.synced
    runner._answer(wire.encode_batch(wire.Batch("b", 0, 0.0, True, 0, (), ())), "")
    assert runner.synced
    await shared.stop()


async def test_a_new_sender_beyond_the_peer_cap_is_dropped_as_too_many_peers() -> None:
    hub = MemoryHub()
    a = _router()
    shared = _share(a, hub, "a")
    await shared.start()
    replica = shared.replica
    cap = replica.peers.max_peers
    for i in range(cap + 3):
        replica.receive(wire.encode_batch(wire.Batch(f"peer-{i}", 0, 0.0, True, 0, (), ())))
    assert len(replica.peers.peers) == cap
    sample = a.metrics.registry.get_sample_value
    assert sample("pd_extproc_shared_messages_dropped_total", {"reason": "too_many_peers"}) == 3
    assert sample("pd_extproc_shared_messages_dropped_total", {"reason": "stale"}) is None
    await shared.stop()


async def test_a_placement_on_an_endpoint_not_known_here_is_counted_and_only_the_known_holders_learn() -> (
    None
):
    a = _router()
    shared = _share(a, MemoryHub(), "a")
    replica = shared.replica
    chain = np.arange(1, 9, dtype=np.int64)
    holders = ((P1, 1000.0), ("10.9.9.9:8000", 1000.0))
    placed = wire.Placed(holders, chain)
    replica.receive(wire.encode_batch(wire.Batch("b", 0, 0.0, True, replica.fingerprint(), (), (placed,))))
    sample = a.metrics.registry.get_sample_value
    assert sample("pd_extproc_shared_messages_dropped_total", {"reason": "unknown_endpoint"}) == 1
    assert set(a.live.prefix.index.match(chain)) == {P1}  # type: ignore[union-attr]


def test_a_delayed_hub_hands_over_in_publishing_order_when_messages_fall_due_together() -> None:
    """On virtual time every message sent at one instant is due at the same instant; the event loop's
    timers alone would hand them over in any order, and a batch overtaken by a newer one is dropped as
    stale. The hub keeps the order, as one NATS connection does."""
    hub = MemoryHub(0.002)
    sender, receiver = hub.bus(), hub.bus()
    got: list[tuple[bytes, float]] = []
    loop = new_loop()

    async def run() -> None:
        await receiver.start({"s": lambda payload, _: got.append((payload, loop.time()))}, lambda: None)
        await sender.start({}, lambda: None)
        for i in range(50):
            sender.publish("s", b"%d" % i)
        await asyncio.sleep(0.001)
        sender.publish("s", b"late")
        await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    assert [p for p, _ in got] == [b"%d" % i for i in range(50)] + [b"late"]
    assert {t for _, t in got[:50]} == {0.002} and got[50][1] == pytest.approx(0.003)
