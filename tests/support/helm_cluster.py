"""A stand-in Kubernetes API server for what Helm reads from a cluster while it renders a chart
(``helm template --dry-run=server``: the chart's ``lookup`` calls, and whether each object exists).

It answers as the real API server does, in its JSON wire format: ``/version``; the legacy discovery
documents (``/api``, ``/api/v1``, ``/apis``, ``/apis/{group}/{version}``: an ``APIVersions``,
``APIGroupList`` and ``APIResourceList`` naming the namespaced kinds it was given; the aggregated
form Helm asks for first is not offered, so Helm falls back to these, as it does with older
servers); and ``GET`` of one namespaced object, from :meth:`HelmCluster.put`, or a ``404 NotFound``
``Status``. Nothing else is served (a request for anything else is a 404 and is recorded in
``unexpected``): rendering never writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from aiohttp import web


def _plural(kind: str) -> str:
    """The resource name of ``kind`` (every kind the chart renders takes a plain ``s``)."""
    return kind.lower() + "s"


def _not_found(what: str) -> web.Response:
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"{what} not found",
        "reason": "NotFound",
        "code": 404,
    }
    return web.json_response(status, status=404)


class HelmCluster:
    """The stand-in, serving ``kinds`` (``(apiVersion, kind)`` pairs, all namespaced) on 127.0.0.1."""

    def __init__(self, kinds: set[tuple[str, str]]) -> None:
        self.kinds = kinds
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.unexpected: list[str] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    def put(self, obj: dict[str, Any], namespace: str, release: str) -> None:
        """Store ``obj`` (a manifest) as the cluster holds it once Helm installed it in ``namespace``
        as part of ``release``: with the ownership annotations Helm adds (and checks at an upgrade)."""
        stored = json.loads(json.dumps(obj))
        stored["metadata"].setdefault("namespace", namespace)
        owner = {"meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": namespace}
        stored["metadata"]["annotations"] = {**stored["metadata"].get("annotations", {}), **owner}
        stored["metadata"].setdefault("resourceVersion", "1")
        key = (stored["apiVersion"], _plural(stored["kind"]), namespace, stored["metadata"]["name"])
        self.objects[key] = stored

    def kubeconfig(self, folder: Path, namespace: str) -> Path:
        """A kubeconfig file in ``folder`` pointing at this server, its context in ``namespace``."""
        path = folder / "kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "helm", "user": {"token": "stand-in"}}],
            "contexts": [
                {
                    "name": "stand-in",
                    "context": {"cluster": "stand-in", "user": "helm", "namespace": namespace},
                }
            ],
            "current-context": "stand-in",
        }
        path.write_text(json.dumps(config))
        return path

    # --- wire ---------------------------------------------------------------------------

    def _group_versions(self) -> list[str]:
        return sorted({api for api, _ in self.kinds})

    def _resource_list(self, group_version: str) -> dict[str, Any]:
        resources = [
            {
                "name": _plural(kind),
                "singularName": kind.lower(),
                "namespaced": True,
                "kind": kind,
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            }
            for api, kind in sorted(self.kinds)
            if api == group_version
        ]
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": resources,
        }

    async def _version(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"major": "1", "minor": "30", "gitVersion": "v1.30.0", "platform": "linux/amd64"}
        )

    async def _core(self, _: web.Request) -> web.Response:
        address = [{"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.port}"}]
        return web.json_response(
            {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": address}
        )

    async def _groups(self, _: web.Request) -> web.Response:
        groups = []
        for group_version in self._group_versions():
            if "/" not in group_version:
                continue
            group, version = group_version.split("/")
            entry = {"groupVersion": group_version, "version": version}
            groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
        return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})

    async def _resources(self, request: web.Request) -> web.Response:
        group_version = request.match_info.get("group", "") + "/" + request.match_info["version"]
        group_version = group_version.removeprefix("/")
        if group_version not in self._group_versions():
            return _not_found(f"the server could not find {group_version}")
        return web.json_response(self._resource_list(group_version))

    async def _object(self, request: web.Request) -> web.Response:
        info = request.match_info
        api = f"{info['group']}/{info['version']}" if "group" in info else info["version"]
        key = (api, info["resource"], info["namespace"], info["name"])
        if key not in self.objects:
            return _not_found(f'{info["resource"]} "{info["name"]}"')
        return web.json_response(self.objects[key])

    async def _other(self, request: web.Request) -> web.Response:
        self.unexpected.append(f"{request.method} {request.path_qs}")
        return _not_found(request.path)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/version", self._version)
        app.router.add_get("/api", self._core)
        app.router.add_get("/apis", self._groups)
        app.router.add_get("/api/{version}", self._resources)
        app.router.add_get("/apis/{group}/{version}", self._resources)
        app.router.add_get("/api/{version}/namespaces/{namespace}/{resource}/{name}", self._object)
        app.router.add_get("/apis/{group}/{version}/namespaces/{namespace}/{resource}/{name}", self._object)
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner.cleanup()
            self._runner = None
