"""Malicious and broken headers through the real Envoy, sent as raw bytes (an HTTP client library would
refuse to send them): too many or too large headers, control characters in values, bytes that are not
UTF-8; and a decode engine answering bytes that are not HTTP. Envoy refuses the malformed ones at its
codec with a JSON error, before any filter: pd-extproc never sees them (Envoy's ext_proc stream count
stays put); what Envoy lets through, pd-extproc routes without a 500."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from builders import endpoint
from e2e_harness import Gatewayed, gateway_over, raw_http, wait_idle

from standins.backends import EchoBackend, start_backend, start_broken_engine

BODY = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()


def _raw_request(port: int, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """POST :data:`BODY` to the chat path with exactly ``headers`` (plus host, length, close), as bytes;
    the JSON answer's status and body."""
    lines = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        + lines
        + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(BODY)
        + BODY
    )
    return raw_http(port, request)


async def _ext_proc_streams(g: Gatewayed) -> int:
    """ext_proc streams Envoy has opened to pd-extproc so far (its ``streams_started`` counter)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{g.gateway.admin_url}/stats?filter=ext_proc.streams_started") as response,
    ):
        text = await response.text()
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())


@contextlib.asynccontextmanager
async def one_decode(tmp_path: Path) -> AsyncIterator[tuple[Gatewayed, EchoBackend]]:
    """pd-extproc and Envoy over one recording decode backend (no prefill)."""
    decode = await start_backend()
    try:
        async with gateway_over(tmp_path, [], [endpoint(decode.address, "a")]) as g:
            yield g, decode
    finally:
        await decode.stop()


def _error(status: int, body: bytes, expected: int, code: str) -> str:
    assert status == expected, (status, body)
    error = json.loads(body)["error"]
    assert error["code"] == code, error
    return error["message"]


async def test_malformed_headers_get_json_errors_from_envoy_and_never_reach_pd_extproc(tmp_path):
    async with one_decode(tmp_path) as (g, decode):
        port = g.gateway.listen_port
        before = await _ext_proc_streams(g)
        refusals = {
            "too many": [(b"x-h%d" % i, b"v") for i in range(120)],  # Envoy's limit: 100 headers
            "too large in all": [(b"x-h%d" % i, b"v" * 1024) for i in range(70)],  # 70 KiB > 60 KiB
        }
        for name, headers in refusals.items():
            status, body = await asyncio.to_thread(_raw_request, port, headers)
            message = _error(status, body, 431, "headers_too_large")
            assert "100 headers and 60 KiB" in message, name
        details = {}
        for char in (b"\x00", b"\x01", b"\x1b", b"\x7f"):
            status, body = await asyncio.to_thread(_raw_request, port, [(b"x-evil", b"a" + char + b"b")])
            details[char] = _error(status, body, 400, "bad_http_request")
        assert all("invalid_characters" in message for message in details.values()), details
        assert await _ext_proc_streams(g) == before and decode.requests == []


async def test_a_bare_cr_or_folded_value_is_cleaned_by_envoy_before_anyone_reads_it(tmp_path):
    async with one_decode(tmp_path) as (g, decode):
        port = g.gateway.listen_port
        for value in (b"a\rb", b"a\r x-injected: 1", b"a\r\n x-folded"):
            status, body = await asyncio.to_thread(_raw_request, port, [(b"x-evil", value)])
            assert status == 200, body
        seen = [request["headers"] for request in decode.requests]
        assert [h["x-evil"] for h in seen] == ["ab", "a x-injected: 1", "a x-folded"]
        assert all("x-injected" not in {k.lower() for k in h} for h in seen)


async def test_header_values_that_are_not_utf8_are_routed_without_a_500(tmp_path):
    """Envoy passes bytes 0x80-0xFF (HTTP's obs-text) through; pd-extproc reads the headers it uses
    (request id, authorization, the subset hint) leniently."""
    async with one_decode(tmp_path) as (g, decode):
        port = g.gateway.listen_port
        for name in (b"x-request-id", b"authorization", b"x-evil"):
            status, body = await asyncio.to_thread(_raw_request, port, [(name, b"\xff\xfe\x80 x")])
            assert status == 200, body
        assert len(decode.requests) == 3


async def test_a_decode_answering_garbage_gets_a_json_502(tmp_path):
    garbage = await start_broken_engine("garbage")
    try:
        decodes = [endpoint(garbage.address, "a")]
        async with gateway_over(tmp_path, [], decodes) as g, aiohttp.ClientSession() as session:
            async with session.post(f"{g.gateway.url}/v1/chat/completions", data=BODY) as response:
                status, headers, body = response.status, response.headers, await response.read()
            error = json.loads(body)["error"]
            assert (status, headers["content-type"]) == (502, "application/json")
            assert (error["code"], error["type"]) == ("upstream_bad_response", "bad_gateway")
            assert "protocol_error" in error["message"]
            assert await wait_idle(session, g.admin_url) == []  # released when Envoy ends the stream
    finally:
        await garbage.stop()
