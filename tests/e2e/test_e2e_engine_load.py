"""Two gateway replicas (two real Envoys, two pd-extprocs) over simulated engines: with the engine load
signal, one replica sees the load the other placed and routes around it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from e2e_harness import Gatewayed, gateway_over
from polling import until

from ext_proc.discovery.eds import write_eds_file
from sim.cluster import EngineSpec, endpoint_specs, start_cluster, stop_cluster

ENGINE_METRICS = {"engine_metrics.enabled": True, "engine_metrics.interval_seconds": 0.05}
PROMPT = "the cache " * 800  # about 2,000 tokens by the gateway's estimate


@contextlib.asynccontextmanager
async def two_replicas(tmp_path: Path) -> AsyncIterator[tuple[Gatewayed, Gatewayed, set[str]]]:
    engine_eds = tmp_path / "engines.json"
    specs = [EngineSpec("prefill", "a"), EngineSpec("decode", "a"), EngineSpec("decode", "a")]
    engines = await start_cluster(specs, [engine_eds])
    try:
        prefills = endpoint_specs(engines, ["prefill"])
        decodes = endpoint_specs(engines, ["decode"])
        write_eds_file(engine_eds, "pd", prefills + decodes)
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        async with (
            gateway_over(tmp_path / "a", prefills, decodes, ENGINE_METRICS) as first,
            gateway_over(tmp_path / "b", prefills, decodes, ENGINE_METRICS) as second,
        ):
            yield first, second, {d.address for d in decodes}
    finally:
        await stop_cluster(engines)


async def rows(session: aiohttp.ClientSession, g: Gatewayed) -> dict[str, dict]:
    async with session.get(f"{g.admin_url}/debug/endpoints") as response:
        return {(r["role"], r["address"]): r for r in await response.json()}


async def test_a_replica_routes_around_the_load_another_one_placed(tmp_path: Path) -> None:
    async with two_replicas(tmp_path) as (first, second, decodes), aiohttp.ClientSession() as session:
        body = {"model": "sim-llama-3-8b", "prompt": PROMPT, "max_tokens": 4000, "stream": True}
        long = await session.post(f"{first.gateway.url}/v1/completions", json=body)
        assert long.status == 200
        busy = long.headers["x-sim-engine"]
        idle = (decodes - {busy}).pop()

        async def second_sees_it() -> bool:
            row = (await rows(session, second))[("decode", busy)]
            return row["engine"]["fresh"] and row["engine"]["kv_usage"] > 0 and row["blended_tokens"] >= 2000

        await until(second_sees_it)
        view = (await rows(session, second))[("decode", busy)]
        assert view["active_tokens"] == 0  # the second replica placed nothing there itself
        assert view["engine"]["error"] is None and view["engine"]["age_seconds"] < 1
        for _ in range(3):  # the second replica's own requests go to the idle decode
            short = {"model": "sim-llama-3-8b", "prompt": PROMPT, "max_tokens": 2}
            async with session.post(f"{second.gateway.url}/v1/completions", json=short) as response:
                assert response.status == 200
                assert response.headers["x-sim-engine"] == idle
        long.close()
        async with session.get(f"{second.admin_url}/metrics") as response:
            text = await response.text()
        assert 'pd_extproc_engine_scrapes_total{outcome="ok"}' in text
        assert "pd_extproc_endpoint_blended_tokens" in text
