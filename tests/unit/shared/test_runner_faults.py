"""The shared state's shell under faults and floods, on an in-process bus (:class:`MemoryHub`): a fault
while a peer's message is applied, while a sync answer or a batch is built, is counted and logged once
per cause, and the subscription and the heartbeats go on; a flood of sync requests costs each replica
one answer per ``answer_seconds``, and a replica starting meanwhile still learns its peers' state."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest
from test_replicas import CONFIG, _body, _peer, _route, _router, _share, _turns

from ext_proc.router import Router
from ext_proc.shared import wire
from ext_proc.shared.runner import MemoryBus, MemoryHub

DROPPED = "pd_extproc_shared_messages_dropped_total"
SYNC = "pd_extproc_shared_sync_requests_total"
SYNC_SUBJECT, INBOX = "pd-extproc.sync", "pd-extproc.inbox.flooder"
FLOODED = replace(CONFIG, sync_answer_seconds=0.1, sync_max_waiting=8)
"""The answer window and the waiting cap the flood tests configure (not the defaults: the keys are read)."""
SYNC_ANSWER_SECONDS, MAX_WAITING_ANSWERS = FLOODED.sync_answer_seconds, FLOODED.sync_max_waiting


def _sample(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(autouse=True)
def _warnings_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The shared state's warnings reach ``caplog`` whatever level an earlier test left the root at."""
    caplog.set_level(logging.WARNING, logger="ext_proc.shared")


def _warnings(caplog: pytest.LogCaptureFixture, reason: str) -> list[logging.LogRecord]:
    marker = f"a message dropped ({reason})"
    return [r for r in caplog.records if r.levelno == logging.WARNING and marker in r.getMessage()]


class Boom(RuntimeError):
    """A fault in the shared state's own code (a bug)."""


async def test_a_fault_applying_peers_messages_is_counted_logged_once_and_the_subscription_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = MemoryHub()
    a, b = _router(), _router()
    shared = [_share(a, hub, "a"), _share(b, hub, "b")]
    await asyncio.gather(*(s.start() for s in shared))
    learned = b.live.prefix.learned  # type: ignore[union-attr]

    def broken(*args: object) -> None:
        raise Boom("the index cannot learn")

    b.live.prefix.learned = broken  # type: ignore[union-attr,method-assign]
    for seed in range(3):  # each batch carries a placement that b fails to learn
        _route(a, _body(300, seed)).lease.release()
        await _turns()
    assert _sample(b, DROPPED, reason="apply_error") == 3
    assert len(_warnings(caplog, "apply_error")) == 1  # once per cause, with its traceback
    assert _warnings(caplog, "apply_error")[0].exc_info is not None
    b.live.prefix.learned = learned  # type: ignore[union-attr,method-assign]
    held = _route(a, _body(300, seed=9))  # the subscription still applies what comes
    await _turns()
    decode = held.lease.decode
    assert decode is not None and _peer(b, "decode", decode.address)[1] == 1
    held.lease.release()
    await asyncio.gather(*(s.stop() for s in shared))


async def test_a_fault_building_the_sync_answer_is_counted_and_a_later_request_is_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = MemoryHub()
    a = _router()
    shared_a = _share(a, hub, "a")
    await shared_a.start()
    held = _route(a, _body(300))
    snapshot = a.live.prefix.snapshot  # type: ignore[union-attr]

    def broken() -> list:
        raise Boom("the index cannot be listed")

    a.live.prefix.snapshot = broken  # type: ignore[union-attr,method-assign]
    c = _router()
    shared_c = _share(c, hub, "c")
    await shared_c.start()  # waits sync_wait_seconds for an answer that never comes
    assert not shared_c.runner.synced
    assert _sample(a, DROPPED, reason="answer_error") == 1
    assert len(_warnings(caplog, "answer_error")) == 1
    a.live.prefix.snapshot = snapshot  # type: ignore[union-attr,method-assign]
    d = _router()
    shared_d = _share(d, hub, "d")
    await shared_d.start()
    assert shared_d.runner.synced
    decode = held.lease.decode
    assert decode is not None and _peer(d, "decode", decode.address) == (decode.own_tokens, 1)
    held.lease.release()
    await asyncio.gather(*(s.stop() for s in (shared_a, shared_c, shared_d)))


async def test_a_fault_building_a_batch_is_counted_and_the_heartbeats_go_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = MemoryHub()
    a, b = _router(), _router()
    shared_a, shared_b = _share(a, hub, "a"), _share(b, hub, "b")
    await asyncio.gather(shared_a.start(), shared_b.start())
    held = _route(a, _body(300))
    await _turns()
    batch = shared_a.replica.batch

    def broken(full: bool = False) -> bytes:
        raise Boom("no batch")

    monkeypatch.setattr(shared_a.replica, "batch", broken)
    seq = shared_b.replica.peers.peers["a"].seq
    await asyncio.sleep(2.5 * CONFIG.heartbeat_seconds)  # two heartbeats fail
    assert _sample(a, DROPPED, reason="send_error") >= 2
    assert len(_warnings(caplog, "send_error")) == 1
    monkeypatch.setattr(shared_a.replica, "batch", batch)
    await asyncio.sleep(2 * CONFIG.heartbeat_seconds)
    assert shared_b.replica.peers.peers["a"].seq > seq  # the heartbeats went on
    held.lease.release()
    await asyncio.gather(shared_a.stop(), shared_b.stop())


async def _flooder(hub: MemoryHub) -> tuple[MemoryBus, list[bytes]]:
    """A bus that asks for sync answers on :data:`INBOX`, and what reaches that inbox."""
    got: list[bytes] = []
    bus = hub.bus()
    await bus.start({INBOX: lambda payload, _: got.append(payload)}, lambda: None)
    return bus, got


def _batches(got: list[bytes]) -> int:
    return sum(isinstance(wire.decode(payload), wire.Batch) for payload in got)


async def test_a_flood_of_sync_requests_gets_one_answer_per_window() -> None:
    hub = MemoryHub()
    a = _router()
    shared = _share(a, hub, "a", FLOODED)
    await shared.start()
    flooder, got = await _flooder(hub)
    request = wire.encode_sync_request(wire.SyncRequest("flooder"))
    for _ in range(200):
        flooder.publish(SYNC_SUBJECT, request, INBOX)
        await asyncio.sleep(0)
    await _turns()
    assert _batches(got) == 1  # answered at once
    assert _sample(a, SYNC, outcome="answered") == 1 and _sample(a, SYNC, outcome="coalesced") == 199
    await asyncio.sleep(SYNC_ANSWER_SECONDS * 1.5)
    assert _batches(got) == 2  # the 199 others: one answer when the window closed
    await asyncio.sleep(SYNC_ANSWER_SECONDS)  # a quiet window
    flooder.publish(SYNC_SUBJECT, request, INBOX)  # answered at once again
    await _turns()
    assert _batches(got) == 3 and _sample(a, SYNC, outcome="answered") == 2
    await shared.stop()


async def test_sync_requests_beyond_the_waiting_cap_are_refused_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = MemoryHub()
    a = _router()
    shared = _share(a, hub, "a", FLOODED)
    await shared.start()
    flooder, _ = await _flooder(hub)
    request = wire.encode_sync_request(wire.SyncRequest("flooder"))
    asked = MAX_WAITING_ANSWERS + 11
    for i in range(asked):  # each on a reply subject of its own
        flooder.publish(SYNC_SUBJECT, request, f"{INBOX}.{i}")
    await _turns()
    assert _sample(a, SYNC, outcome="answered") == 1
    assert _sample(a, SYNC, outcome="coalesced") == MAX_WAITING_ANSWERS
    assert _sample(a, SYNC, outcome="refused") == 10
    refused = [r for r in caplog.records if "a sync request refused" in r.getMessage()]
    assert len(refused) == 1
    await asyncio.sleep(SYNC_ANSWER_SECONDS * 1.5)
    sent = a.metrics.registry.get_sample_value(
        "pd_extproc_shared_messages_sent_total", {"kind": "sync_answer"}
    )
    assert sent == 1 + MAX_WAITING_ANSWERS  # one batch each (no index yet): the answered, the coalesced
    await shared.stop()


async def test_a_replica_starting_during_a_flood_of_sync_requests_still_learns_its_peers_state() -> None:
    hub = MemoryHub()
    a = _router()
    shared_a = _share(a, hub, "a")
    await shared_a.start()
    held = _route(a, _body(800, seed=5))
    flooder, _ = await _flooder(hub)
    request = wire.encode_sync_request(wire.SyncRequest("flooder"))

    async def flood() -> None:
        while True:
            flooder.publish(SYNC_SUBJECT, request, INBOX)
            await asyncio.sleep(0.001)

    flooding = asyncio.create_task(flood())
    try:
        await asyncio.sleep(0.05)  # a's answer window is taken by the flood
        c = _router()
        shared_c = _share(c, hub, "c")
        await shared_c.start()  # waits sync_wait_seconds at most
        assert shared_c.runner.synced  # answered within that wait
        decode = held.lease.decode
        assert decode is not None and _peer(c, "decode", decode.address) == (decode.own_tokens, 1)
    finally:
        flooding.cancel()
    assert _sample(a, SYNC, outcome="coalesced") > 10
    held.lease.release()
    await asyncio.gather(shared_a.stop(), shared_c.stop())
