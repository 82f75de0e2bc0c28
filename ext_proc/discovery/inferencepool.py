"""The ``inferencepool`` discovery source: the pods a GIE InferencePool selects, as endpoints.

Two list + watch collections, followed as :mod:`ext_proc.discovery.kube_watch` describes (resumed,
retried with backoff, counted under ``source="inferencepool"``): the InferencePool object itself
(``fieldSelector=metadata.name=<name>`` in its namespace) and, while it is usable, the pods its
``matchLabels`` select in that namespace. Level-triggered: every list and event rebuilds the view
from the pool's and the pods' current state (:func:`~ext_proc.discovery.pool.view_pool`,
:func:`~ext_proc.discovery.pods.view_pod` with the pool's target ports as the ports).

- A changed selector restarts the pod collection with it (a new list); until that list arrives the
  last view stays published. A changed target port set rebuilds the endpoints at once.
- The pool absent (not there at start, deleted), being deleted or unusable: no endpoints are
  published and the source is *unavailable* (readiness ``NOT_SERVING``), logged once per change and
  shown by ``pd_extproc_inferencepool_usable``; it becomes available again with the first view
  built from a usable pool and its listed pods.
- Nothing is published before the pool has been listed (and, if usable, its pods).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from ext_proc.discovery.config import DiscoveryConfig
from ext_proc.discovery.eds_watch import Available, Publish
from ext_proc.discovery.kube_watch import (
    SERVICE_ACCOUNT,
    Collection,
    Publisher,
    Snapshot,
    Watcher,
    client_settings,
    keep_object,
)
from ext_proc.discovery.pods import PodRules, cluster_endpoints, has_role, view_pod
from ext_proc.discovery.pool import GROUP, PLURAL, VERSION, PoolView, view_pool
from ext_proc.metrics import Metrics

log = logging.getLogger(__name__)

SOURCE = "inferencepool"
"""The ``source`` label of this source's metrics."""
_UNSEEN = object()
"""The pool's logged state before its first list."""


class InferencePoolSource:
    """Discovery source over one InferencePool and the pods it selects.

    The pool ``name`` in ``namespace``, at the API server ``settings`` names.

    ``publish`` receives the prefill and the decode cluster (pods by name); ``available`` whether
    the pool is usable, before the publish that follows a change of it. ``rules``: how a pod is
    read (its ports replaced by the pool's target ports). ``backoff``: as for
    :class:`~ext_proc.discovery.kube_watch.Watcher`.
    """

    def __init__(
        self,
        settings: client.Configuration,
        namespace: str,
        name: str,
        rules: PodRules,
        publish: Publish,
        available: Available,
        metrics: Metrics,
        backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self._settings = settings
        self._namespace = namespace
        self._name = name
        self._what = f"InferencePool {namespace}/{name}"
        self._rules = rules
        self._metrics = metrics
        self._publisher = Publisher(SOURCE, log, self._snapshot, publish, available)
        self._watcher = Watcher(SOURCE, log, metrics, self._changed, self._kept, backoff)
        self._pool: Collection[PoolView] = Collection(
            self._what, self._list_pool, lambda obj, old: view_pool(obj), "InferencePools"
        )
        self._pods: Collection[dict[str, Any]] | None = None
        self._pods_task: asyncio.Task[None] | None = None
        self._selector = ""
        self._logged: object = _UNSEEN
        self._problems: dict[str, tuple[str, ...]] = {}
        self._endpoints = 0
        self._api: client.ApiClient | None = None
        self._tasks: asyncio.TaskGroup | None = None

    @classmethod
    async def connect(
        cls,
        discovery: DiscoveryConfig,
        publish: Publish,
        available: Available,
        metrics: Metrics,
        environ: Mapping[str, str] = os.environ,
        service_account: Path = SERVICE_ACCOUNT,
    ) -> InferencePoolSource:
        """The source ``discovery`` describes; nothing is sent yet.

        The pool's namespace ``""`` stands for the one :func:`client_settings` gives."""
        settings, own_namespace = await client_settings(
            discovery.kubernetes.kubeconfig, environ, service_account
        )
        pool = discovery.inferencepool
        namespace = pool.namespace or own_namespace
        log.info(
            "inferencepool discovery: the pods of InferencePool %s/%s (%s/%s) at %s; readiness is "
            "NOT_SERVING until it and its pods have been listed",
            namespace,
            pool.name,
            GROUP,
            VERSION,
            settings.host,
        )
        return cls(settings, namespace, pool.name, discovery.pod_rules(), publish, available, metrics)

    def pool(self) -> PoolView | None:
        """The pool as last seen: ``None`` while absent (or not listed yet)."""
        return self._pool.items.get(self._name)

    async def run(self) -> None:
        """List, watch and publish until cancelled (the API client lives as long as this call)."""
        async with client.ApiClient(self._settings) as api, asyncio.TaskGroup() as tasks:
            self._api, self._tasks = api, tasks
            tasks.create_task(self._watcher.follow(self._pool), name="inferencepool-watch")
            tasks.create_task(self._publisher.run(), name="inferencepool-publish")

    def _list_pool(self, **parameters: Any) -> Any:
        """The pool's list (or, with ``watch``, watch) request (during :meth:`run`)."""
        objects = client.CustomObjectsApi(self._api)
        selector = f"metadata.name={self._name}"
        return objects.list_namespaced_custom_object(
            GROUP, VERSION, self._namespace, PLURAL, field_selector=selector, **parameters
        )

    def _list_pods(self, selector: str, **parameters: Any) -> Any:
        """The member pods' list (or watch) request for the pool's ``selector`` (during :meth:`run`)."""
        pods = client.CoreV1Api(self._api)
        return pods.list_namespaced_pod(self._namespace, label_selector=selector, **parameters)

    def _changed(self) -> None:
        """A list or an event of either collection: follow the pool's selector, rebuild the view."""
        if self._pool.confirmed:
            pool = self.pool()
            self._log_pool(pool)
            spec = pool.spec if pool is not None else None
            selector = spec.label_selector() if spec is not None else ""
            if selector != self._selector:
                self._follow_pods(selector)
        self._publisher.changed()

    def _follow_pods(self, selector: str) -> None:
        """Stop following the pods of the old selector; follow those of ``selector`` (``""``: none)."""
        if self._pods_task is not None:
            self._pods_task.cancel()
        self._selector, self._pods, self._pods_task = selector, None, None
        if selector:
            assert self._tasks is not None
            what = f"pods of {self._what} ({selector})"
            self._pods = Collection(what, functools.partial(self._list_pods, selector), keep_object, "pods")
            self._pods_task = self._tasks.create_task(
                self._watcher.follow(self._pods), name="inferencepool-pods-watch"
            )

    def _log_pool(self, pool: PoolView | None) -> None:
        """Log the pool's state and set ``pd_extproc_inferencepool_usable`` when it changed."""
        if pool == self._logged:
            return
        self._metrics.inferencepool_usable(pool is not None and pool.spec is not None)
        if pool is None:
            log.warning(
                "inferencepool discovery: %s %s: no endpoints, readiness NOT_SERVING until it exists",
                self._what,
                "not found" if self._logged is _UNSEEN else "was deleted",
            )
        elif pool.spec is None:
            log.warning(
                "inferencepool discovery: %s is not usable (%s): no endpoints, readiness NOT_SERVING",
                self._what,
                "; ".join(pool.problems),
            )
        else:
            log.info(
                "inferencepool discovery: %s: pods with %s, port(s) %s; endpoint picker: %s%s",
                self._what,
                pool.spec.label_selector(),
                ", ".join(map(str, pool.spec.target_ports)),
                pool.picker,
                "".join(f"; {problem}" for problem in pool.problems),
            )
        self._logged = pool

    def _snapshot(self) -> Snapshot | None:
        """The view to publish: ``None`` before the pool (and the pods of its selector) were listed;
        unavailable and empty while the pool is not usable."""
        if not self._pool.confirmed:
            return None
        pool = self.pool()
        if pool is None or pool.spec is None:
            self._endpoints = 0
            return False, cluster_endpoints((), self._rules, SOURCE)
        if self._pods is None or not self._pods.confirmed:
            return None
        rules = dataclasses.replace(self._rules, target_ports=pool.spec.target_ports)
        views, problems = [], {}
        for name in sorted(self._pods.items):
            pod = self._pods.items[name]
            view = view_pod(pod, rules)
            views.append(view)
            found = view.problems if has_role(pod, rules) else (self._no_role(rules),)
            if found:
                problems[name] = found
                if self._problems.get(name) != found:
                    log.warning(
                        "inferencepool discovery: pod %s/%s: %s", self._namespace, name, "; ".join(found)
                    )
        self._problems = problems
        clusters = cluster_endpoints(views, rules, SOURCE)
        self._endpoints = sum(len(cluster.endpoints) for cluster in clusters)
        return True, clusters

    @staticmethod
    def _no_role(rules: PodRules) -> str:
        scheme = rules.scheme
        return (
            f"selected by the pool, but its label {scheme.role_label} is not one of "
            f"{', '.join(scheme.role_values())}: not an endpoint"
        )

    def _kept(self) -> int:
        return self._endpoints
