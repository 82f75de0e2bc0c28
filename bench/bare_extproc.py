"""The floor a Python ext_proc server cannot go below: grpc.aio answering every message unchanged.

Same phases as pd-extproc, no parsing, no decision: BUFFERED (Envoy sends request headers and the
buffered body), or FULL_DUPLEX_STREAMED when Envoy's first message says so (the least that mode
asks: the headers answer held until the body ends, the body sent back in one chunk, response chunks
echoed). The overhead benchmark renders its Envoy with the fail-open edit (the decode route does not
require a routing header), and the override_host policy falls back to least-request. The overhead benchmark
runs it side by side with pd-extproc to separate Python gRPC's own cost from ours.
Run: ``python -m bench.bare_extproc PORT``; prints the bound port.
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
ANSWERS = {}
for _kind in (
    "request_headers",
    "request_body",
    "response_headers",
    "response_body",
    "request_trailers",
    "response_trailers",
):
    ANSWERS[_kind] = pb.ProcessingResponse()
    getattr(ANSWERS[_kind], _kind).SetInParent()


def _chunk(kind: str, body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    streamed = getattr(response, kind).response.body_mutation.streamed_response
    streamed.body, streamed.end_of_stream = body, end_of_stream
    return response


class Passthrough(pb_grpc.ExternalProcessorServicer):
    """An ext_proc server answering every message unchanged: the floor of Python gRPC's own cost."""

    async def Process(self, request_iterator, context):
        """Answer one ext_proc stream's messages unchanged, in the phases the module docstring names."""
        full_duplex = None
        chunks: list[bytes] = []
        async for request in request_iterator:
            if full_duplex is None:
                full_duplex = request.protocol_config.request_body_mode == FULL_DUPLEX
            kind = request.WhichOneof("request")
            if not full_duplex:
                yield ANSWERS[kind]
            elif kind == "request_headers":
                if request.request_headers.end_of_stream:
                    yield ANSWERS[kind]
            elif kind == "request_body":
                chunks.append(request.request_body.body)
                if request.request_body.end_of_stream:
                    yield ANSWERS["request_headers"]
                    yield _chunk(kind, b"".join(chunks), True)
            elif kind == "response_body":
                yield _chunk(kind, request.response_body.body, request.response_body.end_of_stream)
            else:
                yield ANSWERS[kind]


async def _main(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Passthrough(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(bound, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
