"""Admission control: ``limits.max_inflight_requests`` in the router and the gRPC shell.

A request takes an in-flight slot when it is routed; beyond the limit it is answered 429
``overloaded`` with ``retry-after``; the slot comes back when the request is refused or its stream
ends, whatever ends it (end of messages, cancellation, an exception while routing, a prefill leg
cancelled).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from builders import D_SAME_IDLE, P1, endpoint, make_router, refused, value
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import body, headers, response_headers
from polling import until
from test_server_handover import hanging_prefill_server

from ext_proc.load import Admission
from ext_proc.router import Router
from ext_proc.server import ExternalProcessor

INFLIGHT = "pd_extproc_inflight_requests"
REJECTED = "pd_extproc_rejected_total"


def limited(limit: int) -> Router:
    """A sidecar router over one prefill and one decode admitting ``limit`` requests (Retry-After 7 s)."""
    return make_router(
        [endpoint(P1, "g1")],
        [endpoint(D_SAME_IDLE, "g1")],
        max_inflight_requests=limit,
        retry_after_seconds=7,
    )


class Stream:
    """One ext_proc stream driven in-process: :meth:`send` a message and get the server's answer."""

    def __init__(self, processor: ExternalProcessor) -> None:
        self._inbox: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self._answers = processor.Process(self._requests(), None)  # type: ignore[arg-type]

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (request := await self._inbox.get()) is not None:
            yield request

    async def send(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        self._inbox.put_nowait(request)
        return await anext(self._answers)

    async def next_answer(self) -> pb.ProcessingResponse:
        """The server's next answer to what was already sent (after it asked Envoy to wait)."""
        return await anext(self._answers)

    async def end(self) -> None:
        """Envoy closes the stream: no more messages."""
        self._inbox.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await anext(self._answers)

    async def cancel(self) -> None:
        """gRPC cancels the stream (client gone): the generator is closed where it waits."""
        await self._answers.aclose()


async def routed_stream(processor: ExternalProcessor) -> Stream:
    stream = Stream(processor)
    await stream.send(headers())
    answer = await stream.send(body())
    assert answer.WhichOneof("response") == "request_body", answer
    return stream


def overloaded(answer: pb.ProcessingResponse) -> dict[str, object]:
    """The 429's JSON error, after checking its status and headers."""
    immediate = answer.immediate_response
    assert immediate.status.code == 429
    sent = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert sent == {"content-type": b"application/json", "retry-after": b"7"}
    assert immediate.details == "pd_extproc_overloaded"
    return json.loads(immediate.body)["error"]


def test_admission_counts_up_to_the_limit_and_zero_is_unlimited() -> None:
    admission = Admission(2, 1)
    assert [admission.admit() for _ in range(3)] == [True, True, False]
    assert admission.inflight == 2
    admission.release()
    assert admission.admit() and admission.inflight == 2
    unlimited = Admission(0, 1)
    assert all(unlimited.admit() for _ in range(10_000)) and unlimited.inflight == 10_000


def test_router_admit_beyond_the_limit_is_a_counted_429_with_retry_after() -> None:
    router = limited(1)
    assert router.admit() is None
    answer = refused(router.admit())
    assert (answer.status, answer.code, answer.retry_after) == (429, "overloaded", 7)
    assert "1 requests are in flight" in answer.message and "limits.max_inflight_requests" in answer.message
    assert router.admission.inflight == 1  # the refused request took nothing
    assert value(router, REJECTED, reason="overloaded") == 1
    assert value(router, INFLIGHT) == 1


async def test_requests_beyond_the_limit_get_429_until_a_stream_ends() -> None:
    router = limited(2)
    processor = ExternalProcessor(router)
    first, second = await routed_stream(processor), await routed_stream(processor)
    assert value(router, INFLIGHT) == 2
    third = Stream(processor)
    await third.send(headers())  # the headers are not a routing decision: no slot yet
    error = overloaded(await third.send(body()))
    assert error == {
        "message": error["message"],
        "type": "rate_limit_error",
        "param": None,
        "code": "overloaded",
    }
    await third.end()
    answer = await first.send(response_headers())  # the response phase does not change the count
    assert answer.WhichOneof("response") == "response_headers"
    assert value(router, INFLIGHT) == 2
    await first.end()
    assert value(router, INFLIGHT) == 1
    fourth = await routed_stream(processor)  # the freed slot admits the next request
    await second.cancel()
    await fourth.cancel()
    assert value(router, INFLIGHT) == 0
    assert value(router, REJECTED, reason="overloaded") == 1
    assert all(s.active_requests == 0 for s in router.registry.endpoints())


async def test_a_bodiless_request_takes_a_slot_and_is_refused_beyond_the_limit() -> None:
    router = limited(1)
    processor = ExternalProcessor(router)
    first = Stream(processor)
    assert (await first.send(headers(end_of_stream=True))).WhichOneof("response") == "request_headers"
    second = Stream(processor)
    overloaded(await second.send(headers(end_of_stream=True)))
    await first.end()
    await second.end()
    assert router.admission.inflight == 0


async def test_a_refused_request_gives_its_slot_back_at_once() -> None:
    router = limited(1)
    processor = ExternalProcessor(router)
    bad = Stream(processor)
    await bad.send(headers())
    answer = await bad.send(body(b"{not json"))
    assert answer.immediate_response.status.code == 400
    assert router.admission.inflight == 0  # while its stream is still open
    await routed_stream(processor)  # so the one slot admits the next request
    await bad.end()
    assert router.admission.inflight == 1


async def test_an_exception_while_routing_keeps_no_slot_once_the_stream_ends(monkeypatch) -> None:
    router = limited(1)
    processor = ExternalProcessor(router)

    def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(router, "route", broken)
    stream = Stream(processor)
    await stream.send(headers())
    assert (await stream.send(body())).immediate_response.status.code == 500
    await stream.end()
    assert router.admission.inflight == 0


async def test_zero_is_unlimited() -> None:
    router = limited(0)
    processor = ExternalProcessor(router)
    streams = [await routed_stream(processor) for _ in range(200)]
    assert router.admission.inflight == 200
    assert value(router, REJECTED, reason="overloaded") is None
    for stream in streams:
        await stream.end()
    assert router.admission.inflight == 0


async def test_a_stream_cancelled_during_the_prefill_leg_gives_its_slot_back(tmp_path) -> None:
    """kv-transfer-params, over real gRPC: the slot is held while the prefill leg runs (a second
    request is refused), and the cancelled stream gives it back."""
    limits = {"limits.max_inflight_requests": 1, "limits.retry_after_seconds": 7}
    async with (
        hanging_prefill_server(tmp_path, **limits) as (server, prefill),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel,
    ):
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await call.write(headers())
        await call.read()
        await call.write(body())
        assert (await call.read()).HasField("override_message_timeout")  # the leg runs
        other = stub.Process()
        await other.write(headers())
        await other.read()
        await other.write(body())
        overloaded(await other.read())
        await other.done_writing()
        assert server.router.admission.inflight == 1
        call.cancel()
        await until(lambda: server.router.admission.inflight == 0)
        await until(lambda: prefill.cancelled == 1)
