"""The pure part of a failed KV pull: which first streamed event is the failure, and what replaces it."""

from __future__ import annotations

import json

import pytest

from ext_proc import envoy_messages as msg
from ext_proc.handoff import kv_failure
from standins.backends import VLLM_GENERATION_ERROR

DECODE, PREFILL = "10.0.0.2:8000", "10.0.0.1:8000"


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


ROLE = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
"""What vLLM streams first for a chat request, before its failure (measured on vLLM 0.32)."""
TOKEN = {"id": "cmpl-1", "choices": [{"index": 0, "text": " w1", "finish_reason": None}]}


def error_of(rewritten: bytes) -> dict:
    (replaced,) = [e for e in rewritten.split(b"\n\n") if b"kv_transfer_failed" in e]
    return json.loads(replaced.removeprefix(b"data: "))["error"]


@pytest.mark.parametrize(
    "before", [b"", b": keep-alive\n\n", event(ROLE)], ids=["first", "after-a-comment", "after-the-role"]
)
def test_vllms_streamed_error_becomes_the_named_cause_and_the_rest_stays(before):
    chunk = before + event(VLLM_GENERATION_ERROR) + b"data: [DONE]\n\n"
    rewritten, watching = kv_failure.watch_chunk(chunk, DECODE, PREFILL)
    assert rewritten is not None and not watching
    assert rewritten.startswith(before) and rewritten.endswith(b"\n\ndata: [DONE]\n\n")
    error = error_of(rewritten)
    assert error["code"] == "kv_transfer_failed" and error["type"] == "bad_gateway"
    assert DECODE in error["message"] and PREFILL in error["message"]


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
