"""A decode that fails at once, through the real Envoy with the shipped outlier detection and pd-extproc
polling Envoy's admin (``envoy_health``): Envoy ejects it, pd-extproc stops naming it, the healthy
decode serves the rest; once Envoy takes it back it is a candidate again. And the fact that makes the
poll necessary: override_host forwards to a host pd-extproc names even when Envoy ejected it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
from builders import endpoint
from e2e_harness import Gatewayed, gateway_over
from polling import until
from prometheus_client.parser import text_string_to_metric_families

from sim.gateway import free_port
from standins.backends import BrokenEngine, EchoBackend, start_backend, start_broken_engine

BODY = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()


@contextlib.asynccontextmanager
async def _garbage_and_good(
    tmp_path: Path, poll: bool, edit: Callable[[dict], None] | None = None
) -> AsyncIterator[tuple[Gatewayed, BrokenEngine, EchoBackend]]:
    """Envoy over a decode answering garbage and a healthy one; ``poll``: pd-extproc reads Envoy's
    admin every 0.05 s. ``edit`` changes the decode cluster's outlier detection."""
    garbage, good = await start_broken_engine("garbage"), await start_backend()
    admin = free_port()

    def bootstrap(b: dict) -> None:
        b["admin"]["address"]["socket_address"]["port_value"] = admin
        if edit is not None:
            edit(next(c for c in b["static_resources"]["clusters"] if c["name"] == "decode"))

    settings = {"envoy_health.admin_url": f"http://127.0.0.1:{admin}", "envoy_health.interval_seconds": 0.05}
    decodes = [endpoint(a, "a") for a in (garbage.address, good.address)]
    try:
        async with gateway_over(tmp_path, [], decodes, settings if poll else None, edit=bootstrap) as g:
            yield g, garbage, good
    finally:
        await garbage.stop()
        await good.stop()


async def _post(session: aiohttp.ClientSession, g: Gatewayed) -> int:
    async with session.post(f"{g.gateway.url}/v1/chat/completions", data=BODY) as response:
        await response.read()
        return response.status


async def _envoy_ejected(session: aiohttp.ClientSession, g: Gatewayed) -> int:
    """Hosts of the decode cluster Envoy's outlier detection holds ejected now."""
    stat = "decode.outlier_detection.ejections_active"
    async with session.get(f"{g.gateway.admin_url}/stats?filter={stat}") as r:
        return int((await r.text()).split(":")[1])


async def _health_changes(session: aiohttp.ClientSession, g: Gatewayed, change: str) -> float:
    """pd-extproc's ``pd_extproc_envoy_health_changes_total`` of decodes for ``change``."""
    text = await (await session.get(f"{g.admin_url}/metrics")).text()
    (value,) = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pd_extproc_envoy_health_changes_total"
        and sample.labels == {"role": "decode", "change": change}
    ]
    return value


async def test_override_host_forwards_to_an_ejected_host_it_is_told_to(tmp_path):
    """Each garbage answer is retried on the healthy fallback (the decode-only route retries resets,
    a non-HTTP answer included), so clients get 200s; the garbage decode still gets the requests."""
    async with _garbage_and_good(tmp_path, poll=False) as (g, garbage, good), aiohttp.ClientSession() as s:
        statuses = [await _post(s, g) for _ in range(8)]
        assert await _envoy_ejected(s, g) == 1
        # pd-extproc alone never learns it: the ejected decode keeps getting its share (least loaded).
        before = garbage.requests
        later = [await _post(s, g) for _ in range(4)]
        assert garbage.requests > before and await _envoy_ejected(s, g) == 1
        assert statuses + later == [200] * 12 and len(good.requests) == 12


async def test_a_garbage_decode_is_ejected_and_the_healthy_one_serves_the_rest(tmp_path):
    def long(cluster: dict) -> None:  # the shipped detection; an ejection outlasting any slow machine
        cluster["outlier_detection"] |= {"base_ejection_time": "600s", "max_ejection_time": "600s"}

    async with (
        _garbage_and_good(tmp_path, poll=True, edit=long) as (g, garbage, good),
        aiohttp.ClientSession() as s,
    ):
        ejections = g.server.router.decode_ejections

        async def held() -> bool:
            assert await _post(s, g) == 200  # a garbage answer is retried on the healthy decode
            return garbage.address in ejections.ejected()

        await until(held)
        assert garbage.requests >= 3
        served, tried = len(good.requests), garbage.requests
        assert [await _post(s, g) for _ in range(20)] == [200] * 20
        assert len(good.requests) == served + 20 and garbage.requests == tried
        assert await _health_changes(s, g, "ejected") == 1


async def test_a_decode_envoy_takes_back_is_a_candidate_again(tmp_path):
    def short(cluster: dict) -> None:
        cluster["outlier_detection"] |= {"interval": "0.1s", "base_ejection_time": "0.2s"}

    async with (
        _garbage_and_good(tmp_path, poll=True, edit=short) as (g, garbage, _good),
        aiohttp.ClientSession() as s,
    ):
        ejections = g.server.router.decode_ejections
        seen = set()

        async def state_seen(held: bool) -> bool:
            await _post(s, g)
            seen.add(garbage.address in ejections.ejected())
            return held in seen

        await until(lambda: state_seen(True))
        seen.clear()
        await until(lambda: state_seen(False))  # Envoy took it back, and pd-extproc names it again
        assert await _health_changes(s, g, "returned") >= 1  # the series exists at 0 from the ejection on
