"""The gRPC shell: Envoy's ``ExternalProcessor.Process`` stream plus the gRPC health service.

One HTTP request is one stream. The stream's messages are answered by phase:
- ``request_headers``: a request without a body is routed here; otherwise client-supplied
  routing headers are stripped and the body awaited.
- ``request_body`` (must be BUFFERED: the whole body in one message): parse, decide, charge,
  answer with routing headers and ``envoy.lb`` metadata, or with an ``ImmediateResponse`` error.
- ``response_headers``: the prefill has finished; its charge is released.
- anything else passes through unchanged.
Whatever ends the stream (completion, upstream error, client abort, cancellation), the
request's charges are released in a ``finally``. No exception escapes a stream: an unexpected
one becomes a logged 500 answer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ext_proc import envoy_messages as msg
from ext_proc.load import Lease
from ext_proc.router import Refused, Router

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"


def _refusal(refused: Refused) -> msg.ProcessingResponse:
    return msg.immediate_error(refused.status, refused.message, refused.code, refused.param)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """Answers Envoy's ext_proc streams with decisions from a :class:`Router`."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._strip = msg.strip_on_headers(router.handoff.routing_headers)
        self._passthrough = {kind: msg.passthrough(kind) for kind in msg.PHASES}

    def _answer(
        self, request: msg.ProcessingRequest, kind: str | None, lease: Lease | None
    ) -> tuple[msg.ProcessingResponse, Lease | None]:
        router = self._router
        if kind == "request_body":
            body = request.request_body
            if not body.end_of_stream:
                return _refusal(
                    router.refuse(
                        500,
                        "gateway misconfigured: ext_proc request_body_mode must be BUFFERED",
                        "ext_proc_misconfigured",
                    )
                ), lease
            outcome = router.route_body(body.body)
        elif kind == "request_headers":
            if not request.request_headers.end_of_stream:
                return self._strip, lease
            outcome = router.route_bodiless()
            if not isinstance(outcome, Refused):
                return msg.route_on_headers(outcome.instructions), outcome.lease
        elif kind == "response_headers":
            if lease is not None:
                lease.release_prefill()
            return self._passthrough[kind], lease
        elif kind is None:
            return _refusal(router.refuse(500, "empty ext_proc message", "ext_proc_protocol_error")), lease
        else:
            return self._passthrough[kind], lease
        if isinstance(outcome, Refused):
            return _refusal(outcome), lease
        return msg.route_on_body(outcome.instructions), outcome.lease

    async def Process(
        self, request_iterator: AsyncIterator[msg.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[msg.ProcessingResponse]:
        """Serve one HTTP request's ext_proc stream; see the module docstring for the phases."""
        lease: Lease | None = None
        try:
            async for request in request_iterator:
                try:
                    response, new_lease = self._answer(request, request.WhichOneof("request"), lease)
                except Exception:
                    log.exception("unexpected error while routing; answering 500")
                    response = _refusal(
                        self._router.refuse(500, "internal error in the routing server", "internal_error")
                    )
                    new_lease = lease
                if new_lease is not lease and lease is not None:
                    lease.release()
                lease = new_lease
                yield response
        finally:
            if lease is not None:
                lease.release()


class Health:
    """gRPC health as the endpoint-picker protocol defines it.

    ``liveness`` and ``""`` serve while the process runs; ``readiness`` and the ext_proc service
    serve once endpoints have been loaded (:meth:`set_ready`).
    """

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.ready = False

    async def start(self, ready: bool) -> None:
        for service in ("", LIVENESS):
            await self.servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(ready)

    async def set_ready(self, ready: bool) -> None:
        self.ready = ready
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in (READINESS, SERVICE_NAME):
            await self.servicer.set(service, status)


async def start_grpc(router: Router, listen: str, ready: bool) -> tuple[grpc.aio.Server, int, Health]:
    """Start the ext_proc and health services on ``listen`` (``host:port``, port 0 = any).

    Returns the server, the bound port and its :class:`Health`.
    """
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(router), server)
    server_health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(server_health.servicer, server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen} for gRPC")
    await server.start()
    await server_health.start(ready)
    return server, port, server_health
