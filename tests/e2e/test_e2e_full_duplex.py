"""FULL_DUPLEX_STREAMED body modes through the real Envoy: the shipped bootstrap with the ext_proc
filter's processing modes set as the Gateway API Inference Extension gateways set them
(``sim.gateway.FULL_DUPLEX_MODES``), real echo engines, the OpenAI SDK unchanged.

The gateway shapes themselves (Istio, Envoy AI Gateway, kgateway, the GIE reference) are tested in
``test_e2e_gateway_shapes.py``, the OpenAI SDK in both modes in ``test_e2e_envoy.py``; this file pins
the choreography: chunked bodies both ways, errors, handoff body rewrites, the served-endpoint report
and load release.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from builders import endpoint
from e2e_harness import busy_endpoints, gateway_over, stack, wait_idle

from ext_proc.choreography import STREAMED_CHUNK_BYTES
from standins.backends import start_scripted_prefill


def _assert_no_stale_length(record: dict) -> None:
    """The engine got the body's own length, or none: Envoy 1.40 forwards a FULL_DUPLEX_STREAMED body
    chunked and drops content-length (pd-extproc's answer sets the right one, as GIE's picker does)."""
    headers = record["headers"]
    if "Content-Length" in headers:
        assert headers["Content-Length"] == str(record["size"])
    else:
        assert headers["Transfer-Encoding"] == "chunked"


async def test_a_large_body_crosses_in_chunks_byte_for_byte(tmp_path):
    prompt = "word " * 30_000  # 150 KB: three streamed_response chunks of at most 62,000 bytes
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()
    assert len(raw) > 2 * STREAMED_CHUNK_BYTES
    async with stack(tmp_path, ["a"], ["a"], full_duplex=True) as s, aiohttp.ClientSession() as session:
        headers = {"content-type": "application/json"}
        async with session.post(f"{s.gateway.url}/v1/completions", data=raw, headers=headers) as response:
            assert response.status == 200, await response.text()
        (record,) = next(iter(s.decodes.values())).requests
        assert record["body"] == json.loads(raw) and record["size"] == len(raw)
        _assert_no_stale_length(record)
        assert await wait_idle(session, s.admin_url) == []


async def test_a_body_over_the_limit_is_a_json_413(tmp_path):
    raw = b'{"model": "m", "prompt": "' + b"x" * (16 * 1024 * 1024) + b'"}'
    async with stack(tmp_path, ["a"], ["a"], full_duplex=True) as s, aiohttp.ClientSession() as session:
        async with session.post(f"{s.gateway.url}/v1/completions", data=raw) as response:
            assert response.status == 413
            error = (await response.json())["error"]
        assert error["code"] == "request_too_large"
        assert "16 MiB" in error["message"]
        assert not any(b.requests for b in s.decodes.values())
        assert await wait_idle(session, s.admin_url) == []


async def test_client_routing_headers_are_stripped_in_the_held_headers_answer(tmp_path):
    async with stack(tmp_path, ["a"], ["a", "a"], full_duplex=True) as s, aiohttp.ClientSession() as session:
        # The shipped bootstrap strips them early too; a gateway's Envoy does not: take that away.
        spoof = {"x-gateway-destination-endpoint": "10.9.9.9:80", "x-prefiller-host-port": "10.9.9.9:81"}
        body = {"model": "m", "prompt": "x" * 40, "max_tokens": 4}
        async with session.post(f"{s.gateway.url}/v1/completions", json=body, headers=spoof) as response:
            assert response.status == 200
            assert response.headers["x-seen-prefiller"] in s.prefills
            assert response.headers["x-served-by"] in s.decodes


@pytest.mark.parametrize("mode", ["kv-transfer-params", "sglang-bootstrap"])
async def test_engine_handoffs_rewrite_the_streamed_body(tmp_path, mode):
    answer = {"kv_transfer_params": {"remote_engine_id": "e1", "remote_block_ids": [[1, 2]]}}
    prefill = await start_scripted_prefill(200, json.dumps(answer).encode())
    decodes = []
    try:
        from standins.backends import start_backend

        decodes = [await start_backend()]
        prefill_spec = [endpoint(prefill.address, "a")]
        decode_spec = [endpoint(decodes[0].address, "a")]
        settings = {"handoff.mode": mode}
        async with (
            gateway_over(tmp_path, prefill_spec, decode_spec, settings, full_duplex=True) as g,
            aiohttp.ClientSession() as session,
        ):
            body = {"model": "m", "prompt": "y" * 400, "max_tokens": 4, "stream": True}
            async with session.post(f"{g.gateway.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                events = [line async for line in response.content if line.startswith(b"data:")]
            assert events[-1].strip() == b"data: [DONE]" and len(events) == 4
            (record,) = decodes[0].requests
            sent = record["body"]
            if mode == "kv-transfer-params":
                assert sent["kv_transfer_params"] == answer["kv_transfer_params"]
            else:
                assert sent["bootstrap_host"] == "127.0.0.1"
            assert record["size"] > len(json.dumps(body))
            _assert_no_stale_length(record)
            assert len(prefill.legs) == 1
            assert await wait_idle(session, g.admin_url) == []
    finally:
        await prefill.stop()
        for backend in decodes:
            await backend.stop()


async def test_the_served_endpoint_moves_the_decode_charge_after_a_retry(tmp_path):
    async with (
        stack(tmp_path, ["a"], ["a", "a", "a"], full_duplex=True) as s,
        aiohttp.ClientSession() as session,
    ):
        victim = next(iter(s.decodes.values()))
        await victim.stop()  # still listed as healthy: pd-extproc names it first now and then
        moved = 0
        for _ in range(12):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            delay = {"x-test-delay-ms": "300"}
            url = f"{s.gateway.url}/v1/chat/completions"
            async with session.post(url, json=body, headers=delay) as response:
                assert response.status == 200
                served = response.headers["x-served-by"]
                first = response.headers["x-seen-destination"].split(",")[0]
                await response.content.readline()  # the first event: the response phase has run
                busy = {row["address"] for row in await busy_endpoints(session, s.admin_url)}
                assert served in busy and victim.address not in busy
                moved += first == victim.address
                await response.read()
            if moved:
                break
        assert moved == 1
        metrics = await (await session.get(f"{s.admin_url}/metrics")).text()
        assert 'pd_extproc_served_endpoint_total{outcome="moved"} 1.0' in metrics
        assert await wait_idle(session, s.admin_url) == []
