"""A decode that could not pull the KV cache its prefill leg announced, as the client is told.

What vLLM 0.32 does with its default ``kv_load_failure_policy: fail`` (measured on real engines,
``bench/vllm_kv_failure.py``: the prefill killed after its leg answered, a NIXL handshake that timed
out or was refused): a non-streaming request is answered ``500`` with vLLM's generic
``{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null,
"code": 500}}``; a streaming one ``200``, and its only event is that error, then ``[DONE]``. Nothing
in either says the KV pull failed. The gateway knows it handed that decode a KV cache to pull, so
it answers with the cause instead: :func:`failed_answer` is what a non-streaming client gets
(``502 kv_transfer_failed``), :func:`rewrite_stream_error` turns the stream's error event into one
carrying the same. Pure: bytes in, bytes out.
"""

from __future__ import annotations

import json

CODE = "kv_transfer_failed"
STATUS = 502
FAILED_STATUS = 500
"""The decode status that means a failed pull for a request carrying a KV handoff (vLLM's
``GenerationError``; Envoy's own answers for an unreachable decode are 502/503/504)."""
EVENT_STREAM = "text/event-stream"


def message(decode: str, prefill: str) -> str:
    """The error message: which decode could not pull from which prefill, and what to do."""
    return (
        f"the decode engine {decode} could not load the KV cache the prefill engine {prefill} computed "
        "for this request (the prefill died, its KV lease ran out, or the KV handshake timed out); "
        "the request can be sent again. Decode engines started with kv_load_failure_policy=recompute "
        "compute the prompt themselves instead"
    )


def error_event(decode: str, prefill: str) -> bytes:
    """The server-sent event of the error, OpenAI-style (the SDKs raise it as an ``APIError``)."""
    error = {"message": message(decode, prefill), "type": "bad_gateway", "param": None, "code": CODE}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def rewrite_stream_error(chunk: bytes, decode: str, prefill: str) -> bytes | None:
    """``chunk``, the first body chunk of a streamed answer, with its first event replaced by
    :func:`error_event` when that event is an error (what vLLM streams when the pull failed);
    ``None`` when the first event is anything else (tokens: the pull worked). Comment events before
    it (SSE keep-alives) and the rest of the chunk (vLLM's ``[DONE]``) are kept. A first event not
    complete in the chunk is not an error."""
    start = 0
    while True:
        end = chunk.find(b"\n\n", start)
        if end < 0:
            return None
        lines = chunk[start:end].split(b"\n")
        if not all(line.startswith(b":") for line in lines):
            break
        start = end + 2
    data = b"".join(line[5:].strip() for line in lines if line.startswith(b"data:"))
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("error"), dict):
        return None
    return chunk[:start] + error_event(decode, prefill) + chunk[end + 2 :]


def only_comments(chunk: bytes) -> bool:
    """Whether ``chunk`` holds nothing but complete SSE comment events (keep-alives): the first event
    that says something is still to come."""
    events = chunk.split(b"\n\n")
    return (
        bool(chunk)
        and events[-1] == b""
        and all(line.startswith(b":") for event in events[:-1] for line in event.split(b"\n"))
    )
