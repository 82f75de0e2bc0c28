"""A decode that could not pull the KV cache its prefill leg announced, or died, as the client is told.

What vLLM 0.32 does with its default ``kv_load_failure_policy: fail`` (measured on real engines,
``bench/vllm_kv_failure.py``: the prefill killed after its leg answered, a NIXL handshake that timed
out or was refused): a non-streaming request is answered ``500`` with vLLM's generic
``{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null,
"code": 500}}``; a streaming one ``200``, and its only event is that error (a chat stream announces
the role first), then ``[DONE]``. Nothing in either says the KV pull failed. The gateway knows it
handed that decode a KV cache to pull, so it answers with the cause instead (``502
kv_transfer_failed``, the prefill to blame).

A decode whose engine core died (vLLM's ``EngineDeadError``) answers the same ways, but its error's
message is :data:`ENGINE_DEAD` (vLLM 0.32 ``vllm/v1/engine/exceptions.py``; a request arriving at a
dead engine gets the 500, one in flight when it died the stream's error event): that is the decode's
fault, not the prefill's, and is answered ``503 decode_engine_dead``, the decode to blame.

:func:`judge_body` (the whole body of a decode's 500) and :func:`watch_chunk` (a streamed answer's
first chunks) are pure, bytes in and a :class:`Failure` out; :class:`KvPullWatcher`, which the engine
handoffs attach to a routed request, applies them to the decode's answer, counts the failure and
ejects the engine to blame.
"""

from __future__ import annotations

import json
import logging
from typing import NamedTuple

from ext_proc.handoff.base import Rerouter
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused, Watch
from ext_proc.refusal import refuse

log = logging.getLogger(__name__)

CODE = "kv_transfer_failed"
STATUS = 502
DEAD_CODE = "decode_engine_dead"
DEAD_STATUS = 503
FAILED_STATUS = 500
"""The decode status of a failed pull or a dead engine core for a request carrying a KV handoff
(vLLM's ``GenerationError`` or ``EngineDeadError``; Envoy's own answers for an unreachable decode
are 502/503/504)."""
ENGINE_DEAD = "EngineCore encountered an issue"
"""How the message of vLLM's error for a dead engine core starts (``EngineDeadError``)."""
EVENT_STREAM = "text/event-stream"


class Failure(NamedTuple):
    """What the client is told of a decode's failure, and whom it blames.

    ``status``, OpenAI error ``kind`` (type), ``code`` and ``message``. ``code`` says whom to blame:
    :data:`CODE` the prefill, :data:`DEAD_CODE` the decode."""

    status: int
    kind: str
    code: str
    message: str


class Rewrite(NamedTuple):
    """A streamed chunk whose error event was replaced (``chunk``), and the ``failure`` it reports."""

    chunk: bytes
    failure: Failure


def message(decode: str, prefill: str) -> str:
    """The error message: which decode could not pull from which prefill, and what to do."""
    return (
        f"the decode engine {decode} could not load the KV cache the prefill engine {prefill} computed "
        "for this request (the prefill died, its KV lease ran out, or the KV handshake timed out); "
        "the request can be sent again. Decode engines started with kv_load_failure_policy=recompute "
        "compute the prompt themselves instead"
    )


def dead_message(decode: str) -> str:
    """The error message of a decode whose engine core died: which one, and what to do."""
    return (
        f"the decode engine {decode} failed: its engine core is dead (vLLM: {ENGINE_DEAD}), so it is "
        "left out of routing for a while; the request can be sent again"
    )


def failure(error: object, decode: str, prefill: str) -> Failure:
    """The failure a decode's OpenAI-style ``error`` object (or anything else) reports.

    vLLM's dead engine core (a message starting with :data:`ENGINE_DEAD`) is the decode's
    (:data:`DEAD_CODE`); anything else, its generic error included, a failed pull (:data:`CODE`)."""
    said = error.get("message") if isinstance(error, dict) else None
    if isinstance(said, str) and said.startswith(ENGINE_DEAD):
        return Failure(DEAD_STATUS, "service_unavailable", DEAD_CODE, dead_message(decode))
    return Failure(STATUS, "bad_gateway", CODE, message(decode, prefill))


def judge_body(body: bytes, decode: str, prefill: str) -> Failure:
    """The failure the body of a decode's 500 reports: its JSON ``error`` as :func:`failure` reads it.

    A body that is not such JSON (empty, cut, not an object) is a failed pull."""
    return failure(_error_of(body), decode, prefill)


def error_event(failed: Failure) -> bytes:
    """The server-sent event of the error, OpenAI-style (the SDKs raise it as an ``APIError``)."""
    error = {"message": failed.message, "type": failed.kind, "param": None, "code": failed.code}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def watch_chunk(chunk: bytes, decode: str, prefill: str) -> tuple[Rewrite | None, bool]:
    """Scan a chunk of a streamed answer for a failed KV pull or a dead decode: ``(rewrite, keep_watching)``.

    The chunk belongs to an answer whose pull is not known to have worked yet; it is scanned event
    by event. ``rewrite``: ``chunk`` with its first error event (what vLLM streams when the pull
    failed or its engine core died) replaced by the :func:`error_event` of its :func:`failure`,
    everything around it kept (vLLM's ``[DONE]``), or ``None`` when no error comes first. Events that
    say nothing yet come before it: SSE comments (keep-alives) and a chat answer's role announcement
    (vLLM sends ``{"delta": {"role": "assistant", "content": ""}}`` before it fails).
    ``keep_watching``: the chunk held nothing but such events, so the next one decides. An event with
    text, or one not complete in the chunk, ends the watch: the pull worked (or, for an event split
    across chunks, nothing is rewritten)."""
    start = 0
    while (end := chunk.find(b"\n\n", start)) >= 0:
        kind = _event_kind(chunk[start:end])
        if isinstance(kind, dict):
            failed = failure(kind, decode, prefill)
            return Rewrite(chunk[:start] + error_event(failed) + chunk[end + 2 :], failed), False
        if kind == "said":
            return None, False
        start = end + 2
    return None, start == len(chunk) and start > 0


class KvPullWatcher:
    """Watches the decode's answer to a KV-handoff request and blames its failure on the right engine.

    A :class:`~ext_proc.outcome.ResponseWatcher`: the decode's 500 is judged by its body
    (:func:`judge_body`: ``502 kv_transfer_failed`` or ``503 decode_engine_dead``); a streamed
    answer's first chunks are inspected (:func:`watch_chunk`). A failed pull is counted in
    ``metrics`` and ejects the prefill through ``router``; a dead decode is counted and ejects the
    decode.

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

    def headers(self, status: int, content_type: str, chunks_sent: bool) -> Watch:
        """Judge the decode's answer headers: what of its body to see.

        A 500 is judged by its whole body (:meth:`body`); a 200 event stream is watched chunk by chunk
        when the chunks come anyway (``chunks_sent``) or may be asked for; anything else passes."""
        if status == FAILED_STATUS:
            return Watch.BODY
        if status == 200 and content_type.startswith(EVENT_STREAM) and (chunks_sent or self._ask_for_chunks):
            return Watch.CHUNKS
        return Watch.NONE

    def body(self, body: bytes) -> Refused:
        """The whole body of the decode's 500: the error to answer instead (:func:`judge_body`)."""
        failed = judge_body(body, self._decode(), self.prefill)
        self._blame(failed, stream=False)
        return refuse(self._metrics, failed.status, failed.message, failed.code)

    def chunk(self, chunk: bytes) -> tuple[bytes | None, bool]:
        """:func:`watch_chunk` of a chunk before the answer said anything.

        A rewritten error is counted and logged."""
        rewrite, keep_watching = watch_chunk(chunk, self._decode(), self.prefill)
        if rewrite is None:
            return None, keep_watching
        self._blame(rewrite.failure, stream=True)
        log.warning(
            "streamed %s instead of the decode's error: %s", rewrite.failure.code, rewrite.failure.message
        )
        return rewrite.chunk, keep_watching

    def _decode(self) -> str:
        decode = self._lease.decode
        return decode.address if decode is not None else "(released)"

    def _blame(self, failed: Failure, stream: bool) -> None:
        """Count ``failed`` and eject the engine to blame: the prefill of a failed pull (it died, or was
        too loaded to answer the handshake), the decode of a dead engine core."""
        if failed.code == CODE:
            self._metrics.kv_transfer_failed(stream)
            self._router.leg_failed(self.prefill, CODE)
            return
        self._metrics.decode_engine_dead(stream)
        decode = self._lease.decode
        if decode is not None:
            self._router.decode_failed(decode.address, DEAD_CODE)


def _parsed(data: bytes) -> object:
    """The JSON value ``data`` holds; ``None`` when it is not JSON."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None


def _error_of(body: bytes) -> object:
    """The ``error`` member of a JSON object ``body``; ``None`` when it is no such thing."""
    parsed = _parsed(body)
    return parsed.get("error") if isinstance(parsed, dict) else None


def _event_kind(event: bytes) -> str | dict[str, object]:
    """``quiet`` (a comment, or choices without text yet), the event's OpenAI-style error object, or
    ``said`` (anything else: text, a finish, ``[DONE]``, what is not JSON)."""
    lines = event.split(b"\n")
    if all(line.startswith(b":") for line in lines):
        return "quiet"
    data = b"".join(line[5:].strip() for line in lines if line.startswith(b"data:"))
    parsed = _parsed(data)
    if not isinstance(parsed, dict):
        return "said"
    error = parsed.get("error")
    if isinstance(error, dict):
        return error
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
