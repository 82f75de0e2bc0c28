"""The gRPC shell: Envoy's ``ExternalProcessor.Process`` stream plus the gRPC health service of
:mod:`ext_proc.health` (and, when pd-extproc serves EDS, the ADS service of :mod:`ext_proc.xds`).

One HTTP request is one stream. The stream's messages are answered by phase:
- ``request_headers``: a request without a body is routed here; otherwise client-supplied
  routing headers are stripped, the path, ``x-request-id`` and ``authorization`` noted, and the
  body awaited.
- ``request_body`` (must be BUFFERED: the whole body in one message, after the headers): parse,
  decide, charge, answer with routing headers, ``envoy.lb`` metadata and, for the engine handoffs,
  a new body; or with an ``ImmediateResponse`` error. When the handoff first runs a prefill leg,
  the stream first asks Envoy to wait longer (``override_message_timeout``), then answers. An
  endpoint-subset hint in the metadata (endpoint-picker protocol) restricts the decode choice; no
  eligible endpoint in it → 503. A body without headers, or in chunks, means Envoy is misconfigured
  in a way that would silently bypass routing: answered 500 ``ext_proc_misconfigured``.
- ``response_headers``: the prefill has finished; its charge is released.
- anything else passes through unchanged.
Admission control: a request about to be routed (headers without a body, or the body) first takes an
in-flight slot (:meth:`Router.admit`); when all ``limits.max_inflight_requests`` are taken it is
answered 429 ``overloaded`` with ``retry-after``. A refused request gives its slot back at once.
Whatever ends the stream (completion, upstream error, client abort, cancellation, even in the
middle of a prefill leg, which is then cancelled), the request's charges and its in-flight slot are
released and its background prefill leg cancelled in a ``finally``. No exception escapes a stream:
an unexpected one becomes a logged 500 answer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from ext_proc import envoy_messages as msg
from ext_proc.config import ConfigError, TlsConfig
from ext_proc.handoff import Handover, Refused, RequestMeta, Routed, RoutingInstructions
from ext_proc.health import Health
from ext_proc.load import Admission
from ext_proc.router import Router
from ext_proc.xds import AdsServer

log = logging.getLogger(__name__)

ENVOY_BODY_LIMIT_BYTES = 16 * 1024 * 1024
"""The largest request body the shipped Envoy buffers, in bytes: the gateway listener's
``per_connection_buffer_limit_bytes`` in ``envoy/envoy.yaml`` (a test keeps the two equal). A larger
body is refused by Envoy itself (413) and never reaches pd-extproc."""
MAX_RECEIVE_BYTES = ENVOY_BODY_LIMIT_BYTES + 1024 * 1024
"""The ext_proc service's gRPC receive limit, in bytes: one ``request_body`` message carries the whole
buffered body plus its own overhead (protobuf framing, metadata context: tens of bytes to a few KiB;
the request headers come in their own message, at most Envoy's 60 KiB default). gRPC's default of
4 MiB would refuse a long-context body, and Envoy would answer the client an empty 500."""


def _refusal(refused: Refused) -> msg.ProcessingResponse:
    return msg.immediate_error(
        refused.status, refused.message, refused.code, refused.param, refused.body, refused.retry_after
    )


class _Stream:
    """Per-stream state: the routed request (charges, background prefill leg) or the handover in
    progress, whether it holds an in-flight slot of ``admission``, whether Envoy sent the request
    headers, what they said, and the data plane's endpoint-subset hint if any."""

    __slots__ = ("admission", "admitted", "handover", "meta", "routed", "saw_headers", "subset")

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.admitted = False
        self.routed: Routed | None = None
        self.handover: Handover | None = None
        self.saw_headers = False
        self.meta = RequestMeta()
        self.subset: frozenset[str] | None = None

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
        self._strip = msg.strip_on_headers(router.handoff.routing_headers)
        self._passthrough = {kind: msg.passthrough(kind) for kind in msg.PHASES}

    def _misconfigured(self, message: str) -> msg.ProcessingResponse:
        return _refusal(
            self._router.refuse(500, f"gateway misconfigured: {message}", "ext_proc_misconfigured")
        )

    def _routed(
        self,
        outcome: Routed | Refused,
        build: Callable[[RoutingInstructions], msg.ProcessingResponse],
        stream: _Stream,
    ) -> msg.ProcessingResponse:
        if isinstance(outcome, Refused):
            stream.release_slot()  # not routed: no longer in flight
            return _refusal(outcome)
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

    def _answer(self, request: msg.ProcessingRequest, stream: _Stream) -> msg.ProcessingResponse | Handover:
        kind = request.WhichOneof("request")
        if stream.subset is None and request.HasField("metadata_context"):
            stream.subset = msg.subset_hint(request)
        if kind == "request_headers":
            stream.saw_headers = True
            if not request.request_headers.end_of_stream:
                stream.meta = msg.request_meta(request.request_headers)
                return self._strip
            overloaded = self._admit(stream)
            outcome = self._router.route_bodiless(stream.subset) if overloaded is None else overloaded
            return self._routed(outcome, msg.route_on_headers, stream)
        if kind == "request_body":
            if not stream.saw_headers:
                return self._misconfigured(
                    "ext_proc request_header_mode must be SEND (with SKIP, Envoy picks the upstream "
                    "before the body is answered, so no routing decision can take effect)"
                )
            if not request.request_body.end_of_stream:
                return self._misconfigured("ext_proc request_body_mode must be BUFFERED")
            overloaded = self._admit(stream)
            if overloaded is not None:
                return _refusal(overloaded)
            outcome = self._router.route_body(request.request_body.body, stream.meta, stream.subset)
            if isinstance(outcome, Routed | Refused):
                return self._routed(outcome, msg.route_on_body, stream)
            return outcome
        if kind is None:
            return _refusal(self._router.refuse(500, "empty ext_proc message", "ext_proc_protocol_error"))
        if kind == "response_headers" and stream.routed is not None:
            stream.routed.lease.release_prefill()
        return self._passthrough[kind]

    async def _complete(self, handover: Handover, stream: _Stream) -> msg.ProcessingResponse:
        """Complete ``stream.handover``; route with its outcome (until then its charges are the stream's)."""
        outcome = await handover.complete()
        stream.handover = None
        return self._routed(outcome, msg.route_on_body, stream)

    async def Process(
        self, request_iterator: AsyncIterator[msg.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[msg.ProcessingResponse]:
        """Serve one HTTP request's ext_proc stream; see the module docstring for the phases."""
        stream = _Stream(self._router.admission)
        try:
            async for request in request_iterator:
                try:
                    answer = self._answer(request, stream)
                    if not isinstance(answer, msg.ProcessingResponse):
                        stream.handover = answer  # released by close() if the stream ends from here on
                        yield msg.extend_timeout(answer.timeout)
                        answer = await self._complete(answer, stream)
                except Exception:
                    log.exception("unexpected error while routing; answering 500")
                    answer = _refusal(
                        self._router.refuse(500, "internal error in the routing server", "internal_error")
                    )
                yield answer
        finally:
            stream.close()


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """The gRPC port's TLS credentials (``None``: plaintext); with ``client_ca_file``, clients must
    present a certificate it signed. Raises :class:`ConfigError` when a file cannot be read."""
    if not tls.cert_file:
        return None
    contents: dict[str, bytes | None] = {}
    for key in ("cert_file", "key_file", "client_ca_file"):
        path = getattr(tls, key)
        try:
            contents[key] = Path(path).read_bytes() if path else None
        except OSError as exc:
            raise ConfigError(f"tls.{key}: cannot read {path}: {exc}") from None
    ca = contents["client_ca_file"]
    return grpc.ssl_server_credentials(
        [(contents["key_file"], contents["cert_file"])],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def tls_mode(tls: TlsConfig) -> str:
    """How the gRPC port is served, for the start-up log line."""
    if not tls.cert_file:
        return "plaintext"
    return "mutual TLS" if tls.client_ca_file else "TLS"


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
