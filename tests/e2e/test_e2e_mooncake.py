"""The vllm-mooncake handoff end to end: simulated engines running vLLM's upstream MooncakeConnector
(``kv_connector mooncake``) and scripted parts for the legs' exact contents and the failure paths,
the real pd-extproc server and the real Envoy (the prefill leg through its listener)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from builders import endpoint
from e2e_harness import Gatewayed, gateway_over, wait_idle
from polling import until
from steering import INJECTED
from test_e2e_handoff import CHAT, _legs, _post, sim_gateway

from ext_proc.endpoints import EndpointSpec
from sim.cluster import EngineSpec
from sim.config import KvConfig
from standins.backends import (
    BootstrapServer,
    EchoBackend,
    ScriptedPrefill,
    start_backend,
    start_bootstrap_server,
    start_kv_failing_decode,
    start_scripted_prefill,
)
from standins.metrics import by_outcome

MODE = {"handoff.mode": "vllm-mooncake"}
MOONCAKE = KvConfig(kv_connector="mooncake")


def _spec(address: str, bootstrap_port: int | None = None) -> EndpointSpec:
    return endpoint(address, "a", bootstrap_port=bootstrap_port)


@pytest.mark.parametrize("stream", [False, True])
async def test_mooncake_with_the_openai_sdk_moves_the_kv_in_the_group(tmp_path, stream):
    specs = [EngineSpec("prefill", "a"), EngineSpec("prefill", "b"), EngineSpec("decode", "a")]
    specs.append(EngineSpec("decode", "b"))
    async with (
        sim_gateway(tmp_path, specs, {**MODE, "affinity.mode": "strict"}, kv=MOONCAKE) as c,
        aiohttp.ClientSession() as session,
        openai.AsyncOpenAI(base_url=c.g.gateway.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        for _ in range(4):
            raw = await client.chat.completions.with_raw_response.create(
                model="sim", messages=CHAT["messages"], max_tokens=6, stream=stream
            )
            parsed = raw.parse()
            if stream:
                chunks = [chunk async for chunk in parsed]
                assert chunks[-1].choices[0].finish_reason == "length"
            else:
                assert parsed.usage.completion_tokens == 6
            assert raw.headers["x-sim-kv-transfer"] == "same_group"  # pulled from its group's prefill
            assert raw.headers["x-sim-prefill-engine"] in c.addresses("prefill")
            assert "x-sim-warning" not in raw.headers

        async def four_legs_ok() -> bool:  # the legs run alongside the decodes: the last may end after
            return await _legs(session, c.g) == {"ok": 4.0}

        await until(four_legs_ok)
        queries = await by_outcome(session, c.g.admin_url, "pd_extproc_bootstrap_queries_total")
        assert 1 <= queries["ok"] <= 2  # each prefill's engine ids queried once, then cached
        assert await wait_idle(session, c.g.admin_url) == []
        for engine in c.engines:
            assert engine.engine.scheduler.used_blocks == 0  # every held transfer was pulled


@contextlib.asynccontextmanager
async def one_pair(
    tmp_path: Path, decode: EchoBackend
) -> AsyncIterator[tuple[Gatewayed, aiohttp.ClientSession, BootstrapServer, ScriptedPrefill]]:
    """pd-extproc (vllm-mooncake) and Envoy over one scripted prefill with its bootstrap server and
    ``decode``; every part is stopped afterwards."""
    bootstrap = await start_bootstrap_server({0: "engine-p0"})
    prefill = await start_scripted_prefill(body=b'{"choices": [{"text": "x"}]}')
    specs = ([_spec(prefill.address, bootstrap.port)], [_spec(decode.address)])
    try:
        async with gateway_over(tmp_path, *specs, MODE) as g, aiohttp.ClientSession() as session:
            yield g, session, bootstrap, prefill
    finally:
        for part in (bootstrap, prefill, decode):
            await part.stop()


async def test_both_legs_carry_one_gateway_made_transfer_id_and_the_decode_its_prefills_engine(tmp_path):
    decode = await start_backend()
    async with one_pair(tmp_path, decode) as (g, session, bootstrap, prefill):
        status, _, _ = await _post(session, g, {**CHAT, **INJECTED}, headers={"x-request-id": "client"})
        assert status == 200
        assert await wait_idle(session, g.admin_url) == []
        ((leg_headers, leg),) = prefill.legs
        (seen,) = decode.requests
        transfer_id = leg["kv_transfer_params"]["transfer_id"]
        assert transfer_id.startswith("xfer-") and len(transfer_id) > 20
        assert leg["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        }
        assert (leg["stream"], leg["max_tokens"]) == (False, 1)
        assert leg_headers["x-data-parallel-rank"] == "0"
        assert seen["body"]["kv_transfer_params"] == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap.port}",
            "remote_engine_id": "engine-p0",
        }
        assert {k: v for k, v in seen["body"].items() if k != "kv_transfer_params"} == CHAT
        assert leg_headers["x-request-id"] == seen["x-request-id"] != "client"
        assert bootstrap.queries == 1


async def test_a_decode_that_cannot_pull_is_a_kv_transfer_failed_error(tmp_path):
    """The decode answers as vLLM does when its Mooncake pull fails (HTTP 500 "Internal server
    error"): the client gets 502 ``kv_transfer_failed`` naming both engines, the prefill is ejected."""
    decode = await start_kv_failing_decode()
    async with one_pair(tmp_path, decode) as (g, session, _, prefill):
        status, _, text = await _post(session, g)
        error = json.loads(text)["error"]
        assert (status, error["code"]) == (502, "kv_transfer_failed")
        assert prefill.address in error["message"] and decode.address in error["message"]
        ejections = await by_outcome(session, g.admin_url, "pd_extproc_prefill_ejections_total")
        assert ejections == {"kv_transfer_failed": 1.0}
        assert await wait_idle(session, g.admin_url) == []


@pytest.mark.parametrize("policy", ["decode-only", "error"])
async def test_an_unreachable_bootstrap_server_is_retried_on_the_next_prefill_then_the_policy(
    tmp_path, unused_tcp_port, policy
):
    """The first prefill's bootstrap server is down: the request goes to the next-ranked prefill (its
    own bootstrap server answers); with every bootstrap server down, ``on_prefill_failure`` decides."""
    bootstrap = await start_bootstrap_server({0: "engine-p1"})
    dead = await start_scripted_prefill(body=b"{}")
    alive = await start_scripted_prefill(body=b"{}")
    decode = await start_backend()
    settings = {**MODE, "handoff.on_prefill_failure": policy, "handoff.eject_failed_prefill_seconds": 0}
    prefills = [_spec(dead.address, unused_tcp_port), _spec(alive.address, bootstrap.port)]
    decodes = [_spec(decode.address)]
    try:
        async with (
            gateway_over(tmp_path, prefills, decodes, settings) as g,
            aiohttp.ClientSession() as session,
        ):
            for _ in range(2):
                status, _, _ = await _post(session, g)
                assert status == 200
            queries = await by_outcome(session, g.admin_url, "pd_extproc_bootstrap_queries_total")
            assert queries["ok"] == 1.0 and queries["connect_error"] >= 1.0
            await until(lambda: len(alive.legs) == 2)  # the leg runs alongside the decode: it may land after
            assert dead.legs == [] and len(alive.legs) == 2
            assert await wait_idle(session, g.admin_url) == []
        async with (
            gateway_over(tmp_path, prefills[:1], decodes, settings) as g,
            aiohttp.ClientSession() as session,
        ):
            status, _, text = await _post(session, g)
            if policy == "error":
                error = json.loads(text)["error"]
                assert (
                    status == 502
                    and error["code"] == "prefill_failed"
                    and "bootstrap server" in error["message"]
                )
            else:
                assert status == 200
                assert "kv_transfer_params" not in decode.requests[-1]["body"]  # decode-only
            assert await wait_idle(session, g.admin_url) == []
        assert dead.legs == []
    finally:
        for part in (bootstrap, dead, alive, decode):
            await part.stop()
