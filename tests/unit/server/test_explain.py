"""``POST /debug/explain`` and ``pd-extproc explain`` against a real server: the decision a request would
get now, with the terms of the rule, booking nothing; bounded, with precise errors."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from grpc_harness import start_with

from ext_proc.cli import main
from ext_proc.explain import EXPLAIN_BODY_LIMIT_BYTES
from ext_proc.outcome import RequestMeta, Routed

CHAT = {"model": "m", "messages": [{"role": "user", "content": "explain me " * 200}], "max_tokens": 50}
DECODES = ["10.0.1.1:8000", "10.0.1.2:8000"]


@pytest.fixture
async def server(tmp_path):
    settings = {"affinity.prefix.enabled": True, "affinity.mode": "prefer"}
    running = await start_with(tmp_path, DECODES, settings=settings)
    yield running
    await running.stop(grace=0)


async def _explain(server, body: bytes, query: str = "") -> tuple[int, dict]:
    url = f"http://127.0.0.1:{server.admin_port}/debug/explain{query}"
    async with aiohttp.ClientSession() as session, session.post(url, data=body) as response:
        return response.status, await response.json()


def _loads(server) -> list[tuple[int, int]]:
    return [(e.active_tokens, e.active_requests) for e in server.router.registry.endpoints()]


async def test_explain_reports_the_decision_and_its_terms_and_books_nothing(server) -> None:
    body = json.dumps(CHAT).encode()
    before = _loads(server)
    status, report = await _explain(server, body)
    assert status == 200, report
    assert _loads(server) == before == [(0, 0)] * 3
    assert report["mode"] == "prefer" and report["unit"] == "utilisation"
    assert report["prompt_tokens"] > 0 and report["decode_tokens"] == report["prompt_tokens"] + 50
    decision = report["decision"]
    assert decision["prefill"] == "10.0.0.1:8000" and decision["decode"] in DECODES
    assert decision["locality"] == "same_group" and len(decision["fallbacks"]) == 1
    assert [p["cost"] for p in report["pairs"]] == sorted(p["cost"] for p in report["pairs"])
    assert decision["cost"] == report["pairs"][0]["cost"]
    assert {row["address"] for row in report["decodes"]} == set(DECODES)
    assert all(row["hit_tokens"] in (None, 0) for row in report["prefills"] + report["decodes"])  # none yet
    # Asked again, nothing changed: nothing was recorded in the prefix index or charged.
    assert (await _explain(server, body))[1]["decodes"] == report["decodes"]
    # Routed for real, the prompt is placed: now the chosen pair is credited its hit.
    routed = server.router.route_body(body, RequestMeta("/v1/chat/completions"))
    assert isinstance(routed, Routed)
    routed.lease.release()
    again = (await _explain(server, body))[1]
    held = {row["address"]: row["hit_tokens"] for row in again["prefills"] + again["decodes"]}
    assert held["10.0.0.1:8000"] > 0 and held[decision["decode"]] > 0
    assert again["pairs"][0]["cost"] < report["pairs"][0]["cost"]


async def test_a_short_prompt_to_another_path_is_decode_only(server) -> None:
    body = json.dumps({"model": "m", "input": "hi"}).encode()
    status, report = await _explain(server, body, "?path=/v1/embeddings&limit=1")
    assert status == 200
    assert report["decision"]["prefill"] is None and report["decision"]["locality"] == "decode_only"
    assert len(report["pairs"]) == 1 and report["pairs"][0]["prefill"] is None


@pytest.mark.parametrize(
    ("body", "query", "status", "code"),
    [
        (b"{not json", "", 400, "invalid_request"),
        (b'{"prompt": "x", "max_tokens": -1}', "", 400, "invalid_request"),
        (b"{}", "?limit=0", 400, "invalid_parameter"),
        (b"{}", "?limit=ten", 400, "invalid_parameter"),
        (b"{}", "?path=v1", 400, "invalid_parameter"),
        (b" " * (EXPLAIN_BODY_LIMIT_BYTES + 1), "", 413, "request_too_large"),
    ],
)
async def test_bad_asks_get_precise_errors(server, body, query, status, code) -> None:
    answer = await _explain(server, body, query)
    assert answer[0] == status and answer[1]["error"]["code"] == code, answer


async def test_switched_off_with_the_debug_endpoints(tmp_path) -> None:
    running = await start_with(tmp_path, DECODES, settings={"admin.debug_endpoints": False})
    try:
        status, answer = await _explain(running, json.dumps(CHAT).encode())
    finally:
        await running.stop(grace=0)
    assert status == 404 and answer["error"]["code"] == "disabled"


async def test_the_cli_prints_the_table_or_the_json(server, tmp_path, capsys) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(CHAT))
    admin = f"http://127.0.0.1:{server.admin_port}"
    assert await asyncio.to_thread(main, ["explain", str(request), "--admin", admin]) == 0
    out = capsys.readouterr().out
    assert out.startswith("/v1/chat/completions: ") and "decision: prefill 10.0.0.1:8000 -> decode" in out
    assert "cheapest pairs:" in out and "cost_from_other_groups" in out
    assert await asyncio.to_thread(main, ["explain", str(request), "--admin", admin, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decision"]["prefill"] == "10.0.0.1:8000"
    request.write_text("[]")
    assert await asyncio.to_thread(main, ["explain", str(request), "--admin", admin]) == 1
    assert "answered 400" in capsys.readouterr().err
    assert await asyncio.to_thread(main, ["explain", str(request), "--admin", "http://127.0.0.1:1"]) == 1
    assert "cannot ask http://127.0.0.1:1" in capsys.readouterr().err
