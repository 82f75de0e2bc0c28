"""A request flow control queued: its span records the seconds it waited (``pd_extproc.queue_wait_s``).

A request without a body queues as one with a body does; the model list the gateway answers needs no slot.

Driven through the gRPC shell in process (:class:`ExternalProcessor` with tracing and flow control), the
spans kept by the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio

from builders import D_SAME_IDLE, P1, endpoint, make_router, value
from extproc_messages import body, headers
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_admission import Stream, limited, routed_stream

from ext_proc.flow.config import FlowControlConfig
from ext_proc.flow.control import FlowControl
from ext_proc.server import ExternalProcessor
from ext_proc.tracing import Tracing
from ext_proc.tracing_config import TracingConfig

QUEUE_WAIT = "pd_extproc.queue_wait_s"


class Clock:
    """Flow control's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_queued_requests_span_records_its_wait_and_a_direct_one_records_none() -> None:
    router = limited(1)
    clock = Clock()
    flow = FlowControl(FlowControlConfig(enabled=True), router.admission, router.metrics, 7, clock=clock)
    spans = InMemorySpanExporter()
    tracing = Tracing(TracingConfig("http://127.0.0.1:4317", 1.0), spans)
    processor = ExternalProcessor(router, tracing, flow, 30.0)

    first = await routed_stream(processor)  # takes the only slot at once
    second = Stream(processor)
    await second.send(headers())
    extension = await second.send(body())  # Envoy is first asked to wait: the request is queued
    assert extension.HasField("override_message_timeout"), extension
    routed = asyncio.create_task(second.next_answer())
    clock.now += 2.5
    await first.end()  # its slot goes to the queued request
    assert (await routed).WhichOneof("response") == "request_body"
    await second.end()
    tracing.shutdown()

    waits = sorted(span.attributes.get(QUEUE_WAIT, -1.0) for span in spans.get_finished_spans())
    assert waits == [-1.0, 2.5]
    assert value(router, "pd_extproc_inflight_requests") == 0


async def test_a_bodiless_request_queues_for_a_slot_and_a_gateway_answered_list_needs_none() -> None:
    router = limited(1)
    flow = FlowControl(FlowControlConfig(enabled=True), router.admission, router.metrics, 7)
    processor = ExternalProcessor(router, None, flow, 30.0)
    first = await routed_stream(processor)  # takes the only slot
    shed = Stream(processor)
    refused = await shed.send(headers(end_of_stream=True, extra={"x-gateway-inference-objective": b"batch"}))
    assert refused.immediate_response.status.code == 429  # sheddable: no queue, with or without a body
    bodiless = Stream(processor)
    extension = await bodiless.send(headers(end_of_stream=True, path="/v1/other"))  # queued: Envoy waits
    assert extension.HasField("override_message_timeout"), extension
    routed = asyncio.create_task(bodiless.next_answer())
    await asyncio.sleep(0)
    assert not routed.done()
    await first.end()  # its slot goes to the queued request, routed as before
    assert (await routed).WhichOneof("response") == "request_headers"
    assert router.admission.inflight == 1
    await bodiless.end()
    await shed.end()
    assert router.admission.inflight == 0
    assert value(router, "pd_extproc_flow_requests_total", priority="0", outcome="dispatched") == 2


async def test_get_models_the_gateway_answers_takes_no_slot() -> None:
    router = make_router(
        [endpoint(P1, "g1", models=("m",))],
        [endpoint(D_SAME_IDLE, "g1", models=("m",))],
        max_inflight_requests=1,
    )
    flow = FlowControl(FlowControlConfig(enabled=True), router.admission, router.metrics, 7)
    processor = ExternalProcessor(router, None, flow, 30.0)
    first = await routed_stream(processor)  # the only slot taken
    listing = Stream(processor)
    answer = await listing.send(headers(end_of_stream=True, path="/v1/models"))
    assert answer.immediate_response.status.code == 200  # at once, though the pool is saturated
    assert router.admission.inflight == 1
    await listing.end()
    await first.end()
