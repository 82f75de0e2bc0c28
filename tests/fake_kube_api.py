"""A small Kubernetes API server for pods, speaking the real list/watch wire format over HTTP.

``GET /api/v1/namespaces/{ns}/pods?labelSelector=...`` answers a ``PodList`` JSON carrying
``metadata.resourceVersion``; with ``watch=true&resourceVersion=N`` it streams, chunked, one JSON
watch event per line (``ADDED`` / ``MODIFIED`` / ``DELETED`` after version N, ``BOOKMARK`` to
watches that allow them, ``ERROR`` with a ``410 Expired`` status for a version older than the
compaction point) until the test ends it cleanly or drops the connection. Only the ``key in
(a,b)`` label selector form the discovery source sends is understood. Tests mutate the pods
(``put``, ``delete``, optionally ``silent``: the change is in no watch history, as if compacted
away) and steer the connection (``bookmark``, ``expire``, ``end_watches``, ``drop``,
``refuse``, ``stop`` / ``start``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_SELECTOR = re.compile(r"(?P<key>[^ ]+) in \((?P<values>[^)]*)\)")


@dataclass
class _Watch:
    namespace: str
    bookmarks: bool
    response: web.StreamResponse
    request: web.Request
    lines: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)


def _line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeApi:
    """The fake API server. ``requests`` records every request: ``kind`` (list / watch),
    ``namespace``, ``authorization`` and the query parameters."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, dict[str, Any]]] = {}
        self.version = 100
        self.compacted = 0
        self.history: list[tuple[int, str, bytes, dict[str, str]]] = []
        self.requests: list[dict[str, str]] = []
        self.list_gates: dict[str, asyncio.Event] = {}
        self.refusal: int | None = None
        self.port = 0
        self._watches: list[_Watch] = []
        self._runner: web.AppRunner | None = None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve on 127.0.0.1 (the same port again after :meth:`stop`)."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Drop every watch and stop listening: connections are refused until :meth:`start`."""
        self.drop()
        assert self._runner is not None
        await self._runner.cleanup()

    def kubeconfig(self, namespace: str = "team-a") -> str:
        """A kubeconfig (YAML) pointing at this server, with a bearer token and ``namespace``."""
        return (
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{self.port}'}}}}]\n"
            "users: [{name: tester, user: {token: secret-token}}]\n"
            f"contexts: [{{name: fake, context: {{cluster: fake, user: tester, namespace: {namespace}}}}}]\n"
        )

    # --- what the tests do to the pods ----------------------------------------------------

    def put(self, pod: dict[str, Any], *, silent: bool = False) -> int:
        """Create or replace ``pod``; returns its new resourceVersion."""
        pod = copy.deepcopy(pod)
        metadata = pod["metadata"]
        namespace = self.pods.setdefault(metadata["namespace"], {})
        kind = "MODIFIED" if metadata["name"] in namespace else "ADDED"
        self.version += 1
        metadata["resourceVersion"] = str(self.version)
        namespace[metadata["name"]] = pod
        if not silent:
            self._emit(kind, pod)
        return self.version

    def delete(self, namespace: str, name: str, *, silent: bool = False) -> int:
        """Delete a pod; returns the resourceVersion of the deletion."""
        pod = self.pods[namespace].pop(name)
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        if not silent:
            self._emit("DELETED", pod)
        return self.version

    def _emit(self, kind: str, pod: dict[str, Any]) -> None:
        labels = pod["metadata"].get("labels") or {}
        line = _line(kind, pod)
        self.history.append((self.version, pod["metadata"]["namespace"], line, labels))
        for watch in self._watches:
            if watch.namespace == pod["metadata"]["namespace"] and self._selected(watch.request, labels):
                watch.lines.put_nowait(line)

    # --- what the tests do to the connections ----------------------------------------------

    def watching(self, namespace: str) -> int:
        """How many watches of ``namespace`` are open."""
        return sum(w.namespace == namespace for w in self._watches)

    def bookmark(self) -> int:
        """Send a BOOKMARK at the current resourceVersion to every watch that allows bookmarks."""
        obj = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}}
        for watch in self._watches:
            if watch.bookmarks:
                watch.lines.put_nowait(_line("BOOKMARK", obj))
        return self.version

    def expire(self) -> None:
        """Compact the history up to the current version (only a watch from it stays possible); open
        watches get ``ERROR 410`` and end."""
        self.compacted = self.version
        for watch in self._watches:
            watch.lines.put_nowait(_line("ERROR", self._gone(watch.request)))
            watch.lines.put_nowait(None)

    def end_watches(self) -> None:
        """End every open watch cleanly, as the API server does when a watch's timeout is over."""
        for watch in self._watches:
            watch.lines.put_nowait(None)

    def drop(self) -> None:
        """Drop every open watch connection mid-stream (no end of the chunked body)."""
        for watch in self._watches:
            if watch.request.transport is not None:  # None: the client has gone already
                watch.request.transport.abort()
            watch.lines.put_nowait(None)

    def refuse(self, status: int | None) -> None:
        """Answer every request with this HTTP error status (``None``: serve again)."""
        self.refusal = status

    # --- the HTTP side --------------------------------------------------------------------

    def _selected(self, request: web.Request, labels: dict[str, str]) -> bool:
        match = _SELECTOR.fullmatch(request.query["labelSelector"])
        assert match is not None, f"unsupported label selector {request.query['labelSelector']!r}"
        return labels.get(match["key"]) in match["values"].split(",")

    def _gone(self, request: web.Request) -> dict[str, Any]:
        asked = request.query.get("resourceVersion", "")
        return _status(410, "Expired", f"too old resource version: {asked} ({self.compacted})")

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info["namespace"]
        watch = request.query.get("watch", "").lower() == "true"
        self.requests.append(
            {
                "kind": "watch" if watch else "list",
                "namespace": namespace,
                "authorization": request.headers.get("Authorization", ""),
                **request.query,
            }
        )
        if self.refusal is not None:
            status = _status(self.refusal, "Forbidden", f'pods is forbidden in namespace "{namespace}"')
            return web.json_response(status, status=self.refusal)
        if watch:
            return await self._watch(request, namespace)
        gate = self.list_gates.get(namespace)
        if gate is not None:
            await gate.wait()
        items = [
            p
            for p in self.pods.get(namespace, {}).values()
            if self._selected(request, p["metadata"]["labels"])
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _watch(self, request: web.Request, namespace: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        since = int(request.query["resourceVersion"])
        bookmarks = request.query.get("allowWatchBookmarks", "").lower() == "true"
        watch = _Watch(namespace, bookmarks, response, request)
        if since < self.compacted:
            watch.lines.put_nowait(_line("ERROR", self._gone(request)))
            watch.lines.put_nowait(None)
        else:
            for version, where, line, labels in self.history:
                if version > since and where == namespace and self._selected(request, labels):
                    watch.lines.put_nowait(line)
        self._watches.append(watch)
        try:
            while (line := await watch.lines.get()) is not None:
                await response.write(line)
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
        except ConnectionError:
            pass  # dropped
        finally:
            self._watches.remove(watch)
        return response
