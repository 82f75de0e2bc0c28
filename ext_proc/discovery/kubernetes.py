"""The ``kubernetes`` discovery source: list and watch pods through the API server, publish endpoints.

Per namespace: list the pods carrying one of the role label's values, then watch from the list's
``resourceVersion`` with bookmarks. A watch the API server ends is resumed from the last
``resourceVersion`` seen (an event's or a bookmark's). A failure is logged, counted in
``pd_extproc_discovery_errors_total{source="kubernetes",reason}`` and retried after a capped,
jittered exponential backoff (as client-go's reflector does), while the last view stays published:
``gone`` (``410 Gone``: the version expired, so the retry lists again), ``connection`` (refused or
dropped, silence past the read timeout), ``api_error`` (another HTTP error), ``unexpected``. Each event
rebuilds its pod's endpoints from the pod's current state (:func:`~ext_proc.discovery.pods.view_pod`).
Nothing is published before every namespace has been listed once; after that, every change is,
with the changes of one burst coalesced into one publish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, watch
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client.exceptions import ApiException

from ext_proc.config import ConfigError, DiscoveryConfig
from ext_proc.discovery.eds import ClusterEndpoints
from ext_proc.discovery.eds_watch import Publish
from ext_proc.discovery.pods import PodRules, PodView, cluster_endpoints, view_pod
from ext_proc.metrics import Metrics

log = logging.getLogger(__name__)

SOURCE = "kubernetes"
"""The ``source`` label of this source's metrics."""
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where a pod finds its service account token, CA certificate and namespace."""
WATCH_TIMEOUT_SECONDS = 300
"""Server-side bound of one watch request; the watch then resumes from its last resourceVersion."""
CONNECT_TIMEOUT_SECONDS = 10.0
READ_TIMEOUT_SECONDS = WATCH_TIMEOUT_SECONDS + 30.0
"""Longest silence tolerated from the API server: catches a connection that died without a reset."""
_REQUEST_TIMEOUT = (CONNECT_TIMEOUT_SECONDS, READ_TIMEOUT_SECONDS)


def backoff_delay(failures: int, initial: float, maximum: float) -> float:
    """Seconds to wait after ``failures`` (>= 1) consecutive failures: ``initial``, doubled for each
    further failure, at most ``maximum``."""
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


@dataclass
class _Namespace:
    """What is known of one namespace's pods."""

    name: str
    pods: dict[str, PodView] = field(default_factory=dict)
    """By pod name."""
    version: str | None = None
    """The resourceVersion to watch from; ``None``: list first."""
    confirmed: float = 0.0
    """Unix time of the last list, watch event or bookmark; 0 before the first list."""
    failures: int = 0
    """Consecutive failed exchanges with the API server."""


class KubernetesSource:
    """Discovery source over the pods of ``namespaces``, at the API server ``settings`` names.

    ``publish`` receives the prefill and the decode cluster (each possibly empty; pods in
    namespace order, then by name) once every namespace has been listed, then after every change.
    ``backoff`` is the first and the largest delay before a retry, in seconds.
    """

    def __init__(
        self,
        settings: client.Configuration,
        namespaces: Sequence[str],
        rules: PodRules,
        publish: Publish,
        metrics: Metrics,
        backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self._settings = settings
        self._namespaces = [_Namespace(name) for name in namespaces]
        self._rules = rules
        self._selector = rules.scheme.label_selector()
        self._publish = publish
        self._metrics = metrics
        self._backoff = backoff
        self._dirty = asyncio.Event()

    @classmethod
    async def connect(
        cls,
        discovery: DiscoveryConfig,
        publish: Publish,
        metrics: Metrics,
        environ: Mapping[str, str] = os.environ,
        service_account: Path = SERVICE_ACCOUNT,
    ) -> KubernetesSource:
        """The source ``discovery`` describes (see :func:`client_settings`); nothing is sent yet."""
        kubernetes = discovery.kubernetes
        settings, own_namespace = await client_settings(kubernetes.kubeconfig, environ, service_account)
        rules = PodRules(
            kubernetes.scheme(),
            kubernetes.group_label,
            kubernetes.capacity_annotation,
            kubernetes.bootstrap_port_annotation,
            discovery.prefill_cluster,
            discovery.decode_cluster,
            kubernetes.metrics_port_annotation,
        )
        namespaces = kubernetes.namespaces or (own_namespace,)
        log.info(
            "kubernetes discovery: pods with %s in namespace(s) %s of %s; readiness is NOT_SERVING "
            "until every namespace has been listed",
            rules.scheme.label_selector(),
            ", ".join(namespaces),
            settings.host,
        )
        return cls(settings, namespaces, rules, publish, metrics)

    def clusters(self) -> list[ClusterEndpoints]:
        """The current view: the prefill and the decode cluster."""
        views = (ns.pods[name] for ns in self._namespaces for name in sorted(ns.pods))
        return cluster_endpoints(views, self._rules, SOURCE)

    async def run(self) -> None:
        """List, watch and publish until cancelled (the API client lives as long as this call)."""
        async with client.ApiClient(self._settings) as api, asyncio.TaskGroup() as tasks:
            pods = client.CoreV1Api(api)
            for namespace in self._namespaces:
                tasks.create_task(self._follow(pods, namespace), name=f"kubernetes-watch-{namespace.name}")
            tasks.create_task(self._publisher(), name="kubernetes-publish")

    async def _publisher(self) -> None:
        """Publish the view each time it changed; changes made while it was waiting coalesce."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                self._publish(self.clusters())
            except Exception:  # the watch goes on; the next change publishes again
                log.exception("kubernetes discovery: publishing the endpoints failed")

    async def _follow(self, pods: client.CoreV1Api, ns: _Namespace) -> None:
        """List and watch one namespace forever, recovering from every failure."""
        while True:
            try:
                if ns.version is None:
                    await self._list(pods, ns)
                await self._watch(pods, ns)
            except ApiException as exc:
                if exc.status == 410:  # the version expired: only a new list tells what changed since
                    ns.version = None
                reason = "gone" if exc.status == 410 else "api_error"
                await self._retry(ns, reason, f"HTTP {exc.status}: {exc.reason}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                await self._retry(ns, "connection", f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # a watcher must outlive any surprise; the last view stays
                log.exception("kubernetes discovery: namespace %s: unexpected failure", ns.name)
                await self._retry(ns, "unexpected", repr(exc))

    async def _list(self, pods: client.CoreV1Api, ns: _Namespace) -> None:
        """Replace ``ns``'s view with a complete list; raises on failures."""
        response = await pods.list_namespaced_pod(
            ns.name,
            label_selector=self._selector,
            _preload_content=False,
            _request_timeout=_REQUEST_TIMEOUT,
        )
        try:
            if response.status != 200:
                raise ApiException(status=response.status, reason=await response.text())
            body = await response.json()
        finally:
            response.release()
        previous = ns.pods
        ns.pods = {}
        for pod in body.get("items") or ():
            name = pod["metadata"]["name"]
            ns.pods[name] = self._view(ns, pod, previous.get(name))
        ns.version = body["metadata"]["resourceVersion"]
        log.info(
            "kubernetes discovery: namespace %s listed: %d pods, %d endpoints (resourceVersion %s)",
            ns.name,
            len(ns.pods),
            sum(len(view.endpoints) for view in ns.pods.values()),
            ns.version,
        )
        self._confirm(ns)
        self._changed()

    async def _watch(self, pods: client.CoreV1Api, ns: _Namespace) -> None:
        """Apply the events of one watch request until the API server ends it; raises on failures."""
        async with watch.Watch(return_type="object") as stream:
            events = stream.stream(
                pods.list_namespaced_pod,
                ns.name,
                label_selector=self._selector,
                resource_version=ns.version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
                _request_timeout=_REQUEST_TIMEOUT,
            )
            async for event in events:
                if event["type"] != "BOOKMARK":
                    self._apply(ns, event["type"], event["object"])
                ns.version = stream.resource_version
                self._confirm(ns)

    def _apply(self, ns: _Namespace, kind: str, pod: dict[str, Any]) -> None:
        """Take one watch event: the pod's endpoints from its current state, none once it is deleted."""
        name = pod["metadata"]["name"]
        old = ns.pods.pop(name, None)
        new = None if kind == "DELETED" else self._view(ns, pod, old)
        if new is not None:
            ns.pods[name] = new
        if (old.endpoints if old else ()) != (new.endpoints if new else ()):
            self._changed()

    def _view(self, ns: _Namespace, pod: dict[str, Any], old: PodView | None) -> PodView:
        """:func:`view_pod`, warning about the pod's problems when they are new."""
        view = view_pod(pod, self._rules)
        if view.problems and (old is None or old.problems != view.problems):
            name = pod["metadata"]["name"]
            log.warning("kubernetes discovery: pod %s/%s: %s", ns.name, name, "; ".join(view.problems))
        return view

    def _confirm(self, ns: _Namespace) -> None:
        """The API server just confirmed ``ns``'s view: reset its backoff, refresh the sync metric."""
        ns.confirmed = time.time()
        ns.failures = 0
        oldest = min(n.confirmed for n in self._namespaces)
        if oldest:
            self._metrics.discovery_synced(SOURCE, oldest)

    def _changed(self) -> None:
        """Have the view published, once every namespace has been listed."""
        if all(n.confirmed for n in self._namespaces):
            self._dirty.set()

    async def _retry(self, ns: _Namespace, reason: str, detail: str) -> None:
        """Count and log a failure, then wait the backoff delay (jittered) before the next try."""
        ns.failures += 1
        self._metrics.discovery_error(SOURCE, reason)
        delay = backoff_delay(ns.failures, *self._backoff) * random.uniform(0.5, 1.0)
        kept = sum(len(view.endpoints) for n in self._namespaces for view in n.pods.values())
        log.warning(
            "kubernetes discovery: namespace %s: %s; keeping the last view (%d endpoints), "
            "retrying in %.1f s",
            ns.name,
            detail,
            kept,
            delay,
        )
        await asyncio.sleep(delay)
