"""The per-stream state machine (ext_proc/stream.py) driven directly, without gRPC: Envoy's messages in,
the answers out; a pending answer (the kv-transfer-params prefill leg) awaited by the test."""

from __future__ import annotations

import json

import pytest
from builders import D_SAME_IDLE, DEST, P1, PREFILL, endpoint, make_router, value
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from extproc_messages import (
    BodySendMode,
    body,
    destination,
    headers,
    response_body,
    response_headers,
    trailers,
    with_modes,
)

from ext_proc.choreography import BODY_LIMIT_BYTES, Answers
from ext_proc.handoff.base import DecodeRoute, FailurePolicy
from ext_proc.handoff.config import HandoffConfig
from ext_proc.handoff.kv_transfer import KvTransferParamsHandoff
from ext_proc.handoff.leg import LegReply
from ext_proc.metrics import Metrics
from ext_proc.outcome import PendingAnswer
from ext_proc.router import Router
from ext_proc.stream import JUDGED_BODY_BYTES, TOO_LARGE, Stream, Streams
from standins.backends import VLLM_ENGINE_DEAD, VLLM_GENERATION_ERROR

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
REJECTED = "pd_extproc_rejected_total"


class AnsweringPrefill:
    """A prefill client whose every leg answers 200 with ``kv_transfer_params`` (no I/O)."""

    async def send(self, address: str, path: str, body: bytes, headers: object) -> LegReply:
        return LegReply(200, json.dumps({"kv_transfer_params": PARAMS}).encode(), None, 0.01)

    async def close(self) -> None:
        """Nothing to close."""


def kv_handoff(metrics: Metrics, watch_streams: bool = True) -> KvTransferParamsHandoff:
    """The kv-transfer-params handoff over :class:`AnsweringPrefill`."""
    client = AnsweringPrefill()
    route = DecodeRoute(DEST, PREFILL)
    settings = HandoffConfig(
        prefill_timeout_seconds=10.0,
        on_prefill_failure=FailurePolicy.ERROR,
        watch_streamed_answers=watch_streams,
    )
    return KvTransferParamsHandoff(settings, route=route, client=client, metrics=metrics)  # type: ignore[arg-type]


def router(kv: bool = False) -> Router:
    """One prefill, one decode; the sidecar handoff, or (``kv``) kv-transfer-params with ejection on."""
    return make_router(
        [endpoint(P1, "g1")],
        [endpoint(D_SAME_IDLE, "g1")],
        handoff=kv_handoff if kv else None,
        eject_seconds=30.0 if kv else 0.0,
    )


def first(full_duplex: bool) -> pb.ProcessingRequest:
    """The request headers as Envoy's first message: FULL_DUPLEX_STREAMED both ways, or (no
    ``protocol_config``) BUFFERED."""
    return with_modes(headers()) if full_duplex else headers()


def answers(outcome: Answers | PendingAnswer) -> Answers:
    assert isinstance(outcome, tuple), outcome
    return outcome


def error(answers: Answers) -> tuple[int, dict[str, object]]:
    """The status and OpenAI-style error of a single ``ImmediateResponse`` answer."""
    (answer,) = answers
    immediate = answer.immediate_response
    return immediate.status.code, json.loads(immediate.body)["error"]


def load(router: Router) -> list[tuple[str, int, int]]:
    """Every endpoint's (role, active tokens, active requests)."""
    return [(s.role.value, s.active_tokens, s.active_requests) for s in router.registry.endpoints()]


async def routed_kv(router: Router, full_duplex: bool) -> Stream:
    """A stream whose request went through the prefill leg to the decode (the pending answer awaited)."""
    stream = Streams(router).open()
    stream.answer(first(full_duplex))
    pending = stream.answer(body())
    assert not isinstance(pending, tuple)
    assert pending.timeout == 2 * 10.0 + 5.0
    routed = stream.completed(await pending.complete())
    assert destination(routed[0]) == D_SAME_IDLE
    return stream


def test_buffered_headers_then_body_are_routed_and_charged():
    r = router()
    stream = Streams(r).open()
    (held,) = answers(stream.answer(headers()))
    assert held.request_headers.response.header_mutation.remove_headers  # client routing headers stripped
    (routed,) = answers(stream.answer(body()))
    assert destination(routed) == D_SAME_IDLE
    set_headers = {
        h.header.key: h.header.raw_value for h in routed.request_body.response.header_mutation.set_headers
    }
    assert set_headers[PREFILL] == P1.encode()
    assert load(r) == [("prefill", 10, 1), ("decode", 20, 1)]
    assert r.admission.inflight == 1


def test_a_full_duplex_body_beyond_the_limit_is_a_counted_413_and_ends_the_stream():
    r = router()
    stream = Streams(r).open()
    assert answers(stream.answer(first(full_duplex=True))) == ()
    too_large = answers(stream.answer(body(b"x" * (BODY_LIMIT_BYTES + 1), end_of_stream=False)))
    status, refused = error(too_large)
    assert (status, refused["code"], refused["message"]) == (413, "request_too_large", TOO_LARGE)
    assert value(r, REJECTED, reason="request_too_large") == 1
    assert answers(stream.answer(body(b"", end_of_stream=True))) == ()  # nothing more is answered
    assert r.admission.inflight == 0 and all(tokens == 0 for _, tokens, _ in load(r))


def asks_for_the_whole_body(answered: Answers, full_duplex: bool) -> bool:
    """A decode's 500 headers answered by asking for its whole body (BUFFERED) or held (FDS: it comes)."""
    if full_duplex:
        return answered == ()
    (asked,) = answered
    return (
        asked.HasField("response_headers") and asked.mode_override.response_body_mode == BodySendMode.BUFFERED
    )


def chunks_of(error_body: bytes, full_duplex: bool) -> list[bytes]:
    """The decode's 500 body as Envoy sends it: whole (BUFFERED), in two chunks (FDS)."""
    return [error_body[:10], error_body[10:]] if full_duplex else [error_body]


def judged(stream: Stream, error_body: bytes, full_duplex: bool) -> Answers:
    """The answers to a decode's 500 carrying ``error_body``: headers, then the body's chunks."""
    assert asks_for_the_whole_body(
        answers(stream.answer(response_headers(500, "application/json"))), full_duplex
    )
    *parts, last = chunks_of(error_body, full_duplex)
    for part in parts:
        assert answers(stream.answer(response_body(part, end_of_stream=False))) == ()
    return answers(stream.answer(response_body(last, end_of_stream=True)))


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
async def test_a_decode_500_on_a_kv_handoff_is_a_502_kv_transfer_failed_from_the_watcher(full_duplex):
    r = router(kv=True)
    stream = await routed_kv(r, full_duplex)
    status, refused = error(judged(stream, json.dumps(VLLM_GENERATION_ERROR).encode(), full_duplex))
    assert (status, refused["code"], refused["type"]) == (502, "kv_transfer_failed", "bad_gateway")
    assert P1 in str(refused["message"]) and D_SAME_IDLE in str(refused["message"])
    assert value(r, REJECTED, reason="kv_transfer_failed") == 1
    assert value(r, "pd_extproc_kv_transfer_failures_total", stream="false") == 1
    assert value(r, "pd_extproc_prefill_ejections_total", outcome="kv_transfer_failed") == 1
    assert P1 in r.ejections.ejected() and D_SAME_IDLE not in r.decode_ejections.ejected()
    assert answers(stream.answer(response_body(b"{}", end_of_stream=True))) == ()


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
async def test_a_dead_decode_on_a_kv_handoff_is_a_503_decode_engine_dead_ejecting_the_decode(full_duplex):
    r = router(kv=True)
    stream = await routed_kv(r, full_duplex)
    status, refused = error(judged(stream, json.dumps(VLLM_ENGINE_DEAD).encode(), full_duplex))
    assert (status, refused["code"], refused["type"]) == (503, "decode_engine_dead", "service_unavailable")
    assert D_SAME_IDLE in str(refused["message"]) and P1 not in str(refused["message"])
    assert value(r, REJECTED, reason="decode_engine_dead") == 1
    assert value(r, "pd_extproc_decode_engine_dead_total", stream="false") == 1
    assert value(r, "pd_extproc_decode_ejections_total", outcome="decode_engine_dead") == 1
    assert value(r, "pd_extproc_kv_transfer_failures_total", stream="false") is None
    assert D_SAME_IDLE in r.decode_ejections.ejected() and P1 not in r.ejections.ejected()


async def test_a_decode_500_without_a_body_is_a_failed_pull_at_once():
    r = router(kv=True)
    stream = await routed_kv(r, full_duplex=False)
    bodiless = response_headers(500)
    bodiless.response_headers.end_of_stream = True
    status, refused = error(answers(stream.answer(bodiless)))
    assert (status, refused["code"]) == (502, "kv_transfer_failed")


async def test_full_duplex_response_trailers_end_a_judged_body():
    r = router(kv=True)
    stream = await routed_kv(r, full_duplex=True)
    assert answers(stream.answer(response_headers(500))) == ()
    dead = json.dumps(VLLM_ENGINE_DEAD).encode()
    assert answers(stream.answer(response_body(dead, end_of_stream=False))) == ()
    status, refused = error(answers(stream.answer(trailers("response_trailers"))))
    assert (status, refused["code"]) == (503, "decode_engine_dead")


async def test_a_judged_body_is_kept_up_to_its_limit():
    """A 500 body beyond ``JUDGED_BODY_BYTES`` is judged by its beginning (and the rest dropped)."""
    r = router(kv=True)
    stream = await routed_kv(r, full_duplex=True)
    assert answers(stream.answer(response_headers(500))) == ()
    dead = json.dumps(VLLM_ENGINE_DEAD).encode()
    assert answers(stream.answer(response_body(b" " * (JUDGED_BODY_BYTES - 1), end_of_stream=False))) == ()
    status, refused = error(answers(stream.answer(response_body(dead, end_of_stream=True))))
    assert (status, refused["code"]) == (502, "kv_transfer_failed")  # "{" kept alone: not JSON
    assert len(stream.judged) == JUDGED_BODY_BYTES


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
async def test_a_streamed_error_event_on_a_kv_handoff_is_replaced_by_kv_transfer_failed(full_duplex):
    r = router(kv=True)
    stream = await routed_kv(r, full_duplex)
    (started,) = answers(stream.answer(response_headers(200, "text/event-stream")))
    assert started.WhichOneof("response") == "response_headers"
    asked = started.mode_override.response_body_mode == BodySendMode.STREAMED
    assert asked != full_duplex  # BUFFERED: Envoy is asked for the chunks; FDS: they come anyway
    chunk = b"data: " + json.dumps(VLLM_GENERATION_ERROR).encode() + b"\n\ndata: [DONE]\n\n"
    (answer,) = answers(stream.answer(response_body(chunk, end_of_stream=True)))
    mutation = answer.response_body.response.body_mutation
    sent = mutation.streamed_response.body if full_duplex else mutation.body
    assert b'"code": "kv_transfer_failed"' in sent and sent.endswith(b"data: [DONE]\n\n")
    assert value(r, "pd_extproc_kv_transfer_failures_total", stream="true") == 1
    assert value(r, REJECTED, reason="kv_transfer_failed") is None  # the answer goes ahead, rewritten


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
async def test_a_streamed_engine_dead_event_on_a_kv_handoff_is_replaced_by_decode_engine_dead(full_duplex):
    r = router(kv=True)
    stream = await routed_kv(r, full_duplex)
    answers(stream.answer(response_headers(200, "text/event-stream")))
    chunk = b"data: " + json.dumps(VLLM_ENGINE_DEAD).encode() + b"\n\ndata: [DONE]\n\n"
    (answer,) = answers(stream.answer(response_body(chunk, end_of_stream=True)))
    mutation = answer.response_body.response.body_mutation
    sent = mutation.streamed_response.body if full_duplex else mutation.body
    assert b'"code": "decode_engine_dead"' in sent and sent.endswith(b"data: [DONE]\n\n")
    assert value(r, "pd_extproc_decode_engine_dead_total", stream="true") == 1
    assert D_SAME_IDLE in r.decode_ejections.ejected() and P1 not in r.ejections.ejected()


def test_close_releases_the_charges_and_the_slot_of_a_routed_stream():
    r = router()
    stream = Streams(r).open()
    stream.answer(headers())
    stream.answer(body())
    assert r.admission.inflight == 1 and load(r) != [("prefill", 0, 0), ("decode", 0, 0)]
    stream.close()
    stream.close()  # idempotent
    assert r.admission.inflight == 0 and load(r) == [("prefill", 0, 0), ("decode", 0, 0)]


def test_close_releases_the_charges_of_a_pending_answer_never_completed():
    r = router(kv=True)
    stream = Streams(r).open()
    stream.answer(headers())
    pending = stream.answer(body())
    assert not isinstance(pending, tuple)
    assert load(r) == [("prefill", 10, 1), ("decode", 20, 1)]
    stream.close()  # the stream ended while the prefill leg ran
    assert r.admission.inflight == 0 and load(r) == [("prefill", 0, 0), ("decode", 0, 0)]
