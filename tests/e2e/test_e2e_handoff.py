"""The engine handoffs end to end: simulated vLLM engines (and scripted prefills for the failure
paths), the real pd-extproc server, the real Envoy with the prefill leg through its listener."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from builders import endpoint
from e2e_harness import Gatewayed, gateway_over, wait_idle
from polling import until

from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import EndpointSpec
from sim.cluster import EngineSpec, endpoint_specs, start_cluster, stop_cluster
from sim.config import KvConfig
from sim.server import RunningEngine
from standins.backends import start_backend, start_scripted_prefill
from standins.metrics import by_outcome

KV = "kv-transfer-params"
PROMPT = "tell me about KV caches " * 40
CHAT = {"model": "sim", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}
PARAMS = {  # what a vLLM 0.32 NIXL prefill answers (nixl/pull_scheduler.py request_finished)
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "e1",
    "remote_request_id": "cmpl-r-0",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 241,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


@dataclass
class Cluster:
    """Simulated engines behind the gateway."""

    g: Gatewayed
    engines: list[RunningEngine]

    def addresses(self, role: str) -> set[str]:
        return {e.address for e in self.engines if e.engine.config.role == role}


@contextlib.asynccontextmanager
async def sim_gateway(
    tmp_path: Path,
    specs: list[EngineSpec],
    settings: dict[str, object],
    extra_prefills: list[str] = (),
    kv: KvConfig | None = None,
) -> AsyncIterator[Cluster]:
    """Simulated engines (``specs``, KV model ``kv``), then pd-extproc + Envoy over them;
    ``extra_prefills`` (addresses of scripted prefills) join the prefill cluster in group ``a``."""
    engine_eds = tmp_path / "engines.json"
    engines = await start_cluster(specs, [engine_eds], kv=kv)
    try:
        prefills = [*endpoint_specs(engines, ["prefill"])]
        prefills += [endpoint(a, "a") for a in extra_prefills]
        decodes = endpoint_specs(engines, ["decode"])
        write_eds_file(engine_eds, "pd", prefills + decodes)
        async with gateway_over(tmp_path, prefills, decodes, settings) as g:
            yield Cluster(g, engines)
    finally:
        await stop_cluster(engines)


async def _legs(session: aiohttp.ClientSession, g: Gatewayed) -> dict[str, float]:
    return await by_outcome(session, g.admin_url, "pd_extproc_prefill_leg_total")


async def _post(
    session: aiohttp.ClientSession, g: Gatewayed, body: dict = CHAT, path: str = "/v1/chat/completions", **kw
) -> tuple[int, dict[str, str], str]:
    async with session.post(g.gateway.url + path, json=body, **kw) as response:
        return response.status, dict(response.headers), await response.text()


@pytest.mark.parametrize("stream", [False, True])
async def test_kv_transfer_params_with_the_openai_sdk_keeps_kv_in_the_group(tmp_path, stream):
    specs = [EngineSpec("prefill", "a"), EngineSpec("prefill", "b"), EngineSpec("decode", "a")]
    specs.append(EngineSpec("decode", "b"))
    async with (
        sim_gateway(tmp_path, specs, {"handoff.mode": KV}) as c,
        aiohttp.ClientSession() as session,
        openai.AsyncOpenAI(base_url=c.g.gateway.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        for path in ("chat", "completions"):
            for _ in range(4):
                if path == "chat":
                    raw = await client.chat.completions.with_raw_response.create(
                        model="sim", messages=CHAT["messages"], max_tokens=6, stream=stream
                    )
                else:
                    raw = await client.completions.with_raw_response.create(
                        model="sim", prompt=PROMPT, max_tokens=6, stream=stream
                    )
                headers = raw.headers
                parsed = raw.parse()
                if stream:
                    chunks = [chunk async for chunk in parsed]
                    assert chunks[-1].choices[0].finish_reason == "length"
                else:
                    assert parsed.choices[0].finish_reason == "length"
                    assert parsed.usage.completion_tokens == 6
                assert headers["x-sim-kv-transfer"] == "same_group"
                assert headers["x-sim-prefill-engine"] in c.addresses("prefill")
                assert headers["x-sim-engine"] in c.addresses("decode")
                assert float(headers["x-sim-remote-prefill-ms"]) > 0  # the prefill's time, passed through
        assert await _legs(session, c.g) == {"ok": 8.0}
        assert await wait_idle(session, c.g.admin_url) == []


async def test_prefill_leg_carries_the_handoff_fields_and_the_decode_gets_the_params(tmp_path):
    answer = {"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}
    prefill = await start_scripted_prefill(body=json.dumps(answer).encode())
    decode = await start_backend()
    specs = ([endpoint(prefill.address, "a")], [_spec(decode.address)])
    try:
        async with gateway_over(tmp_path, *specs, {"handoff.mode": KV}) as g, aiohttp.ClientSession() as s:
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3}
            body["max_completion_tokens"] = 6
            body["kv_transfer_params"] = {"do_remote_prefill": True, "remote_host": "10.9.9.9"}
            headers = {"authorization": "Bearer sk-1", "x-request-id": "client-chosen"}
            status, _, text = await _post(s, g, body, headers=headers)
            assert status == 200, text
            ((leg_headers, leg),) = prefill.legs
            assert leg_headers["authorization"] == "Bearer sk-1"
            request_id = leg_headers["x-request-id"]
            assert request_id != "client-chosen" and len(request_id) == 36
            assert leg["kv_transfer_params"] == {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            assert (leg["stream"], leg["max_tokens"], leg["max_completion_tokens"], leg["min_tokens"]) == (
                False,
                1,
                1,
                1,
            )
            assert "stream_options" not in leg and leg["messages"] == CHAT["messages"]
            (seen,) = decode.requests
            assert seen["x-request-id"] == request_id
            assert seen["x-seen-prefiller"] == ""
            assert seen["body"] == {**body, "kv_transfer_params": PARAMS}  # the client's own fields kept
            assert await wait_idle(s, g.admin_url) == []
    finally:
        await prefill.stop()
        await decode.stop()


def _spec(address: str, group: str = "a") -> EndpointSpec:
    return endpoint(address, group)


async def test_prefill_without_kv_transfer_params_sends_the_plain_body_and_says_so(tmp_path, caplog):
    """A prefill that answers without ``kv_transfer_params`` (vLLM's MooncakeConnector does, always):
    the decode prefills again; counted per prefill, a WARNING the first time, INFO after."""
    prefill = await start_scripted_prefill(body=b'{"choices": [{"text": "", "finish_reason": "stop"}]}')
    caplog.set_level(logging.INFO, "ext_proc.handoff.kv_transfer")
    try:
        async with (
            sim_gateway(tmp_path, [EngineSpec("decode", "a")], {"handoff.mode": KV}, [prefill.address]) as c,
            aiohttp.ClientSession() as session,
        ):
            for _ in range(3):
                status, seen, _ = await _post(session, c.g)
                assert status == 200
                assert seen["x-sim-kv-transfer"] == "none"  # the decode prefilled locally
            assert await _legs(session, c.g) == {"no_kv_transfer_params": 3.0}
            async with session.get(f"{c.g.admin_url}/metrics") as response:
                text = await response.text()
            line = f'pd_extproc_prefill_no_kv_transfer_params_total{{endpoint="{prefill.address}"}} 3.0'
            assert line in text
            assert await wait_idle(session, c.g.admin_url) == []
    finally:
        await prefill.stop()
    said = [r for r in caplog.records if "no_kv_transfer_params" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.INFO, logging.INFO]
    assert "vllm-mooncake" in said[0].getMessage()


FAILURES = {
    "server-error": (500, b'{"error": {"message": "boom"}}', 0.0, "server_error"),
    "garbage": (200, b"<html>not json</html>", 0.0, "bad_response"),
    "wrong-type": (200, b'{"kv_transfer_params": [1, 2]}', 0.0, "bad_response"),
    "hang": (200, b"{}", 30.0, "timeout"),
}


@pytest.mark.parametrize("failure", FAILURES, ids=list(FAILURES))
async def test_failed_prefill_is_retried_on_the_next_ranked_prefill(tmp_path, failure):
    status, body, delay, outcome = FAILURES[failure]
    broken = await start_scripted_prefill(status, body, delay)
    settings = {"handoff.mode": KV, "handoff.prefill_timeout_seconds": 1.0, "affinity.mode": "strict"}
    try:
        async with (
            sim_gateway(tmp_path, [EngineSpec("decode", "a"), EngineSpec("prefill", "a")], settings) as c,
            aiohttp.ClientSession() as session,
        ):
            good = next(iter(c.addresses("prefill")))
            _prefer_first(c, broken.address, good)
            await _wait_prefills(session, c.g, 2)
            status_code, seen, text = await _post(session, c.g)
            assert status_code == 200, text
            assert len(broken.legs) == 1
            assert seen["x-sim-kv-transfer"] == "same_group"
            assert seen["x-sim-prefill-engine"] == good
            assert await _legs(session, c.g) == {outcome: 1.0, "ok": 1.0}
            assert await wait_idle(session, c.g.admin_url) == []
    finally:
        await broken.stop()


def _prefer_first(c: Cluster, first: str, then: str) -> None:
    """List both prefills in group ``a``; ``first`` has far more capacity, so it ranks first."""
    specs = [endpoint(first, "a", 1e12), endpoint(then, "a")]
    write_eds_file(c.g.prefill_eds, "prefill", specs)


async def _wait_prefills(session: aiohttp.ClientSession, g: Gatewayed, count: int) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        async with session.get(f"{g.admin_url}/healthz") as response:
            if (await response.json())["prefills"] == count:
                await asyncio.sleep(0.3)  # Envoy polls the same file
                return
        await asyncio.sleep(0.05)
    raise AssertionError("pd-extproc did not pick up the prefill EDS file")


@contextlib.asynccontextmanager
async def scripted_gateway(
    tmp_path: Path, prefills: list[tuple[int, bytes, float]], settings: dict[str, object], **kwargs
) -> AsyncIterator[tuple[Gatewayed, list, object]]:
    """Scripted prefills (status, body, delay) in group ``a``, ranked in list order (capacities), one
    recording decode backend, pd-extproc in kv-transfer-params mode and Envoy."""
    scripted = [await start_scripted_prefill(*p) for p in prefills]
    decode = await start_backend()
    specs = [endpoint(p.address, "a", 1e6 / 1000**i) for i, p in enumerate(scripted)]
    try:
        async with gateway_over(
            tmp_path, specs, [_spec(decode.address)], {"handoff.mode": KV, **settings}, **kwargs
        ) as g:
            yield g, scripted, decode
    finally:
        for backend in [*scripted, decode]:
            await backend.stop()


GOOD = (200, json.dumps({"kv_transfer_params": PARAMS}).encode(), 0.0)
REJECTED = json.dumps(
    {"error": {"message": "context too long", "type": "BadRequestError", "param": None, "code": 400}}
).encode()


async def test_a_prefill_4xx_goes_back_to_the_client_without_retry(tmp_path):
    async with (
        scripted_gateway(tmp_path, [(400, REJECTED, 0.0), GOOD], {}) as (g, prefills, decode),
        aiohttp.ClientSession() as s,
    ):
        status, headers, text = await _post(s, g)
        assert (status, text.encode()) == (400, REJECTED)
        assert headers["Content-Type"] == "application/json"
        assert [len(p.legs) for p in prefills] == [1, 0] and decode.requests == []
        assert await _legs(s, g) == {"client_error": 1.0}
        assert await wait_idle(s, g.admin_url) == []


@pytest.mark.parametrize(
    ("broken", "status", "code"),
    [((500, b"oops", 0.0), 502, "prefill_failed"), ((200, b"{}", 30.0), 504, "prefill_timeout")],
    ids=["5xx", "timeout"],
)
async def test_on_prefill_failure_error_answers_502_or_504_after_the_retry(tmp_path, broken, status, code):
    settings = {"handoff.on_prefill_failure": "error", "handoff.prefill_timeout_seconds": 0.5}
    async with (
        scripted_gateway(tmp_path, [broken, broken], settings) as (g, prefills, decode),
        aiohttp.ClientSession() as s,
    ):
        answered, _, text = await _post(s, g)
        assert answered == status
        assert json.loads(text)["error"]["code"] == code
        assert [len(p.legs) for p in prefills] == [1, 1] and decode.requests == []
        assert await wait_idle(s, g.admin_url) == []


async def test_dead_prefill_falls_back_to_decode_only_with_the_plain_body(tmp_path):
    async with scripted_gateway(tmp_path, [GOOD], {}) as (g, prefills, decode):
        await prefills[0].stop()  # the node is gone: Envoy answers 503 for it
        async with aiohttp.ClientSession() as s:
            body = {**CHAT, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9"}}
            status, _, text = await _post(s, g, body)
            assert status == 200, text
            (seen,) = decode.requests
            assert seen["body"] == CHAT  # no kv_transfer_params: the decode prefills locally
            assert await _legs(s, g) == {"server_error": 1.0}
            assert await wait_idle(s, g.admin_url) == []


async def test_client_abort_during_the_prefill_leg_cancels_it_and_forwards_nothing(tmp_path):
    async with (
        scripted_gateway(tmp_path, [(200, b"{}", 30.0)], {}) as (g, prefills, decode),
        aiohttp.ClientSession() as s,
    ):
        with pytest.raises(asyncio.TimeoutError):
            await _post(s, g, timeout=aiohttp.ClientTimeout(total=1.0))
        end = time.monotonic() + 10
        while not prefills[0].cancelled and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert prefills[0].cancelled == 1
        assert await wait_idle(s, g.admin_url) == []
        assert await _legs(s, g) == {"cancelled": 1.0}
        assert decode.requests == []


def _short_message_timeout(bootstrap: dict) -> None:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["message_timeout"] = "0.3s"


async def test_a_prefill_longer_than_envoys_message_timeout_still_routes(tmp_path):
    """The server extends Envoy's ext_proc message timeout before the leg (override_message_timeout)."""
    slow = (200, GOOD[1], 1.5)
    async with (
        scripted_gateway(tmp_path, [slow], {}, edit=_short_message_timeout) as (g, _, decode),
        aiohttp.ClientSession() as s,
    ):
        status, _, text = await _post(s, g)
        assert status == 200, text
        assert decode.requests[0]["body"]["kv_transfer_params"] == PARAMS


SGLANG = "sglang-bootstrap"
TWO_GROUPS = [EngineSpec("prefill", "a"), EngineSpec("prefill", "b"), EngineSpec("decode", "a")]
TWO_GROUPS.append(EngineSpec("decode", "b"))


async def _wait_legs(session: aiohttp.ClientSession, g: Gatewayed, expected: dict[str, float]) -> dict:
    """The prefill-leg counters once they reach ``expected`` (legs end in the background), or as they are."""
    end = time.monotonic() + 10
    while (legs := await _legs(session, g)) != expected and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return legs


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_bootstrap_rendezvous_in_the_group_with_the_openai_sdk(tmp_path, stream):
    async with (
        sim_gateway(tmp_path, TWO_GROUPS, {"handoff.mode": SGLANG}) as c,
        aiohttp.ClientSession() as session,
        openai.AsyncOpenAI(base_url=c.g.gateway.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        for _ in range(6):
            raw = await client.chat.completions.with_raw_response.create(
                model="sim", messages=CHAT["messages"], max_tokens=6, stream=stream
            )
            parsed = raw.parse()
            if stream:
                assert [chunk async for chunk in parsed][-1].choices[0].finish_reason == "length"
            else:
                assert parsed.usage.completion_tokens == 6
            assert raw.headers["x-sim-kv-transfer"] == "same_group"
            assert raw.headers["x-sim-prefill-engine"] in c.addresses("prefill")
            assert float(raw.headers["x-sim-remote-prefill-ms"]) > 0  # the decode's wait for the KV
        assert await _wait_legs(session, c.g, {"ok": 6.0}) == {"ok": 6.0}
        assert await wait_idle(session, c.g.admin_url) == []


async def test_sglang_bootstrap_dead_prefill_ends_in_the_decodes_error(tmp_path):
    """What docs/handoffs.md promises: the client gets the decode engine's own error (here at once: the dead
    prefill's bootstrap server refuses the decode); the gateway counts the failed leg; no load is left."""
    dead = await start_scripted_prefill()
    await dead.stop()
    kv = KvConfig(bootstrap_timeout_s=1.0)
    async with (
        sim_gateway(tmp_path, [EngineSpec("decode", "a")], {"handoff.mode": SGLANG}, [dead.address], kv) as c,
        aiohttp.ClientSession() as session,
    ):
        status, headers, text = await _post(session, c.g)
        assert status >= 500 and "error" in json.loads(text)
        assert headers["x-sim-engine"] in c.addresses("decode")  # the decode engine answered
        assert await _wait_legs(session, c.g, {"server_error": 1.0}) == {"server_error": 1.0}
        assert await wait_idle(session, c.g.admin_url) == []


async def test_sglang_bootstrap_a_dead_prefill_is_ejected_after_its_first_failed_leg(tmp_path):
    """Found by ``bench/faults.py``: a dead prefill still listed never carries load, so without ejection
    it ranked first for every request and each one failed on its decode. After its first failed leg
    the live prefill serves every request."""
    dead = await start_scripted_prefill()
    await dead.stop()
    kv = KvConfig(bootstrap_timeout_s=1.0)
    specs = [EngineSpec("decode", "a"), EngineSpec("prefill", "a")]
    async with (
        sim_gateway(tmp_path, specs, {"handoff.mode": SGLANG}, [dead.address], kv) as c,
        aiohttp.ClientSession() as session,
    ):
        good = next(iter(c.addresses("prefill")))
        ranked_first = endpoint(dead.address, "a", 1e12)  # far more capacity
        write_eds_file(c.g.prefill_eds, "prefill", [ranked_first, *endpoint_specs(c.engines, ["prefill"])])
        await _wait_prefills(session, c.g, 2)
        assert (await _post(session, c.g))[0] >= 500  # ranked first, it fails once
        assert await _wait_legs(session, c.g, {"server_error": 1.0}) == {"server_error": 1.0}
        for _ in range(3):
            status, headers, text = await _post(session, c.g)
            assert status == 200, text
            assert headers["x-sim-prefill-engine"] == good
        assert await _ejections(session, c.g) == {"server_error": 1.0}
        assert await wait_idle(session, c.g.admin_url) == []


async def _ejections(session: aiohttp.ClientSession, g: Gatewayed) -> dict[str, float]:
    return await by_outcome(session, g.admin_url, "pd_extproc_prefill_ejections_total")


async def test_kv_transfer_params_ejects_a_failing_prefill_until_its_time_is_over(tmp_path):
    settings = {"handoff.eject_failed_prefill_seconds": 0.5}
    async with (
        scripted_gateway(tmp_path, [(500, b"{}", 0.0), GOOD], settings) as (g, prefills, _),
        aiohttp.ClientSession() as s,
    ):
        for _ in range(3):  # the first request's leg fails and is retried; then only the good one
            status, _, text = await _post(s, g)
            assert status == 200, text
        assert [len(p.legs) for p in prefills] == [1, 3]

        async def tried_again() -> bool:
            assert (await _post(s, g))[0] == 200
            return len(prefills[0].legs) == 2

        await until(tried_again)  # ranked first again once its ejection is over
        assert await _ejections(s, g) == {"server_error": 2.0}
        assert await wait_idle(s, g.admin_url) == []


async def test_prefill_leg_without_envoy_goes_straight_to_the_engine(tmp_path):
    async with (
        scripted_gateway(tmp_path, [GOOD], {"handoff.prefill_via": ""}) as (g, prefills, decode),
        aiohttp.ClientSession() as s,
    ):
        status, _, text = await _post(s, g)
        assert status == 200, text
        ((leg_headers, _),) = prefills[0].legs
        assert "x-gateway-destination-endpoint" not in leg_headers  # no Envoy in between
        assert decode.requests[0]["body"]["kv_transfer_params"] == PARAMS


async def test_the_prefill_charge_ends_with_the_leg_and_the_decode_charge_with_the_stream(tmp_path):
    async with (
        scripted_gateway(tmp_path, [GOOD], {}) as (g, prefills, decode),
        aiohttp.ClientSession() as s,
    ):
        slow = {"x-test-delay-ms": "400"}  # the decode backend waits before each of its 3 chunks
        streaming = asyncio.create_task(_post(s, g, {**CHAT, "stream": True}, headers=slow))
        end = time.monotonic() + 10
        while not decode.requests and time.monotonic() < end:
            await asyncio.sleep(0.02)
        async with s.get(f"{g.admin_url}/debug/endpoints") as response:
            load = {(row["role"], row["address"]): row["active_requests"] for row in await response.json()}
        assert load == {("prefill", prefills[0].address): 0, ("decode", decode.requests[0]["x-served-by"]): 1}
        assert (await streaming)[0] == 200
        assert await wait_idle(s, g.admin_url) == []


async def test_a_prefill_killed_mid_leg_is_retried_on_the_next(tmp_path):
    async with (
        scripted_gateway(tmp_path, [(200, b"{}", 30.0), GOOD], {}) as (g, prefills, decode),
        aiohttp.ClientSession() as s,
    ):
        request = asyncio.create_task(_post(s, g))
        end = time.monotonic() + 10
        while not prefills[0].legs and time.monotonic() < end:
            await asyncio.sleep(0.02)
        await prefills[0].kill()  # the node dies with the leg in flight
        status, _, text = await request
        assert status == 200, text
        assert [len(p.legs) for p in prefills] == [1, 1]
        assert decode.requests[0]["body"]["kv_transfer_params"] == PARAMS
        legs = await _legs(s, g)
        assert legs["ok"] == 1.0 and sum(legs.values()) == 2.0  # one failed leg (how it failed varies)
        assert await wait_idle(s, g.admin_url) == []


async def test_without_a_healthy_prefill_kv_transfer_params_routes_decode_only(tmp_path):
    decode = await start_backend()
    try:
        async with (
            gateway_over(tmp_path, [], [_spec(decode.address)], {"handoff.mode": KV}) as g,
            aiohttp.ClientSession() as s,
        ):
            status, _, _ = await _post(s, g, {**CHAT, "kv_transfer_params": {"remote_host": "10.9.9.9"}})
            assert status == 200
            assert decode.requests[0]["body"] == CHAT
            assert await _legs(s, g) == {}
    finally:
        await decode.stop()


async def test_sglang_batched_prompt_gets_one_bootstrap_room_per_prompt_on_both_legs(tmp_path):
    """A completions prompt of three strings is three SGLang requests: both legs carry lists of three
    hosts, ports and distinct rooms (SGLang's ``GenerateReqInput`` indexes them per prompt)."""
    prefill = await start_scripted_prefill(body=b'{"choices": []}')
    decode = await start_backend()
    specs = ([endpoint(prefill.address, "a", bootstrap_port=9100)], [_spec(decode.address)])
    body = {"model": "sim", "prompt": ["first " * 50, "second " * 50, "third " * 50], "max_tokens": 2}
    try:
        async with (
            gateway_over(tmp_path, *specs, {"handoff.mode": "sglang-bootstrap"}) as g,
            aiohttp.ClientSession() as session,
        ):
            status, _, _ = await _post(session, g, body, path="/v1/completions")
            assert status == 200
            await until(lambda: len(prefill.legs) == 1)
            assert await wait_idle(session, g.admin_url) == []
        ((_, leg),) = prefill.legs
        (seen,) = decode.requests
        assert leg == seen["body"]
        assert leg["bootstrap_host"] == ["127.0.0.1"] * 3 and leg["bootstrap_port"] == [9100] * 3
        assert len(set(leg["bootstrap_room"])) == 3
        assert leg["prompt"] == body["prompt"]
    finally:
        await prefill.stop()
        await decode.stop()
