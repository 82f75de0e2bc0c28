"""The chart's picker mode against the gateway shapes of ``tests/deploy/gateway_shapes/`` (the Envoy each
gateway generates for an InferencePool, as the files were written, before :func:`shapes.render_shape`
binds them to local ports): what the shapes expect of the picker, the chart renders.

- where they dial it: the port of every picker cluster endpoint and ``authority`` is the picker
  Service's port; every one speaks TLS over HTTP/2 without verifying a certificate or presenting
  one, and the chart's pd-extproc serves TLS (the generated certificate) without asking for a client
  certificate;
- what they health-check: the rendered pod, started with the rendered configuration and certificate,
  answers SERVING for every ``grpc_health_check`` service name of the shapes over TLS, and for the
  names kubelet's probes ask;
- the destination: every header or metadata key the pool clusters read is the rendered
  ``routing.destination_header``; ``routing.fallback_count`` is 0 for the provider of the shapes whose
  cluster reads one host (ORIGINAL_DST, a subset load balancer) and a list for the one whose cluster
  tries it (override_host: provider istio);
- failure: every picker reference of the shapes fails closed, as the chart's default failureMode.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helm_chart import FULLNAME, NAMESPACE, Manifests, port_of, template
from polling import until

from ext_proc.app import start_server
from ext_proc.config import load_config
from standins.fake_kube_api import FakeKubeApi
from standins.kube_objects import pod
from standins.shapes import EXT_PROC_TYPE, SHAPES, SHAPES_DIR, nodes

SERVICE_HOST = f"{FULLNAME}.{NAMESPACE}.svc"
PROVIDER_OF = {"gie-standalone": "none", "istio": "istio", "ai-gateway": "none", "kgateway": "none"}
"""The chart's provider for each shape's gateway (docs/deploy/kubernetes.md "Picker mode")."""
TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
PER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"


def load_shape(name: str) -> dict:
    """The shape file as written."""
    return yaml.safe_load((SHAPES_DIR / f"{name}.yaml").read_text(encoding="utf-8"))


def _dicts(node: object) -> list[dict]:
    return [n for n in nodes(node) if isinstance(n, dict)]


def picker_settings(shape: dict) -> list[dict]:
    """Every ext_proc setting (the filter's config, a route's override) whose ``grpc_service`` names a
    cluster the shape has: how the gateway calls the pool's picker."""
    clusters = {c["name"] for c in shape["static_resources"]["clusters"]}
    settings = [n for n in _dicts(shape) if n.get("@type") == EXT_PROC_TYPE]
    settings += [n["overrides"] for n in _dicts(shape) if n.get("@type") == PER_ROUTE_TYPE]
    return [
        s for s in settings if s.get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name") in clusters
    ]


def picker_clusters(shape: dict) -> list[dict]:
    names = {s["grpc_service"]["envoy_grpc"]["cluster_name"] for s in picker_settings(shape)}
    return [c for c in shape["static_resources"]["clusters"] if c["name"] in names]


def pool_clusters(shape: dict) -> list[dict]:
    """The clusters the gateway listener's routes send requests to (the InferencePool's pods)."""
    (listener,) = [
        entry
        for entry in shape["static_resources"]["listeners"]
        if any(n.get("@type") == EXT_PROC_TYPE for n in _dicts(entry))
    ]
    routes = [n["route"] for n in _dicts(listener) if isinstance(n.get("route"), dict)]
    routed = {route["cluster"] for route in routes if "cluster" in route}
    return [c for c in shape["static_resources"]["clusters"] if c["name"] in routed]


def destination_keys(shape: dict) -> tuple[str, set[str]]:
    """How the pool cluster picks the host (``override_host``: it tries the picker's list;
    ``original_dst`` / ``subset``: it reads one ``ip:port``), and the header and metadata keys it
    reads the destination from (a header the shape copies into metadata included)."""
    (cluster,) = pool_clusters(shape)
    keys = {n["http_header_name"] for n in _dicts(cluster) if "http_header_name" in n}
    keys |= {n["header"] for n in _dicts(shape) if "header" in n and "on_header_present" in n}
    keys |= {k for s in cluster.get("lb_subset_config", {}).get("subset_selectors", []) for k in s["keys"]}
    sources = [n for n in _dicts(cluster) if "override_host_sources" in n]
    for source in (s for n in sources for s in n["override_host_sources"]):
        keys |= {source["header"]} if "header" in source else {p["key"] for p in source["metadata"]["path"]}
    if sources:
        return "override_host", keys
    return ("subset" if "lb_subset_config" in cluster else "original_dst"), keys


@pytest.fixture(scope="module")
def chart(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Manifests]:
    """The chart in picker mode at its defaults, for each provider."""
    folder = tmp_path_factory.mktemp("chart")
    return {
        provider: Manifests(
            template(
                helm,
                folder,
                {
                    "mode": "picker",
                    "inferencePool": {"modelServers": {"matchLabels": {"app": "vllm"}}},
                    "provider": {"name": provider},
                },
            )
        )
        for provider in ("none", "istio")
    }


@pytest.mark.parametrize("name", SHAPES)
def test_the_chart_serves_tls_on_the_port_the_shape_dials(name: str, chart: dict[str, Manifests]) -> None:
    manifests = chart[PROVIDER_OF[name]]
    (port,) = manifests.one("Service", FULLNAME)["spec"]["ports"]
    config = yaml.safe_load(manifests.config)
    assert config["tls"]["cert_file"] and config["tls"]["key_file"] and not config["tls"]["client_ca_file"]
    shape = load_shape(name)
    clusters = picker_clusters(shape)
    assert clusters, name
    for cluster in clusters:
        ports = {
            n["socket_address"]["port_value"]
            for n in _dicts(cluster["load_assignment"])
            if "socket_address" in n
        }
        assert ports == {port["port"]}, cluster["name"]
        socket = cluster["transport_socket"]["typed_config"]
        assert socket["@type"] == TLS_TYPE
        context = socket.get("common_tls_context", {})
        assert not context.get("validation_context") and "tls_certificates" not in context, cluster["name"]
        assert any("http2_protocol_options" in n for n in _dicts(cluster["typed_extension_protocol_options"]))
    for setting in picker_settings(shape):
        authority = setting["grpc_service"]["envoy_grpc"].get("authority")
        assert authority is None or port_of(authority) == port["port"]


@pytest.mark.parametrize("name", SHAPES)
def test_the_fallback_list_is_kept_only_where_the_shapes_cluster_tries_it(
    name: str, chart: dict[str, Manifests]
) -> None:
    kind, keys = destination_keys(load_shape(name))
    provider = "istio" if kind == "override_host" else "none"
    assert provider == PROVIDER_OF[name]
    routing = yaml.safe_load(chart[provider].config)["routing"]
    assert keys == {routing["destination_header"]}
    assert (routing["fallback_count"] > 0) == (kind == "override_host"), kind


@pytest.mark.parametrize("name", SHAPES)
def test_the_shapes_fail_closed_as_the_charts_pool(name: str, chart: dict[str, Manifests]) -> None:
    (pool,) = chart[PROVIDER_OF[name]].all("InferencePool")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert {setting.get("failure_mode_allow", False) for setting in picker_settings(load_shape(name))} == {
        False
    }


def shape_health_services() -> set[str]:
    """The gRPC health service names the shapes' picker clusters check."""
    return {
        n["grpc_health_check"]["service_name"]
        for name in SHAPES
        for cluster in picker_clusters(load_shape(name))
        for n in _dicts(cluster.get("health_checks", []))
        if "grpc_health_check" in n
    }


def _pem(secret: dict, key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def _subject_alt_names(cert: bytes) -> set[str]:
    command = ["openssl", "x509", "-noout", "-ext", "subjectAltName"]
    output = subprocess.run(command, input=cert, capture_output=True, check=True, timeout=60).stdout.decode()
    return {name.strip().removeprefix("DNS:") for name in output.splitlines()[1].split(",")}


async def test_the_picker_pod_answers_the_shapes_health_checks_over_tls(
    chart: dict[str, Manifests], tmp_path: Path
) -> None:
    """The picker pod as the chart renders it: the rendered configuration, the rendered Secret's files
    where the pod mounts them (here: a folder of the test's), the rendered InferencePool and two pods
    it selects in the stand-in API server (which the pod would reach with its service account: here a
    kubeconfig), loopback ports. pd-extproc takes the pool's pods as its endpoints; over TLS, trusting
    the certificate for the Service's name, gRPC health answers SERVING for every service the shapes
    check; kubelet's probes are answered in plaintext on the health port; plaintext on the TLS port
    is refused."""
    manifests = chart["none"]
    secret = manifests.one("Secret", f"{FULLNAME}-tls")
    cert = _pem(secret, "tls.crt")
    names = {FULLNAME, f"{FULLNAME}.{NAMESPACE}", SERVICE_HOST, f"{SERVICE_HOST}.cluster.local"}
    assert _subject_alt_names(cert) == names
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "tls.crt").write_bytes(cert)
    (tmp_path / "tls" / "tls.key").write_bytes(_pem(secret, "tls.key"))
    (tmp_path / "config.yaml").write_text(manifests.config)
    api = FakeKubeApi()
    await api.start()
    (tmp_path / "kubeconfig").write_text(api.kubeconfig(NAMESPACE))
    pool = manifests.one("InferencePool")
    api.put({**pool, "metadata": {**pool["metadata"], "namespace": NAMESPACE}})
    selected = pool["spec"]["selector"]["matchLabels"]
    for name, role, ip in (("prefill-0", "prefill", "10.0.0.1"), ("decode-0", "decode", "10.0.1.1")):
        api.put(pod(name, role, ip, namespace=NAMESPACE, labels=selected, ports={"http": 8000}))
    overrides = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "health_listen": "127.0.0.1:0",
        "engine_metrics.enabled": False,
        "tls.cert_file": str(tmp_path / "tls" / "tls.crt"),
        "tls.key_file": str(tmp_path / "tls" / "tls.key"),
        "discovery.kubernetes.kubeconfig": str(tmp_path / "kubeconfig"),
    }
    extproc = manifests.container("pd-extproc")
    probed = {extproc[probe]["grpc"]["service"] for probe in ("readinessProbe", "livenessProbe")}
    shapes = shape_health_services()
    assert "envoy.service.ext_proc.v3.ExternalProcessor" in shapes
    server = await start_server(load_config(str(tmp_path / "config.yaml"), overrides, environ={}))
    target = f"127.0.0.1:{server.grpc_port}"
    options = (("grpc.ssl_target_name_override", SERVICE_HOST),)
    try:

        async def endpoints() -> set[tuple[str, str]]:
            url = f"http://127.0.0.1:{server.admin_port}/debug/endpoints"
            async with aiohttp.ClientSession() as session, session.get(url) as response:
                return {(row["role"], row["address"]) for row in await response.json()}

        expected = {("prefill", "10.0.0.1:8000"), ("decode", "10.0.1.1:8000")}
        async with grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(cert), options) as channel:

            async def ready() -> bool:
                return await health_status(channel, "readiness") == health_pb2.HealthCheckResponse.SERVING

            await until(ready)
            assert await endpoints() == expected
            for service in sorted(shapes | probed):
                assert await health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING, (
                    service
                )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            for service in sorted(probed):
                assert await health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING, (
                    service
                )
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_status(channel, "liveness")
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(grace=0.1)
        await api.stop()


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    """The gRPC health status of ``service`` over ``channel``."""
    answer = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10
    )
    return answer.status
