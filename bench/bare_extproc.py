"""The floor a Python ext_proc server cannot go below: grpc.aio answering every message unchanged.

Same phases as pd-extproc (Envoy sends request headers and the buffered body), no parsing, no
decision: the overhead benchmark renders its Envoy with the fail-open edit (the decode route does not
require a routing header), and the override_host policy falls back to least-request. The overhead benchmark
runs it side by side with pd-extproc to separate Python gRPC's own cost from ours.
Run: ``python bench/bare_extproc.py PORT``; prints the bound port.
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

ANSWERS = {}
for _kind in ("request_headers", "request_body", "response_headers", "response_body"):
    ANSWERS[_kind] = pb.ProcessingResponse()
    getattr(ANSWERS[_kind], _kind).SetInParent()


class Passthrough(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator, context):
        async for request in request_iterator:
            yield ANSWERS[request.WhichOneof("request")]


async def _main(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Passthrough(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(bound, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
