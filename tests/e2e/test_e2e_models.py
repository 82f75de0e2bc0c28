"""Routing by model through the real Envoy: two models on the simulated engines (each refusing the other's
requests with vLLM's 404, so a request on a wrong engine fails the test), 404 for an unknown model,
the rewrite header, and ``GET /v1/models`` answered with the union; the same with the models listed by
the engines themselves instead of declared."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp
import pytest
from e2e_harness import gateway_over
from polling import until

from ext_proc.discovery.eds import write_eds_file
from sim.cluster import EngineSpec, endpoint_specs, start_cluster, stop_cluster

MODELS = {"alpha": "ga", "beta": "gb"}  # the model each group serves
ROLES = ("prefill", "decode", "decode")


def chat(model: str, text: str = "route me by model " * 40) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3}


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "engine-lists"])
async def test_each_model_goes_only_to_its_engines_and_an_unknown_one_is_404(
    tmp_path: Path, declared: bool
) -> None:
    engine_eds = tmp_path / "engines.json"
    specs = [EngineSpec(role, group, model=model) for model, group in MODELS.items() for role in ROLES]
    engines = await start_cluster(specs, [engine_eds])
    serving = {model: {e.address for e in engines if e.engine.config.model == model} for model in MODELS}
    try:
        prefills, decodes = endpoint_specs(engines, ["prefill"]), endpoint_specs(engines, ["decode"])
        assert all(s.models is not None for s in prefills + decodes)
        write_eds_file(engine_eds, "pd", prefills + decodes)
        settings: dict[str, object] = {"affinity.mode": "prefer"}
        if not declared:  # the engines' own GET /v1/models says it
            prefills = [dataclasses.replace(s, models=None) for s in prefills]
            decodes = [dataclasses.replace(s, models=None) for s in decodes]
            settings |= {
                "engine_metrics.enabled": True,
                "engine_metrics.interval_seconds": 0.05,
                "engine_metrics.models_interval_seconds": 0.05,
            }
        async with (
            gateway_over(tmp_path, prefills, decodes, settings) as g,
            aiohttp.ClientSession() as session,
        ):

            async def rows() -> list[dict]:
                async with session.get(f"{g.admin_url}/debug/endpoints") as response:
                    return await response.json()

            async def every_list_known() -> bool:
                return all(row["models"] is not None for row in await rows())

            await until(every_list_known)
            for row in await rows():
                assert row["models_from"] == ("declared" if declared else "engine")
                assert [m["id"] for m in row["models"]] == [
                    next(m for m in MODELS if row["address"] in serving[m])
                ]

            url = f"{g.gateway.url}/v1/chat/completions"
            for _ in range(6):
                for model in MODELS:
                    async with session.post(url, json=chat(model)) as response:
                        assert response.status == 200, await response.text()
                        assert (await response.json())["model"] == model
                        assert response.headers["x-sim-engine"] in serving[model]
                        assert response.headers["x-sim-prefill-engine"] in serving[model]

            async with session.post(url, json=chat("gamma")) as response:
                assert response.status == 404
                error = (await response.json())["error"]
                assert (error["code"], error["param"]) == ("model_not_found", "model")
                assert "'gamma'" in error["message"]

            rewrite = {"x-gateway-model-name-rewrite": "beta"}
            async with session.post(url, json=chat("alpha"), headers=rewrite) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["model"] == "beta"  # the body the engine got said beta
                assert response.headers["x-sim-engine"] in serving["beta"]

            async with session.post(url, json=chat("")) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == "model"

            async with session.get(f"{g.gateway.url}/v1/models") as response:
                assert response.status == 200
                listed = await response.json()
                assert listed["object"] == "list", listed
                assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]

            async with session.get(f"{g.admin_url}/metrics") as response:
                text = await response.text()
            assert 'pd_extproc_model_requests_total{model="alpha"} 6.0' in text
            assert 'pd_extproc_model_requests_total{model="beta"} 7.0' in text
            assert 'pd_extproc_rejected_total{reason="model_not_found"} 1.0' in text
    finally:
        await stop_cluster(engines)
