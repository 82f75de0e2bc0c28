"""A small Kubernetes API server for pods and InferencePools, speaking the real list/watch wire format.

Two namespaced resources: pods (``/api/v1/namespaces/{ns}/pods``) and GIE's InferencePools, a custom
resource (``/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools``). A list answers a
``PodList`` / ``InferencePoolList`` JSON carrying ``metadata.resourceVersion``, filtered by
``labelSelector`` (every form the API server parses: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``,
``k notin (a,b)``, ``k``, ``!k``, comma-separated) and ``fieldSelector`` (``metadata.name`` and
``metadata.namespace``, as for custom resources; another field is a ``400``). ``GET .../{name}``
answers the object or a ``404 NotFound`` status. With ``watch=true&resourceVersion=N`` it streams,
chunked, one JSON watch event per line until the test ends it cleanly or drops the connection. As the
API server's watch cache does, each change after version N is judged against the watch's selectors on
the object's state before and after it: ``ADDED`` (now selected, not before), ``MODIFIED`` (both),
``DELETED`` (selected before, not now or deleted: the previous state at the change's
resourceVersion), nothing otherwise; ``BOOKMARK`` to watches that allow them, ``ERROR`` with a ``410
Expired`` status for a version older than the compaction point (after a restart: every version
before it, as the real server's watch cache starts empty). Every JSON body ends with a newline, as
the real server's do. Tests mutate the objects (``put``,
``delete``, optionally ``silent``: the change is in no watch history, as if compacted away), gate
lists (``list_gates``), take the InferencePool CRD away (``crd_installed``) and steer the
connection (``bookmark``, ``expire``, ``end_watches``, ``drop``, ``refuse``, ``stop`` / ``start``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

POOL_GROUP = "inference.networking.k8s.io"


@dataclass(frozen=True)
class Resource:
    """A namespaced resource the fake serves."""

    plural: str
    kind: str
    api_version: str
    prefix: str


PODS = Resource("pods", "Pod", "v1", "/api/v1")
POOLS = Resource("inferencepools", "InferencePool", f"{POOL_GROUP}/v1", f"/apis/{POOL_GROUP}/v1")
RESOURCES = {r.kind: r for r in (PODS, POOLS)}
FIELDS = ("metadata.name", "metadata.namespace")
"""The field selectors a custom resource supports (pods support these too)."""


class BadSelector(ValueError):
    """A selector the API server would refuse with ``400 BadRequest``."""


_KEY = r"[^\s=!(),]+"
_NOT_EXISTS = re.compile(rf"\s*!\s*(?P<key>{_KEY})\s*")
_SET = re.compile(rf"\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s+\((?P<values>[^()]*)\)\s*")
_EQUALITY = re.compile(rf"\s*(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>[^\s=!(),]*)\s*")
_EXISTS = re.compile(rf"\s*(?P<key>{_KEY})\s*")

Match = Callable[[dict[str, str]], bool]


def _requirements(selector: str) -> list[str]:
    """``selector`` split at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(selector[start:index])
            start = index + 1
    parts.append(selector[start:])
    return parts


def _requirement(text: str) -> Match:
    if match := _NOT_EXISTS.fullmatch(text):
        key = match["key"]
        return lambda labels: key not in labels
    if match := _SET.fullmatch(text):
        key, values = match["key"], {v.strip() for v in match["values"].split(",")}
        if match["op"] == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _EQUALITY.fullmatch(text):
        key, value = match["key"], match["value"]
        if match["op"] == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if match := _EXISTS.fullmatch(text):
        key = match["key"]
        return lambda labels: key in labels
    raise BadSelector(f"unable to parse requirement: {text.strip()!r}")


def label_selector(selector: str) -> Match:
    """The API server's label selector semantics: every requirement holds (``""``: everything)."""
    if not selector.strip():
        return lambda labels: True
    requirements = [_requirement(part) for part in _requirements(selector)]
    return lambda labels: all(requirement(labels) for requirement in requirements)


def field_selector(selector: str) -> Callable[[dict[str, Any]], bool]:
    """``metadata.name`` / ``metadata.namespace`` requirements (``=``, ``==``, ``!=``), comma-separated."""
    checks: list[tuple[str, bool, str]] = []
    for part in _requirements(selector) if selector.strip() else ():
        match = re.fullmatch(r"\s*(?P<field>[^=!\s]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s,]*)\s*", part)
        if match is None:
            raise BadSelector(f"invalid field selector: {part.strip()!r}")
        if match["field"] not in FIELDS:
            raise BadSelector(f"field label not supported: {match['field']}")
        checks.append((match["field"].partition(".")[2], match["op"] != "!=", match["value"]))
    return lambda obj: all((obj["metadata"].get(f) == v) is want for f, want, v in checks)


@dataclass(frozen=True)
class _Change:
    """One change of an object: its state before (``None``: created) and after (``None``: deleted)."""

    version: int
    resource: Resource
    namespace: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


@dataclass
class _Watch:
    resource: Resource
    namespace: str
    bookmarks: bool
    selects: Callable[[dict[str, Any]], bool]
    response: web.StreamResponse
    request: web.Request
    lines: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)


def _json(obj: dict[str, Any], status: int = 200) -> web.Response:
    """A JSON response as the API server writes it (Go's JSON encoder: the object, then a newline)."""
    return web.Response(text=json.dumps(obj) + "\n", status=status, content_type="application/json")


def _line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def _status(code: int, reason: str, message: str, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        **extra,
        "code": code,
    }


def _event(change: _Change, selects: Callable[[dict[str, Any]], bool]) -> bytes | None:
    """The watch event ``change`` is for a watch selecting with ``selects`` (None: no event)."""
    before = change.before is not None and selects(change.before)
    after = change.after is not None and selects(change.after)
    if after:
        assert change.after is not None
        return _line("MODIFIED" if before else "ADDED", change.after)
    if before:
        assert change.before is not None
        gone = copy.deepcopy(change.before)
        gone["metadata"]["resourceVersion"] = str(change.version)
        return _line("DELETED", gone)
    return None


class FakeKubeApi:
    """The fake Kubernetes API server; ``requests`` records every request.

    A request's record: ``kind`` (list / watch / get), ``resource`` (pods / inferencepools), ``namespace``,
    ``authorization`` and the query parameters. ``list_gates`` maps ``(resource, namespace)`` to an event a
    list waits for."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        """``(resource plural, namespace)`` → name → object."""
        self.version = 100
        self.compacted = 0
        self.history: list[_Change] = []
        self.requests: list[dict[str, str]] = []
        self.list_gates: dict[tuple[str, str], asyncio.Event] = {}
        self.refusal: int | None = None
        self.crd_installed = True
        self.port = 0
        self._watches: list[_Watch] = []
        self._runner: web.AppRunner | None = None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve on 127.0.0.1 (the same port again after :meth:`stop`).

        As a (re)started API server's watch cache, the event history starts now: a watch from an older version
        gets ``410 Expired``."""
        self.history = []
        self.compacted = self.version
        app = web.Application()
        for resource in RESOURCES.values():
            path = f"{resource.prefix}/namespaces/{{namespace}}/{resource.plural}"
            app.router.add_get(path, self._handler(resource, self._collection))
            app.router.add_get(path + "/{name}", self._handler(resource, self._get))
        # handler_cancellation: a watch whose client went away ends, as the API server's does
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True)
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

    # --- what the tests do to the objects -------------------------------------------------

    def put(self, obj: dict[str, Any], *, silent: bool = False) -> int:
        """Create or replace ``obj``; returns its new resourceVersion.

        ``obj``: a Pod or an InferencePool, by its ``kind``."""
        obj = copy.deepcopy(obj)
        resource = RESOURCES[obj["kind"]]
        metadata = obj["metadata"]
        stored = self.objects.setdefault((resource.plural, metadata["namespace"]), {})
        before = stored.get(metadata["name"])
        self.version += 1
        metadata["resourceVersion"] = str(self.version)
        stored[metadata["name"]] = obj
        self._emit(_Change(self.version, resource, metadata["namespace"], before, obj), silent)
        return self.version

    def delete(self, namespace: str, name: str, *, kind: str = "Pod", silent: bool = False) -> int:
        """Delete an object; returns the resourceVersion of the deletion."""
        resource = RESOURCES[kind]
        before = self.objects[(resource.plural, namespace)].pop(name)
        self.version += 1
        self._emit(_Change(self.version, resource, namespace, before, None), silent)
        return self.version

    def _emit(self, change: _Change, silent: bool) -> None:
        if silent:
            return
        self.history.append(change)
        for watch in self._watches:
            if (watch.resource, watch.namespace) == (change.resource, change.namespace):
                line = _event(change, watch.selects)
                if line is not None:
                    watch.lines.put_nowait(line)

    # --- what the tests do to the connections ----------------------------------------------

    def watching(self, namespace: str, resource: str = "pods") -> int:
        """How many watches of ``resource`` in ``namespace`` are open."""
        return sum((w.resource.plural, w.namespace) == (resource, namespace) for w in self._watches)

    def bookmark(self) -> int:
        """Send a BOOKMARK at the current resourceVersion to every watch that allows bookmarks."""
        for watch in self._watches:
            if watch.bookmarks:
                obj = {
                    "kind": watch.resource.kind,
                    "apiVersion": watch.resource.api_version,
                    "metadata": {"resourceVersion": str(self.version)},
                }
                watch.lines.put_nowait(_line("BOOKMARK", obj))
        return self.version

    def expire(self) -> None:
        """Compact the history up to the current version; open watches end.

        Only a watch from the current version stays possible; open watches get ``ERROR 410``."""
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

    def _gone(self, request: web.Request) -> dict[str, Any]:
        asked = request.query.get("resourceVersion", "")
        return _status(410, "Expired", f"too old resource version: {asked} ({self.compacted})")

    def _handler(self, resource: Resource, serve: Callable[..., Any]) -> Callable[..., Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            namespace = request.match_info["namespace"]
            watch = request.query.get("watch", "").lower() == "true"
            kind = "get" if "name" in request.match_info else "watch" if watch else "list"
            self.requests.append(
                {
                    "kind": kind,
                    "resource": resource.plural,
                    "namespace": namespace,
                    "authorization": request.headers.get("Authorization", ""),
                    **request.query,
                }
            )
            if resource is POOLS and not self.crd_installed:
                status = _status(404, "NotFound", "the server could not find the requested resource")
                return _json(status, status=404)
            if self.refusal is not None:
                message = f'{resource.plural} is forbidden in namespace "{namespace}"'
                return _json(_status(self.refusal, "Forbidden", message), status=self.refusal)
            return await serve(request, resource, namespace)

        return handle

    async def _get(self, request: web.Request, resource: Resource, namespace: str) -> web.StreamResponse:
        name = request.match_info["name"]
        obj = self.objects.get((resource.plural, namespace), {}).get(name)
        if obj is None:
            group = resource.api_version.rpartition("/")[0]
            qualified = f"{resource.plural}.{group}" if group else resource.plural
            details = {"name": name, "group": group, "kind": resource.plural}
            status = _status(404, "NotFound", f'{qualified} "{name}" not found', details=details)
            return _json(status, status=404)
        return _json(obj)

    async def _collection(
        self, request: web.Request, resource: Resource, namespace: str
    ) -> web.StreamResponse:
        try:
            labels = label_selector(request.query.get("labelSelector", ""))
            fields = field_selector(request.query.get("fieldSelector", ""))
        except BadSelector as exc:
            return _json(_status(400, "BadRequest", str(exc)), status=400)

        def selects(obj: dict[str, Any]) -> bool:
            return labels(obj["metadata"].get("labels") or {}) and fields(obj)

        if request.query.get("watch", "").lower() == "true":
            return await self._watch(request, resource, namespace, selects)
        gate = self.list_gates.get((resource.plural, namespace))
        if gate is not None:
            await gate.wait()
        items = [o for o in self.objects.get((resource.plural, namespace), {}).values() if selects(o)]
        return _json(
            {
                "kind": f"{resource.kind}List",
                "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _watch(
        self,
        request: web.Request,
        resource: Resource,
        namespace: str,
        selects: Callable[[dict[str, Any]], bool],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        since = int(request.query["resourceVersion"])
        bookmarks = request.query.get("allowWatchBookmarks", "").lower() == "true"
        watch = _Watch(resource, namespace, bookmarks, selects, response, request)
        if since < self.compacted:
            watch.lines.put_nowait(_line("ERROR", self._gone(request)))
            watch.lines.put_nowait(None)
        else:
            for change in self.history:
                if change.version > since and (change.resource, change.namespace) == (resource, namespace):
                    line = _event(change, selects)
                    if line is not None:
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
