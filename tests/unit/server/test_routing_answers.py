"""The BUFFERED routing answers built once per routing and reused (ext_proc/choreography.py)."""

from __future__ import annotations

import pytest
from builders import D_SAME_IDLE, P1, endpoint, make_router
from extproc_messages import body, destination, headers

from ext_proc import choreography
from ext_proc import envoy_messages as msg
from ext_proc.choreography import RoutingAnswers
from ext_proc.outcome import RoutingInstructions
from ext_proc.stream import Streams


def routing(decode: str, body: bytes | None = None) -> RoutingInstructions:
    return RoutingInstructions((("x-gateway-destination-endpoint", decode),), (), (("k", decode),), body)


def test_an_answer_is_built_once_per_routing_and_is_the_one_built_fresh():
    reused = RoutingAnswers()
    (first,) = reused.of(routing("10.0.0.1:8000"))
    assert reused.of(routing("10.0.0.1:8000"))[0] is first  # an equal routing: the same answer
    assert first == msg.route_on_body(routing("10.0.0.1:8000"))
    (other,) = reused.of(routing("10.0.0.2:8000"))
    assert other is not first and other == msg.route_on_body(routing("10.0.0.2:8000"))


def test_the_answers_kept_are_bounded(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(choreography, "ROUTING_ANSWERS_KEPT", 2)
    reused = RoutingAnswers()
    (first,) = reused.of(routing("10.0.0.1:8000"))
    reused.of(routing("10.0.0.2:8000"))
    reused.of(routing("10.0.0.3:8000"))  # full: every answer kept is forgotten
    (again,) = reused.of(routing("10.0.0.1:8000"))
    assert again is not first and again == first


def test_streams_routed_alike_share_one_answer_and_a_rewritten_body_gets_its_own():
    router = make_router([endpoint(P1, "g1")], [endpoint(D_SAME_IDLE, "g1")])
    streams = Streams(router)
    routed = []
    plain = b'{"model": "m", "prompt": "hi"}'
    for raw in (plain, plain, b'{"model": "m", "prompt": "hi", "kv_transfer_params": {}}'):
        stream = streams.open()
        stream.answer(headers())
        (answer,) = stream.answer(body(raw))
        assert destination(answer) == D_SAME_IDLE
        routed.append(answer)
        stream.close()
    assert routed[1] is routed[0]
    assert routed[2] is not routed[0]  # the sidecar removed the client's handoff field: a new body
    assert routed[2].request_body.response.body_mutation.body
