"""The pure part of a failed KV pull: which first streamed event is the failure, and what replaces it."""

from __future__ import annotations

import json

import pytest
from backends import VLLM_GENERATION_ERROR

from ext_proc import envoy_messages as msg
from ext_proc.handoff import kv_failure

DECODE, PREFILL = "10.0.0.2:8000", "10.0.0.1:8000"


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_vllms_streamed_error_becomes_the_named_cause_and_the_rest_stays():
    chunk = event(VLLM_GENERATION_ERROR) + b"data: [DONE]\n\n"
    rewritten = kv_failure.rewrite_stream_error(chunk, DECODE, PREFILL)
    assert rewritten is not None and rewritten.endswith(b"\n\ndata: [DONE]\n\n")
    error = json.loads(rewritten.split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["code"] == "kv_transfer_failed" and error["type"] == "bad_gateway"
    assert DECODE in error["message"] and PREFILL in error["message"]


@pytest.mark.parametrize(
    "chunk",
    [
        event({"id": "cmpl-1", "choices": [{"index": 0, "text": " w1"}]}),  # a token: the pull worked
        b'data: {"error": {"message": "cut',
        b"data: not json\n\n",
        b": keep-alive comment\n\n",
        event(["error"]),
        event({"error": "a string"}),
        b"",
    ],
    ids=["token", "incomplete", "not-json", "comment", "a-list", "error-not-an-object", "empty"],
)
def test_anything_but_a_complete_error_event_first_is_left_alone(chunk):
    assert kv_failure.rewrite_stream_error(chunk, DECODE, PREFILL) is None


def test_keep_alive_comments_before_the_error_are_kept_and_skipped():
    chunk = b": keep-alive\n\n" + event(VLLM_GENERATION_ERROR)
    rewritten = kv_failure.rewrite_stream_error(chunk, DECODE, PREFILL)
    assert rewritten is not None and rewritten.startswith(b": keep-alive\n\ndata: ")
    assert b"kv_transfer_failed" in rewritten


@pytest.mark.parametrize(
    ("chunk", "comments"),
    [
        (b": keep-alive\n\n", True),
        (b": a\n: b\n\n: c\n\n", True),
        (b": cut", False),
        (b"", False),
        (b": keep-alive\n\n" + event({"id": 1}), False),
    ],
)
def test_a_chunk_of_comments_only_keeps_the_watch_on(chunk, comments):
    assert kv_failure.only_comments(chunk) is comments


def test_an_error_event_over_several_data_lines_is_recognised():
    body = json.dumps(VLLM_GENERATION_ERROR)
    chunk = b"data: " + body[:20].encode() + b"\ndata: " + body[20:].encode() + b"\n\n"
    assert kv_failure.rewrite_stream_error(chunk, DECODE, PREFILL) is not None


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
