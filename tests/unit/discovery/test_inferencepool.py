"""The inferencepool discovery source against a fake API server speaking the real list/watch wire
format for pods and for the InferencePool custom resource, driven through the real client library
(kubernetes_asyncio) with a kubeconfig pointing at it; and through ``start_server``, readiness as a
real gRPC health client sees it on the ext_proc port and on ``health_listen``.

No Kubernetes API server can run here: this is the level of testing (docs/deploy/kubernetes.md
"Discovery from an InferencePool").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import until
from source_run import Run
from source_run import running as run_source

from ext_proc.app import start_server
from ext_proc.config import load_config
from ext_proc.discovery.config import DiscoveryConfig, InferencePoolConfig, KubernetesConfig
from ext_proc.discovery.inferencepool import InferencePoolSource
from ext_proc.discovery.kube_watch import client_settings
from ext_proc.discovery.pods import Preset
from ext_proc.endpoints import ClusterEndpoints
from ext_proc.metrics import Metrics
from standins.fake_kube_api import FakeKubeApi
from standins.kube_objects import INFERNEX_RULES as RULES
from standins.kube_objects import inference_pool, pod

NS = "serving"
POOL = "llama"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def engine(name: str, role: str, ip: str, **kwargs) -> dict:
    """A pod of the pool (label ``app: vllm`` unless ``labels`` say otherwise)."""
    labels = kwargs.pop("labels", {"app": "vllm"})
    return pod(name, role, ip, namespace=NS, labels=labels, **kwargs)


def pool(**kwargs) -> dict:
    return inference_pool(POOL, namespace=NS, **kwargs)


def fast_source(kubeconfig: Path):
    """The source on ``kubeconfig`` for the pool ``NS/POOL``, retrying after 50-100 ms."""

    async def build(publish, available, metrics) -> InferencePoolSource:
        settings, _ = await client_settings(str(kubeconfig), {})
        return InferencePoolSource(settings, NS, POOL, RULES, publish, available, metrics, backoff=(0.1, 0.2))

    return build


def running(kubeconfig: Path):
    return run_source(fast_source(kubeconfig), "inferencepool")


@pytest.fixture
async def followed(api: FakeKubeApi, kubeconfig: Path) -> AsyncIterator[Run]:
    """The source following the pool (``app: vllm`` at port 8000) and its decode ``d0`` (10.0.0.2)."""
    api.put(pool())
    api.put(engine("d0", "decode", "10.0.0.2"))
    async with running(kubeconfig) as run:
        await until(lambda: run.published and api.watching(NS, "pods") == 1)
        yield run


def requests(api: FakeKubeApi, kind: str, resource: str) -> list[dict[str, str]]:
    return [r for r in api.requests if r["kind"] == kind and r["resource"] == resource]


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ext_proc.discovery.inferencepool"]


# --- the pool, then its pods ---------------------------------------------------------------------


async def test_the_pool_then_the_pods_it_selects_at_its_target_ports(
    api: FakeKubeApi, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.put(pool(labels={"app": "vllm", "model": "llama"}, ports=[8000, 8001]))
    api.put(inference_pool("other", namespace=NS, labels={"app": "other"}))
    api.put(engine("p0", "prefill", "10.0.0.1", labels={"app": "vllm", "model": "llama"}))
    api.put(engine("d0", "decode", "10.0.0.2", labels={"app": "vllm", "model": "llama"}))
    api.put(engine("d1", "decode", "10.0.0.3", labels={"app": "vllm", "model": "mistral"}))  # not selected
    api.put(pod("d2", "decode", "10.0.0.4", namespace="elsewhere", labels={"app": "vllm", "model": "llama"}))
    with caplog.at_level(logging.INFO, logger="ext_proc.discovery.inferencepool"):
        async with running(kubeconfig) as run:
            await until(lambda: run.published)
            assert run.view() == {
                "prefill": ["10.0.0.1:8000", "10.0.0.1:8001"],
                "decode": ["10.0.0.2:8000", "10.0.0.2:8001"],
            }
            assert run.available == [True]
            await until(lambda: api.watching(NS, "pods") == 1 and api.watching(NS, "inferencepools") == 1)
    (listed_pool,) = requests(api, "list", "inferencepools")
    assert listed_pool["fieldSelector"] == f"metadata.name={POOL}"
    assert listed_pool["authorization"] == "Bearer secret-token"
    (watched_pool,) = requests(api, "watch", "inferencepools")
    assert watched_pool["fieldSelector"] == f"metadata.name={POOL}"
    assert watched_pool["allowWatchBookmarks"].lower() == "true"
    (listed_pods,) = requests(api, "list", "pods")
    assert listed_pods["labelSelector"] == "app=vllm,model=llama"
    (watched_pods,) = requests(api, "watch", "pods")
    assert watched_pods["labelSelector"] == "app=vllm,model=llama"
    assert int(watched_pods["timeoutSeconds"]) > 0
    described = f"InferencePool {NS}/{POOL}: pods with app=vllm,model=llama, port(s) 8000, 8001; "
    assert f"inferencepool discovery: {described}endpoint picker: Service llama-epp:9002 (FailClose)" in (
        messages(caplog)
    )
    assert run.sample("pd_extproc_inferencepool_usable") == 1.0
    assert run.sample("pd_extproc_discovery_last_sync_timestamp_seconds", source="inferencepool") > 0


async def test_pod_events_are_applied_and_a_pod_relabelled_out_of_the_pool_leaves(
    api: FakeKubeApi, followed: Run
) -> None:
    run = followed
    api.put(engine("d1", "decode", "10.0.0.3"))  # ADDED
    await until(lambda: run.view()["decode"] == ["10.0.0.2:8000", "10.0.0.3:8000"])
    api.put(engine("d0", "decode", "10.0.0.2", ready="False"))  # MODIFIED: unready
    await until(lambda: run.view()["decode"] == ["10.0.0.3:8000"])
    api.put(engine("d1", "decode", "10.0.0.3", labels={"app": "retired"}))  # DELETED for this watch
    await until(lambda: run.view()["decode"] == [])
    api.put(engine("d1", "decode", "10.0.0.3"))  # back: ADDED
    api.delete(NS, "d0")
    await until(lambda: run.view()["decode"] == ["10.0.0.3:8000"])
    assert all(a != b for a, b in zip(run.published, run.published[1:], strict=False))  # only changes
    assert len(requests(api, "list", "pods")) == 1
    assert run.available == [True]


async def test_a_changed_selector_restarts_the_pod_watch_with_it(api: FakeKubeApi, kubeconfig: Path) -> None:
    api.put(pool())
    api.put(engine("d0", "decode", "10.0.0.2"))
    api.put(engine("d1", "decode", "10.0.0.3", labels={"app": "vllm-v2"}))
    async with running(kubeconfig) as run:
        await until(lambda: run.published and api.watching(NS, "pods") == 1)
        assert run.view()["decode"] == ["10.0.0.2:8000"]
        api.put(pool(labels={"app": "vllm-v2"}))
        await until(lambda: run.view()["decode"] == ["10.0.0.3:8000"])
        await until(lambda: api.watching(NS, "pods") == 1 and len(requests(api, "watch", "pods")) == 2)
        assert [r["labelSelector"] for r in requests(api, "list", "pods")] == ["app=vllm", "app=vllm-v2"]
        assert requests(api, "watch", "pods")[-1]["labelSelector"] == "app=vllm-v2"
        api.put(engine("d0", "decode", "10.0.0.2", ready="False"))  # the old selector's pod: no event now
        api.put(engine("d2", "decode", "10.0.0.4", labels={"app": "vllm-v2"}))
        await until(lambda: run.view()["decode"] == ["10.0.0.3:8000", "10.0.0.4:8000"])
    assert run.available == [True]


async def test_a_changed_target_port_moves_the_endpoints_without_a_new_pod_list(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(pool(ports=[8000]))
    api.put(engine("p0", "prefill", "10.0.0.1"))
    api.put(engine("d0", "decode", "10.0.0.2"))
    async with running(kubeconfig) as run:
        await until(lambda: run.published)
        api.put(pool(ports=[9000, 9001]))
        await until(lambda: run.view()["decode"] == ["10.0.0.2:9000", "10.0.0.2:9001"])
        assert run.view()["prefill"] == ["10.0.0.1:9000", "10.0.0.1:9001"]
        api.put(pool(ports=[9000, 9001], picker={"name": "new-epp", "port": {"number": 9002}}))  # same view
        await until(
            lambda: len(requests(api, "watch", "inferencepools")) == 1 and run.source.pool() is not None
        )
        await until(lambda: run.source.pool().picker.startswith("Service new-epp"))
    assert len(requests(api, "list", "pods")) == 1
    assert all(a != b for a, b in zip(run.published, run.published[1:], strict=False))  # only changes


# --- the pool absent, deleted, unusable ----------------------------------------------------------


async def test_a_pool_absent_at_start_publishes_nothing_until_it_appears(
    api: FakeKubeApi, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.put(engine("d0", "decode", "10.0.0.2"))
    with caplog.at_level(logging.INFO, logger="ext_proc.discovery.inferencepool"):
        async with running(kubeconfig) as run:
            await until(lambda: run.published and api.watching(NS, "inferencepools") == 1)
            assert run.view() == {"prefill": [], "decode": []}
            assert run.available == [False]
            assert requests(api, "list", "pods") == []  # no selector: no pods followed
            assert run.sample("pd_extproc_inferencepool_usable") == 0.0
            api.put(pool())
            await until(lambda: run.view()["decode"] == ["10.0.0.2:8000"])
            assert run.available == [False, True]
    assert (
        f"inferencepool discovery: InferencePool {NS}/{POOL} not found: no endpoints, readiness NOT_SERVING "
        "until it exists"
    ) in messages(caplog)


async def test_a_deleted_pool_leaves_no_endpoints_and_comes_back(
    api: FakeKubeApi, followed: Run, caplog: pytest.LogCaptureFixture
) -> None:
    run = followed
    with caplog.at_level(logging.WARNING, logger="ext_proc.discovery.inferencepool"):
        api.delete(NS, POOL, kind="InferencePool")
        await until(lambda: run.view() == {"prefill": [], "decode": []})
        assert run.available == [True, False]
        await until(lambda: api.watching(NS, "pods") == 0)  # the pods are no longer followed
    assert messages(caplog) == [
        f"inferencepool discovery: InferencePool {NS}/{POOL} was deleted: no endpoints, readiness "
        "NOT_SERVING until it exists"
    ]
    assert run.sample("pd_extproc_inferencepool_usable") == 0.0
    api.put(pool())
    await until(lambda: run.view()["decode"] == ["10.0.0.2:8000"])
    assert run.available == [True, False, True]
    assert run.sample("pd_extproc_inferencepool_usable") == 1.0
    assert len(requests(api, "list", "inferencepools")) == 1  # the pool's watch saw it all


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}, "it is being deleted"),
        ({"spec": {"selector": {}}}, "spec.selector.matchLabels is missing or empty"),
        ({"spec": {"targetPorts": []}}, "spec.targetPorts is missing or empty"),
    ],
)
async def test_an_unusable_pool_is_like_a_deleted_one(
    api: FakeKubeApi, followed: Run, caplog: pytest.LogCaptureFixture, change: dict, problem: str
) -> None:
    run = followed
    broken = pool()
    for section, values in change.items():
        broken[section].update(values)
    with caplog.at_level(logging.WARNING, logger="ext_proc.discovery.inferencepool"):
        api.put(broken)
        await until(lambda: run.view() == {"prefill": [], "decode": []})
    assert run.available == [True, False]
    (logged,) = messages(caplog)
    assert logged.startswith(f"inferencepool discovery: InferencePool {NS}/{POOL} is not usable ({problem}")
    assert logged.endswith("): no endpoints, readiness NOT_SERVING")


async def test_a_selected_pod_without_a_role_is_warned_about_once(
    api: FakeKubeApi, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.put(pool())
    api.put(engine("router-0", None, "10.0.0.9"))
    with caplog.at_level(logging.WARNING, logger="ext_proc.discovery.inferencepool"):
        async with running(kubeconfig) as run:
            await until(lambda: run.published and api.watching(NS, "pods") == 1)
            api.put(engine("router-0", None, "10.0.0.9", annotations={"a": "b"}))  # the same problem
            api.put(engine("d0", "decode", "10.0.0.2"))
            await until(lambda: run.view()["decode"] == ["10.0.0.2:8000"])
    assert messages(caplog) == [
        f"inferencepool discovery: pod {NS}/router-0: selected by the pool, but its label "
        "openfuyao.com/pdRole is not one of prefill, decode: not an endpoint"
    ]


# --- failures ------------------------------------------------------------------------------------


async def test_a_410_on_the_pool_watch_lists_the_pool_again_and_the_pods_go_on(
    api: FakeKubeApi, followed: Run
) -> None:
    run = followed
    api.put(pool(ports=[9000]), silent=True)  # lost to compaction: only a new list shows it
    api.expire()  # every watch, the pods' too
    await until(lambda: run.view()["decode"] == ["10.0.0.2:9000"])
    assert run.errors("gone") >= 1
    await until(lambda: api.watching(NS, "pods") == 1 and api.watching(NS, "inferencepools") == 1)
    assert len(requests(api, "list", "inferencepools")) == 2
    assert len(requests(api, "list", "pods")) == 2  # its watch expired too
    api.put(engine("d1", "decode", "10.0.0.3"))
    await until(lambda: run.view()["decode"] == ["10.0.0.2:9000", "10.0.0.3:9000"])


async def test_a_pool_watch_the_server_ends_resumes_from_its_last_version(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(pool())
    async with running(kubeconfig) as run:
        await until(lambda: run.published and api.watching(NS, "inferencepools") == 1)
        seen = api.put(pool(ports=[8100]))
        await until(lambda: run.source.pool() is not None and run.source.pool().spec.target_ports == (8100,))
        api.end_watches()
        await until(lambda: len(requests(api, "watch", "inferencepools")) == 2)
        assert requests(api, "watch", "inferencepools")[1]["resourceVersion"] == str(seen)
        assert len(requests(api, "list", "inferencepools")) == 1
        assert run.errors("gone") == 0


async def test_without_the_crd_the_source_retries_and_says_why(
    api: FakeKubeApi, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.crd_installed = False
    api.put(pool())
    api.put(engine("d0", "decode", "10.0.0.2"))
    with caplog.at_level(logging.WARNING, logger="ext_proc.discovery.inferencepool"):
        async with running(kubeconfig) as run:
            await until(lambda: run.errors("api_error") >= 2)
            assert run.published == []
            assert run.available == []
            logged = messages(caplog)[-1]
            assert logged.startswith(f"inferencepool discovery: InferencePool {NS}/{POOL}: HTTP 404: ")
            assert "; keeping the last view (0 endpoints), retrying in " in logged
            api.crd_installed = True
            await until(lambda: run.published and run.view()["decode"] == ["10.0.0.2:8000"])


async def test_while_the_api_server_is_down_the_last_view_stays(api: FakeKubeApi, followed: Run) -> None:
    run = followed
    publishes = len(run.published)
    await api.stop()
    await until(lambda: run.errors("connection") >= 4)  # both watches retried with backoff
    assert len(run.published) == publishes
    assert run.available == [True]
    api.delete(NS, "d0")  # changes older than the restarted server's watch cache
    api.put(pool(ports=[8100]))
    api.put(engine("d1", "decode", "10.0.0.3"))
    await api.start()
    await until(lambda: run.view()["decode"] == ["10.0.0.3:8100"])
    assert run.errors("gone") == 2  # both resumes got 410 Expired: both collections listed again
    assert len(requests(api, "list", "pods")) == len(requests(api, "list", "inferencepools")) == 2
    assert run.available == [True]


# --- through the server --------------------------------------------------------------------------


async def test_readiness_follows_the_pool_on_both_health_ports(api: FakeKubeApi, kubeconfig: Path) -> None:
    api.put(engine("p0", "prefill", "10.0.0.1"))
    api.put(engine("d0", "decode", "10.0.0.2"))
    overrides = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "health_listen": "127.0.0.1:0",
        "discovery.source": "inferencepool",
        "discovery.kubernetes.kubeconfig": str(kubeconfig),
        "discovery.inferencepool.name": POOL,
    }
    server = await start_server(load_config(None, overrides, environ={}))
    registry = server.router.registry
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as main,
            grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as separate,
        ):
            stubs = [health_pb2_grpc.HealthStub(channel) for channel in (main, separate)]

            async def statuses(service: str) -> set[int]:
                request = health_pb2.HealthCheckRequest(service=service)
                return {(await stub.Check(request)).status for stub in stubs}

            async def ready(expected: int) -> bool:
                names = (
                    "readiness",
                    "inference-extension",
                    "envoy.service.ext_proc.v3.ExternalProcessor",
                    "",
                )
                return all([await statuses(name) == {expected} for name in names])

            await until(lambda: api.watching(NS, "inferencepools") == 1)  # listed: absent (the context's ns)
            assert await ready(NOT_SERVING)
            assert await statuses("liveness") == {SERVING}
            api.put(pool())
            await until(lambda: ready(SERVING))
            assert [e.address for e in registry.decodes] == ["10.0.0.2:8000"]
            (d0,) = registry.decodes
            d0.charge(500)
            api.put(pool(ports=[8000], picker=None))  # the same endpoints: the load stays
            api.put(engine("d0", "decode", "10.0.0.2", annotations={"pd-extproc/token-capacity": "4000"}))
            await until(lambda: registry.decodes[0].token_capacity == 4000.0)
            assert registry.decodes[0] is d0 and d0.active_tokens == 500

            api.delete(NS, POOL, kind="InferencePool")
            await until(lambda: ready(NOT_SERVING))
            assert (registry.prefills, registry.decodes) == ((), ())
            assert await statuses("liveness") == {SERVING}
            api.put(pool())
            await until(lambda: ready(SERVING))
            assert [e.address for e in registry.prefills] == ["10.0.0.1:8000"]
    finally:
        await server.stop(grace=0)


async def test_the_connect_path_takes_the_contexts_namespace_and_the_pod_rules(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(pool())
    api.put(pod("b0", "both", "10.0.0.5", namespace=NS, labels={"app": "vllm"}, role_label="llm-d.ai/role"))
    discovery = DiscoveryConfig(
        kubernetes=KubernetesConfig(kubeconfig=str(kubeconfig), preset=Preset.LLM_D, namespaces=("ignored",)),
        inferencepool=InferencePoolConfig(POOL, ""),
    )
    published: list[list[ClusterEndpoints]] = []
    source = await InferencePoolSource.connect(
        discovery, published.append, lambda now: None, Metrics(lambda: ()), {}
    )
    task = asyncio.create_task(source.run())
    try:
        await until(lambda: published)
        assert {c.cluster_name: [e.address for e in c.endpoints] for c in published[-1]} == {
            "prefill": ["10.0.0.5:8000"],
            "decode": ["10.0.0.5:8000"],
        }
        assert {r["namespace"] for r in api.requests} == {NS}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
