"""End to end through the real Envoy binary: routing, the OpenAI SDK, retries, accounting, bad input."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest
from builders import endpoint
from e2e_harness import Stack, busy_endpoints, stack, wait_idle

from standins.metrics import by_outcome

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "tell me about KV caches " * 20}],
    "max_tokens": 16,
}


async def _post(
    session: aiohttp.ClientSession, s: Stack, body: object = CHAT, **kwargs
) -> tuple[int, dict, str]:
    async with session.post(f"{s.gateway.url}/v1/chat/completions", json=body, **kwargs) as response:
        return response.status, dict(response.headers), await response.text()


@pytest.mark.parametrize("mode", ["off", "prefer", "strict", "auto"])
async def test_requests_land_on_the_decode_the_decision_names(tmp_path, mode):
    async with (
        stack(tmp_path, ["a", "b"], ["a", "a", "b", "b"], mode=mode) as s,
        aiohttp.ClientSession() as session,
    ):
        localities = []
        for _ in range(12):
            status, headers, _ = await _post(session, s)
            assert status == 200
            destination = headers["x-seen-destination"].split(",")
            assert headers["x-served-by"] == destination[0]
            assert len(set(destination)) == len(destination) == (2 if mode == "strict" else 3)
            assert headers["x-served-by"] in s.decodes
            prefill = headers["x-seen-prefiller"]
            assert prefill in s.prefills
            localities.append(s.group_of[prefill] == s.group_of[headers["x-served-by"]])
            if mode == "strict":
                assert {s.group_of[d] for d in destination} == {s.group_of[prefill]}
        if mode != "off":  # auto: idle decodes, so the transfer decides: the prefill's group
            assert all(localities)
        assert await wait_idle(session, s.admin_url) == []
        if mode == "auto":  # the estimate's parts, per decision
            async with session.get(f"{s.admin_url}/metrics") as response:
                text = await response.text()
            for part in ("transfer", "wait", "margin"):
                assert f'pd_extproc_auto_{part}_seconds_count{{locality="same_group"}} 12.0' in text


async def test_off_mode_spreads_decode_load_across_groups(tmp_path):
    async with stack(tmp_path, ["a"], ["a", "b"], mode="off") as s, aiohttp.ClientSession() as session:
        served = set()
        for _ in range(6):
            status, headers, _ = await _post(session, s)
            assert status == 200
            served.add(s.group_of[headers["x-served-by"]])
        assert served == {"a", "b"}


async def test_strict_without_same_group_decode_is_a_clear_503(tmp_path):
    async with stack(tmp_path, ["c"], ["a", "b"], mode="strict") as s, aiohttp.ClientSession() as session:
        status, headers, text = await _post(session, s)
        assert status == 503
        assert headers["Content-Type"] == "application/json", headers
        error = __import__("json").loads(text)["error"]
        assert error["code"] == "no_same_group_decode_endpoint"
        assert "strict" in error["message"]
        async with session.get(f"{s.admin_url}/metrics") as response:
            assert (
                'pd_extproc_rejected_total{reason="no_same_group_decode_endpoint"} 1.0'
                in await response.text()
            )


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex-streamed"])
async def test_openai_sdk_works_unchanged_streaming_included(tmp_path, full_duplex):
    """The shipped phases (BUFFERED) and the GIE gateways' (FULL_DUPLEX_STREAMED both ways)."""
    async with stack(tmp_path, ["a", "b"], ["a", "a", "b"], full_duplex=full_duplex) as s:
        client = openai.AsyncOpenAI(base_url=f"{s.gateway.url}/v1", api_key="unused", max_retries=0)
        try:
            chat = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
            assert chat.choices[0].message.content.startswith("Hello from 127.0.0.1:")
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
            assert len(pieces) == 3 and "".join(pieces).startswith("Hello from 127.0.0.1:")
            completion = await client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4)
            assert completion.choices[0].text.startswith("Hello from")
            models = await client.models.list()
            assert [m.id for m in models.data] == ["test"]
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(model="m", messages="not a list")  # type: ignore[arg-type]
            assert bad.value.code == "invalid_request"
        finally:
            await client.close()
        served = [r for b in s.decodes.values() for r in b.requests if r["path"] != "/v1/models"]
        assert len(served) == 3
        for record in served:  # sidecar handoff: the prefill header names a prefill of the same group
            assert s.group_of[record["x-seen-prefiller"]] == s.group_of[record["x-served-by"]]
        async with aiohttp.ClientSession() as session:
            assert await wait_idle(session, s.admin_url) == []
            modes = await by_outcome(session, s.admin_url, "pd_extproc_ext_proc_streams_total", "body_mode")
        assert modes == {
            "buffered": 0.0 if full_duplex else 5.0,
            "full_duplex_streamed": 5.0 if full_duplex else 0.0,
        }


async def _decode_retries(session: aiohttp.ClientSession, s: Stack) -> int:
    """Envoy's count of retried requests to the decode cluster."""
    url = f"{s.gateway.admin_url}/stats?filter=cluster.decode.upstream_rq_retry$"
    async with session.get(url) as response:
        return int((await response.text()).split(":")[1])


async def test_a_killed_decode_backend_is_retried_on_the_fallback(tmp_path):
    async with stack(tmp_path, ["a"], ["a", "a", "a"]) as s, aiohttp.ClientSession() as session:
        victim = next(iter(s.decodes.values()))
        await victim.stop()  # still listed as healthy: pd-extproc keeps naming it first now and then
        assert await _decode_retries(session, s) == 0
        victim_first = 0
        for _ in range(9):
            status, headers, _ = await _post(session, s)
            assert status == 200
            destination = headers["x-seen-destination"].split(",")
            if destination[0] == victim.address:  # refused: Envoy retried on the next listed decode
                victim_first += 1
                assert headers["x-served-by"] == destination[1]
            else:
                assert headers["x-served-by"] == destination[0]
        assert victim_first >= 1
        assert await _decode_retries(session, s) == victim_first
        assert await wait_idle(session, s.admin_url) == []


@pytest.mark.parametrize("response_headers", [False, True], ids=["shipped-phases", "response-headers-phase"])
async def test_load_is_charged_while_streaming_and_released_after_completion_and_abort(
    tmp_path, response_headers
):
    async with (
        stack(tmp_path, ["a"], ["a"], response_headers=response_headers) as s,
        aiohttp.ClientSession() as session,
    ):
        body = {**CHAT, "stream": True}
        slow = {"x-test-delay-ms": "300"}
        async with session.post(f"{s.gateway.url}/v1/chat/completions", json=body, headers=slow) as response:
            await response.content.readline()
            busy = {row["role"]: row for row in await busy_endpoints(session, s.admin_url)}
            assert busy["decode"]["active_requests"] == 1
            assert busy["decode"]["active_tokens"] == 120 + 16  # ceil(480 chars / 4) prompt + max_tokens
            if response_headers:  # the decode answered: the prefill is done and released
                assert "prefill" not in busy
            else:  # without that phase the prefill charge lasts until the exchange ends
                assert busy["prefill"]["active_tokens"] == 120
            await response.read()
        assert await wait_idle(session, s.admin_url) == []
        response = await session.post(f"{s.gateway.url}/v1/chat/completions", json=body, headers=slow)
        await response.content.readline()
        assert await busy_endpoints(session, s.admin_url) != []
        response.close()
        assert await wait_idle(session, s.admin_url) == []


async def test_bodiless_requests_go_to_the_least_loaded_decode(tmp_path):
    async with stack(tmp_path, ["a"], ["a", "b"]) as s, aiohttp.ClientSession() as session:
        slow = {"x-test-delay-ms": "500"}
        busy = asyncio.create_task(_post(session, s, {**CHAT, "stream": True}, headers=slow))
        while not await busy_endpoints(session, s.admin_url):
            await asyncio.sleep(0.02)
        rows = await busy_endpoints(session, s.admin_url)
        loaded = next(row["address"] for row in rows if row["role"] == "decode")
        spoof = {"x-gateway-destination-endpoint": loaded, "x-prefiller-host-port": "10.9.9.9:2"}
        for _ in range(3):
            async with session.get(f"{s.gateway.url}/v1/models", headers=spoof) as response:
                assert response.status == 200
                assert response.headers["x-served-by"] in s.decodes
                assert response.headers["x-served-by"] != loaded
                # the client's headers did not survive: destination overwritten, prefill removed
                assert response.headers["x-seen-destination"].split(",")[0] == response.headers["x-served-by"]
                assert response.headers["x-seen-prefiller"] == ""
        assert (await busy)[0] == 200


async def test_bad_input_gets_openai_style_errors(tmp_path):
    async with stack(tmp_path, ["a"], ["a"]) as s, aiohttp.ClientSession() as session:
        async with session.post(f"{s.gateway.url}/v1/chat/completions", data=b"{not json") as response:
            assert response.status == 400
            error = (await response.json())["error"]
            assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]
        status, _, text = await _post(session, s, {"model": "m", "messages": [], "max_tokens": "lots"})
        assert status == 400
        assert '"param": "max_tokens"' in text
        status, _, text = await _post(session, s, {"model": 7, "messages": []})
        assert status == 400 and '"param": "model"' in text
        async with session.get(f"{s.gateway.url}/admin/secrets") as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "unknown_path"
        for backend in s.decodes.values():
            assert backend.requests == []
        assert await wait_idle(session, s.admin_url) == []


async def test_clients_cannot_pick_hosts_with_spoofed_routing_headers(tmp_path):
    async with stack(tmp_path, [], ["a", "a"]) as s, aiohttp.ClientSession() as session:
        decodes = list(s.decodes)
        spoof = {"x-gateway-destination-endpoint": "10.9.9.9:1", "x-prefiller-host-port": "10.9.9.9:2"}
        for _ in range(4):
            status, headers, _ = await _post(session, s, headers=spoof)
            assert status == 200
            assert headers["x-seen-destination"].split(",")[0] == headers["x-served-by"]
            assert headers["x-seen-prefiller"] == ""  # decode-only: no prefill, header removed
        async with session.get(f"{s.gateway.url}/v1/models", headers=spoof) as response:
            assert response.status == 200
            assert response.headers["x-served-by"] in decodes
            assert response.headers["x-seen-destination"].split(",")[0] == response.headers["x-served-by"]
            assert "10.9.9.9" not in response.headers["x-seen-destination"]
            assert response.headers["x-seen-prefiller"] == ""


async def test_an_eds_update_by_atomic_rename_takes_effect(tmp_path):
    async with stack(tmp_path, ["a"], ["a", "a"]) as s, aiohttp.ClientSession() as session:
        keep, drop = list(s.decodes)
        s.write_decodes(
            [
                endpoint(keep, "a"),
                endpoint(drop, "a", None, "UNHEALTHY"),
            ]
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            status, headers, _ = await _post(session, s)
            assert status == 200
            if headers["x-seen-destination"] == keep:
                break
            await asyncio.sleep(0.1)
        for _ in range(4):
            status, headers, _ = await _post(session, s)
            assert headers["x-served-by"] == keep and headers["x-seen-destination"] == keep
