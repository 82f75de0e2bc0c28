"""The gRPC shell with a pending answer (the kv-transfer-params prefill leg): Envoy is asked to wait first,
and a stream that ends while the leg runs cancels it and leaves no charge behind."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import body, headers
from grpc_harness import load, start_with
from polling import until

from ext_proc.app import RunningServer
from standins.backends import ScriptedPrefill, start_scripted_prefill

Prefilled = tuple[RunningServer, ScriptedPrefill]


@contextlib.asynccontextmanager
async def hanging_prefill_server(tmp_path: Path, **settings: object) -> AsyncIterator[Prefilled]:
    """A kv-transfer-params server (more ``settings``: dotted keys) whose only prefill never answers
    (30 s), and one decode; yields the server and the scripted prefill."""
    prefill = await start_scripted_prefill(delay=30.0)
    kv_transfer = {"handoff.mode": "kv-transfer-params", **settings}
    server = await start_with(
        tmp_path, ["10.0.0.2:8000"], prefill_address=prefill.address, settings=kv_transfer
    )
    try:
        yield server, prefill
    finally:
        await server.stop(grace=0)
        await prefill.stop()


async def test_a_stream_cancelled_during_the_prefill_leg_releases_everything(tmp_path):
    timeout = {"handoff.prefill_timeout_seconds": 60.0}
    async with (
        hanging_prefill_server(tmp_path, **timeout) as (server, prefill),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel,
    ):
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers())
        await call.read()  # the headers answer
        await call.write(body())
        extend = await call.read()
        assert extend.WhichOneof("response") is None
        assert extend.override_message_timeout.seconds == 2 * 60 + 5  # leg, retry, margin
        await until(lambda: len(prefill.legs) == 1)
        assert sorted(load(server)) == [("decode", 20, 1), ("prefill", 10, 1)]  # prompt 10 + 10 tokens
        call.cancel()
        await until(lambda: prefill.cancelled == 1)
        await until(lambda: all(requests == 0 for _, _, requests in load(server)))
        assert all(tokens == 0 for _, tokens, _ in load(server))
