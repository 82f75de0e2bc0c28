"""Flow control end to end through the real Envoy (its ext_proc filter's ``message_timeout`` cut to 1 s, so
that a wait past it shows the ``override_message_timeout`` honoured): with one in-flight slot held by a
decode that does not answer yet, a sheddable request gets 429 ``shed`` at once, the others queue (beyond
the queue's bound: 429 ``queue_full``), a client that goes away leaves the queue, and the slot goes to
the interactive request before the standard one that came first; a request waiting too long gets 503
``queue_timeout``; every refusal with ``Retry-After``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from builders import endpoint
from e2e_harness import Gatewayed, gateway_over, wait_idle
from polling import until
from prometheus_client.parser import text_string_to_metric_families

from standins.backends import EchoBackend, start_backend

RETRY_AFTER = 3


def _short_message_timeout(bootstrap: dict) -> None:
    """The gateway's ext_proc filter answers within 1 s unless pd-extproc asks for longer."""
    listener = next(
        entry for entry in bootstrap["static_resources"]["listeners"] if entry["name"] == "gateway"
    )
    filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["message_timeout"] = "1s"


@asynccontextmanager
async def flow_gateway(tmp_path: Path, **flow: object) -> AsyncIterator[tuple[Gatewayed, EchoBackend]]:
    """pd-extproc with one in-flight slot and flow control (``flow``: more of its keys), Envoy, one prefill
    and one decode backend."""
    prefill, decode = await start_backend(), await start_backend()
    settings = {
        "limits.max_inflight_requests": 1,
        "limits.retry_after_seconds": RETRY_AFTER,
        "flow_control.enabled": True,
        **{f"flow_control.{key}": value for key, value in flow.items()},
    }
    try:
        async with gateway_over(
            tmp_path,
            [endpoint(prefill.address, "a")],
            [endpoint(decode.address, "a")],
            settings,
            edit=_short_message_timeout,
        ) as g:
            yield g, decode
    finally:
        await prefill.stop()
        await decode.stop()


async def _chat(
    session: aiohttp.ClientSession, url: str, name: str, objective: str, tenant: str = "t"
) -> tuple[int, str | None, dict]:
    """POST a chat completion marked ``name``: its status, ``Retry-After`` and JSON answer."""
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": name}]}
    headers = {"x-gateway-inference-objective": objective, "x-gateway-inference-fairness-id": tenant}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, response.headers.get("retry-after"), json.loads(await response.read())


async def _metrics(session: aiohttp.ClientSession, admin_url: str) -> dict[tuple[str, tuple], float]:
    async with session.get(f"{admin_url}/metrics") as response:
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("pd_extproc_flow_")
    }


async def _queued(session: aiohttp.ClientSession, admin_url: str) -> float:
    metrics = await _metrics(session, admin_url)
    return sum(v for (name, _), v in metrics.items() if name == "pd_extproc_flow_queued_requests")


def _served(decode: EchoBackend) -> list[str]:
    return [request["body"]["messages"][0]["content"] for request in decode.requests]


async def test_priority_order_sheds_a_full_queue_and_a_client_leaving(tmp_path):
    async with (
        flow_gateway(tmp_path, max_queued_requests=3) as (g, decode),
        aiohttp.ClientSession() as session,
    ):
        url, admin = g.gateway.url, g.admin_url
        decode.answering.clear()
        first = asyncio.create_task(_chat(session, url, "first", "standard"))
        await until(lambda: len(decode.requests) == 1)
        status, retry_after, answer = await _chat(session, url, "batch", "batch")
        assert (status, retry_after, answer["error"]["code"]) == (429, str(RETRY_AFTER), "shed")
        standard = asyncio.create_task(_chat(session, url, "standard", "standard", "tenant-a"))
        await until(lambda: _queued(session, admin))
        interactive = asyncio.create_task(_chat(session, url, "interactive", "interactive", "tenant-b"))
        leaving = asyncio.create_task(_chat(session, url, "leaving", "no-such-objective", "tenant-c"))
        await until(lambda: _queued_is(session, admin, 3))
        status, retry_after, answer = await _chat(session, url, "overflow", "standard")
        assert (status, retry_after, answer["error"]["code"]) == (429, str(RETRY_AFTER), "queue_full")
        leaving.cancel()  # the client goes away: Envoy cancels its ext_proc stream
        await asyncio.gather(leaving, return_exceptions=True)
        await until(lambda: _queued_is(session, admin, 2))
        await asyncio.sleep(1.5)  # longer than the filter's message_timeout: the extension holds them
        decode.answering.set()
        results = await asyncio.gather(first, standard, interactive)
        assert [status for status, _, _ in results] == [200, 200, 200]
        assert _served(decode) == ["first", "interactive", "standard"]
        metrics = await _metrics(session, admin)
        outcomes = {
            (dict(labels)["priority"], dict(labels)["outcome"]): value
            for (name, labels), value in metrics.items()
            if name == "pd_extproc_flow_requests_total" and value
        }
        assert outcomes == {
            ("0", "dispatched"): 2,
            ("10", "dispatched"): 1,
            ("-1", "shed"): 1,
            ("0", "queue_full"): 1,
            ("0", "cancelled"): 1,
        }
        assert metrics["pd_extproc_flow_unknown_objectives_total", ()] == 1
        assert await wait_idle(session, admin) == []
        assert g.server.router.admission.inflight == 0


async def _queued_is(session: aiohttp.ClientSession, admin_url: str, count: int) -> bool:
    return await _queued(session, admin_url) == count


async def test_a_request_waiting_longer_than_max_queue_seconds_gets_503_with_retry_after(tmp_path):
    async with (
        flow_gateway(tmp_path, max_queue_seconds=1.5) as (g, decode),
        aiohttp.ClientSession() as session,
    ):
        decode.answering.clear()
        first = asyncio.create_task(_chat(session, g.gateway.url, "first", "interactive"))
        await until(lambda: len(decode.requests) == 1)
        status, retry_after, answer = await _chat(session, g.gateway.url, "late", "interactive")
        assert (status, retry_after) == (503, str(RETRY_AFTER))
        assert answer["error"]["code"] == "queue_timeout" and answer["error"]["type"] == "service_unavailable"
        decode.answering.set()
        assert (await first)[0] == 200
        assert _served(decode) == ["first"]


async def _get_models(session: aiohttp.ClientSession, url: str, objective: str) -> tuple[int, dict]:
    headers = {"x-gateway-inference-objective": objective, "x-gateway-inference-fairness-id": "t"}
    async with session.get(f"{url}/v1/models", headers=headers) as response:
        return response.status, json.loads(await response.read())


async def test_bodiless_requests_queue_and_the_engines_get_the_objectives_priority(tmp_path):
    async with (
        flow_gateway(tmp_path, engine_priority=True) as (g, decode),
        aiohttp.ClientSession() as session,
    ):
        url, admin = g.gateway.url, g.admin_url
        decode.answering.clear()
        first = asyncio.create_task(_chat(session, url, "first", "standard"))
        await until(lambda: len(decode.requests) == 1)
        status, answer = await _get_models(session, url, "batch")  # sheddable: no queue for it either
        assert (status, answer["error"]["code"]) == (429, "shed")
        listing = asyncio.create_task(_get_models(session, url, "interactive"))  # no body: queued too
        await until(lambda: _queued_is(session, admin, 1))
        body = {
            "model": "m",
            "max_tokens": 4,
            "priority": -99,
            "messages": [{"role": "user", "content": "i"}],
        }
        headers = {"x-gateway-inference-objective": "interactive", "x-gateway-inference-fairness-id": "t"}
        interactive = asyncio.create_task(
            session.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        )
        await until(lambda: _queued_is(session, admin, 2))
        async with session.get(f"{admin}/debug/queue") as response:
            view = await response.json()
        band = next(b for b in view["bands"] if b["priority"] == 10)
        assert (view["queued"], view["inflight"], band["queued"], band["flows"]) == (2, 1, 2, 1)
        assert [(f["fairness_id"], f["queued"]) for f in band["largest_flows"]] == [("t", 2)]
        assert band["oldest_wait_seconds"] > 0
        assert next(b for b in view["bands"] if b["priority"] == -1)["outcomes"]["shed"] == 1
        decode.answering.set()
        assert (await first)[0] == 200
        status, listed = await listing
        assert (
            status == 200 and listed["object"] == "list"
        )  # the decode's own list (no endpoint names its models)
        async with await interactive as response:
            assert response.status == 200
        chats = [r["body"] for r in decode.requests if "body" in r]
        assert [(c["messages"][0]["content"], c["priority"]) for c in chats] == [("first", 0), ("i", -10)]
        assert [r["path"] for r in decode.requests] == [
            "/v1/chat/completions",
            "/v1/models",
            "/v1/chat/completions",
        ]
        assert await wait_idle(session, admin) == []
        assert g.server.router.admission.inflight == 0
