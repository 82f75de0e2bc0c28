"""The kubernetes discovery source against a fake API server speaking the real list/watch wire format,
driven through the real client library (kubernetes_asyncio) with a kubeconfig pointing at it.

No Kubernetes API server can run here: this is the level of testing (docs/deploy/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import until
from source_run import running

from ext_proc.app import start_server
from ext_proc.checks import ConfigError
from ext_proc.config import load_config
from ext_proc.discovery.config import DiscoveryConfig, KubernetesConfig
from ext_proc.discovery.kube_watch import backoff_delay, client_settings, status_message
from ext_proc.discovery.kubernetes import KubernetesSource
from standins.fake_kube_api import FakeKubeApi
from standins.kube_objects import INFERNEX_RULES as RULES
from standins.kube_objects import pod

NS = "team-a"
SELECTOR = "openfuyao.com/pdRole in (prefill,decode)"


def fast_source(
    kubeconfig: Path, namespaces: tuple[str, ...] = (NS,), backoff: tuple[float, float] = (0.1, 0.2)
):
    """A source on ``kubeconfig`` that retries after ``backoff`` (default: 50-100 ms, then 100-200 ms)."""

    async def build(publish, available, metrics) -> KubernetesSource:
        settings, _ = await client_settings(str(kubeconfig), {})
        return KubernetesSource(settings, namespaces, RULES, publish, metrics, backoff=backoff)

    return build


def requests(api: FakeKubeApi, kind: str) -> list[dict[str, str]]:
    return [r for r in api.requests if r["kind"] == kind]


def decode(name: str, ip: str, **kwargs) -> dict:
    return pod(name, "decode", ip, namespace=kwargs.pop("namespace", NS), **kwargs)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ext_proc.discovery.kubernetes"]


# --- list, then watch ----------------------------------------------------------------------------


async def test_list_then_watch_from_its_version_with_added_modified_and_deleted(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(pod("p0", "prefill", "10.0.0.1", namespace=NS))
    api.put(decode("d0", "10.0.0.2"))
    api.put(decode("d1", "10.0.0.3", ready="False"))
    api.put(decode("elsewhere", "10.9.9.9", namespace="team-b"))
    listed_at = api.version

    async def build(publish, available, metrics) -> KubernetesSource:
        discovery = DiscoveryConfig(kubernetes=KubernetesConfig(kubeconfig=str(kubeconfig)))
        return await KubernetesSource.connect(discovery, publish, metrics, environ={})

    async with running(build, "kubernetes") as run:  # namespaces unset: the kubeconfig context's, team-a
        await until(lambda: run.published)
        assert run.view() == {"prefill": ["10.0.0.1:8000"], "decode": ["10.0.0.2:8200"]}
        await until(lambda: api.watching(NS) == 1)
        (listed,) = requests(api, "list")
        (watched,) = requests(api, "watch")
        expected = {
            "kind": "list",
            "resource": "pods",
            "namespace": NS,
            "authorization": "Bearer secret-token",
        }
        assert listed == {**expected, "labelSelector": SELECTOR}
        assert watched["resourceVersion"] == str(listed_at)
        assert watched["allowWatchBookmarks"].lower() == "true"
        assert watched["labelSelector"] == SELECTOR
        assert int(watched["timeoutSeconds"]) > 0

        api.put(decode("d1", "10.0.0.3"))  # MODIFIED: now ready
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.3:8200"])
        api.put(decode("d2", "10.0.0.4"))  # ADDED
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.3:8200", "10.0.0.4:8200"])
        api.put(decode("d0", "10.0.0.2", annotations={"unrelated": "x"}))  # MODIFIED, same endpoints
        api.delete(NS, "d1")  # DELETED
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.4:8200"])
        api.put(decode("d2", "10.0.0.4", phase="Failed"))  # MODIFIED: no longer routable
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200"])
        assert run.view()["prefill"] == ["10.0.0.1:8000"]
    assert all(a != b for a, b in zip(run.published, run.published[1:], strict=False))  # only changes
    assert len(requests(api, "list")) == 1
    assert run.synced() > 0


async def test_a_pod_relabelled_out_of_the_selector_leaves_and_comes_back(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(decode("d0", "10.0.0.2"))
    api.put(decode("d1", "10.0.0.3"))
    async with running(fast_source(kubeconfig), "kubernetes") as run:
        await until(lambda: run.published and api.watching(NS) == 1)
        api.put(pod("d1", "router", "10.0.0.3", namespace=NS))  # a DELETED for this watch's selector
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200"])
        api.put(decode("d1", "10.0.0.3"))  # selected again: ADDED
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.3:8200"])
        assert len(requests(api, "list")) == 1


async def test_a_pods_problem_is_logged_once(
    api: FakeKubeApi, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.put(decode("d0", "10.0.0.2", ports={"http": 80}))
    with caplog.at_level(logging.WARNING, logger="ext_proc.discovery.kubernetes"):
        async with running(fast_source(kubeconfig), "kubernetes") as run:
            await until(lambda: run.published and api.watching(NS) == 1)
            api.put(decode("d0", "10.0.0.2", ports={"http": 80}, annotations={"a": "b"}))  # same problem
            api.put(decode("d1", "10.0.0.3"))
            await until(lambda: run.view()["decode"] == ["10.0.0.3:8200"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"kubernetes discovery: pod {NS}/d0: no container port named 'decode-port' (the decode port)"
    ]


async def test_a_bookmark_advances_the_version_a_watch_resumes_from(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(decode("d0", "10.0.0.2"))
    async with running(fast_source(kubeconfig), "kubernetes") as run:
        await until(lambda: run.published and api.watching(NS) == 1)
        for index in range(3):  # history the team-a watch never sees
            api.put(decode(f"other-{index}", "10.9.0.1", namespace="team-b"))
        marked = api.bookmark()
        api.compacted = marked  # a watch from the list's version would now be 410 Gone
        api.end_watches()  # the API server ends the watch (its timeout): resume at once
        await until(lambda: len(requests(api, "watch")) == 2 and api.watching(NS) == 1)
        assert requests(api, "watch")[1]["resourceVersion"] == str(marked)
        api.put(decode("d1", "10.0.0.3"))
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.3:8200"])
        assert len(requests(api, "list")) == 1
        assert run.errors("gone") == 0


async def test_error_410_gone_lists_again(api: FakeKubeApi, kubeconfig: Path) -> None:
    api.put(decode("d0", "10.0.0.2"))
    api.put(decode("d1", "10.0.0.3"))
    async with running(fast_source(kubeconfig), "kubernetes") as run:
        await until(lambda: run.published and api.watching(NS) == 1)
        api.delete(NS, "d1", silent=True)  # changes lost to compaction: only a new list shows them
        api.put(decode("d2", "10.0.0.4"), silent=True)
        api.expire()
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.4:8200"])
        assert run.errors("gone") == 1
        assert len(requests(api, "list")) == 2
        await until(lambda: api.watching(NS) == 1)
        assert requests(api, "watch")[-1]["resourceVersion"] == str(api.version)  # the new list's


async def test_a_dropped_connection_reconnects_from_the_last_version(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(decode("d0", "10.0.0.2"))
    async with running(fast_source(kubeconfig), "kubernetes") as run:
        await until(lambda: run.published and api.watching(NS) == 1)
        seen = api.put(decode("d1", "10.0.0.3"))
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.3:8200"])
        api.drop()
        api.put(decode("d2", "10.0.0.4"))  # while the watch is down, or just after: delivered either way
        await until(lambda: run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.3:8200", "10.0.0.4:8200"])
        assert run.errors("connection") >= 1
        assert requests(api, "watch")[1]["resourceVersion"] == str(seen)
        assert len(requests(api, "list")) == 1


async def test_while_the_api_server_is_down_the_last_view_stays_and_after_its_restart_it_lists_at_once(
    api: FakeKubeApi, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.put(decode("d0", "10.0.0.2"))
    backoff = (0.01, 2.0)  # grown to 0.64-1.28 s by the 8th failure
    async with running(fast_source(kubeconfig, backoff=backoff), "kubernetes") as run:
        await until(lambda: run.published and api.watching(NS) == 1)
        synced = run.synced()
        publishes = len(run.published)
        with caplog.at_level(logging.WARNING, logger="ext_proc.discovery.kubernetes"):
            await api.stop()
            await until(lambda: run.errors("connection") >= 8)  # refused, retried with backoff
            assert len(run.published) == publishes
            assert run.view()["decode"] == ["10.0.0.2:8200"]
            assert run.synced() == synced
            assert warnings(caplog)[-1].startswith(f"kubernetes discovery: namespace {NS}: ")
            assert "; keeping the last view (1 endpoints), retrying in " in warnings(caplog)[-1]
            api.delete(NS, "d0")  # changes made while it was down, older than its new watch cache
            api.put(decode("d1", "10.0.0.3"))
            await api.start()
            await until(lambda: run.view()["decode"] == ["10.0.0.3:8200"])
        # The resume got 410 Expired from the restarted server: listed again after the first delay,
        # not after the one grown during the outage.
        (gone,) = [m for m in warnings(caplog) if ": HTTP 410: Expired: too old resource version: " in m]
        delay = float(re.search(r"retrying in ([0-9.]+) s$", gone)[1])
        assert delay <= backoff[0], gone
        assert run.errors("gone") == 1
        assert len(requests(api, "list")) == 2
        await until(lambda: run.synced() > synced)


async def test_a_watch_the_server_ends_cleanly_confirms_the_view(api: FakeKubeApi, kubeconfig: Path) -> None:
    api.put(decode("d0", "10.0.0.2"))
    async with running(fast_source(kubeconfig), "kubernetes") as run:
        await until(lambda: run.published and api.watching(NS) == 1)
        listed = run.synced()
        api.end_watches()  # a quiet server's watch timeout: no event, no bookmark before it
        await until(lambda: len(requests(api, "watch")) == 2)
        assert run.synced() > listed
        assert len(requests(api, "list")) == 1


async def test_an_http_error_is_retried_logged_on_one_line_and_nothing_is_published_before_a_list(
    api: FakeKubeApi, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.put(decode("d0", "10.0.0.2"))
    api.refuse(403)
    forbidden = f'HTTP 403: Forbidden: pods is forbidden in namespace "{NS}"; keeping the last view'
    with caplog.at_level(logging.WARNING, logger="ext_proc.discovery.kubernetes"):
        async with running(fast_source(kubeconfig), "kubernetes") as run:
            await until(lambda: run.errors("api_error") >= 2)  # the list refused
            assert run.published == []
            assert run.synced() is None
            api.refuse(None)
            await until(lambda: run.published and api.watching(NS) == 1)
            assert run.view()["decode"] == ["10.0.0.2:8200"]
            api.refuse(403)
            api.end_watches()  # the watch's resume refused
            await until(lambda: run.errors("api_error") >= 3)
            assert run.view()["decode"] == ["10.0.0.2:8200"]
    refused = [m for m in warnings(caplog) if "HTTP 403" in m]
    assert len(refused) >= 3
    for message in refused:  # the body's Status message (its trailing newline dropped), on one line
        assert message.startswith(f"kubernetes discovery: namespace {NS}: {forbidden} (")
        assert "\n" not in message


async def test_publishes_wait_for_the_first_list_of_every_namespace(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(decode("d0", "10.0.0.2"))
    api.put(decode("b0", "10.0.1.2", namespace="team-b"))
    api.list_gates["pods", "team-b"] = asyncio.Event()
    async with running(fast_source(kubeconfig, (NS, "team-b")), "kubernetes") as run:
        await until(lambda: api.watching(NS) == 1)  # team-a listed and watched
        api.put(decode("d1", "10.0.0.3"))
        await until(lambda: len(run.source.clusters()[1].endpoints) == 2)  # seen, not published
        assert run.published == []
        assert run.synced() is None
        api.list_gates["pods", "team-b"].set()
        await until(
            lambda: (
                run.published and run.view()["decode"] == ["10.0.0.2:8200", "10.0.0.3:8200", "10.0.1.2:8200"]
            )
        )


# --- client settings -------------------------------------------------------------------------------


async def test_kubeconfig_from_the_environment_and_its_context_namespace(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    path = tmp_path / "config"
    path.write_text(api.kubeconfig("ns-x"))
    settings, namespace = await client_settings("", {"KUBECONFIG": str(path)})
    assert (settings.host, namespace) == (f"http://127.0.0.1:{api.port}", "ns-x")
    path.write_text(api.kubeconfig("ns-x").replace(", namespace: ns-x", ""))
    assert (await client_settings(str(path), {"KUBECONFIG": "/nowhere"}))[1] == "default"


async def test_in_cluster_service_account_and_own_namespace(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "namespace").write_text("serving\n")
    environ = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    settings, namespace = await client_settings("", environ, tmp_path)
    assert (settings.host, namespace) == ("https://[fd00::1]:443", "serving")
    assert settings.api_key["BearerToken"] == "Bearer sa-token"
    assert settings.ssl_ca_cert == str(tmp_path / "ca.crt")


async def test_neither_kubeconfig_nor_service_account_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        await client_settings("", {}, tmp_path)
    assert str(info.value).startswith(
        f"discovery.kubernetes: cannot use the in-cluster service account ({tmp_path}): "
    )
    assert "--kubeconfig" in str(info.value)


def test_an_error_body_is_one_line() -> None:
    status = '{"kind": "Status", "reason": "Forbidden", "message": "pods is forbidden:\\n no"}\n'
    assert status_message(status) == "Forbidden: pods is forbidden: no"
    assert status_message('{"kind": "Status", "message": "m"}') == "m"
    assert (
        status_message("<html>\n<body>Bad Gateway</body>\n</html>\n")
        == "<html> <body>Bad Gateway</body> </html>"
    )
    assert status_message("[1]") == "[1]"
    assert status_message(" \n") == "(no body)"


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_delay(n, 0.5, 30.0) for n in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff_delay(10**6, 0.5, 30.0) == 30.0


# --- through the server ----------------------------------------------------------------------------


async def test_server_readiness_waits_for_every_namespace_and_load_survives_updates(
    api: FakeKubeApi, kubeconfig: Path
) -> None:
    api.put(pod("p0", "prefill", "10.0.0.1", namespace=NS))
    api.put(decode("d0", "10.0.0.2"))
    api.put(decode("b0", "10.0.1.2", namespace="team-b"))
    for namespace in (NS, "team-b"):
        api.list_gates["pods", namespace] = asyncio.Event()
    overrides = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "discovery.source": "kubernetes",
        "discovery.kubernetes.kubeconfig": str(kubeconfig),
        "discovery.kubernetes.namespaces": [NS, "team-b"],
    }
    running_server = await start_server(load_config(None, overrides, environ={}))
    registry = running_server.router.registry
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running_server.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            readiness = health_pb2.HealthCheckRequest(service="readiness")

            async def serving() -> bool:
                return (await health.Check(readiness)).status == health_pb2.HealthCheckResponse.SERVING

            assert not await serving()
            api.list_gates["pods", NS].set()
            await until(lambda: api.watching(NS) == 1)  # team-a listed (a watch follows a list)
            assert not await serving()
            api.list_gates["pods", "team-b"].set()
            await until(serving)
        assert [e.address for e in registry.decodes] == ["10.0.0.2:8200", "10.0.1.2:8200"]
        (d0, _) = registry.decodes
        d0.charge(500)
        api.put(decode("d0", "10.0.0.2", annotations={"pd-extproc/token-capacity": "4000"}))
        await until(lambda: registry.decodes[0].token_capacity == 4000.0)
        assert registry.decodes[0] is d0
        assert (d0.active_tokens, d0.active_requests) == (500, 1)
    finally:
        await running_server.stop(grace=0)
