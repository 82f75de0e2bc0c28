"""A decode that cannot pull the KV cache its prefill leg announced, through the real Envoy.

The decode answers as vLLM 0.32 does with ``kv_load_failure_policy: fail`` (measured on real engines:
``tests/vllm/`` and ``bench/vllm_kv_failure.py``): HTTP 500 "Internal server error", or a 200 stream
whose only event is that error. The client gets an OpenAI-style error naming the cause,
``kv_transfer_failed`` (502, or the stream's error event), counted, the prefill ejected; in both body
modes. A decode whose engine core died answers the same ways with vLLM's ``EngineDeadError``: the
client gets ``decode_engine_dead`` (503, or the stream's error event), the decode is ejected and the
prefill stays in rotation. A KV handoff whose pull worked streams unchanged, and an engine's 500 to a
request without a KV handoff is not relabelled.
"""

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
from prometheus_client.parser import text_string_to_metric_families

from standins.backends import (
    VLLM_ENGINE_DEAD,
    EchoBackend,
    ScriptedPrefill,
    start_backend,
    start_kv_failing_decode,
    start_scripted_prefill,
)

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1]], "remote_port": 1}
LEG_ANSWER = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}).encode()
KV = {"handoff.mode": "kv-transfer-params"}


async def counters(admin_url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(f"{admin_url}/metrics") as response:
        text = await response.text()
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(
            (
                "pd_extproc_kv_transfer_failures",
                "pd_extproc_prefill_ejections",
                "pd_extproc_decode_engine_dead",
                "pd_extproc_decode_ejections",
            )
        )
    }


async def chat(url: str, stream: bool) -> str:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": "tell me about KV caches " * 20}]
        if not stream:
            reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            return reply.choices[0].message.content or ""
        chunks = await client.chat.completions.create(model="m", messages=messages, max_tokens=4, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


@contextlib.asynccontextmanager
async def kv_handoff_to(
    tmp_path: Path, decode: EchoBackend, full_duplex: bool, watch_streams: bool = True
) -> AsyncIterator[tuple[Gatewayed, ScriptedPrefill]]:
    """pd-extproc (kv-transfer-params, ``handoff.watch_streamed_answers``) and Envoy over a prefill
    whose legs answer ``PARAMS`` and ``decode``; both engines are stopped afterwards, and pd-extproc
    must hold no load then."""
    prefill = await start_scripted_prefill(200, LEG_ANSWER)
    settings = {**KV, "handoff.watch_streamed_answers": watch_streams}
    try:
        async with gateway_over(
            tmp_path,
            [endpoint(prefill.address)],
            [endpoint(decode.address)],
            settings,
            full_duplex=full_duplex,
        ) as g:
            yield g, prefill
            async with aiohttp.ClientSession() as session:
                assert await wait_idle(session, g.admin_url) == []
    finally:
        await prefill.stop()
        await decode.stop()


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_failed_kv_pull_is_a_kv_transfer_failed_error_naming_both_engines(
    tmp_path, stream, full_duplex
):
    decode = await start_kv_failing_decode()
    async with kv_handoff_to(tmp_path, decode, full_duplex) as (g, prefill):
        with pytest.raises(openai.APIError) as raised:
            await chat(g.gateway.url, stream)
        error = raised.value
        assert error.code == "kv_transfer_failed"
        assert prefill.address in error.message and decode.address in error.message
        assert "kv_load_failure_policy=recompute" in error.message
        if not stream:
            assert isinstance(error, openai.APIStatusError) and error.status_code == 502
        seen = await counters(g.admin_url)
        label = "true" if stream else "false"
        assert seen[f"pd_extproc_kv_transfer_failures_total[('stream', '{label}')]"] == 1
        assert seen["pd_extproc_prefill_ejections_total[('outcome', 'kv_transfer_failed')]"] == 1
        (pulled,) = decode.requests
        assert pulled["body"]["kv_transfer_params"] == PARAMS


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_dead_decode_is_a_decode_engine_dead_error_and_the_prefill_stays_in_rotation(
    tmp_path, stream, full_duplex
):
    """Two decodes, one whose engine core is dead: the request routed there gets ``decode_engine_dead``
    naming it; that decode is ejected, not the prefill, whose next legs serve the requests that follow,
    all on the live decode."""
    dead, live = await start_kv_failing_decode(VLLM_ENGINE_DEAD), await start_backend()
    prefill = await start_scripted_prefill(200, LEG_ANSWER)
    settings = {**KV, "handoff.eject_failed_prefill_seconds": 60.0}
    decodes = [endpoint(dead.address), endpoint(live.address)]
    try:
        async with gateway_over(
            tmp_path, [endpoint(prefill.address)], decodes, settings, full_duplex=full_duplex
        ) as g:
            failures: list[openai.APIError] = []
            while not dead.requests:  # the idle decodes take turns: the dead one within two requests
                assert len(prefill.legs) < 2
                try:
                    assert await chat(g.gateway.url, stream) == f"Hello from {live.address}"
                except openai.APIError as failed:
                    failures.append(failed)
            (error,) = failures
            assert error.code == "decode_engine_dead"
            assert dead.address in error.message and prefill.address not in error.message
            if not stream:
                assert isinstance(error, openai.APIStatusError) and error.status_code == 503
            served = len(live.requests)
            for _ in range(3):
                assert await chat(g.gateway.url, stream) == f"Hello from {live.address}"
            assert len(live.requests) == served + 3 and len(dead.requests) == 1
            assert len(prefill.legs) == len(dead.requests) + len(live.requests)
            seen = await counters(g.admin_url)
            label = "true" if stream else "false"
            assert seen[f"pd_extproc_decode_engine_dead_total[('stream', '{label}')]"] == 1
            assert seen["pd_extproc_decode_ejections_total[('outcome', 'decode_engine_dead')]"] == 1
            assert not any(
                k.startswith(("pd_extproc_prefill_ejections", "pd_extproc_kv_transfer")) for k in seen
            )
            async with aiohttp.ClientSession() as session:
                assert await wait_idle(session, g.admin_url) == []
    finally:
        for engine in (prefill, dead, live):
            await engine.stop()


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
async def test_a_kv_handoff_whose_pull_worked_streams_unchanged(tmp_path, full_duplex):
    decode = await start_backend()
    async with kv_handoff_to(tmp_path, decode, full_duplex) as (g, _):
        assert await chat(g.gateway.url, stream=True) == f"Hello from {decode.address}"
        (served,) = decode.requests
        assert served["body"]["kv_transfer_params"] == PARAMS
        assert "x-gateway-kv-handoff" not in {k.lower() for k in served["headers"]}  # Envoy removed it
        assert not any(k.startswith("pd_extproc_kv_transfer_failures") for k in await counters(g.admin_url))


async def test_without_the_stream_watch_a_streamed_failure_is_the_engines_own_error(tmp_path):
    """``handoff.watch_streamed_answers: false`` in BUFFERED: the chunks do not cross pd-extproc, the
    decode's error event reaches the client as vLLM sent it; a non-streamed failure is still named."""
    decode = await start_kv_failing_decode()
    async with kv_handoff_to(tmp_path, decode, full_duplex=False, watch_streams=False) as (g, _):
        with pytest.raises(openai.APIError) as streamed:
            await chat(g.gateway.url, stream=True)
        assert streamed.value.code == "500" and streamed.value.message == "Internal server error"
        with pytest.raises(openai.APIStatusError) as answered:
            await chat(g.gateway.url, stream=False)
        assert answered.value.code == "kv_transfer_failed"
        seen = await counters(g.admin_url)
        assert seen["pd_extproc_kv_transfer_failures_total[('stream', 'false')]"] == 1
        assert "pd_extproc_kv_transfer_failures_total[('stream', 'true')]" not in seen


async def test_a_decode_500_without_a_kv_handoff_is_the_engines_own(tmp_path):
    """The prefill stopped at its first token (no kv_transfer_params): the decode computes the prompt
    itself, so its 500 is not a failed pull and reaches the client as the engine sent it."""
    prefill = await start_scripted_prefill(200, json.dumps({"choices": [{"text": "x"}]}).encode())
    decode = await start_kv_failing_decode()
    error_500 = b'{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}'
    broken = await start_scripted_prefill(500, error_500)  # answers every POST with that 500
    try:
        async with gateway_over(tmp_path, [endpoint(prefill.address)], [endpoint(broken.address)], KV) as g:
            async with aiohttp.ClientSession() as session:
                body = {"model": "m", "prompt": "tell me about KV caches " * 20, "max_tokens": 4}
                async with session.post(f"{g.gateway.url}/v1/completions", json=body) as response:
                    assert response.status == 500
                    assert await response.read() == error_500
                assert await wait_idle(session, g.admin_url) == []
            assert not any(
                k.startswith("pd_extproc_kv_transfer_failures") for k in await counters(g.admin_url)
            )
    finally:
        for engine in (prefill, decode, broken):
            await engine.stop()
