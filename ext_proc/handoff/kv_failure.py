"""A decode that could not pull the KV cache its prefill leg announced, as the client is told.

What vLLM 0.32 does with its default ``kv_load_failure_policy: fail`` (measured on real engines,
``bench/vllm_kv_failure.py``: the prefill killed after its leg answered, a NIXL handshake that timed
out or was refused): a non-streaming request is answered ``500`` with vLLM's generic
``{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null,
"code": 500}}``; a streaming one ``200``, and its only event is that error (a chat stream announces
the role first), then ``[DONE]``. Nothing
in either says the KV pull failed. The gateway knows it handed that decode a KV cache to pull, so
it answers with the cause instead: :func:`message` is what a non-streaming client gets (``502
kv_transfer_failed``), :func:`watch_chunk` turns the stream's error event into one carrying the same.
Those functions are pure (bytes in, bytes out); :class:`KvPullWatcher`, which the engine handoffs attach
to a routed request, applies them to the decode's answer, counts a failed pull and ejects its prefill.
"""

from __future__ import annotations

import json
import logging

from ext_proc.handoff.base import Rerouter
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused
from ext_proc.refusal import refuse

log = logging.getLogger(__name__)

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


def watch_chunk(chunk: bytes, decode: str, prefill: str) -> tuple[bytes | None, bool]:
    """Scan a chunk of a streamed answer for a failed KV pull: ``(rewritten, keep_watching)``.

    The chunk belongs to an answer whose pull is not known to have worked yet; it is scanned event
    by event. ``rewritten`` is ``chunk`` with its first error event (what vLLM streams when the pull
    failed) replaced by :func:`error_event`, everything around it kept (vLLM's ``[DONE]``), or
    ``None`` when no error comes first. Events that say nothing yet come before it: SSE comments
    (keep-alives) and a chat answer's role announcement (vLLM sends
    ``{"delta": {"role": "assistant", "content": ""}}`` before it fails). ``keep_watching``: the chunk
    held nothing but such events, so the next one decides. An event with text, or one not complete in
    the chunk, ends the watch: the pull worked (or, for an event split across chunks, nothing is
    rewritten)."""
    start = 0
    while (end := chunk.find(b"\n\n", start)) >= 0:
        kind = _event_kind(chunk[start:end])
        if kind == "error":
            return chunk[:start] + error_event(decode, prefill) + chunk[end + 2 :], False
        if kind == "said":
            return None, False
        start = end + 2
    return None, start == len(chunk) and start > 0


class KvPullWatcher:
    """Watches the decode's answer to a KV-handoff request and turns a failed pull into a 502.

    A :class:`~ext_proc.outcome.ResponseWatcher`: the decode's 500 is a failed pull, answered ``502
    kv_transfer_failed``; a streamed answer's first chunks are inspected (:func:`watch_chunk`). A
    failed pull is counted in ``metrics`` and ejects the prefill through ``router``.

    ``prefill`` holds the KV; the decode is the one ``lease`` charges (the one that served, once the
    data plane said so). ``ask_for_chunks``: in BUFFERED mode, Envoy is asked to send a streamed
    answer chunk by chunk (``handoff.watch_streamed_answers``)."""

    __slots__ = ("_ask_for_chunks", "_lease", "_metrics", "_router", "prefill")

    def __init__(
        self, prefill: str, lease: Lease, metrics: Metrics, router: Rerouter, ask_for_chunks: bool
    ) -> None:
        self.prefill = prefill
        self._lease = lease
        self._metrics = metrics
        self._router = router
        self._ask_for_chunks = ask_for_chunks

    def headers(self, status: int, content_type: str, chunks_sent: bool) -> Refused | bool:
        """Judge the decode's answer headers: the 502 to answer for its 500, else whether to watch the body.

        A 200 event stream is watched chunk by chunk when the chunks come anyway (``chunks_sent``) or
        may be asked for; anything else passes unwatched."""
        if status == FAILED_STATUS:
            return refuse(self._metrics, STATUS, self._failed(stream=False), CODE)
        if status == 200 and content_type.startswith(EVENT_STREAM):
            return chunks_sent or self._ask_for_chunks
        return False

    def chunk(self, chunk: bytes) -> tuple[bytes | None, bool]:
        """:func:`watch_chunk` of a chunk before the answer said anything.

        A rewritten error is counted and logged."""
        rewritten, keep_watching = watch_chunk(chunk, self._decode(), self.prefill)
        if rewritten is not None:
            log.warning("streamed %s instead of the decode's error: %s", CODE, self._failed(stream=True))
        return rewritten, keep_watching

    def _decode(self) -> str:
        decode = self._lease.decode
        return decode.address if decode is not None else "(released)"

    def _failed(self, stream: bool) -> str:
        """The decode could not pull the prefill's KV cache: count it and eject that prefill (it died,
        or was too loaded to answer the handshake); the message for the client."""
        self._metrics.kv_transfer_failed(stream)
        self._router.leg_failed(self.prefill, CODE)
        return message(self._decode(), self.prefill)


def _event_kind(event: bytes) -> str:
    """``quiet`` (a comment, or choices without text yet), ``error`` (an OpenAI-style error), or
    ``said`` (anything else: text, a finish, ``[DONE]``, what is not JSON)."""
    lines = event.split(b"\n")
    if all(line.startswith(b":") for line in lines):
        return "quiet"
    data = b"".join(line[5:].strip() for line in lines if line.startswith(b"data:"))
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return "said"
    if not isinstance(parsed, dict):
        return "said"
    if isinstance(parsed.get("error"), dict):
        return "error"
    choices = parsed.get("choices")
    if isinstance(choices, list) and choices and all(_quiet_choice(c) for c in choices):
        return "quiet"
    return "said"


def _quiet_choice(choice: object) -> bool:
    """A streamed choice that generated nothing yet: no text, no tool call, no finish."""
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return not delta.get("content") and not delta.get("tool_calls") and not delta.get("reasoning_content")
    return "text" in choice and not choice["text"]
