"""The gRPC shell: Envoy's ``ExternalProcessor.Process`` stream plus the health and ADS services.

The health service is :mod:`ext_proc.health`'s; the ADS service of :mod:`ext_proc.xds` runs when
pd-extproc serves EDS.

One HTTP request is one stream, whose state machine is :class:`~ext_proc.stream.Stream` (the phases,
the body modes and admission are described there). This shell only dispatches: it feeds Envoy's
messages to the stream and sends its answers; when flow control queues the request, it asks Envoy to
wait longer (``override_message_timeout``, once per message: long enough for the queue and a prefill
leg after it), awaits its turn and hands it back; when the prompt is to be tokenized first or the request
waits for its decision slot, it awaits that and hands the tokens back; when the answer is pending (a
prefill leg first), it first asks Envoy to wait longer unless it already did, then awaits it. Whatever
ends the stream (completion, upstream error, client abort, cancellation, even in the middle of a prefill leg,
which is then cancelled), the stream is closed in a ``finally``: its charges and its in-flight slot
are released and its background prefill leg cancelled. No exception escapes a stream: an unexpected
one becomes a logged 500 answer. The rest: TLS credentials, binding, and starting the servers.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from ext_proc import envoy_messages as msg
from ext_proc.checks import ConfigError
from ext_proc.choreography import BODY_LIMIT_BYTES
from ext_proc.flow.control import FlowControl
from ext_proc.health import Health
from ext_proc.refusal import refuse
from ext_proc.router import Router
from ext_proc.stream import PendingFlow, PendingRoute, Streams
from ext_proc.tls import TlsConfig
from ext_proc.tracing import Tracing
from ext_proc.xds.ads import AdsServer

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


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """Answers Envoy's ext_proc streams with decisions from a :class:`Router` (and ``flow``, if on).

    ``tracing``: each request's span (``None``: off); ``flow_timeout``: the wait Envoy is asked for while
    flow control queues a request."""

    def __init__(
        self,
        router: Router,
        tracing: Tracing | None = None,
        flow: FlowControl | None = None,
        flow_timeout: float = 0.0,
    ) -> None:
        self._streams = Streams(router, tracing, flow, flow_timeout)

    async def Process(
        self, request_iterator: AsyncIterator[msg.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[msg.ProcessingResponse]:
        """Serve one HTTP request's ext_proc stream (:mod:`ext_proc.stream` for the phases)."""
        stream = self._streams.open()
        try:
            async for request in request_iterator:
                try:
                    answers = stream.answer(request)
                    extended = isinstance(answers, PendingFlow)
                    if isinstance(answers, PendingFlow):
                        yield msg.extend_timeout(answers.timeout)
                        pending = answers
                        answers = stream.dispatched(pending.request, await pending.wait(), pending.waited())
                    if isinstance(answers, PendingRoute):
                        answers = stream.prepared(answers.request, await answers.ready())
                    if not isinstance(answers, tuple):
                        if not extended:
                            yield msg.extend_timeout(answers.timeout)
                        answers = stream.completed(await answers.complete())
                except Exception:
                    log.exception("unexpected error while routing; answering 500")
                    message = "internal error in the routing server"
                    answers = stream.end(refuse(self._streams.metrics, 500, message, "internal_error"))
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
    tracing: Tracing | None = None,
    flow: tuple[FlowControl, float] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the ext_proc gRPC server on ``listen``: returns the server and the bound port.

    It serves the ext_proc service (with flow control and its wait, ``flow``, when on), ``health``'s
    servicer (started by the caller, :meth:`Health.start`) and ``ads`` if given, on ``listen``
    (``host:port``, port 0 = any), over TLS with ``credentials`` (else plaintext); with ``tracing``, one
    span per request.

    The port is never shared (SO_REUSEPORT off, which gRPC turns on by default): a second copy on
    the same port fails here instead of silently splitting Envoy's streams. Messages up to
    :data:`MAX_RECEIVE_BYTES` are received (any size is sent). An address that cannot be bound
    raises ``OSError``.
    """
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
    )
    flow_control, flow_timeout = (None, 0.0) if flow is None else flow
    processor = ExternalProcessor(router, tracing, flow_control, flow_timeout)
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    if ads is not None:
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    port = _bind(server, listen, credentials, "gRPC")
    await server.start()
    return server, port


async def start_health_grpc(health: Health, listen: str) -> tuple[grpc.aio.Server, int]:
    """Serve only ``health``'s servicer, plaintext, on ``listen``: the server and its bound port.

    ``listen`` is ``health_listen`` (port 0 = any); the port is never shared. An address that cannot
    be bound raises ``OSError``."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    port = _bind(server, listen, None, "gRPC health")
    await server.start()
    return server, port


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """The gRPC port's TLS credentials (``None``: plaintext).

    With ``client_ca_file``, clients must present a certificate it signed. Raises
    :class:`ConfigError` when a file cannot be read."""
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
