"""Prefix-cache aware routing through the real Envoy: pd-extproc's index sends a tenant's next request to
the prefill and decode that hold its prompt, the simulated engines (prefix caching on) confirm the
hits, and the engines' counters come back through the engine load signal."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
from e2e_harness import gateway_over
from polling import until

from ext_proc.discovery.eds import write_eds_file
from sim.cluster import EngineSpec, endpoint_specs, start_cluster, stop_cluster
from sim.config import TimingConfig

SETTINGS = {
    "affinity.prefix.enabled": True,
    "engine_metrics.enabled": True,
    "engine_metrics.interval_seconds": 0.05,
}
TENANT_X = "x" * 8000  # 2,000 tokens by the gateway's estimate: 125 blocks of 16
TENANT_Y = "y" * 8000


def chat(system: str, question: str) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "sim-llama-3-8b", "messages": messages, "max_tokens": 4}


async def test_a_tenants_next_request_goes_where_its_prompt_is_cached(tmp_path: Path) -> None:
    engine_eds = tmp_path / "engines.json"
    # three of each: the round-robin tie-break alone would send the third request elsewhere
    specs = [EngineSpec(role, "a") for role in ("prefill", "decode") for _ in range(3)]
    engines = await start_cluster(specs, [engine_eds], timing=TimingConfig(enable_prefix_caching=True))
    try:
        prefills, decodes = endpoint_specs(engines, ["prefill"]), endpoint_specs(engines, ["decode"])
        write_eds_file(engine_eds, "pd", prefills + decodes)
        async with (
            gateway_over(tmp_path, prefills, decodes, SETTINGS) as g,
            aiohttp.ClientSession() as session,
        ):

            async def send(system: str, question: str) -> dict[str, str]:
                url = f"{g.gateway.url}/v1/chat/completions"
                async with session.post(url, json=chat(system, question)) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                    return dict(response.headers)

            first = await send(TENANT_X, "what is a prefill?")
            assert first["x-sim-prefill-cached-tokens"] == "0" and first["x-sim-cached-tokens"] == "0"
            await send(TENANT_Y, "and a decode?")
            again = await send(TENANT_X, "and what is a KV cache?")
            assert again["x-sim-prefill-engine"] == first["x-sim-prefill-engine"]
            assert again["x-sim-engine"] == first["x-sim-engine"]
            assert (
                int(again["x-sim-prefill-cached-tokens"]) >= 2000 - 16
            )  # the tenant's blocks, computed once
            assert int(again["x-sim-cached-tokens"]) >= 2000 - 16  # and not pulled again by the decode

            async def metrics() -> str:
                async with session.get(f"{g.admin_url}/metrics") as response:
                    return await response.text()

            text = await metrics()
            count = re.search(r'pd_extproc_prefix_predicted_hit_tokens_count\{role="prefill"\} (\S+)', text)
            total = re.search(r'pd_extproc_prefix_predicted_hit_tokens_sum\{role="prefill"\} (\S+)', text)
            assert count and float(count.group(1)) == 3.0
            assert total and float(total.group(1)) >= 2000 - 16  # only the third predicted a hit
            prefill = first["x-sim-prefill-engine"]
            hit = f'pd_extproc_prefix_engine_tokens_total{{endpoint="{prefill}",kind="hit"}}'

            async def engine_hits_reported() -> bool:
                found = re.search(re.escape(hit) + r" (\S+)", await metrics())
                return found is not None and float(found.group(1)) >= 2000 - 16

            await until(engine_hits_reported)
    finally:
        await stop_cluster(engines)
