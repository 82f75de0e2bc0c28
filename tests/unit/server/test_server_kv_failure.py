"""A decode's failed KV pull, seen by the ext_proc servicer without Envoy: after a routed KV handoff
(kv-transfer-params, a scripted prefill), the decode's ``:status 500`` is judged by its body (asked
for in BUFFERED): vLLM's generic error is answered ``502 kv_transfer_failed`` naming both engines, its
dead engine core ``503 decode_engine_dead`` naming the decode, in FULL_DUPLEX_STREAMED as in BUFFERED;
any other answer passes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import BodySendMode, body, headers, response_body, response_headers, with_modes
from grpc_harness import load, start_with

from ext_proc.app import RunningServer
from standins.backends import VLLM_ENGINE_DEAD, VLLM_GENERATION_ERROR, start_scripted_prefill

DECODE = "10.0.0.2:8000"
LEG_ANSWER = json.dumps(
    {"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": True}}
).encode()


@contextlib.asynccontextmanager
async def kv_handoff_stream(
    tmp_path: Path, full_duplex: bool
) -> AsyncIterator[tuple[object, RunningServer, str]]:
    """A kv-transfer-params server whose prefill answers with ``kv_transfer_params``, and one of its
    ext_proc streams with a request routed to the decode ``DECODE`` (every answer up to the routed body
    read); yields the stream, the server and the prefill's address."""
    prefill = await start_scripted_prefill(body=LEG_ANSWER)
    settings = {"handoff.mode": "kv-transfer-params", "handoff.eject_failed_prefill_seconds": 60.0}
    server = await start_with(tmp_path, [DECODE], prefill_address=prefill.address, settings=settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(with_modes(headers()) if full_duplex else headers())
            await call.write(body())
            answer = await call.read()
            while not answer.HasField("request_body"):  # the routed body ends what the request gets
                answer = await call.read()
            assert len(prefill.legs) == 1
            yield call, server, prefill.address
    finally:
        await server.stop(grace=0)
        await prefill.stop()


async def answer_500(call: object, error: object, full_duplex: bool) -> object:
    """Send a decode's 500 carrying ``error`` (BUFFERED: once pd-extproc asked for its body); its answer."""
    await call.write(response_headers(500))
    if not full_duplex:
        asked = await call.read()
        assert asked.mode_override.response_body_mode == BodySendMode.BUFFERED, asked
    await call.write(response_body(json.dumps(error).encode(), end_of_stream=True))
    return await call.read()


@pytest.mark.parametrize("full_duplex", [True, False], ids=["full-duplex-streamed", "buffered"])
async def test_a_decodes_500_after_a_kv_handoff_is_answered_502_kv_transfer_failed(tmp_path, full_duplex):
    async with kv_handoff_stream(tmp_path, full_duplex) as (call, server, prefill):
        answer = await answer_500(call, VLLM_GENERATION_ERROR, full_duplex)
        assert answer.HasField("immediate_response"), answer
        immediate = answer.immediate_response
        assert immediate.status.code == 502
        assert immediate.details == "pd_extproc_kv_transfer_failed"
        error = json.loads(immediate.body)["error"]
        assert (error["code"], error["type"]) == ("kv_transfer_failed", "bad_gateway")
        assert (
            f"the decode engine {DECODE} could not load the KV cache the prefill engine {prefill}"
            in (error["message"])
        )
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert load(server) == [("prefill", 0, 0), ("decode", 0, 0)]
        assert prefill in server.router.ejections.ejected()


@pytest.mark.parametrize("full_duplex", [True, False], ids=["full-duplex-streamed", "buffered"])
async def test_a_dead_decode_after_a_kv_handoff_is_answered_503_decode_engine_dead(tmp_path, full_duplex):
    async with kv_handoff_stream(tmp_path, full_duplex) as (call, server, prefill):
        answer = await answer_500(call, VLLM_ENGINE_DEAD, full_duplex)
        immediate = answer.immediate_response
        assert (immediate.status.code, immediate.details) == (503, "pd_extproc_decode_engine_dead")
        error = json.loads(immediate.body)["error"]
        assert (error["code"], error["type"]) == ("decode_engine_dead", "service_unavailable")
        assert f"the decode engine {DECODE} failed: its engine core is dead" in error["message"]
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert load(server) == [("prefill", 0, 0), ("decode", 0, 0)]
        assert prefill not in server.router.ejections.ejected()
        assert DECODE in server.router.decode_ejections.ejected()


@pytest.mark.parametrize("full_duplex", [True, False], ids=["full-duplex-streamed", "buffered"])
@pytest.mark.parametrize("status", [200, 503])
async def test_any_other_decode_answer_to_a_kv_handoff_passes(tmp_path, full_duplex, status):
    async with kv_handoff_stream(tmp_path, full_duplex) as (call, server, prefill):
        await call.write(response_headers(status))
        answer = await call.read()
        assert answer.HasField("response_headers"), answer
        assert prefill not in server.router.ejections.ejected()
