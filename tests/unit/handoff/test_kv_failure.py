"""The pure part of a failed KV pull or a dead decode: which first streamed event is the failure, which
engine a decode's 500 blames, and what replaces it."""

from __future__ import annotations

import json

import pytest

from ext_proc import envoy_messages as msg
from ext_proc.handoff import kv_failure
from standins.backends import VLLM_ENGINE_DEAD, VLLM_GENERATION_ERROR

DECODE, PREFILL = "10.0.0.2:8000", "10.0.0.1:8000"


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


ROLE = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
"""What vLLM streams first for a chat request, before its failure (measured on vLLM 0.32)."""
TOKEN = {"id": "cmpl-1", "choices": [{"index": 0, "text": " w1", "finish_reason": None}]}


def error_of(rewritten: bytes, code: str = "kv_transfer_failed") -> dict:
    (replaced,) = [e for e in rewritten.split(b"\n\n") if code.encode() in e]
    return json.loads(replaced.removeprefix(b"data: "))["error"]


@pytest.mark.parametrize(
    "before", [b"", b": keep-alive\n\n", event(ROLE)], ids=["first", "after-a-comment", "after-the-role"]
)
def test_vllms_streamed_error_becomes_the_named_cause_and_the_rest_stays(before):
    chunk = before + event(VLLM_GENERATION_ERROR) + b"data: [DONE]\n\n"
    rewrite, watching = kv_failure.watch_chunk(chunk, DECODE, PREFILL)
    assert rewrite is not None and not watching
    assert rewrite.chunk.startswith(before) and rewrite.chunk.endswith(b"\n\ndata: [DONE]\n\n")
    assert rewrite.failure.code == "kv_transfer_failed"
    error = error_of(rewrite.chunk)
    assert error["code"] == "kv_transfer_failed" and error["type"] == "bad_gateway"
    assert DECODE in error["message"] and PREFILL in error["message"]


@pytest.mark.parametrize("before", [b"", event(ROLE)], ids=["first", "after-the-role"])
def test_vllms_streamed_engine_dead_error_blames_the_decode(before):
    """An engine core that died while the request ran: vLLM streams its EngineDeadError as the event."""
    chunk = before + event(VLLM_ENGINE_DEAD) + b"data: [DONE]\n\n"
    rewrite, watching = kv_failure.watch_chunk(chunk, DECODE, PREFILL)
    assert rewrite is not None and not watching
    assert rewrite.failure == kv_failure.Failure(
        503, "service_unavailable", "decode_engine_dead", kv_failure.dead_message(DECODE)
    )
    assert rewrite.chunk.startswith(before) and rewrite.chunk.endswith(b"\n\ndata: [DONE]\n\n")
    error = error_of(rewrite.chunk, "decode_engine_dead")
    assert error == {
        "message": kv_failure.dead_message(DECODE),
        "type": "service_unavailable",
        "param": None,
        "code": "decode_engine_dead",
    }
    assert DECODE in error["message"] and PREFILL not in error["message"]


def body_of(payload: object) -> bytes:
    return json.dumps(payload).encode()


@pytest.mark.parametrize(
    "body",
    [
        body_of(VLLM_ENGINE_DEAD),
        body_of({"error": {"message": "EngineCore encountered an issue"}}),  # the prefix is enough
        json.dumps(VLLM_ENGINE_DEAD, separators=(",", ":")).encode(),  # compact, as Starlette sends it
    ],
    ids=["vllm", "prefix-only", "compact"],
)
def test_a_500_saying_the_engine_core_is_dead_blames_the_decode(body):
    failed = kv_failure.judge_body(body, DECODE, PREFILL)
    assert (failed.status, failed.kind, failed.code) == (503, "service_unavailable", "decode_engine_dead")
    assert failed.message == kv_failure.dead_message(DECODE) and DECODE in failed.message


@pytest.mark.parametrize(
    "body",
    [
        body_of(VLLM_GENERATION_ERROR),  # vLLM's failed pull
        b"",
        b"Internal Server Error",
        b'{"error": {"message": "EngineCore encountered',  # cut
        b"\xff\xfe",
        body_of(["error"]),
        body_of({"error": "EngineCore encountered an issue"}),  # not an object
        body_of({"error": {"message": 500}}),
        body_of({"error": {"message": "boom: EngineCore encountered an issue"}}),  # not how it starts
        body_of({"message": "EngineCore encountered an issue"}),  # no error member
        b"[" * 100_000,  # too deep for json
    ],
    ids=[
        "vllm-generic",
        "empty",
        "text",
        "cut",
        "not-utf8",
        "a-list",
        "error-a-string",
        "message-not-a-string",
        "elsewhere",
        "no-error",
        "too-deep",
    ],
)
def test_any_other_500_is_a_failed_pull_blaming_the_prefill(body):
    failed = kv_failure.judge_body(body, DECODE, PREFILL)
    assert failed == kv_failure.Failure(
        502, "bad_gateway", "kv_transfer_failed", kv_failure.message(DECODE, PREFILL)
    )


@pytest.mark.parametrize(
    "chunk",
    [
        event(TOKEN),  # a token: the pull worked
        event({"choices": [{"index": 0, "delta": {"content": " w1"}}]}),
        event({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}),
        event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
        event(TOKEN) + event(VLLM_GENERATION_ERROR),  # an error after text is not a failed pull
        b"data: [DONE]\n\n",
        b"data: not json\n\n",
        event(["error"]),
        event({"error": "a string"}),
        b'data: {"error": {"message": "cut',  # split across chunks: not rewritten
        event(ROLE) + b'data: {"error": {"message": "cut',
    ],
    ids=[
        "text",
        "chat-text",
        "tool-call",
        "finish",
        "error-after-text",
        "done",
        "not-json",
        "a-list",
        "error-not-an-object",
        "incomplete",
        "role-then-incomplete",
    ],
)
def test_anything_but_an_error_before_the_first_text_ends_the_watch_unchanged(chunk):
    assert kv_failure.watch_chunk(chunk, DECODE, PREFILL) == (None, False)


@pytest.mark.parametrize(
    "chunk",
    [b": keep-alive\n\n", event(ROLE), b": a\n: b\n\n" + event(ROLE)],
    ids=["comment", "role", "both"],
)
def test_a_chunk_that_says_nothing_yet_keeps_the_watch_on(chunk):
    assert kv_failure.watch_chunk(chunk, DECODE, PREFILL) == (None, True)


def test_an_error_event_over_several_data_lines_is_recognised():
    body = json.dumps(VLLM_GENERATION_ERROR)
    chunk = b"data: " + body[:20].encode() + b"\ndata: " + body[20:].encode() + b"\n\n"
    assert kv_failure.watch_chunk(chunk, DECODE, PREFILL)[0] is not None


def test_the_buffered_strip_answer_asks_for_response_headers_only_for_kv_handoffs():
    plain = msg.strip_on_headers(("x-a",))
    assert not plain.HasField("mode_override")
    watched = msg.strip_on_headers(("x-a",), response_headers=True).mode_override
    modes = watched.DESCRIPTOR.fields_by_name
    assert watched.request_body_mode == modes["request_body_mode"].enum_type.values_by_name["BUFFERED"].number
    assert (
        watched.response_header_mode == modes["response_header_mode"].enum_type.values_by_name["SEND"].number
    )
    assert watched.response_body_mode == modes["response_body_mode"].enum_type.values_by_name["NONE"].number
