"""The gRPC shell on its own: a real grpc.aio server on an ephemeral loopback port, driven by a
real gRPC client sending the messages Envoy would (no Envoy needed to reach the odd cases)."""

from __future__ import annotations

import json

import grpc
import pytest
from builders import endpoint
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import body, headers, response_headers
from grpc_harness import error_code, load, start_with
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import until

from ext_proc.app import start_server
from ext_proc.config import load_config
from ext_proc.discovery.eds import write_eds_file
from ext_proc.handoff.base import STEERING_HEADERS
from ext_proc.server import ENVOY_BODY_LIMIT_BYTES, MAX_RECEIVE_BYTES


async def test_headers_then_body_routes_and_charges_until_the_stream_ends(server, stub):
    call = stub[0].Process()
    await call.write(headers())
    first = await call.read()
    assert list(first.request_headers.response.header_mutation.remove_headers) == [
        "x-gateway-destination-endpoint",
        "x-prefiller-host-port",
        "x-gateway-kv-handoff",
        *STEERING_HEADERS,
    ]
    await call.write(body())
    routed = await call.read()
    lb = routed.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.2:8000"
    assert load(server) == [("prefill", 10, 1), ("decode", 20, 1)]
    await call.write(response_headers())
    await call.read()
    assert load(server) == [("prefill", 0, 0), ("decode", 20, 1)]  # prefill done, decode still running
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert load(server) == [("prefill", 0, 0), ("decode", 0, 0)]


async def test_a_cancelled_stream_releases_its_load(server, stub):
    call = stub[0].Process()
    await call.write(headers())
    await call.read()
    await call.write(body())
    await call.read()
    assert load(server)[1] == ("decode", 20, 1)
    call.cancel()
    await until(lambda: load(server)[1] == ("decode", 0, 0))


@pytest.mark.parametrize(
    ("messages", "phrase"),
    [([body()], "request_header_mode must be SEND"), ([headers(), body(end_of_stream=False)], "BUFFERED")],
    ids=["body-without-headers", "chunked-body"],
)
async def test_envoy_misconfiguration_is_a_clear_500(server, stub, messages, phrase):
    call = stub[0].Process()
    for message in messages:
        await call.write(message)
        answer = await call.read()
    assert answer.immediate_response.status.code == 500
    assert error_code(answer) == "ext_proc_misconfigured"
    assert phrase in json.loads(answer.immediate_response.body)["error"]["message"]
    await call.done_writing()
    assert load(server) == [("prefill", 0, 0), ("decode", 0, 0)]


async def test_an_unexpected_error_is_a_logged_500_and_the_server_keeps_serving(
    server, stub, monkeypatch, caplog
):
    def explode(*args: object):
        raise KeyError("boom")

    monkeypatch.setattr(server.router, "route", explode)
    call = stub[0].Process()
    await call.write(headers())
    await call.read()
    await call.write(body())
    answer = await call.read()
    assert answer.immediate_response.status.code == 500 and error_code(answer) == "internal_error"
    assert "unexpected error while routing" in caplog.text and "KeyError: 'boom'" in caplog.text
    monkeypatch.undo()
    call = stub[0].Process()
    await call.write(headers(end_of_stream=True))
    assert (await call.read()).request_headers.response.header_mutation.set_headers


async def test_the_largest_body_envoy_buffers_is_routed_and_a_larger_message_refused(server, stub):
    """gRPC's default 4 MiB receive limit refused long-context bodies (Envoy then answered an empty
    500); the limit now is Envoy's buffer plus the message's overhead."""
    prompt_chars = ENVOY_BODY_LIMIT_BYTES - len(json.dumps({"model": "m", "prompt": ""}))
    raw = json.dumps({"model": "m", "prompt": "x" * prompt_chars}).encode()
    assert len(raw) == ENVOY_BODY_LIMIT_BYTES
    request = body(raw)
    request.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
        "x-gateway-destination-endpoint-subset"
    ].string_value = "10.0.0.2:8000"
    call = stub[0].Process()
    await call.write(headers())
    await call.read()
    await call.write(request)
    routed = await call.read()
    lb = routed.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.2:8000"
    assert load(server)[0] == ("prefill", -(-prompt_chars // 4), 1)
    await call.done_writing()
    call = stub[0].Process()
    await call.write(body(b" " * MAX_RECEIVE_BYTES))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call.read()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_an_empty_message_is_a_protocol_error(server, stub):
    call = stub[0].Process()
    await call.write(pb.ProcessingRequest())
    answer = await call.read()
    assert error_code(answer) == "ext_proc_protocol_error"


@pytest.mark.parametrize(
    "service", ["", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]
)
async def test_health_services_serve_once_endpoints_are_loaded(stub, service):
    reply = await stub[1].Check(health_pb2.HealthCheckRequest(service=service))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_readiness_waits_for_a_valid_eds_file(tmp_path):
    missing = tmp_path / "decode.json"
    config = load_config(
        None,
        {
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "discovery.eds_files": [str(missing)],
            "discovery.poll_interval_seconds": 0.05,
        },
        environ={},
    )
    running = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="readiness")
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await health.Check(health_pb2.HealthCheckRequest(service="liveness"))).status == 1
            write_eds_file(missing, "decode", [endpoint("10.0.0.2:8000", "a")])

            async def serving() -> bool:
                return (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING

            await until(serving)
    finally:
        await running.stop(grace=0)


def with_subset(request: pb.ProcessingRequest, subset: object) -> pb.ProcessingRequest:
    hint = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    hint.update({"x-gateway-destination-endpoint-subset": subset})
    return request


@pytest.fixture
async def two_decodes(tmp_path):
    running = await start_with(tmp_path, ["10.0.0.2:8000", "10.0.0.3:8000"])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)
    await running.stop(grace=0)


@pytest.mark.parametrize("subset", [["10.0.0.3:8000", "10.9.9.9:1"], "10.0.0.3:8000"], ids=["list", "string"])
async def test_the_endpoint_subset_hint_restricts_the_decode(two_decodes, subset):
    for _ in range(3):  # without the hint, round robin over the two idle decodes would alternate
        call = two_decodes.Process()
        await call.write(with_subset(headers(), subset))
        await call.read()
        await call.write(body())
        routed = await call.read()
        lb = routed.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.3:8000"
        await call.done_writing()
        await call.read()


async def test_an_endpoint_subset_with_no_eligible_decode_is_a_503(two_decodes):
    call = two_decodes.Process()
    await call.write(with_subset(headers(), ["10.9.9.9:1"]))
    await call.read()
    await call.write(body())
    answer = await call.read()
    assert answer.immediate_response.status.code == 503
    assert error_code(answer) == "no_endpoint_in_subset"


async def test_a_busy_grpc_port_is_refused_not_shared(server, tmp_path):
    busy = f"127.0.0.1:{server.grpc_port}"
    with pytest.raises(OSError, match=f"cannot listen on {busy} for gRPC"):
        await start_with(tmp_path, ["10.0.0.2:8000"], listen=busy)


async def test_a_busy_metrics_port_is_a_clear_error(server, tmp_path):
    busy = f"127.0.0.1:{server.admin_port}"
    with pytest.raises(OSError, match=f"cannot listen on {busy} for metrics and admin"):
        await start_with(tmp_path, ["10.0.0.2:8000"], metrics_listen=busy)
