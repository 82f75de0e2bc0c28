"""What the Kubernetes API discovery sources share: API access, list + watch, retries, coalesced publishes.

A :class:`Collection` is one list + watch request (a namespace's pods with a label selector, one named
custom object with a field selector). :meth:`Watcher.follow` lists it, then watches from the list's
``resourceVersion`` with bookmarks; a watch the API server ends is resumed from the last
``resourceVersion`` seen (an event's or a bookmark's). A failure is logged (on one line: an error
body's ``Status`` message), counted in ``pd_extproc_discovery_errors_total{source,reason}`` and
retried after a capped, jittered exponential backoff (as client-go's reflector does), while the last
view stays: ``gone`` (``410 Gone``: the version expired, so the retry lists again), ``connection``
(refused or dropped, silence past the read timeout), ``api_error`` (another HTTP error),
``unexpected``. The backoff starts again from its first delay once the API server answers (a list or
watch accepted, a ``410``): after an API server restart the watch's resume gets ``410`` and the new
list follows at once, not after the delay grown during the outage. A list, a watch event or bookmark,
and a watch the server ended cleanly each confirm the view (the last-sync metric; a quiet server sends
no bookmark until something changes). Every list and event calls the source's ``changed``;
a :class:`Publisher` then rebuilds the source's view from the collections' current state
(level-triggered) and publishes it when it differs from the last one, the changes of one burst
coalesced into one publish.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import aiohttp
from kubernetes_asyncio import client, watch
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client.exceptions import ApiException

from ext_proc.checks import ConfigError
from ext_proc.discovery.eds_watch import Available, Publish
from ext_proc.endpoints import ClusterEndpoints
from ext_proc.metrics import Metrics

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where a pod finds its service account token, CA certificate and namespace."""
WATCH_TIMEOUT_SECONDS = 300
"""Server-side bound of one watch request; the watch then resumes from its last resourceVersion."""
CONNECT_TIMEOUT_SECONDS = 10.0
READ_TIMEOUT_SECONDS = WATCH_TIMEOUT_SECONDS + 30.0
"""Longest silence tolerated from the API server: catches a connection that died without a reset."""
_REQUEST_TIMEOUT = (CONNECT_TIMEOUT_SECONDS, READ_TIMEOUT_SECONDS)

V = TypeVar("V")


def status_message(body: str) -> str:
    """An API server's error body on one line.

    Its ``Status``'s ``reason: message``, else the text (whitespace runs, the trailing newline
    included, as one space)."""
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if isinstance(status, dict) and status.get("message"):
        body = ": ".join(str(part) for part in (status.get("reason"), status["message"]) if part)
    return " ".join(body.split()) or "(no body)"


def backoff_delay(failures: int, initial: float, maximum: float) -> float:
    """Seconds to wait after ``failures`` (>= 1) consecutive failures.

    ``initial``, doubled for each further failure, at most ``maximum``."""
    return min(maximum, initial * 2.0 ** min(failures - 1, 64))


async def client_settings(
    kubeconfig: str, environ: Mapping[str, str], service_account: Path = SERVICE_ACCOUNT
) -> tuple[client.Configuration, str]:
    """The API server's address and credentials, and the namespace to watch by default.

    ``kubeconfig``, else ``$KUBECONFIG`` in ``environ``: that file's current context and its
    namespace (``default`` when it names none). Neither: the in-cluster service account (the
    ``KUBERNETES_SERVICE_HOST`` / ``_PORT`` of ``environ``, ``token`` and ``ca.crt`` in
    ``service_account``) and the pod's own namespace (``service_account/namespace``). Raises
    :class:`ConfigError` when the chosen way cannot be used.
    """
    settings = client.Configuration()
    path = kubeconfig or environ.get("KUBECONFIG", "")
    try:
        if path:
            loader = await kube_config.load_kube_config(
                config_file=path, client_configuration=settings, persist_config=False
            )
            return settings, loader.current_context["context"].get("namespace") or "default"
        kube_config.load_incluster_config(
            client_configuration=settings,
            token_filename=str(service_account / "token"),
            cert_filename=str(service_account / "ca.crt"),
            environ=dict(environ),
        )
        return settings, (service_account / "namespace").read_text(encoding="utf-8").strip()
    except Exception as exc:  # the library raises ConfigException, OSError, YAML and type errors alike
        where = f"kubeconfig {path}" if path else f"in-cluster service account ({service_account})"
        raise ConfigError(
            f"discovery.kubernetes: cannot use the {where}: {exc} (set discovery.kubernetes.kubeconfig, "
            "--kubeconfig or KUBECONFIG, or run in a pod with a service account)"
        ) from None


def keep_object(obj: dict[str, Any], old: object) -> dict[str, Any]:
    """The view that keeps an object's JSON as it is (a source that interprets it when it publishes)."""
    return obj


@dataclass(eq=False)
class Collection(Generic[V]):
    """What is known of one list + watch request.

    ``what`` names it in log lines (``namespace team-a``). ``request`` is the API client's list
    method with everything but the list/watch parameters bound (namespace, selectors). ``view``
    turns an object's JSON and its previous view into what ``items`` keeps; ``noun`` counts them in
    the list's log line.
    """

    what: str
    request: Callable[..., Awaitable[Any]]
    view: Callable[[dict[str, Any], V | None], V]
    noun: str
    items: dict[str, V] = field(default_factory=dict)
    """By object name."""
    version: str | None = None
    """The resourceVersion to watch from; ``None``: list first."""
    confirmed: float = 0.0
    """Unix time of the last list, watch event, bookmark or clean end of a watch; 0 before the first
    list."""
    failures: int = 0
    """Consecutive failed exchanges with the API server."""


class Watcher:
    """Follows collections for one discovery source.

    ``source``: its metrics label and log prefix; ``log``: the source's logger.

    ``changed`` is called after every list and watch event; ``kept`` counts the endpoints of the
    view in force, for the retry log line. ``backoff`` is the first and the largest delay before a
    retry, in seconds. ``pd_extproc_discovery_last_sync_timestamp_seconds{source}`` is the oldest
    confirmation among the collections followed, once each has been listed.
    """

    def __init__(
        self,
        source: str,
        log: logging.Logger,
        metrics: Metrics,
        changed: Callable[[], None],
        kept: Callable[[], int],
        backoff: tuple[float, float],
    ) -> None:
        self.source = source
        self._log = log
        self._metrics = metrics
        self._changed = changed
        self._kept = kept
        self._backoff = backoff
        self._followed: list[Collection[Any]] = []

    async def follow(self, collection: Collection[Any]) -> None:
        """List and watch ``collection`` until cancelled, recovering from every failure."""
        self._followed.append(collection)
        try:
            while True:
                try:
                    if collection.version is None:
                        await self._list(collection)
                    await self._watch(collection)
                except ApiException as exc:
                    if exc.status == 410:  # the version expired: only a new list tells what changed since
                        collection.version = None
                    reason = "gone" if exc.status == 410 else "api_error"
                    await self._retry(collection, reason, f"HTTP {exc.status}: {exc.reason}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    await self._retry(collection, "connection", f"{type(exc).__name__}: {exc}")
                except Exception as exc:  # a watcher must outlive any surprise; the last view stays
                    self._log.exception("%s discovery: %s: unexpected failure", self.source, collection.what)
                    await self._retry(collection, "unexpected", repr(exc))
        finally:
            self._followed.remove(collection)

    async def _send(self, collection: Collection[Any], **parameters: Any) -> Any:
        """``collection``'s request with ``parameters`` (``_preload_content=False``): its ``200``
        response; another status is raised as :class:`ApiException` (reason: :func:`status_message`).
        A ``200`` or a ``410`` (the server serves; only the version is too old) resets the backoff."""
        response = await collection.request(**parameters)
        if response.status in (200, 410):
            collection.failures = 0
        if response.status != 200:
            try:
                body = await response.text()
            finally:
                response.release()
            raise ApiException(status=response.status, reason=status_message(body))
        return response

    async def _list(self, collection: Collection[Any]) -> None:
        """Replace ``collection``'s items with a complete list; raises on failures."""
        response = await self._send(collection, _preload_content=False, _request_timeout=_REQUEST_TIMEOUT)
        try:
            body = await response.json()
        finally:
            response.release()
        previous = collection.items
        collection.items = {}
        for obj in body.get("items") or ():
            name = obj["metadata"]["name"]
            collection.items[name] = collection.view(obj, previous.get(name))
        collection.version = body["metadata"]["resourceVersion"]
        self._log.info(
            "%s discovery: %s listed: %d %s (resourceVersion %s)",
            self.source,
            collection.what,
            len(collection.items),
            collection.noun,
            collection.version,
        )
        self._confirm(collection)
        self._changed()

    async def _watch(self, collection: Collection[Any]) -> None:
        """Apply the events of one watch request until the API server ends it (a confirmation of the
        view: everything up to then was sent); raises on failures."""
        async with watch.Watch(return_type="object") as stream:
            events = stream.stream(
                functools.partial(self._send, collection),
                resource_version=collection.version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
                _request_timeout=_REQUEST_TIMEOUT,
            )
            async for event in events:
                if event["type"] != "BOOKMARK":
                    obj = event["object"]
                    name = obj["metadata"]["name"]
                    old = collection.items.pop(name, None)
                    if event["type"] != "DELETED":
                        collection.items[name] = collection.view(obj, old)
                collection.version = stream.resource_version
                self._confirm(collection)
                if event["type"] != "BOOKMARK":
                    self._changed()
        self._confirm(collection)

    def _confirm(self, collection: Collection[Any]) -> None:
        """The API server just confirmed ``collection``: reset its backoff, refresh the sync metric."""
        collection.confirmed = time.time()
        collection.failures = 0
        oldest = min(c.confirmed for c in self._followed)
        if oldest:
            self._metrics.discovery_synced(self.source, oldest)

    async def _retry(self, collection: Collection[Any], reason: str, detail: str) -> None:
        """Count and log a failure, then wait the backoff delay (jittered) before the next try."""
        collection.failures += 1
        self._metrics.discovery_error(self.source, reason)
        delay = backoff_delay(collection.failures, *self._backoff) * random.uniform(0.5, 1.0)
        self._log.warning(
            "%s discovery: %s: %s; keeping the last view (%d endpoints), retrying in %.1f s",
            self.source,
            collection.what,
            detail,
            self._kept(),
            delay,
        )
        await asyncio.sleep(delay)


Snapshot = tuple[bool, list[ClusterEndpoints]]
"""A source's whole view: whether it has a set to serve at all, and its prefill and decode clusters."""


class Publisher:
    """Publishes a source's view each time it changed; changes made while it was waiting coalesce.

    ``source`` and ``log``: as for :class:`Watcher`.

    ``build`` returns the current :data:`Snapshot`, or ``None`` while nothing may be published yet
    (a collection not listed once). When it differs from the last one, its availability goes to
    ``available`` (if given, and only when it changed), then its clusters to ``publish`` (even if
    only the availability changed: the server's readiness waits for a publish after it).
    """

    def __init__(
        self,
        source: str,
        log: logging.Logger,
        build: Callable[[], Snapshot | None],
        publish: Publish,
        available: Available | None = None,
    ) -> None:
        self._source = source
        self._log = log
        self._build = build
        self._publish = publish
        self._available = available
        self._dirty = asyncio.Event()
        self._last: Snapshot | None = None

    def changed(self) -> None:
        """Have the view rebuilt and, if it differs, published."""
        self._dirty.set()

    async def run(self) -> None:
        """Publish until cancelled."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                self._publish_once()
            except Exception:  # the watch goes on; the next change publishes again
                self._log.exception("%s discovery: publishing the endpoints failed", self._source)

    def _publish_once(self) -> None:
        snapshot = self._build()
        if snapshot is None or snapshot == self._last:
            return
        available, clusters = snapshot
        if self._available is not None and (self._last is None or self._last[0] != available):
            self._available(available)
        self._publish(clusters)
        self._last = snapshot
