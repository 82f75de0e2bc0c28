"""Pooled upstream connections and the engines' HTTP keep-alive, through the real Envoy.

vLLM's and SGLang's HTTP server (uvicorn) closes a connection idle for 5 s. A request written on a
pooled connection at the moment the engine closes it comes back reset, with no answer: after its
prefill leg had run, that was a 503 for the client. The engine here (:class:`KeepAliveEngine`) makes
that crossing happen on every request that reuses a connection idle past its keep-alive. The
shipped clusters (and pd-extproc's own direct prefill legs) close idle connections after 3 s, so
they never reuse one the engine is closing; a decode-only request is also retried when it happens,
a request carrying a KV handoff is not (another decode must not pull KV the first may have read).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import yaml
from builders import endpoint
from e2e_harness import gateway_over, wait_idle

from ext_proc.handoff.leg import IDLE_CONNECTION_SECONDS
from sim.gateway import SHIPPED_ADS_BOOTSTRAP, SHIPPED_BOOTSTRAP
from standins.backends import KeepAliveEngine, start_keepalive_engine, start_scripted_prefill

UVICORN_KEEPALIVE_SECONDS = 5.0
"""vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` default and SGLang's ``timeout_keep_alive`` (uvicorn)."""
KV = "kv-transfer-params"
ANSWER = json.dumps(
    {"object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
).encode()
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1]], "remote_port": 1}
LEG_ANSWER = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}).encode()
BODY = {"model": "m", "prompt": "tell me about KV caches", "max_tokens": 4}


def without_idle_timeout(bootstrap: dict) -> None:
    """Envoy's default for pooled upstream connections (1 h idle) on the engine clusters."""
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] in ("decode", "prefill"):
            del cluster["typed_extension_protocol_options"]


async def two_requests_apart(url: str, pause: float) -> list[tuple[int, dict]]:
    """Two completions through the gateway ``pause`` seconds apart (each on a fresh client
    connection): their statuses and JSON bodies."""
    answers = []
    for index in range(2):
        if index:
            await asyncio.sleep(pause)
        async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=BODY) as r:
            answers.append((r.status, await r.json()))
    return answers


async def cluster_stat(admin_url: str, name: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{admin_url}/stats?filter={name}$") as r:
        return sum(int(line.rsplit(":", 1)[1]) for line in (await r.text()).splitlines() if line)


@pytest.mark.parametrize("template", [SHIPPED_BOOTSTRAP, SHIPPED_ADS_BOOTSTRAP], ids=["files", "ads"])
def test_pooled_engine_connections_close_before_the_engines_keepalive(template):
    clusters = {c["name"]: c for c in yaml.safe_load(template.read_text())["static_resources"]["clusters"]}
    for name in ("decode", "prefill"):
        options = clusters[name]["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ]
        idle = float(options["common_http_protocol_options"]["idle_timeout"].removesuffix("s"))
        assert idle == IDLE_CONNECTION_SECONDS < UVICORN_KEEPALIVE_SECONDS


async def test_a_request_after_the_engines_keepalive_goes_on_a_new_connection(tmp_path):
    decode = await start_keepalive_engine(UVICORN_KEEPALIVE_SECONDS, ANSWER)
    try:
        async with gateway_over(tmp_path, [], [endpoint(decode.address)]) as g:
            answers = await two_requests_apart(g.gateway.url, UVICORN_KEEPALIVE_SECONDS + 0.5)
            assert [status for status, _ in answers] == [200, 200]
            assert (decode.served, decode.resets, decode.connections) == (2, 0, 2)
            assert await cluster_stat(g.gateway.admin_url, "cluster.decode.upstream_cx_idle_timeout") == 1
    finally:
        await decode.stop()


async def test_a_decode_only_request_on_a_connection_the_engine_closed_is_retried(tmp_path):
    """Without the idle timeout the crossing happens; the decode-only route's retry policy covers it."""
    decode = await start_keepalive_engine(0.3, ANSWER)
    try:
        async with gateway_over(tmp_path, [], [endpoint(decode.address)], edit=without_idle_timeout) as g:
            answers = await two_requests_apart(g.gateway.url, 0.6)
            assert [status for status, _ in answers] == [200, 200]
            assert (decode.served, decode.resets) == (2, 1)
            assert await cluster_stat(g.gateway.admin_url, "cluster.decode.upstream_rq_retry_success") == 1
    finally:
        await decode.stop()


async def test_a_kv_handoff_request_on_a_connection_the_engine_closed_is_not_sent_again(tmp_path):
    """The same crossing for a body carrying kv_transfer_params: not retried (a second decode must not
    pull what the first may have read), so only the idle timeout keeps it from the client."""
    prefill = await start_scripted_prefill(200, LEG_ANSWER)
    decode = await start_keepalive_engine(0.3, ANSWER)
    try:
        async with gateway_over(
            tmp_path,
            [endpoint(prefill.address)],
            [endpoint(decode.address)],
            {"handoff.mode": KV},
            edit=without_idle_timeout,
        ) as g:
            answers = await two_requests_apart(g.gateway.url, 0.6)
            assert [status for status, _ in answers] == [200, 503]
            assert answers[1][1]["error"]["code"] == "upstream_unavailable"
            assert (decode.served, decode.resets) == (1, 1)
            async with aiohttp.ClientSession() as session:
                assert await wait_idle(session, g.admin_url) == []
    finally:
        await prefill.stop()
        await decode.stop()


@pytest.mark.parametrize("via_envoy", [True, False], ids=["legs-through-envoy", "legs-direct"])
async def test_kv_handoffs_and_prefill_legs_keep_clear_of_the_engines_keepalive(tmp_path, via_envoy):
    prefill: KeepAliveEngine = await start_keepalive_engine(UVICORN_KEEPALIVE_SECONDS, LEG_ANSWER)
    decode = await start_keepalive_engine(UVICORN_KEEPALIVE_SECONDS, ANSWER)
    settings: dict[str, object] = {"handoff.mode": KV}
    if not via_envoy:
        settings["handoff.prefill_via"] = ""
    try:
        async with gateway_over(
            tmp_path, [endpoint(prefill.address)], [endpoint(decode.address)], settings
        ) as g:
            answers = await two_requests_apart(g.gateway.url, UVICORN_KEEPALIVE_SECONDS + 0.5)
            assert [status for status, _ in answers] == [200, 200]
            assert (prefill.served, prefill.resets) == (2, 0)
            assert (decode.served, decode.resets) == (2, 0)
    finally:
        await prefill.stop()
        await decode.stop()
