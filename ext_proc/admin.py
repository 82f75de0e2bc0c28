"""The admin HTTP endpoint: ``/metrics``, ``/debug/endpoints``, ``/debug/explain`` and ``/healthz``.

``/metrics`` is Prometheus; ``/debug/endpoints``, ``/debug/shared``, ``/debug/queue`` and
``/debug/explain`` are JSON, unless switched off."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ext_proc.metrics import Metrics
from ext_proc.registry import EndpointState, Registry

EngineView = Callable[[EndpointState], dict[str, object]]
"""What the engine load signal knows of an endpoint (:mod:`ext_proc.engine_load.scraper`'s ``describe``)."""
KvEventsView = Callable[[], dict[str, object] | None]
"""The ``kv-events`` source's block sizes (:meth:`ext_proc.kv_subscribers.KvEventSubscribers.report`)."""
Handler = Callable[[web.Request], Awaitable[web.Response]]


def endpoint_rows(registry: Registry, engine_view: EngineView | None = None) -> list[dict[str, object]]:
    """One row per known endpoint for ``/debug/endpoints``: identity, health, capacity and load.

    Each row says whether the router may pick the endpoint now (healthy and still listed: not a
    departed endpoint finishing its requests), its capacity (tokens) and live load:
    ``active_tokens`` and ``active_requests`` (every gateway replica's), of which ``peer_tokens`` and
    ``peer_requests`` the peer replicas' (shared state), ``blended_tokens`` (what the decision reads),
    ``models`` (the names it serves with their parents, ``null``: every model) and ``models_from``
    (``declared``, ``engine`` or ``null``: see :mod:`ext_proc.registry`) and, with
    ``engine_view`` (engine metrics enabled), ``engine``: the last engine sample, its age and freshness."""
    pickable = {id(s) for s in (*registry.prefills, *registry.decodes)}
    return [
        {
            "address": s.address,
            "role": s.role.value,
            "group": s.group,
            "healthy": s.healthy,
            "health_status": s.health_status,
            "pickable": id(s) in pickable,
            "token_capacity": s.token_capacity,
            "active_tokens": s.active_tokens,
            "active_requests": s.active_requests,
            "peer_tokens": s.peer_tokens,
            "peer_requests": s.peer_requests,
            "blended_tokens": s.blended_tokens,
            "models": None
            if s.served is None
            else [{"id": m.name, "parent": m.parent} for m in s.models() or ()],
            "models_from": _models_from(s),
        }
        | ({"engine": engine_view(s)} if engine_view is not None else {})
        for s in registry.endpoints()
    ]


def _models_from(state: EndpointState) -> str | None:
    """Where ``state``'s model list comes from: ``declared``, ``engine``, or ``None`` (every model)."""
    if state.declared_models is not None:
        return "declared"
    return None if state.engine_models is None else "engine"


def build_admin_app(
    registry: Registry,
    metrics: Metrics,
    debug_endpoints: bool = True,
    engine_view: EngineView | None = None,
    shared_view: Callable[[], dict[str, object]] | None = None,
    kv_events: KvEventsView | None = None,
    explain: Handler | None = None,
    client_max_size: int = 1024**2,
    queue_view: Callable[[], dict[str, object]] | None = None,
) -> web.Application:
    """The aiohttp application serving the admin routes.

    Without ``debug_endpoints`` (config ``admin.debug_endpoints``), ``/debug/endpoints`` and
    ``/debug/shared`` answer 404 with a JSON error; ``engine_view``: see :func:`endpoint_rows`;
    ``shared_view``: what ``/debug/shared`` shows of the shared state (its kind, this replica's name,
    the connection and each peer heard from). ``/healthz`` answers the number of pickable prefills and
    decodes and, while ``kv_events`` reports (the ``kv-events`` prefix source is in force),
    ``kv_events``: the pool's block size and the engines whose events are of another. ``explain``
    answers ``POST /debug/explain`` (:func:`ext_proc.explain.handler`; ``None``: 404, as switched off);
    ``client_max_size``: the largest request body read, in bytes. ``queue_view``: what ``GET
    /debug/queue`` shows of flow control (:meth:`ext_proc.flow.control.FlowControl.describe`; ``None``:
    flow control is off, and the page says so)."""

    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def endpoints_handler(_: web.Request) -> web.Response:
        return web.json_response(endpoint_rows(registry, engine_view))

    async def shared_handler(_: web.Request) -> web.Response:
        return web.json_response(shared_view() if shared_view is not None else {"kind": "local"})

    async def queue_handler(_: web.Request) -> web.Response:
        return web.json_response(queue_view() if queue_view is not None else {"enabled": False})

    async def debug_off_handler(request: web.Request) -> web.Response:
        error = {"message": f"{request.path} is switched off (admin.debug_endpoints)", "code": "disabled"}
        return web.json_response({"error": error}, status=404)

    async def healthz_handler(_: web.Request) -> web.Response:
        health: dict[str, object] = {
            "status": "ok",
            "prefills": len(registry.prefills),
            "decodes": len(registry.decodes),
        }
        report = None if kv_events is None else kv_events()
        if report is not None:
            health["kv_events"] = report
        return web.json_response(health)

    app = web.Application(client_max_size=client_max_size)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/debug/endpoints", endpoints_handler if debug_endpoints else debug_off_handler)
    app.router.add_get("/debug/shared", shared_handler if debug_endpoints else debug_off_handler)
    app.router.add_get("/debug/queue", queue_handler if debug_endpoints else debug_off_handler)
    app.router.add_post("/debug/explain", explain if debug_endpoints and explain else debug_off_handler)
    app.router.add_get("/healthz", healthz_handler)
    return app
