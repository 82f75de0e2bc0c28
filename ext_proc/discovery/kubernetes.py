"""The ``kubernetes`` discovery source: list and watch pods through the API server, publish endpoints.

Per namespace, one :class:`~ext_proc.discovery.kube_watch.Collection`: the pods carrying one of the
role label's values, listed and watched (resumed, retried with backoff, counted under
``source="kubernetes"``) as :mod:`ext_proc.discovery.kube_watch` describes. Each event rebuilds its
pod's endpoints from the pod's current state (:func:`~ext_proc.discovery.pods.view_pod`). Nothing is
published before every namespace has been listed once; after that, every change is, with the
changes of one burst coalesced into one publish.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from ext_proc.discovery.config import DiscoveryConfig
from ext_proc.discovery.eds_watch import Publish
from ext_proc.discovery.kube_watch import (
    SERVICE_ACCOUNT,
    Collection,
    Publisher,
    Snapshot,
    Watcher,
    client_settings,
)
from ext_proc.discovery.pods import PodRules, PodView, cluster_endpoints, view_pod
from ext_proc.endpoints import ClusterEndpoints
from ext_proc.metrics import Metrics

log = logging.getLogger(__name__)

SOURCE = "kubernetes"
"""The ``source`` label of this source's metrics."""


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
        self._pods: client.CoreV1Api | None = None
        self._namespaces = [
            Collection(
                f"namespace {name}",
                functools.partial(self._list, name),
                functools.partial(self._view, name),
                "pods",
            )
            for name in namespaces
        ]
        self._rules = rules
        self._selector = rules.scheme.label_selector()
        self._publisher = Publisher(SOURCE, log, self._snapshot, publish)
        self._watcher = Watcher(SOURCE, log, metrics, self._publisher.changed, self._kept, backoff)

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
        rules = discovery.pod_rules()
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
        views = (ns.items[name] for ns in self._namespaces for name in sorted(ns.items))
        return cluster_endpoints(views, self._rules, SOURCE)

    def _snapshot(self) -> Snapshot | None:
        """The view to publish, once every namespace has been listed."""
        return (True, self.clusters()) if all(n.confirmed for n in self._namespaces) else None

    def _kept(self) -> int:
        return sum(len(view.endpoints) for ns in self._namespaces for view in ns.items.values())

    async def run(self) -> None:
        """List, watch and publish until cancelled (the API client lives as long as this call)."""
        async with client.ApiClient(self._settings) as api, asyncio.TaskGroup() as tasks:
            self._pods = client.CoreV1Api(api)
            for namespace in self._namespaces:
                tasks.create_task(self._watcher.follow(namespace), name=f"kubernetes-watch-{namespace.what}")
            tasks.create_task(self._publisher.run(), name="kubernetes-publish")

    def _list(self, namespace: str, **parameters: Any) -> Any:
        """The pods list (or, with ``watch``, watch) request for ``namespace`` (during :meth:`run`)."""
        assert self._pods is not None
        return self._pods.list_namespaced_pod(namespace, label_selector=self._selector, **parameters)

    def _view(self, namespace: str, pod: dict[str, Any], old: PodView | None) -> PodView:
        """:func:`view_pod`, warning about the pod's problems when they are new."""
        view = view_pod(pod, self._rules)
        if view.problems and (old is None or old.problems != view.problems):
            name = pod["metadata"]["name"]
            log.warning("kubernetes discovery: pod %s/%s: %s", namespace, name, "; ".join(view.problems))
        return view
