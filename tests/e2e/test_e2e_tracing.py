"""Traces end to end: the real pd-extproc behind the real Envoy exports its request spans over OTLP to a
real gRPC collector (standins/otlp.py), and the prefill leg and the decode request carry the span's W3C
context, so an engine's own spans join the same trace."""

from __future__ import annotations

import json

import aiohttp
import pytest
from builders import endpoint
from e2e_harness import gateway_over
from polling import until

from standins.backends import start_backend, start_scripted_prefill
from standins.otlp import OtlpReceiver

CHAT = {"model": "m", "messages": [{"role": "user", "content": "trace me " * 30}], "max_tokens": 4}
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
PARAMS = {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}}


def _parts(traceparent: str) -> tuple[str, str, str, bool]:
    """A ``traceparent``'s version, trace id, parent span id and sampled flag (flags bit 0; the SDK sets
    bit 1 too on a trace id it made: W3C Trace Context level 2's random flag)."""
    version, trace_id, span_id, flags = traceparent.split("-")
    return version, trace_id, span_id, bool(int(flags, 16) & 1)


@pytest.fixture
async def receiver():
    collector = await OtlpReceiver().start()
    yield collector
    await collector.stop()


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full_duplex"])
async def test_one_trace_holds_the_gateways_span_and_the_context_both_legs_carried(
    tmp_path, receiver, monkeypatch, full_duplex
):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the SDK's batch delay, ms (default 5 s)
    prefill = await start_scripted_prefill(200, json.dumps(PARAMS).encode())
    decode = await start_backend()
    settings = {
        "handoff.mode": "kv-transfer-params",
        "tracing.otlp_endpoint": receiver.endpoint,
        "tracing.sampling_ratio": 1.0,
    }
    caller = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "tracestate": "vendor=x"}
    try:
        async with (
            gateway_over(
                tmp_path,
                [endpoint(prefill.address, "a")],
                [endpoint(decode.address, "b")],
                settings,
                full_duplex=full_duplex,
            ) as g,
            aiohttp.ClientSession() as session,
        ):
            url = f"{g.gateway.url}/v1/chat/completions"
            for headers in (caller, {}):
                async with session.post(url, json=CHAT, headers=headers) as response:
                    assert response.status == 200, await response.text()
            await until(lambda: len(receiver.spans) == 2)
    finally:
        await prefill.stop()
        await decode.stop()
    legs = sorted(
        (headers for headers, _ in prefill.legs), key=lambda h: CALLER_TRACE not in h["traceparent"]
    )
    decoded = [{k.lower(): v for k, v in seen["headers"].items()} for seen in decode.requests]
    decoded.sort(key=lambda h: CALLER_TRACE not in h["traceparent"])
    assert len(legs) == len(decoded) == 2
    (continued,) = receiver.trace(CALLER_TRACE)
    (fresh,) = [span for span in receiver.spans if span is not continued]
    # The caller's request: the span is its child, and both legs name that span as their parent.
    assert (continued.trace_id, continued.parent_span_id) == (CALLER_TRACE, CALLER_SPAN)
    assert continued.service == "pd-extproc" and continued.kind == 2  # SERVER
    assert continued.name == fresh.name == "pd_extproc.route"
    assert continued.status_code == fresh.status_code == 0  # UNSET
    assert 0 < continued.start_ns < continued.end_ns and 0 < fresh.start_ns < fresh.end_ns
    assert continued.attributes == {
        "pd_extproc.mode": "prefer",
        "pd_extproc.prefill": prefill.address,
        "pd_extproc.decode": decode.address,
        "pd_extproc.group": "a",
        "pd_extproc.cross_group": True,
    }
    expected = ("00", CALLER_TRACE, continued.span_id, True)
    assert _parts(legs[0]["traceparent"]) == _parts(decoded[0]["traceparent"]) == expected
    assert legs[0]["tracestate"] == decoded[0]["tracestate"] == "vendor=x"
    # Without a caller's context: a new trace, sampled at ratio 1, whose span both legs name.
    assert fresh.parent_span_id == "" and fresh.trace_id != CALLER_TRACE
    expected = ("00", fresh.trace_id, fresh.span_id, True)
    assert _parts(legs[1]["traceparent"]) == _parts(decoded[1]["traceparent"]) == expected
    assert "tracestate" not in legs[1] and "tracestate" not in decoded[1]


async def test_a_refused_request_is_an_error_span_and_unsampled_ones_still_pass_their_context(
    tmp_path, receiver, monkeypatch
):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    decode = await start_backend()
    settings = {"tracing.otlp_endpoint": receiver.endpoint, "tracing.sampling_ratio": 0.0}
    try:
        async with (
            gateway_over(tmp_path, [], [endpoint(decode.address, "a")], settings) as g,
            aiohttp.ClientSession() as session,
        ):
            url = f"{g.gateway.url}/v1/chat/completions"
            async with session.post(url, json=CHAT) as response:  # ratio 0: not recorded
                assert response.status == 200, await response.text()
            sampled = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
            async with session.post(url, data=b"{not json", headers=sampled) as response:
                assert response.status == 400
            await until(lambda: len(receiver.spans) == 1)
    finally:
        await decode.stop()
    (refused,) = receiver.spans  # the caller sampled it: recorded at ratio 0
    assert refused.trace_id == CALLER_TRACE and refused.status_code == 2  # ERROR
    assert refused.attributes["error.type"] == "invalid_request"
    assert refused.attributes["http.response.status_code"] == 400
    (seen,) = decode.requests
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    version, trace_id, _, flags = _parts(headers["traceparent"])
    assert (version, flags) == ("00", False) and trace_id != CALLER_TRACE
