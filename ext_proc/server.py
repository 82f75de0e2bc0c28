"""The gRPC shell: Envoy's ``ExternalProcessor.Process`` stream plus the gRPC health service of
:mod:`ext_proc.health` (and, when pd-extproc serves EDS, the ADS service of :mod:`ext_proc.xds`).

One HTTP request is one stream. Envoy's first message states the body modes; the stream's
:class:`~ext_proc.choreography.Choreography` (BUFFERED, or FULL_DUPLEX_STREAMED as the Gateway API
Inference Extension gateways configure it) decides which answers go out when; the routing is the same
in every mode. By phase:
- ``request_headers``: a request without a body is routed here; otherwise the path, ``x-request-id``
  and ``authorization`` are noted and the body awaited (BUFFERED: client-supplied routing headers are
  stripped at once; FULL_DUPLEX_STREAMED: the answer is held until the body is complete).
- ``request_body``: BUFFERED, the whole body in one message after the headers; FULL_DUPLEX_STREAMED,
  chunks collected up to :data:`~ext_proc.choreography.BODY_LIMIT_BYTES` (beyond: 413
  ``request_too_large``) until ``end_of_stream`` (or the request trailers). Then parse, decide, charge,
  answer with routing headers, ``envoy.lb`` metadata and, for the engine handoffs, a new body; or with
  an ``ImmediateResponse`` error. When the handoff first runs a prefill leg, the stream first asks
  Envoy to wait longer (``override_message_timeout``), then answers. An endpoint-subset hint in the
  metadata (endpoint-picker protocol) restricts the decode choice; no eligible endpoint in it → 503.
  A body without headers, a BUFFERED body in chunks, or a body mode pd-extproc cannot route by means
  Envoy is misconfigured in a way that would silently bypass routing: answered 500
  ``ext_proc_misconfigured``.
- ``response_headers``: the prefill has finished; its charge is released. When the data plane reports
  the endpoint that served (``envoy.lb`` ``x-gateway-destination-endpoint-served``) and it is another
  decode than the one chosen (a retry walked the fallback list), the decode charge moves there.
- ``response_body``: echoed unchanged in FULL_DUPLEX_STREAMED (chunk by chunk, as the engine streams
  tokens), else passed through; anything else passes through unchanged.
Admission control: a request about to be routed (headers without a body, or the body) first takes an
in-flight slot (:meth:`Router.admit`); when all ``limits.max_inflight_requests`` are taken it is
answered 429 ``overloaded`` with ``retry-after``. A refused request gives its slot back at once.
Whatever ends the stream (completion, upstream error, client abort, cancellation, even in the
middle of a prefill leg, which is then cancelled), the request's charges and its in-flight slot are
released and its background prefill leg cancelled in a ``finally``. No exception escapes a stream:
an unexpected one becomes a logged 500 answer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from ext_proc import envoy_messages as msg
from ext_proc.choreography import BODY_LIMIT_BYTES, Answers, BodyCollector, Choreographies, Choreography
from ext_proc.handoff import Handover, Refused, RequestMeta, Routed, RoutingInstructions, kv_failure
from ext_proc.health import Health
from ext_proc.load import Admission
from ext_proc.router import Router
from ext_proc.xds import AdsServer

log = logging.getLogger(__name__)

ENVOY_BODY_LIMIT_BYTES = BODY_LIMIT_BYTES
"""The largest request body the shipped Envoy buffers, in bytes: the gateway listener's
``per_connection_buffer_limit_bytes`` in ``envoy/envoy.yaml`` (a test keeps the two equal). A larger
body is refused by Envoy itself (413) and never reaches pd-extproc."""
MAX_RECEIVE_BYTES = ENVOY_BODY_LIMIT_BYTES + 1024 * 1024
"""The ext_proc service's gRPC receive limit, in bytes: one ``request_body`` message carries the whole
buffered body plus its own overhead (protobuf framing, metadata context: tens of bytes to a few KiB;
the request headers come in their own message, at most Envoy's 60 KiB default). gRPC's default of
4 MiB would refuse a long-context body, and Envoy would answer the client an empty 500."""
TOO_LARGE = (
    f"request body too large: the gateway buffers at most {BODY_LIMIT_BYTES // (1024 * 1024)} MiB "
    f"({BODY_LIMIT_BYTES} bytes)"
)
"""The 413 message, the same as the shipped Envoy's own (``envoy/envoy.yaml`` local reply)."""

Build = Callable[[RoutingInstructions], Answers]


def _refusal(refused: Refused) -> msg.ProcessingResponse:
    return msg.immediate_error(
        refused.status, refused.message, refused.code, refused.param, refused.body, refused.retry_after
    )


class _Stream:
    """Per-stream state: its choreography (from Envoy's first message), the routed request (charges,
    background prefill leg) or the handover in progress, whether it holds an in-flight slot of
    ``admission``, whether Envoy sent the request headers, what they said, the data plane's
    endpoint-subset hint if any, the FULL_DUPLEX_STREAMED body collected so far, how a handover's
    outcome becomes answers, whether the stream was answered with an error (later messages get
    no answer), and whether the first chunk of a streamed answer to a KV handoff is still to come."""

    __slots__ = (
        "admission",
        "admitted",
        "body",
        "build",
        "choreography",
        "ended",
        "handover",
        "meta",
        "routed",
        "saw_headers",
        "subset",
        "watch_stream",
    )

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.admitted = False
        self.choreography: Choreography | None = None
        self.routed: Routed | None = None
        self.handover: Handover | None = None
        self.saw_headers = False
        self.meta = RequestMeta()
        self.subset: frozenset[str] | None = None
        self.body: BodyCollector | None = None
        self.build: Build | None = None
        self.ended = False
        self.watch_stream = False

    def release_slot(self) -> None:
        """Give back the stream's in-flight slot if it holds one (idempotent)."""
        if self.admitted:
            self.admitted = False
            self.admission.release()

    def close(self) -> None:
        """The stream has ended: give back its in-flight slot and release its charges (idempotent)."""
        self.release_slot()
        self.release_charges()

    def release_charges(self) -> None:
        """Release every charge and cancel a background prefill leg (idempotent)."""
        if self.handover is not None:
            self.handover.lease.release()
        routed = self.routed
        if routed is not None:
            routed.lease.release()
            if routed.background is not None:
                routed.background.cancel()


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """Answers Envoy's ext_proc streams with decisions from a :class:`Router`."""

    def __init__(self, router: Router) -> None:
        self._router = router
        # Constant answers, built once and shared by every stream: never modified after this.
        self._choreographies = Choreographies(router.handoff.routing_headers, router.handoff.hands_kv)
        self._passthrough = {kind: msg.passthrough(kind) for kind in msg.PHASES}
        self._stream_body = msg.stream_response_body()

    def _refuse(self, stream: _Stream, refused: Refused) -> Answers:
        """End ``stream`` with the error answer ``refused``; Envoy sends nothing more that needs one."""
        stream.ended = True
        return (_refusal(refused),)

    def _misconfigured(self, stream: _Stream, message: str) -> Answers:
        refused = self._router.refuse(500, f"gateway misconfigured: {message}", "ext_proc_misconfigured")
        return self._refuse(stream, refused)

    def _routed(self, outcome: Routed | Refused, build: Build, stream: _Stream) -> Answers:
        if isinstance(outcome, Refused):
            stream.release_slot()  # not routed: no longer in flight
            return self._refuse(stream, outcome)
        stream.release_charges()  # a stream is routed once; never leak an earlier charge
        stream.routed = outcome
        return build(outcome.instructions)

    def _admit(self, stream: _Stream) -> Refused | None:
        """Take an in-flight slot for ``stream`` unless it holds one: ``None``, or the 429 to answer."""
        if stream.admitted:
            return None
        overloaded = self._router.admit()
        stream.admitted = overloaded is None
        return overloaded

    def _route_body(self, raw: bytes, stream: _Stream, trailers: bool = False) -> Answers | Handover:
        overloaded = self._admit(stream)
        if overloaded is not None:
            return self._refuse(stream, overloaded)
        outcome = self._router.route_body(raw, stream.meta, stream.subset)
        assert stream.choreography is not None
        build = functools.partial(stream.choreography.route_body, body=raw, trailers=trailers)
        if isinstance(outcome, Routed | Refused):
            return self._routed(outcome, build, stream)
        stream.handover = outcome  # released by close() if the stream ends from here on
        stream.build = build
        return outcome

    def _answer(self, request: msg.ProcessingRequest, stream: _Stream) -> Answers | Handover:
        if stream.ended:
            return ()
        choreography = stream.choreography
        if choreography is None:
            chosen = self._choreographies.choreography_for(request)
            if isinstance(chosen, str):
                return self._misconfigured(stream, chosen)
            choreography = stream.choreography = chosen
            self._router.metrics.stream_started(chosen.name)
        kind = request.WhichOneof("request")
        if stream.subset is None and request.HasField("metadata_context"):
            stream.subset = msg.subset_hint(request)
        if kind == "request_headers":
            stream.saw_headers = True
            if not request.request_headers.end_of_stream:
                stream.meta = msg.request_meta(request.request_headers)
                if choreography.full_duplex:
                    stream.body = BodyCollector()
                return choreography.header_hold
            overloaded = self._admit(stream)
            outcome = self._router.route_bodiless(stream.subset) if overloaded is None else overloaded
            return self._routed(outcome, choreography.route_bodiless, stream)
        if kind == "request_body":
            return self._request_body(request.request_body, stream)
        if kind is None:
            return self._refuse(
                stream, self._router.refuse(500, "empty ext_proc message", "ext_proc_protocol_error")
            )
        if kind == "request_trailers" and stream.body is not None and stream.routed is None:
            # FULL_DUPLEX_STREAMED: trailers end the body (its last chunk had no end_of_stream).
            return self._route_body(stream.body.body(), stream, trailers=True)
        if kind == "response_headers" and stream.routed is not None:
            served = msg.served_endpoint(request)
            if served is not None:
                self._router.served_by(stream.routed.lease, served)
            stream.routed.lease.release_prefill()
            if stream.routed.kv_source is not None:
                return self._kv_answer_headers(request.response_headers, stream, choreography)
        if kind == "response_body":
            if stream.watch_stream:
                return (self._kv_first_chunk(request.response_body, stream, choreography),)
            return (choreography.response_body(request.response_body, self._passthrough[kind]),)
        return (self._passthrough[kind],)

    def _kv_names(self, stream: _Stream) -> tuple[str, str]:
        """(prefill, decode) of a routed KV handoff: the prefill that holds the KV, the decode charged
        (the one that served, once the data plane said so)."""
        routed = stream.routed
        assert routed is not None and routed.kv_source is not None
        decode = routed.lease.decode
        return routed.kv_source, decode.address if decode is not None else "(released)"

    def _kv_answer_headers(
        self, headers: msg.HttpHeaders, stream: _Stream, choreography: Choreography
    ) -> Answers:
        """The decode's answer to a KV handoff starts (``handoff/kv_failure.py``): its 500 is a failed
        pull, answered ``502 kv_transfer_failed``; a streamed answer's first chunks are inspected (in
        BUFFERED mode, with ``handoff.watch_streamed_answers``, Envoy is asked to send that body chunk
        by chunk)."""
        status, content_type = msg.response_status(headers)
        if status == kv_failure.FAILED_STATUS:
            prefill, decode = self._kv_names(stream)
            message = self._router.kv_transfer_failed(prefill, decode, stream=False)
            return self._refuse(stream, self._router.refuse(kv_failure.STATUS, message, kv_failure.CODE))
        if status == 200 and content_type.startswith(kv_failure.EVENT_STREAM):
            if choreography.streams_response_body:
                stream.watch_stream = True  # the chunks come anyway
            elif self._router.handoff.watch_streams:
                stream.watch_stream = True
                return (self._stream_body,)
        return (self._passthrough["response_headers"],)

    def _kv_first_chunk(
        self, body: msg.HttpBody, stream: _Stream, choreography: Choreography
    ) -> msg.ProcessingResponse:
        """A chunk of a streamed answer to a KV handoff before it said anything (``kv_failure.watch_chunk``):
        an error event (the failed pull) is replaced by one naming the cause; anything else passes as
        it came, and text ends the watch."""
        prefill, decode = self._kv_names(stream)
        rewritten, stream.watch_stream = kv_failure.watch_chunk(body.body, decode, prefill)
        if rewritten is None:
            return choreography.response_body(body, self._passthrough["response_body"])
        message = self._router.kv_transfer_failed(prefill, decode, stream=True)
        log.warning("streamed %s instead of the decode's error: %s", kv_failure.CODE, message)
        if choreography.streams_response_body:
            return msg.streamed_chunk("response_body", rewritten, body.end_of_stream)
        return msg.replace_body(rewritten)

    def _request_body(self, body: msg.HttpBody, stream: _Stream) -> Answers | Handover:
        if not stream.saw_headers:
            return self._misconfigured(
                stream,
                "ext_proc request_header_mode must be SEND (with SKIP, Envoy picks the upstream "
                "before the body is answered, so no routing decision can take effect)",
            )
        collector = stream.body
        if collector is None:  # BUFFERED: the whole body in this one message
            if not body.end_of_stream:
                return self._misconfigured(stream, "ext_proc request_body_mode must be BUFFERED")
            return self._route_body(body.body, stream)
        if not collector.add(body.body):
            too_large = self._router.refuse(413, TOO_LARGE, "request_too_large")
            return self._refuse(stream, too_large)
        if not body.end_of_stream:
            return ()
        return self._route_body(collector.body(), stream)

    async def _complete(self, handover: Handover, stream: _Stream) -> Answers:
        """Complete ``stream.handover``; route with its outcome (until then its charges are the stream's)."""
        outcome = await handover.complete()
        stream.handover = None
        assert stream.build is not None
        return self._routed(outcome, stream.build, stream)

    async def Process(
        self, request_iterator: AsyncIterator[msg.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[msg.ProcessingResponse]:
        """Serve one HTTP request's ext_proc stream; see the module docstring for the phases."""
        stream = _Stream(self._router.admission)
        try:
            async for request in request_iterator:
                try:
                    answers = self._answer(request, stream)
                    if not isinstance(answers, tuple):
                        yield msg.extend_timeout(answers.timeout)
                        answers = await self._complete(answers, stream)
                except Exception:
                    log.exception("unexpected error while routing; answering 500")
                    refused = self._router.refuse(
                        500, "internal error in the routing server", "internal_error"
                    )
                    answers = self._refuse(stream, refused)
                for answer in answers:
                    yield answer
        finally:
            stream.close()


def _bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None, what: str) -> int:
    """Add the port ``listen`` to ``server`` (TLS with ``credentials``, else plaintext): its bound
    number. An address that cannot be bound raises ``OSError`` naming ``what`` it was for."""
    try:
        port = (
            server.add_insecure_port(listen)
            if credentials is None
            else server.add_secure_port(listen, credentials)
        )
    except RuntimeError:  # grpcio reports a failed bind as RuntimeError
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {listen} for {what} (address in use or not available)")
    return port


async def start_grpc(
    router: Router,
    listen: str,
    health: Health,
    ads: AdsServer | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the ext_proc service, ``health``'s servicer (started by the caller, :meth:`Health.start`)
    and ``ads`` if given, on ``listen`` (``host:port``, port 0 = any), over TLS with ``credentials``
    (else plaintext).

    Returns the server and the bound port. The port is never shared (SO_REUSEPORT off, which gRPC
    turns on by default): a second copy on the same port fails here instead of silently splitting
    Envoy's streams. Messages up to :data:`MAX_RECEIVE_BYTES` are received (any size is sent). An
    address that cannot be bound raises ``OSError``.
    """
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(router), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    if ads is not None:
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    port = _bind(server, listen, credentials, "gRPC")
    await server.start()
    return server, port


async def start_health_grpc(health: Health, listen: str) -> tuple[grpc.aio.Server, int]:
    """Serve only ``health``'s servicer, plaintext, on ``listen`` (``health_listen``; port 0 = any):
    the server and its bound port, never shared. An address that cannot be bound raises ``OSError``."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    port = _bind(server, listen, None, "gRPC health")
    await server.start()
    return server, port
