"""A loopback OpenTelemetry collector: the OTLP gRPC ``TraceService`` that tests and benchmarks export to.

:class:`OtlpReceiver` serves ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on a
loopback port and keeps every span it receives (:class:`ReceivedSpan`: ids as hex, attributes as
Python values, the exporting resource's ``service.name``). ``python -m standins.otlp --port N`` runs one
until stopped, printing the spans received each second (the benchmarks' collector, in a process of its
own so its work is not the measured process's).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector received it.

    ``trace_id`` (32 hex digits), ``span_id`` and ``parent_span_id`` (16, ``""`` for a root); ``kind``
    the OTLP enum's number (2: SERVER); ``status_code`` 0 unset, 1 ok, 2 error."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, object]
    status_code: int
    start_ns: int
    end_ns: int


def _value(value: AnyValue) -> object:
    """An attribute's value as Python: str, bool, int, float, or a list of them."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


def decode(request: pb.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of one export request."""
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service,
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        span.kind,
                        {a.key: _value(a.value) for a in span.attributes},
                        span.status.code,
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                    )
                )
    return spans


@dataclass
class OtlpReceiver(pb_grpc.TraceServiceServicer):
    """The collector's trace service on ``127.0.0.1:port`` (:meth:`start`); ``spans`` as received."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    port: int = 0
    _server: grpc.aio.Server | None = None

    @property
    def endpoint(self) -> str:
        """Its address as ``tracing.otlp_endpoint`` names it."""
        return f"http://127.0.0.1:{self.port}"

    async def Export(
        self, request: pb.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExportTraceServiceResponse:
        """Keep the request's spans; accept them all."""
        self.spans.extend(decode(request))
        return pb.ExportTraceServiceResponse()

    async def start(self, port: int = 0) -> OtlpReceiver:
        """Listen on loopback ``port`` (0: any free one, then :attr:`port` holds it)."""
        server = grpc.aio.server()
        pb_grpc.add_TraceServiceServicer_to_server(self, server)
        self.port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        self._server = server
        return self

    async def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            await self._server.stop(None)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans of the trace ``trace_id`` received so far."""
        return [s for s in self.spans if s.trace_id == trace_id]


async def _serve(port: int) -> None:
    receiver = await OtlpReceiver().start(port)
    print(f"OTLP trace receiver on {receiver.endpoint}", flush=True)
    try:
        while True:
            await asyncio.sleep(1.0)
            print(f"spans received: {len(receiver.spans)}", flush=True)
    finally:
        await receiver.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m standins.otlp --port N``: serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.port))


if __name__ == "__main__":
    main()
