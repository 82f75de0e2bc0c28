"""The FULL_DUPLEX_STREAMED choreography at the gRPC level: a real grpc.aio server and a real gRPC
client sending exactly what Envoy sends in that mode (the first message states the modes), so the
odd cases (trailers, chunk sizes, limits, refused modes) are reachable without Envoy."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import (
    BODY,
    BodySendMode,
    body,
    destination,
    headers,
    response_body,
    response_headers,
    trailers,
    with_modes,
)
from grpc_harness import error_code, load, start_with

from ext_proc.choreography import BODY_LIMIT_BYTES, STREAMED_CHUNK_BYTES
from ext_proc.envoy_messages import LB_NAMESPACE, SERVED_KEY


async def read_nothing(call, seconds: float = 0.2) -> asyncio.Future:
    """Nothing is answered within ``seconds`` (the server holds its answer); returns the pending
    read, which yields the next answer."""
    pending = asyncio.ensure_future(call.read())
    done, _ = await asyncio.wait({pending}, timeout=seconds)
    assert not done, pending.result()
    return pending


def streamed(answer, kind: str = "request_body"):
    return getattr(answer, kind).response.body_mutation.streamed_response


async def test_headers_are_held_until_the_body_ends_then_routed_with_the_body_streamed(server, stub):
    call = stub[0].Process()
    await call.write(with_modes(headers()))
    await call.write(body(BODY[:20], end_of_stream=False))
    pending = await read_nothing(call)
    await call.write(body(BODY[20:], end_of_stream=False))
    await call.write(body(b"", end_of_stream=True))  # Envoy ends a body with an empty chunk
    routed = await pending
    common = routed.request_headers.response
    assert common.clear_route_cache
    assert destination(routed) == "10.0.0.2:8000"
    set_headers = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert set_headers["content-length"] == str(len(BODY)).encode()
    assert set_headers["x-gateway-destination-endpoint"] == b"10.0.0.2:8000"
    assert set_headers["x-prefiller-host-port"] == b"10.0.0.1:8000"
    chunk = streamed(await call.read())
    assert (chunk.body, chunk.end_of_stream) == (BODY, True)
    assert load(server) == [("prefill", 10, 1), ("decode", 20, 1)]
    await call.write(response_headers())
    assert (await call.read()).HasField("response_headers")
    for piece, last in ((b"data: 1\n\n", False), (b"data: [DONE]\n\n", True)):
        await call.write(response_body(piece, last))
        echo = streamed(await call.read(), "response_body")
        assert (echo.body, echo.end_of_stream) == (piece, last)
    await call.write(trailers("response_trailers"))
    assert (await call.read()).HasField("response_trailers")
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert load(server) == [("prefill", 0, 0), ("decode", 0, 0)]


async def test_a_long_body_goes_back_in_chunks_of_at_most_62000_bytes(server, stub):
    raw = json.dumps({"model": "m", "prompt": "x" * 150_000}).encode()
    call = stub[0].Process()
    await call.write(with_modes(headers()))
    for start in range(0, len(raw), 16_384):  # Envoy's chunks are its read buffer's, not ours
        await call.write(body(raw[start : start + 16_384], end_of_stream=start + 16_384 >= len(raw)))
    assert (await call.read()).HasField("request_headers")
    chunks = [streamed(await call.read()) for _ in range(-(-len(raw) // STREAMED_CHUNK_BYTES))]
    assert b"".join(c.body for c in chunks) == raw
    assert [len(c.body) for c in chunks[:-1]] == [STREAMED_CHUNK_BYTES] * (len(chunks) - 1)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    await call.done_writing()


async def test_request_trailers_end_the_body(server, stub):
    call = stub[0].Process()
    await call.write(with_modes(headers()))
    await call.write(body(BODY, end_of_stream=False))
    await call.write(trailers())
    assert (await call.read()).HasField("request_headers")
    chunk = streamed(await call.read())
    assert (chunk.body, chunk.end_of_stream) == (BODY, False)
    assert (await call.read()).HasField("request_trailers")
    await call.done_writing()


async def test_a_bodiless_request_is_routed_at_its_headers(server, stub):
    call = stub[0].Process()
    request = with_modes(headers(end_of_stream=True))
    request.request_headers.headers.headers[0].raw_value = b"/v1/models"
    await call.write(request)
    routed = await call.read()
    assert routed.request_headers.response.clear_route_cache
    assert destination(routed) == "10.0.0.2:8000"
    assert load(server) == [("prefill", 0, 0), ("decode", 0, 1)]
    await call.write(response_headers())
    await call.read()
    await call.write(response_body(b'{"data": []}', True))
    assert streamed(await call.read(), "response_body").body == b'{"data": []}'
    await call.done_writing()


async def test_a_malformed_body_is_a_json_400_and_charges_nothing(server, stub):
    call = stub[0].Process()
    await call.write(with_modes(headers()))
    await call.write(body(b'{"model": ', end_of_stream=True))
    answer = await call.read()
    assert answer.immediate_response.status.code == 400 and error_code(answer) == "invalid_request"
    await call.done_writing()
    assert load(server) == [("prefill", 0, 0), ("decode", 0, 0)]
    assert server.router.admission.inflight == 0


async def test_a_body_over_the_limit_is_a_413_and_later_chunks_get_no_answer(server, stub):
    call = stub[0].Process()
    await call.write(with_modes(headers()))
    await call.write(body(b"x" * (BODY_LIMIT_BYTES // 2), end_of_stream=False))
    pending = await read_nothing(call)
    await call.write(body(b"x" * (BODY_LIMIT_BYTES // 2 + 1), end_of_stream=False))
    answer = await pending
    assert answer.immediate_response.status.code == 413 and error_code(answer) == "request_too_large"
    await call.write(body(b"x", end_of_stream=True))
    pending = await read_nothing(call)
    await call.done_writing()
    assert await pending == grpc.aio.EOF
    assert load(server) == [("prefill", 0, 0), ("decode", 0, 0)]


@pytest.mark.parametrize("mode", ["STREAMED", "BUFFERED_PARTIAL", "NONE"])
async def test_a_request_body_mode_that_cannot_route_is_a_clear_500(server, stub, mode):
    call = stub[0].Process()
    await call.write(with_modes(headers(), request_body=BodySendMode.Value(mode)))
    answer = await call.read()
    assert answer.immediate_response.status.code == 500 and error_code(answer) == "ext_proc_misconfigured"
    message = json.loads(answer.immediate_response.body)["error"]["message"]
    assert mode in message and "FULL_DUPLEX_STREAMED" in message
    await call.done_writing()


async def test_buffered_requests_with_streamed_responses_echo_the_response_chunks(server, stub):
    call = stub[0].Process()
    await call.write(with_modes(headers(), request_body=BodySendMode.BUFFERED))
    assert (await call.read()).request_headers.response.header_mutation.remove_headers
    await call.write(body())
    assert (await call.read()).request_body.response.header_mutation.set_headers
    await call.write(response_body(b"data: 1\n\n", False))
    assert streamed(await call.read(), "response_body").body == b"data: 1\n\n"
    await call.done_writing()


async def test_the_reported_serving_decode_takes_over_the_charge(tmp_path):
    running = await start_with(tmp_path, ["10.0.0.2:8000", "10.0.0.3:8000"])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(with_modes(headers()))
            await call.write(body())
            chosen, fallback = destination(await call.read()).split(",")
            await call.read()
            served = response_headers()
            served.metadata_context.filter_metadata[LB_NAMESPACE].fields[SERVED_KEY].string_value = fallback
            await call.write(served)
            await call.read()
            charged = {s.address: s.active_tokens for s in running.router.registry.decodes}
            assert charged == {chosen: 0, fallback: 20}
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
            assert all(s.active_tokens == 0 for s in running.router.registry.endpoints())
    finally:
        await running.stop(grace=0)
