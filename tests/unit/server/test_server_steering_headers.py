"""Every request header a client could steer the engines with is stripped (or replaced by the gateway's
own value) before the request goes upstream: for each handoff mode, in BUFFERED and in
FULL_DUPLEX_STREAMED, with a prefill and decode-only, through the ext_proc servicer without Envoy.

The names are listed here literally, not read from the production list, so that dropping one from
``STEERING_HEADERS`` / ``owned_headers`` fails this test."""

from __future__ import annotations

import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import body, headers, with_modes
from grpc_harness import start_with

from standins.backends import start_scripted_prefill

CLIENT_HEADERS = {
    "x-gateway-destination-endpoint": b"10.6.6.6:6666",
    "x-prefiller-host-port": b"10.6.6.7:6666",
    "x-gateway-kv-handoff": b"1",
    "x-encoder-hosts-ports": b"10.6.6.8:6666",
    "x-kv-cache-source-host-port": b"10.6.6.9:6666",
    "x-data-parallel-host-port": b"10.6.6.10:6666",
    "x-data-parallel-rank": b"3",
    "prefer": b"if-available",
}
"""What a client sends to steer the decode sidecar, the engines or Envoy itself, one value each."""
LEG_ANSWER = json.dumps(
    {"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": True}}
).encode()
MODES = ["sidecar", "kv-transfer-params", "sglang-bootstrap", "vllm-mooncake"]


def upstream_headers(answers: list[pb.ProcessingResponse]) -> dict[str, tuple[str, bytes]]:
    """The request's headers after Envoy applied every header mutation of ``answers`` in order, each as
    (who set it: ``"client"`` or ``"gateway"``, its value); a removed header is absent."""
    result = {name: ("client", value) for name, value in CLIENT_HEADERS.items()}
    for answer in answers:
        for phase in ("request_headers", "request_body"):
            if not answer.HasField(phase):
                continue
            mutation = getattr(answer, phase).response.header_mutation
            for name in mutation.remove_headers:
                result.pop(name, None)
            for option in mutation.set_headers:
                result[option.header.key] = ("gateway", option.header.raw_value)
    return result


@pytest.mark.parametrize("disaggregated", [True, False], ids=["with-prefill", "decode-only"])
@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex-streamed"])
@pytest.mark.parametrize("mode", MODES)
async def test_every_client_steering_header_is_stripped_or_replaced(
    tmp_path, mode, full_duplex, disaggregated
):
    prefill = await start_scripted_prefill(body=LEG_ANSWER)
    settings = {
        "handoff.mode": mode,
        "handoff.default_bootstrap_port": int(prefill.address.rpartition(":")[2]),  # mooncake: no /query
        "routing.pd_threshold_tokens": 0 if disaggregated else 1_000_000,
    }
    server = await start_with(tmp_path, ["10.0.0.2:8000"], prefill_address=prefill.address, settings=settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            sent = headers(extra=CLIENT_HEADERS)
            await call.write(with_modes(sent) if full_duplex else sent)
            await call.write(body())
            answers = [await call.read()]
            while not answers[-1].HasField("request_body"):  # the routed body is the request's last answer
                answers.append(await call.read())
            await call.done_writing()
        upstream = upstream_headers(answers)
        assert upstream["x-gateway-destination-endpoint"] == ("gateway", b"10.0.0.2:8000")  # routed
        for name in CLIENT_HEADERS:
            assert upstream.get(name, ("removed",))[0] != "client", (
                f"{name}: the client's value goes upstream"
            )
    finally:
        await server.stop(grace=0)
        await prefill.stop()
