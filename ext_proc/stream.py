"""One ext_proc stream's state machine, without I/O: Envoy's messages in, answers (or a pending one) out.

One HTTP request is one stream. Envoy's first message states the body modes; the stream's
:class:`~ext_proc.choreography.Choreography` (BUFFERED, or FULL_DUPLEX_STREAMED as the Gateway API
Inference Extension gateways configure it) decides which answers go out when; the routing is the same
in every mode. By phase:
- ``request_headers``: a request without a body is routed here (``GET /v1/models`` answered at once,
  without an in-flight slot, when the endpoints name their models: :meth:`Router.answer_bodiless`;
  otherwise :meth:`Router.route_bodiless`); otherwise the path, ``x-request-id``
  and ``authorization`` are noted and the body awaited (BUFFERED: client-supplied routing headers are
  stripped at once; FULL_DUPLEX_STREAMED: the answer is held until the body is complete).
- ``request_body``: BUFFERED, the whole body in one message after the headers; FULL_DUPLEX_STREAMED,
  chunks collected up to :data:`~ext_proc.choreography.BODY_LIMIT_BYTES` (beyond: 413
  ``request_too_large``) until ``end_of_stream`` (or the request trailers). Then parse, decide, charge,
  answer with routing headers, ``envoy.lb`` metadata and, for the engine handoffs, a new body; or with
  an ``ImmediateResponse`` error. With a gateway tokenizer (``affinity.prefix.tokenizer``) a text
  prompt is first put in token ids, and with decision slots (``shared_state.decision_slot_ms``) the
  request waits for this replica's turn to decide: the answer is then :class:`PendingRoute`, which the
  shell awaits and hands back (:meth:`Stream.prepared`) before routing goes on; Envoy is sent nothing
  meanwhile, so the choreography is the same. When the handoff first runs a prefill leg, the answer is a
  :class:`~ext_proc.outcome.PendingAnswer`: the shell asks Envoy to wait longer, awaits it and hands
  its outcome back (:meth:`Stream.completed`). An endpoint-subset hint in the metadata (endpoint-picker
  protocol) restricts the decode choice; no eligible endpoint in it → 503.
  A body without headers, a BUFFERED body in chunks, or a body mode pd-extproc cannot route by means
  Envoy is misconfigured in a way that would silently bypass routing: answered 500
  ``ext_proc_misconfigured``. A message with no phase at all: 500 ``ext_proc_protocol_error``.
- ``response_headers``: the prefill has finished; its charge is released. When the data plane reports
  the endpoint that served (``envoy.lb`` ``x-gateway-destination-endpoint-served``) and it is another
  decode than the one chosen (a retry walked the fallback list), the decode charge moves there. A routed
  request's :class:`~ext_proc.outcome.ResponseWatcher` (the engine handoffs: a decode's failed KV pull
  or dead engine) sees the status: it may refuse instead, watch the body's first chunks, or judge the
  whole body (a decode's 500) before anything is answered (asking Envoy to send the body, chunk by
  chunk or whole, when it would not come otherwise; FULL_DUPLEX_STREAMED: holding the headers answer).
- ``response_body``: a watched chunk is passed or replaced as the watcher says; a judged body is kept
  until complete, then the watcher's error answers instead (also at the response trailers); otherwise echoed
  unchanged in FULL_DUPLEX_STREAMED (chunk by chunk, as the engine streams tokens), else passed
  through; anything else passes through unchanged.
Admission control: a request about to be routed (headers without a body, or the body) first takes an
in-flight slot (:meth:`Router.admit`); when all ``limits.max_inflight_requests`` are taken it is
answered 429 ``overloaded`` with ``retry-after``. A refused request gives its slot back at once. With
flow control (``flow_control.enabled``, :mod:`ext_proc.flow`) a body is read first (a request without
one: its headers) and then asks :class:`~ext_proc.flow.control.FlowControl` for its slot (and, with
``flow_control.engine_priority``, the priority written into its body): it gets one, is refused, or
the answer is :class:`PendingFlow`, which the shell awaits (after asking Envoy to wait up to
:attr:`PendingFlow.timeout`) and hands back (:meth:`Stream.dispatched`) before routing goes on.
:meth:`Stream.close` (the shell calls it whatever ends the stream) releases the request's charges and
its in-flight slot and cancels its background prefill leg.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ext_proc import envoy_messages as msg
from ext_proc.choreography import BODY_LIMIT_BYTES, Answers, BodyCollector, Choreographies, Choreography
from ext_proc.flow.control import FlowControl, Labels, Ticket
from ext_proc.load import Admission
from ext_proc.metrics import Metrics
from ext_proc.outcome import (
    PendingAnswer,
    Refused,
    RequestMeta,
    ResponseWatcher,
    Routed,
    RoutingInstructions,
    Watch,
)
from ext_proc.refusal import refuse
from ext_proc.request import RequestInfo
from ext_proc.router import BodyRequest, Router
from ext_proc.tracing import RequestSpan, Tracing

TOO_LARGE = (
    f"request body too large: the gateway buffers at most {BODY_LIMIT_BYTES // (1024 * 1024)} MiB "
    f"({BODY_LIMIT_BYTES} bytes)"
)
"""The 413 message, the same as the shipped Envoy's own (``envoy/envoy.yaml`` local reply)."""

Build = Callable[[RoutingInstructions], Answers]
JUDGED_BODY_BYTES = 64 * 1024
"""The most of an answer's body a watcher judges whole (:attr:`Watch.BODY`: a decode's 500, an error of
a few hundred bytes) is given, in bytes; the rest is dropped with the answer."""
BODILESS_INFO = RequestInfo(None, False, 0, 0)
"""What flow control knows of a request without a body: no model, no tokens (its cost in its band's
fair share is nothing)."""


@dataclass(frozen=True, slots=True)
class PendingRoute:
    """A read request that waits before it is routed: for its prompt's token ids, its decision slot, or both.

    ``tokenize``: the gateway tokenizer puts the prompt in token ids first; then the request waits for
    this replica's decision slot (:meth:`Router.decision_turn`, 0 unless ``shared_state.decision_slot_ms``
    is on). The shell awaits :meth:`ready` and passes its tokens, with ``request``, to
    :meth:`Stream.prepared`."""

    router: Router
    request: BodyRequest
    tokenize: bool

    async def ready(self) -> Sequence[int] | None:
        """The prompt's token ids (``None``: not tokenized or unknown), once the decision slot came."""
        tokens = await self.router.prompt_tokens(self.request) if self.tokenize else None
        await self.router.decision_turn()
        return tokens


@dataclass(frozen=True, slots=True)
class PendingFlow:
    """A read request queued by flow control until the pool has room.

    The shell asks Envoy to wait ``timeout`` seconds (the queue's bound plus the longest answer a
    handoff may then take: Envoy extends one message's wait once), awaits :meth:`wait` and passes its
    outcome, with ``request`` (``None``: a request without a body), to :meth:`Stream.dispatched`."""

    flow: FlowControl
    ticket: Ticket
    request: BodyRequest | None
    timeout: float

    async def wait(self) -> Refused | None:
        """``None`` once dispatched (the stream holds an in-flight slot), else the refusal to answer."""
        return await self.flow.wait(self.ticket)

    def waited(self) -> float:
        """Seconds the request has waited in the queue so far."""
        return self.flow.waited(self.ticket)


class Streams:
    """What every stream of a server shares, built once and never modified after.

    The router, flow control (``None``: off), the choreographies of its handoff's routing headers, the
    constant answers and the tracing (``None``: off). ``flow_timeout``: a :class:`PendingFlow`'s."""

    def __init__(
        self,
        router: Router,
        tracing: Tracing | None = None,
        flow: FlowControl | None = None,
        flow_timeout: float = 0.0,
    ) -> None:
        self.router = router
        self.tracing = tracing
        self.flow = flow
        self.flow_timeout = flow_timeout
        self.metrics: Metrics = router.metrics
        self.choreographies = Choreographies(router.handoff.routing_headers, router.handoff.hands_kv)
        self.passthrough = {kind: msg.passthrough(kind) for kind in msg.PHASES}
        self.stream_body = msg.ask_response_body(streamed=True)
        self.buffer_body = msg.ask_response_body(streamed=False)

    def open(self) -> Stream:
        """The state of a new stream."""
        return Stream(self)


class Stream:
    """One stream's state: its choreography, the routed or pending request, and what Envoy sent so far.

    Its choreography (from Envoy's first message), the routed request (charges, background prefill
    leg, response watcher) or the pending answer in progress, whether it holds an in-flight slot,
    whether Envoy sent the request headers, what they said, the data plane's endpoint-subset hint if
    any, the FULL_DUPLEX_STREAMED body collected so far, how a pending answer's outcome becomes
    answers, whether the stream was answered with an error (later messages get no answer), the
    watcher of a streamed answer whose next chunk it still wants to see, and the watcher judging an
    answer's whole body with what of it came so far; with tracing on, the
    request's span (from its headers to :meth:`close`)."""

    __slots__ = (
        "_admission",
        "_shared",
        "admitted",
        "body",
        "build",
        "choreography",
        "ended",
        "judged",
        "judging",
        "meta",
        "pending",
        "routed",
        "saw_headers",
        "subset",
        "trace",
        "watching",
    )

    def __init__(self, shared: Streams) -> None:
        self._shared = shared
        self._admission: Admission = shared.router.admission
        self.admitted = False
        self.choreography: Choreography | None = None
        self.routed: Routed | None = None
        self.pending: PendingAnswer | None = None
        self.saw_headers = False
        self.meta = RequestMeta()
        self.subset: frozenset[str] | None = None
        self.body: BodyCollector | None = None
        self.build: Build | None = None
        self.ended = False
        self.watching: ResponseWatcher | None = None
        self.judging: ResponseWatcher | None = None
        self.judged = b""
        self.trace: RequestSpan | None = None

    def answer(self, request: msg.ProcessingRequest) -> Answers | PendingAnswer | PendingRoute | PendingFlow:
        """The answers to Envoy's message ``request``, or the pending answer, tokens or turn to await.

        No answers once the stream was answered with an error; a pending answer is awaited and passed
        to :meth:`completed`, a pending route to :meth:`prepared`, a pending turn to :meth:`dispatched`."""
        if self.ended:
            return ()
        choreography = self.choreography
        if choreography is None:
            chosen = self._shared.choreographies.choreography_for(request)
            if isinstance(chosen, str):
                return self._misconfigured(chosen)
            choreography = self.choreography = chosen
            self._shared.metrics.stream_started(chosen.name)
        kind = request.WhichOneof("request")
        if self.subset is None and request.HasField("metadata_context"):
            self.subset = msg.subset_hint(request)
        if kind == "request_headers":
            self.saw_headers = True
            headers = request.request_headers
            self.meta = msg.HeadersMeta(headers)
            tracing = self._shared.tracing
            if tracing is not None:
                self.trace = tracing.start(self.meta)
            if not headers.end_of_stream:
                if choreography.full_duplex:
                    self.body = BodyCollector()
                return choreography.header_hold
            return self._bodiless(choreography)
        if kind == "request_body":
            return self._request_body(request.request_body, choreography)
        if kind is None:
            return self._refuse(500, "empty ext_proc message", "ext_proc_protocol_error")
        if kind == "request_trailers" and self.body is not None and self.routed is None:
            # FULL_DUPLEX_STREAMED: trailers end the body (its last chunk had no end_of_stream).
            return self._route_body(self.body.body(), choreography, trailers=True)
        if kind == "response_headers" and self.routed is not None:
            routed = self.routed
            served = msg.served_endpoint(request)
            if served is not None:
                self._shared.router.served_by(routed.lease, served)
            routed.lease.release_prefill()
            if routed.watcher is not None:
                return self._watch_headers(request.response_headers, routed.watcher, choreography)
        if self.judging is not None and kind in ("response_body", "response_trailers"):
            body = request.response_body if kind == "response_body" else None
            return self._judge(body, self.judging, choreography)
        if kind == "response_body":
            if self.watching is not None:
                return (self._watch_chunk(request.response_body, self.watching, choreography),)
            return (choreography.response_body(request.response_body, self._shared.passthrough[kind]),)
        return (self._shared.passthrough[kind],)

    def dispatched(
        self, request: BodyRequest | None, refused: Refused | None, waited: float | None = None
    ) -> Answers | PendingAnswer | PendingRoute:
        """Go on with ``request`` (of :class:`PendingFlow`) once flow control let it through, or refuse it.

        ``request`` ``None``: a request without a body. ``waited``: the seconds it spent queued, recorded
        on the request's span."""
        if waited is not None and self.trace is not None:
            self.trace.queued(waited)
        if refused is not None:
            return self.end(refused)
        self.admitted = True
        assert self.build is not None
        if request is None:
            return self._routed(self._shared.router.route_bodiless(self.subset, self.trace), self.build)
        return self._prepare_or_route(request, self.build)

    def prepared(self, request: BodyRequest, tokens: Sequence[int] | None) -> Answers | PendingAnswer:
        """Route ``request`` (of :class:`PendingRoute`) now that it is ready, with its prompt's ``tokens``."""
        assert self.build is not None
        return self._route(request, tokens, self.build)

    def completed(self, outcome: Routed | Refused) -> Answers:
        """The answers once :attr:`pending` completed with ``outcome``.

        Until then its charges are the stream's."""
        self.pending = None
        assert self.build is not None
        return self._routed(outcome, self.build)

    def end(self, refused: Refused) -> Answers:
        """End the stream with the error answer ``refused``; Envoy sends nothing more that needs one."""
        self.ended = True
        if self.trace is not None:
            self.trace.refused(refused)
        error = msg.immediate_error(
            refused.status, refused.message, refused.code, refused.param, refused.body, refused.retry_after
        )
        return (error,)

    def close(self) -> None:
        """The stream has ended: give back its slot, release its charges, end its span (idempotent)."""
        self._release_slot()
        self._release_charges()
        if self.trace is not None:
            self.trace.end()
            self.trace = None

    def _release_slot(self) -> None:
        """Give back the stream's in-flight slot if it holds one (idempotent)."""
        if self.admitted:
            self.admitted = False
            self._admission.release()

    def _release_charges(self) -> None:
        """Release every charge and cancel a background prefill leg (idempotent)."""
        if self.pending is not None:
            self.pending.lease.release()
        routed = self.routed
        if routed is not None:
            routed.lease.release()
            if routed.background is not None:
                routed.background.cancel()

    def _refuse(self, status: int, message: str, code: str) -> Answers:
        """End the stream with an error answer of its own (counted and logged as every refusal)."""
        return self.end(refuse(self._shared.metrics, status, message, code))

    def _misconfigured(self, message: str) -> Answers:
        return self._refuse(500, f"gateway misconfigured: {message}", "ext_proc_misconfigured")

    def _routed(self, outcome: Routed | Refused, build: Build) -> Answers:
        if isinstance(outcome, Refused):
            self._release_slot()  # not routed: no longer in flight
            return self.end(outcome)
        self._release_charges()  # a stream is routed once; never leak an earlier charge
        self.routed = outcome
        answers = build(outcome.instructions)
        trace = self.trace
        if trace is None:
            return answers
        return (msg.with_headers(answers[0], trace.headers), *answers[1:])  # the first one routes

    def _admit(self) -> Refused | None:
        """Take an in-flight slot unless the stream holds one: ``None``, or the 429 to answer."""
        if self.admitted:
            return None
        overloaded = self._shared.router.admit()
        self.admitted = overloaded is None
        return overloaded

    def _bodiless(self, choreography: Choreography) -> Answers | PendingFlow:
        """A request without a body: the gateway's own answer (no slot needed), or routed once it holds
        an in-flight slot (with flow control, queued for one as a request with a body is)."""
        router = self._shared.router
        answered = router.answer_bodiless(self.meta)
        if answered is not None:
            self.ended = True
            return (msg.immediate_answer(answered.status, answered.body),)
        build = choreography.route_bodiless
        flow = self._shared.flow
        if flow is None:
            overloaded = self._admit()
            if overloaded is not None:
                return self._routed(overloaded, build)
        else:
            queued = self._arrive(flow, BODILESS_INFO, None, build)
            if queued is not None:
                return queued
        return self._routed(router.route_bodiless(self.subset, self.trace), build)

    def _arrive(
        self, flow: FlowControl, info: RequestInfo, request: BodyRequest | None, build: Build
    ) -> Answers | PendingFlow | None:
        """Pass ``request`` (``None``: one without a body) through flow control: its refusal, a
        :class:`PendingFlow` to await, or ``None`` when it holds an in-flight slot now."""
        gate = flow.arrive(Labels(self.meta.objective, self.meta.fairness_id), info)
        if isinstance(gate, Refused):
            return self.end(gate)
        if gate is not None:
            self.build = build
            return PendingFlow(flow, gate, request, self._shared.flow_timeout)
        self.admitted = True
        return None

    def _request_body(
        self, body: msg.HttpBody, choreography: Choreography
    ) -> Answers | PendingAnswer | PendingRoute | PendingFlow:
        if not self.saw_headers:
            return self._misconfigured(
                "ext_proc request_header_mode must be SEND (with SKIP, Envoy picks the upstream "
                "before the body is answered, so no routing decision can take effect)",
            )
        collector = self.body
        if collector is None:  # BUFFERED: the whole body in this one message
            if not body.end_of_stream:
                return self._misconfigured("ext_proc request_body_mode must be BUFFERED")
            return self._route_body(body.body, choreography)
        if not collector.add(body.body):
            return self._refuse(413, TOO_LARGE, "request_too_large")
        if not body.end_of_stream:
            return ()
        return self._route_body(collector.body(), choreography)

    def _route_body(
        self, raw: bytes, choreography: Choreography, trailers: bool = False
    ) -> Answers | PendingAnswer | PendingRoute | PendingFlow:
        flow = self._shared.flow
        if flow is None:
            overloaded = self._admit()
            if overloaded is not None:
                return self.end(overloaded)
        build = functools.partial(choreography.route_body, body=raw, trailers=trailers)
        router = self._shared.router
        priority = None if flow is None else flow.engine_priority(self.meta.objective)
        request = router.read(raw, self.meta, priority)
        if isinstance(request, Refused):
            return self._routed(request, build)
        if flow is not None and not self.admitted:
            queued = self._arrive(flow, request.info, request, build)
            if queued is not None:
                return queued
        return self._prepare_or_route(request, build)

    def _prepare_or_route(self, request: BodyRequest, build: Build) -> Answers | PendingAnswer | PendingRoute:
        router = self._shared.router
        tokenize = router.wants_tokens(request)
        if tokenize or router.decision_wait() > 0:
            self.build = build
            return PendingRoute(router, request, tokenize)
        return self._route(request, None, build)

    def _route(
        self, request: BodyRequest, tokens: Sequence[int] | None, build: Build
    ) -> Answers | PendingAnswer:
        outcome = self._shared.router.route(request, self.subset, tokens, self.trace)
        if isinstance(outcome, Routed | Refused):
            return self._routed(outcome, build)
        self.pending = outcome  # released by close() if the stream ends from here on
        self.build = build
        return outcome

    def _watch_headers(
        self, headers: msg.HttpHeaders, watcher: ResponseWatcher, choreography: Choreography
    ) -> Answers:
        """The routed request's answer starts: its watcher says what of the body it sees.

        Its chunks (in BUFFERED mode Envoy is then asked to send them one by one), or all of it before
        anything is answered (BUFFERED: Envoy is asked for it whole; FULL_DUPLEX_STREAMED: the headers
        answer is held; a bodiless answer is judged at once)."""
        status, content_type = msg.response_status(headers)
        chunks_sent = choreography.streams_response_body
        verdict = watcher.headers(status, content_type, chunks_sent)
        if verdict is Watch.BODY:
            if headers.end_of_stream:
                return self.end(watcher.body(b""))
            self.judging = watcher
            return () if chunks_sent else (self._shared.buffer_body,)
        if verdict is Watch.CHUNKS:
            self.watching = watcher
            if not chunks_sent:
                return (self._shared.stream_body,)
        return (self._shared.passthrough["response_headers"],)

    def _judge(
        self, body: msg.HttpBody | None, watcher: ResponseWatcher, choreography: Choreography
    ) -> Answers:
        """A part of an answer its watcher judges whole (:attr:`Watch.BODY`): kept, up to
        :data:`JUDGED_BODY_BYTES`, until the body is complete, then the watcher's error ends the stream.

        BUFFERED: the body comes in one message. FULL_DUPLEX_STREAMED: its headers answer is held and its
        chunks kept until ``end_of_stream`` or the trailers (``body`` ``None``)."""
        if body is not None:
            self.judged += body.body[: JUDGED_BODY_BYTES - len(self.judged)]
            if not body.end_of_stream and choreography.streams_response_body:
                return ()
        return self.end(watcher.body(self.judged))

    def _watch_chunk(
        self, body: msg.HttpBody, watcher: ResponseWatcher, choreography: Choreography
    ) -> msg.ProcessingResponse:
        """A watched chunk of the answer: passed as it came, or replaced by what the watcher says."""
        replacement, keep_watching = watcher.chunk(body.body)
        if not keep_watching:
            self.watching = None
        if replacement is None:
            return choreography.response_body(body, self._shared.passthrough["response_body"])
        if choreography.streams_response_body:
            return msg.streamed_chunk("response_body", replacement, body.end_of_stream)
        return msg.replace_body(replacement)
