"""The admin HTTP app: /debug/endpoints, /metrics, /healthz."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from builders import endpoint, registry_of

from ext_proc.admin import build_admin_app, endpoint_rows
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.registry import Registry

P1 = "10.0.0.1:8000"
D1 = "10.0.1.1:8000"
D2 = "[fd00::2]:8000"


def make_registry() -> Registry:
    decodes = (endpoint(D1, "g1", None), endpoint(D2, "g2", 8000.0, "DRAINING"))
    return registry_of((endpoint(P1, "g1", 2000.0),), decodes, 4096.0)


@pytest.fixture
def registry() -> Registry:
    return make_registry()


@pytest.fixture
async def client(registry: Registry) -> AsyncIterator[TestClient]:
    app = build_admin_app(registry, Metrics(registry.endpoints))
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as test_client:
        yield test_client


async def test_debug_endpoints_lists_every_endpoint_with_live_load(
    client: TestClient, registry: Registry
) -> None:
    lease = Lease(registry.prefills[0], 30, registry.decodes[0], 80)
    response = await client.get("/debug/endpoints")
    assert response.status == 200
    assert response.content_type == "application/json"
    rows = {row["address"]: row for row in await response.json()}
    assert rows == {
        P1: {
            "address": P1,
            "role": "prefill",
            "group": "g1",
            "healthy": True,
            "health_status": "HEALTHY",
            "pickable": True,
            "token_capacity": 2000.0,
            "active_tokens": 30,
            "active_requests": 1,
            "peer_tokens": 0,
            "peer_requests": 0,
            "blended_tokens": 30,
            "models": None,
            "models_from": None,
        },
        D1: {
            "address": D1,
            "role": "decode",
            "group": "g1",
            "healthy": True,
            "health_status": "HEALTHY",
            "pickable": True,
            "token_capacity": 4096.0,
            "active_tokens": 80,
            "active_requests": 1,
            "peer_tokens": 0,
            "peer_requests": 0,
            "blended_tokens": 80,
            "models": None,
            "models_from": None,
        },
        D2: {
            "address": D2,
            "role": "decode",
            "group": "g2",
            "healthy": False,
            "health_status": "DRAINING",
            "pickable": False,
            "token_capacity": 8000.0,
            "active_tokens": 0,
            "active_requests": 0,
            "peer_tokens": 0,
            "peer_requests": 0,
            "blended_tokens": 0,
            "models": None,
            "models_from": None,
        },
    }
    lease.release()
    rows = {row["address"]: row for row in await (await client.get("/debug/endpoints")).json()}
    assert (rows[D1]["active_tokens"], rows[D1]["active_requests"]) == (0, 0)


async def test_debug_endpoints_shows_departed_endpoint_while_in_flight(
    client: TestClient, registry: Registry
) -> None:
    lease = Lease(None, 0, registry.decodes[0], 5)
    registry.update([])
    rows = await (await client.get("/debug/endpoints")).json()
    assert [(r["address"], r["healthy"], r["pickable"], r["active_requests"]) for r in rows] == [
        (D1, True, False, 1)
    ]
    lease.release()


async def test_metrics_exposes_prometheus_text(client: TestClient, registry: Registry) -> None:
    lease = Lease(registry.prefills[0], 30, registry.decodes[0], 80)
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    text = await response.text()
    for name in (
        "pd_extproc_route_decisions_total",
        "pd_extproc_rejected_total",
        "pd_extproc_decision_seconds",
        "pd_extproc_endpoint_active_tokens",
        "pd_extproc_endpoint_active_requests",
    ):
        assert f"# TYPE {name} " in text, name
    assert f'pd_extproc_endpoint_active_tokens{{endpoint="{D1}",group="g1",role="decode"}} 80.0' in text
    assert f'pd_extproc_endpoint_active_requests{{endpoint="{P1}",group="g1",role="prefill"}} 1.0' in text
    lease.release()


async def test_healthz_reports_candidate_counts(client: TestClient) -> None:
    response = await client.get("/healthz")
    assert response.status == 200
    assert await response.json() == {"status": "ok", "prefills": 1, "decodes": 1}


async def test_healthz_is_ok_even_without_endpoints() -> None:
    registry = Registry("prefill", "decode", 1.0)
    app = build_admin_app(registry, Metrics(registry.endpoints))
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as test_client:
        response = await test_client.get("/healthz")
        assert await response.json() == {"status": "ok", "prefills": 0, "decodes": 0}


async def test_unknown_path_is_404(client: TestClient) -> None:
    assert (await client.get("/debug/nothing")).status == 404


def test_endpoint_rows_without_http(registry: Registry) -> None:
    rows = endpoint_rows(registry)
    assert [(r["address"], r["role"]) for r in rows] == [(P1, "prefill"), (D1, "decode"), (D2, "decode")]
