"""The gRPC shell waits for the replica's decision slot before it routes (``shared_state.decision_slot_ms``).

The stream answers :class:`PendingRoute`, nothing charged while it waits; a client that leaves during
the wait leaves no load and gives its in-flight slot back.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from builders import value
from extproc_messages import body, headers
from polling import until
from sharing import chat, share, two_pair_router
from test_admission import Stream

from ext_proc.router import Router
from ext_proc.server import ExternalProcessor
from ext_proc.shared.config import SharedStateConfig
from ext_proc.shared.kinds import BusState
from ext_proc.shared.replica import ReplicaState
from ext_proc.shared.runner import MemoryHub
from ext_proc.stream import PendingRoute, Streams

CONFIG = SharedStateConfig(sync_wait_seconds=0.0)


def _waiting_router(wait_seconds: float, slot_ms: float = 50.0) -> tuple[Router, BusState]:
    """A router whose decision slot is ``wait_seconds`` away (two replicas, slots of ``slot_ms``, which
    divide 500 s, and a wall clock that stands still)."""
    router, peer = two_pair_router(), two_pair_router()
    config = replace(CONFIG, decision_slot_ms=slot_ms)  # unchecked: a test may take a long slot
    slot = slot_ms / 1000
    # Replica "b" (rank 1) decides from ``slot`` into each cycle of two slots: 1000 s starts a cycle.
    shared = share(router, MemoryHub(), "b", config, lambda: 1000.0 + slot - wait_seconds)
    other = ReplicaState(peer.registry, lambda: None, peer.metrics, 5.0, "a")
    assert shared.replica.receive(other.batch(full=True)) is not None  # "a" is heard from
    return router, shared


async def test_a_request_waits_for_its_slot_in_the_stream_then_routes() -> None:
    router, shared = _waiting_router(0.03)
    assert shared.decision_wait() == pytest.approx(0.03)
    stream = Streams(router).open()
    stream.answer(headers())
    pending = stream.answer(body(chat(100)))
    assert isinstance(pending, PendingRoute) and not pending.tokenize
    assert all(s.active_requests == 0 for s in router.registry.endpoints())  # nothing charged while it waits
    assert await pending.ready() is None
    answers = stream.prepared(pending.request, None)
    assert isinstance(answers, tuple) and answers[0].WhichOneof("response") == "request_body"
    assert sum(s.active_requests for s in router.registry.decodes) == 1
    stream.close()
    assert all(s.active_requests == 0 for s in router.registry.endpoints())
    assert value(router, "pd_extproc_decision_slot_wait_seconds_count") == 1
    assert value(router, "pd_extproc_decision_slot_wait_seconds_sum") == pytest.approx(0.03)


async def test_without_a_wait_the_stream_routes_at_once() -> None:
    router = two_pair_router()  # LocalState: no slots
    stream = Streams(router).open()
    stream.answer(headers())
    answers = stream.answer(body(chat(100)))
    assert isinstance(answers, tuple) and answers[0].WhichOneof("response") == "request_body"
    stream.close()
    assert value(router, "pd_extproc_decision_slot_wait_seconds_count") == 0


async def test_a_client_that_leaves_during_the_wait_leaves_no_load_and_its_slot_back() -> None:
    router, shared = _waiting_router(5.0, slot_ms=10_000.0)
    assert shared.decision_wait() == pytest.approx(5.0)
    stream = Stream(ExternalProcessor(router))
    await stream.send(headers())
    sent = asyncio.ensure_future(stream.send(body(chat(100))))
    await until(lambda: router.admission.inflight == 1)
    assert not sent.done()  # waiting for its slot
    sent.cancel()  # gRPC cancels the stream where it waits (the client left)
    with pytest.raises(asyncio.CancelledError):
        await sent
    assert router.admission.inflight == 0 and value(router, "pd_extproc_inflight_requests") == 0
    assert all(s.active_requests == 0 and s.active_tokens == 0 for s in router.registry.endpoints())


def test_no_slots_while_off_or_alone() -> None:
    off = share(two_pair_router(), MemoryHub(), "a", CONFIG)
    assert off.decision_wait() is None
    alone = share(two_pair_router(), MemoryHub(), "a", replace(CONFIG, decision_slot_ms=10.0))
    assert alone.decision_wait() is None  # no peer heard from: nothing to take turns with
