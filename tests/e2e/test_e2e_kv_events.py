"""The ``kv-events`` prefix source end to end: simulated engines (a process of their own) publishing their
KV-cache events over ZMQ, ``pd-extproc serve`` subscribed to each one on the port EDS names, the real
Envoy in front: a prompt sent straight to one prefill engine, which only its events can tell the
gateway about, routes the next request that repeats it to that engine."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import aiohttp
import pytest

from sim.cluster import EngineSpec
from sim.config import KvEventsConfig, TimingConfig
from sim.stack import Stack, start_stack

CONFIG = {
    "affinity": {"prefix": {"enabled": True, "source": "kv-events", "kv_events": {"recent_seconds": 0}}}
}
PROMPT_TOKENS = 160  # 10 blocks of 16


@pytest.fixture
def stack() -> Iterator[Stack]:
    specs = [EngineSpec(role, "a") for role in ("prefill", "decode") for _ in range(3)]
    timing = TimingConfig(enable_prefix_caching=True, time_scale=0.2)
    running = start_stack(specs, timing, kv_events=KvEventsConfig(encoding="map", hashes="bytes"))
    try:
        yield running
    finally:
        running.stop()


async def test_a_prompt_an_engine_reported_routes_there(stack: Stack) -> None:
    url = await stack.route_with("prefer", pd_threshold_tokens=0, config=CONFIG)
    prefills = [e for e in stack.cluster.engines if e.role == "prefill"]
    assert all(e.kv_events_port for e in stack.cluster.engines)
    prompts = iter(range(1_000, 1_000_000, PROMPT_TOKENS))

    def prompt() -> list[int]:
        first = next(prompts)
        return list(range(first, first + PROMPT_TOKENS))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def complete(base: str, ids: list[int]) -> dict[str, str]:
            body = {"model": "sim-llama-3-8b", "prompt": ids, "max_tokens": 2}
            async with session.post(f"{base}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
                return dict(response.headers)

        async def index_blocks(address: str) -> float:
            async with session.get(f"{stack.admin_url}/metrics") as response:
                text = await response.text()
            sample = rf'pd_extproc_kv_index_blocks{{endpoint="{re.escape(address)}",tier="GPU"}} (\S+)'
            found = re.search(sample, text)
            return float(found.group(1)) if found else 0.0

        async def indexed(address: str, ids: list[int]) -> bool:
            """Send ``ids`` straight to the engine; whether the gateway indexed its blocks within a
            second (a subscriber that joined late missed them)."""
            before = await index_blocks(address)
            await complete(f"http://{address}", ids)
            for _ in range(20):
                if await index_blocks(address) > before:
                    return True
                await asyncio.sleep(0.05)
            return False

        for engine in prefills:
            ids = prompt()
            while not await indexed(engine.address, ids):
                ids = prompt()
            headers = await complete(url, ids)
            assert headers["x-sim-prefill-engine"] == engine.address
            assert int(headers["x-sim-prefill-cached-tokens"]) >= PROMPT_TOKENS - 16
