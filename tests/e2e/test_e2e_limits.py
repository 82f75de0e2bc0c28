"""Limits and Envoy's own error answers, end to end through the real Envoy: long-context bodies up to
the 16 MiB buffer (both ways through the ext_proc stream), the 413 beyond it, deeply nested JSON, and
every Envoy-generated error as an OpenAI-style JSON error while pd-extproc's answers pass untouched."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml
from builders import endpoint
from e2e_harness import Gatewayed, gateway_over, raw_http, stack
from polling import until

from ext_proc.envoy_messages import error_body
from ext_proc.request import MAX_JSON_DEPTH
from ext_proc.server import ENVOY_BODY_LIMIT_BYTES
from sim.gateway import SHIPPED_BOOTSTRAP
from standins.backends import EchoBackend, ScriptedPrefill, start_backend, start_scripted_prefill

MIB = 1024 * 1024
CHAT_PATH = "/v1/chat/completions"
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_port": 1}
JSON_HEADERS = {"content-type": "application/json"}
TOO_DEEP = f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"


def chat_of_size(size: int) -> bytes:
    """A chat completion body of exactly ``size`` bytes: one long user message (a long-context prompt)."""
    shape = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": ""}]}
    shape["messages"][0]["content"] = "x" * (size - len(json.dumps(shape)))
    raw = json.dumps(shape).encode()
    assert len(raw) == size
    return raw


async def _post(
    session: aiohttp.ClientSession, url: str, raw: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict, bytes]:
    """POST ``raw`` to ``url``'s chat completions path: status, response headers and raw body."""
    sent = {**JSON_HEADERS, **(headers or {})}
    async with session.post(url + CHAT_PATH, data=raw, headers=sent) as response:
        return response.status, dict(response.headers), await response.read()


def _envoy_error(status: int, headers: dict, raw: bytes, expected_status: int, code: str) -> dict:
    """The error object of an Envoy-generated JSON answer, after checking its status, type and code."""
    assert (status, headers["Content-Type"]) == (expected_status, "application/json"), raw[:300]
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
    assert error["code"] == code, error
    return error


# --- bodies up to the Envoy buffer route normally ---------------------------------------------------


async def test_long_context_bodies_up_to_the_envoy_buffer_are_routed_and_beyond_it_get_a_json_413(tmp_path):
    async with stack(tmp_path, ["a"], ["a"]) as s, aiohttp.ClientSession() as session:
        (decode,) = s.decodes.values()
        for size in (6 * MIB, ENVOY_BODY_LIMIT_BYTES):  # over gRPC's 4 MiB default; the largest Envoy buffers
            raw = chat_of_size(size)
            status, headers, answer = await _post(session, s.gateway.url, raw)
            assert status == 200, answer[:300]
            assert headers["x-seen-prefiller"] in s.prefills
            assert decode.requests[-1]["body"] == json.loads(raw)
        over = chat_of_size(ENVOY_BODY_LIMIT_BYTES + 1)
        status, headers, answer = await _post(session, s.gateway.url, over)
        error = _envoy_error(status, headers, answer, 413, "request_too_large")
        assert error["type"] == "invalid_request_error"
        assert "16 MiB" in error["message"] and str(ENVOY_BODY_LIMIT_BYTES) in error["message"]
        assert len(decode.requests) == 2
        client = openai.AsyncOpenAI(base_url=f"{s.gateway.url}/v1", api_key="unused", max_retries=0)
        async with client:
            messages = [{"role": "user", "content": "x" * (ENVOY_BODY_LIMIT_BYTES + 1)}]
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model="m", messages=messages)
        assert (refused.value.status_code, refused.value.code) == (413, "request_too_large")


@contextlib.asynccontextmanager
async def kv_gateway(
    tmp_path: Path, status: int = 200, body: bytes | None = None, **kwargs
) -> AsyncIterator[tuple[Gatewayed, ScriptedPrefill, EchoBackend]]:
    """pd-extproc in kv-transfer-params mode and Envoy over one scripted prefill (answering ``status``
    and ``body``, by default a good answer with ``PARAMS``) and one recording decode backend."""
    answer = json.dumps({"kv_transfer_params": PARAMS}).encode() if body is None else body
    prefill = await start_scripted_prefill(status, answer)
    decode = await start_backend()
    specs = [endpoint(b.address, "a") for b in (prefill, decode)]
    try:
        async with gateway_over(
            tmp_path, specs[:1], specs[1:], {"handoff.mode": "kv-transfer-params"}, **kwargs
        ) as g:
            yield g, prefill, decode
    finally:
        await prefill.stop()
        await decode.stop()


@pytest.mark.parametrize("size", [6 * MIB, ENVOY_BODY_LIMIT_BYTES - 1024], ids=["6MiB", "16MiB-1KiB"])
async def test_kv_transfer_params_rewrites_long_bodies_through_both_envoy_listeners(tmp_path, size):
    """The prefill leg (through the prefill-leg listener) and the rewritten body (a ProcessingResponse
    over gRPC's 4 MiB default, up to one just under the buffer limit) both carry the long prompt."""
    async with kv_gateway(tmp_path) as (g, prefill, decode), aiohttp.ClientSession() as session:
        raw = chat_of_size(size)
        status, _, answer = await _post(session, g.gateway.url, raw)
        assert status == 200, answer[:300]
        ((_, leg),) = prefill.legs
        client_body = json.loads(raw)
        assert leg["messages"] == client_body["messages"]
        (seen,) = decode.requests
        assert seen["body"] == {**client_body, "kv_transfer_params": PARAMS}


# --- deeply nested JSON is bad input -----------------------------------------------------------------


async def test_deeply_nested_json_is_a_400_without_a_traceback(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ext_proc")
    async with stack(tmp_path, ["a"], ["a"]) as s, aiohttp.ClientSession() as session:
        depth = 100_000
        for field in (b"tools", b"messages"):
            raw = b'{"model": "m", "messages": [], "%s": %s%s}' % (field, b"[" * depth, b"]" * depth)
            status, headers, answer = await _post(session, s.gateway.url, raw)
            assert (status, headers["Content-Type"]) == (400, "application/json")
            error = json.loads(answer)["error"]
            assert error["code"] == "invalid_request"
            assert error["message"] == TOO_DEEP
        assert all(backend.requests == [] for backend in s.decodes.values())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    refusals = [r.getMessage() for r in caplog.records if "answered 400" in r.getMessage()]
    assert refusals == [f"answered 400 invalid_request: {TOO_DEEP}"] * 2


# --- Envoy's own error answers are OpenAI-style JSON; pd-extproc's pass byte for byte -------------------


def _shipped_404_body() -> bytes:
    routes = yaml.safe_load(SHIPPED_BOOTSTRAP.read_text())["static_resources"]["listeners"][0]
    routes = routes["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]
    (direct,) = [r for r in routes["routes"] if r.get("direct_response", {}).get("status") == 404]
    return direct["direct_response"]["body"]["inline_string"].encode()


async def test_pd_extproc_answers_reach_the_client_byte_for_byte(tmp_path):
    """The local-reply mappers leave pd-extproc's ImmediateResponse errors and the 404 route alone,
    including statuses the mappers rewrite for Envoy's own answers (503, 413)."""
    async with (
        gateway_over(tmp_path, [], []) as g,
        aiohttp.ClientSession() as session,
    ):
        raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        status, headers, answer = await _post(session, g.gateway.url, raw)
        message = json.loads(answer)["error"]["message"]
        assert (status, headers["Content-Type"]) == (503, "application/json")
        assert answer == error_body(503, message, "no_healthy_decode_endpoint")
        status, headers, answer = await _post(session, g.gateway.url, b"{not json")
        message = json.loads(answer)["error"]["message"]
        assert (status, headers["Content-Type"]) == (400, "application/json")
        assert answer == error_body(400, message, "invalid_request")
        async with session.get(f"{g.gateway.url}/admin") as response:
            assert (response.status, response.headers["Content-Type"]) == (404, "application/json")
            assert await response.read() == _shipped_404_body()


async def test_a_prefill_engines_own_413_is_not_taken_for_envoys(tmp_path):
    engine_error = b'{"error": {"message": "prompt too long for this engine", "type": "BadRequestError"}}'
    async with kv_gateway(tmp_path, 413, engine_error) as (g, _, decode), aiohttp.ClientSession() as session:
        status, headers, answer = await _post(session, g.gateway.url, chat_of_size(2000))
        assert (status, headers["Content-Type"], answer) == (413, "application/json", engine_error)
        assert decode.requests == []


async def test_envoys_refusals_of_the_http_request_are_json(tmp_path):
    async with stack(tmp_path, ["a"], ["a"]) as s, aiohttp.ClientSession() as session:
        huge = {"x-filler": "y" * 70 * 1024}
        status, headers, answer = await _post(session, s.gateway.url, chat_of_size(200), headers=huge)
        assert "60 KiB" in _envoy_error(status, headers, answer, 431, "headers_too_large")["message"]
        port = s.gateway.listen_port
        for request, expected in ((b"GET /v1/models HTTP/1.0\r\n\r\n", 426), (b"NOT HTTP\r\n\r\n", 400)):
            status, answer = await asyncio.to_thread(raw_http, port, request)
            assert status == expected
            assert json.loads(answer)["error"]["code"] == "bad_http_request"
        assert all(backend.requests == [] for backend in s.decodes.values())


async def test_a_dead_decode_and_a_dead_pd_extproc_get_json_errors(tmp_path):
    async with stack(tmp_path, ["a"], ["a"]) as s, aiohttp.ClientSession() as session:
        for backend in s.decodes.values():
            await backend.stop()
        status, headers, answer = await _post(session, s.gateway.url, chat_of_size(200))
        error = _envoy_error(status, headers, answer, 503, "upstream_unavailable")
        assert error["type"] == "service_unavailable" and "connection failure" in error["message"]
        await s.server.stop(grace=0.1)
        status, headers, answer = await _post(session, s.gateway.url, chat_of_size(200))
        error = _envoy_error(status, headers, answer, 503, "routing_unavailable")
        assert "not forwarded" in error["message"]


def _short_ext_proc_timeouts(bootstrap: dict) -> None:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"].update(message_timeout="0.2s", max_message_timeout="0.4s")


async def test_pd_extproc_answering_too_late_is_a_json_503_and_nothing_is_forwarded(tmp_path):
    """A prefill leg longer than the filter's max_message_timeout: Envoy gives up on the answer, lets the
    request through without a routing decision (failure_mode_allow) and the route without pd-extproc's
    header refuses it; pd-extproc sees its stream end and cancels the leg."""
    slow = json.dumps({"kv_transfer_params": PARAMS}).encode()
    async with kv_gateway(tmp_path, body=slow, edit=_short_ext_proc_timeouts) as (g, prefill, decode):
        prefill.delay = 2.0
        async with aiohttp.ClientSession() as session:
            status, headers, answer = await _post(session, g.gateway.url, chat_of_size(200))
        error = _envoy_error(status, headers, answer, 503, "routing_unavailable")
        assert "did not answer in time" in error["message"]
        assert decode.requests == []
        await until(lambda: prefill.cancelled == 1)
