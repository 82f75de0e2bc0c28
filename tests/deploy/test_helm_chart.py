"""The Helm chart ``charts/pd-extproc`` with the real Helm 4 (fetched by :mod:`helm_tool`):
``helm lint --strict``, ``helm template`` over several value sets, the rendered manifests against
the Kubernetes schemas (``kubernetes-validate``), the rendered pd-extproc configuration through
``pd-extproc check-config``, the rendered Envoy bootstrap through ``envoy --mode validate`` and
against ``envoy/envoy-ads.yaml``, and bad values refused by ``values.schema.json`` at install time.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import yaml
from helm_chart import (
    CHART,
    CONFIG_KEYS,
    FULLNAME,
    KUBE_VERSIONS,
    NAMESPACE,
    Manifests,
    assert_refused_by_schema,
    check_config,
    effective_config,
    helm_args,
    install_dry_run,
    kubernetes_problems,
    leaf_keys,
    lookup,
    port_of,
    run_helm,
    template,
)

from ext_proc.config import Config, as_dict
from ext_proc.handoff.config import MAX_PREFILL_TIMEOUT
from ext_proc.handoff.kv_transfer import TIMEOUT_MARGIN_SECONDS
from sim.gateway import SHIPPED_ADS_BOOTSTRAP, make_fail_open, validate_envoy


@dataclasses.dataclass(frozen=True)
class ValueSet:
    """A values file and ``--set`` arguments, and what the rendered pd-extproc config must say."""

    values: dict[str, object]
    sets: tuple[str, ...]
    expect: dict[str, object]
    """Dotted keys of the effective configuration (``check-config``'s output) and their values."""


VALUE_SETS = {
    "defaults": ValueSet(
        {},
        (),
        {
            "affinity.mode": "prefer",
            "affinity.bonus": 0.3,
            "handoff.prefill_via": "http://127.0.0.1:10001",
            "metrics_listen": "0.0.0.0:9090",
            "admin.debug_endpoints": True,
        },
    ),
    "cli-set": ValueSet(
        {},
        (
            "affinity.mode=strict",
            "affinity.bonus=0.1",
            "routing.fallback_count=3",
            "handoff.prefill_timeout_seconds=90.5",
            "load.default_token_capacity=5e4",
            "discovery.kubernetes.prefill_port=8000",
            "discovery.kubernetes.decode_port=decode-http",
            "xds.no_envoy_delay_seconds=0.5",
            "admin.debug_endpoints=false",
            "limits.max_inflight_requests=64",
            "limits.retry_after_seconds=5",
            "engine_metrics.interval_seconds=0.05",
            "engine_metrics.engine=sglang",
            "engine_metrics.port=9100",
            "engine_metrics.models_interval_seconds=2.5",
            "envoy.failOpen=true",
            "affinity.auto.num_layers=80",
            "affinity.auto.cross_group_gbps=25",
            "affinity.auto.wait_scale_ms=20.5",
            "affinity.auto.base_latency_ms=0",
        ),
        {
            "affinity.mode": "strict",
            "affinity.bonus": 0.1,
            "routing.fallback_count": 3,
            "handoff.prefill_timeout_seconds": 90.5,
            "load.default_token_capacity": 50000.0,
            "discovery.kubernetes.prefill_port": 8000,
            "discovery.kubernetes.decode_port": "decode-http",
            "xds.no_envoy_delay_seconds": 0.5,
            "admin.debug_endpoints": False,
            "limits.max_inflight_requests": 64,
            "limits.retry_after_seconds": 5,
            "engine_metrics.interval_seconds": 0.05,
            "engine_metrics.engine": "sglang",
            "engine_metrics.port": 9100,
            "engine_metrics.models_interval_seconds": 2.5,
            "affinity.auto.num_layers": 80,
            "affinity.auto.kv_bytes_per_token": 0,
            "affinity.auto.cross_group_gbps": 25.0,
            "affinity.auto.wait_scale_ms": 20.5,
            "affinity.auto.base_latency_ms": 0.0,
        },
    ),
    "namespaces-monitoring-workers": ValueSet(
        {
            "replicaCount": 3,
            "workers": 3,
            "discovery": {
                "kubernetes": {
                    "namespaces": ["engines-a", "engines-b"],
                    "role_label": "example.com/pd-role",
                    "group_label": "pdGroupID",
                    "decode_port": 8200,
                }
            },
            "service": {"type": "LoadBalancer", "port": 80},
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "podDisruptionBudget": {"maxUnavailable": "50%"},
            "affinity": {"bonus": 0.00001},
        },
        (),
        {
            "affinity.bonus": 0.00001,
            "discovery.poll_interval_seconds": 0.25,
            "discovery.kubernetes.namespaces": ["engines-a", "engines-b"],
            "discovery.kubernetes.preset": "infernex",
            "discovery.kubernetes.role_label": "example.com/pd-role",
            "discovery.kubernetes.group_label": "pdGroupID",
            "discovery.kubernetes.decode_port": 8200,
        },
    ),
    "llm-d": ValueSet(
        {
            "discovery": {
                "kubernetes": {
                    "namespaces": ["llm-d"],
                    "preset": "llm-d",
                    "role_label": "llm-d.ai/role",
                    "prefill_role": "prefiller",
                    "decode_role": "decoder",
                    "both_role": "mixed",
                    "prefill_port": "vllm",
                    "decode_port": 8200,
                    "group_label": "llm-d.ai/pd-group",
                    "capacity_annotation": "example.com/token-capacity",
                    "bootstrap_port_annotation": "example.com/bootstrap-port",
                    "metrics_port_annotation": "example.com/metrics-port",
                    "kv_events_port_annotation": "example.com/kv-events-port",
                    "kv_events_replay_port_annotation": "example.com/kv-events-replay-port",
                    "data_parallel_size_annotation": "example.com/dp-size",
                    "models_annotation": "example.com/models",
                    "kubeconfig": "/etc/kube/config",
                }
            },
            "handoff": {"mode": "kv-transfer-params", "prefill_timeout_seconds": 400.25},
            "xds": {"no_envoy_delay_seconds": 0},
        },
        (),
        {
            "discovery.kubernetes": {
                "kubeconfig": "/etc/kube/config",
                "namespaces": ["llm-d"],
                "preset": "llm-d",
                "role_label": "llm-d.ai/role",
                "prefill_role": "prefiller",
                "decode_role": "decoder",
                "both_role": "mixed",
                "prefill_port": "vllm",
                "decode_port": 8200,
                "group_label": "llm-d.ai/pd-group",
                "capacity_annotation": "example.com/token-capacity",
                "bootstrap_port_annotation": "example.com/bootstrap-port",
                "metrics_port_annotation": "example.com/metrics-port",
                "kv_events_port_annotation": "example.com/kv-events-port",
                "kv_events_replay_port_annotation": "example.com/kv-events-replay-port",
                "data_parallel_size_annotation": "example.com/dp-size",
                "models_annotation": "example.com/models",
            },
            "handoff.prefill_timeout_seconds": 400.25,
            "xds.no_envoy_delay_seconds": 0.0,
        },
    ),
    "files": ValueSet(
        {
            "listen": "0.0.0.0:9500",
            "metrics_listen": "0.0.0.0:9100",
            "discovery": {"source": "files", "eds_files": ["/etc/eds/prefill.yaml", "/etc/eds/decode.yaml"]},
            "affinity": {"mode": False},  # what a values file gives for a bare `mode: off`
            "routing": {"destination_header": "x-dest", "prefill_header": "x-pre"},
            "handoff": {
                "mode": "kv-transfer-params",
                "prefill_timeout_seconds": MAX_PREFILL_TIMEOUT,
                "on_prefill_failure": "error",
            },
            "xds": {"no_envoy_delay_seconds": 60},
            "extraVolumes": [{"name": "eds", "configMap": {"name": "engine-eds"}}],
            "extproc": {"extraVolumeMounts": [{"name": "eds", "mountPath": "/etc/eds", "readOnly": True}]},
            "service": {"type": "NodePort"},
            "tracing": {"otlp_endpoint": "http://otel-collector.observability:4317", "sampling_ratio": 0.25},
        },
        (),
        {
            "tracing.otlp_endpoint": "http://otel-collector.observability:4317",
            "tracing.sampling_ratio": 0.25,
            "affinity.mode": "off",
            "listen": "0.0.0.0:9500",
            "discovery.source": "files",
            "discovery.eds_files": ["/etc/eds/prefill.yaml", "/etc/eds/decode.yaml"],
            "routing.destination_header": "x-dest",
            "handoff.mode": "kv-transfer-params",
            "handoff.prefill_timeout_seconds": MAX_PREFILL_TIMEOUT,
            "xds.no_envoy_delay_seconds": 60.0,
        },
    ),
    "shared-state": ValueSet(
        {
            "replicaCount": 3,
            "shared_state": {
                "kind": "nats",
                "peer_timeout_seconds": 4,
                "sync_answer_seconds": 0.5,
                "sync_max_waiting": 16,
                "nats": {"subject_prefix": "team.pool-a"},
            },
            "natsServer": {"enabled": True},
            "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
        },
        ("shared_state.batch_seconds=0.002",),
        {
            "shared_state.kind": "nats",
            "shared_state.nats.url": "nats://gw-pd-extproc-nats:4222",
            "shared_state.nats.subject_prefix": "team.pool-a",
            "shared_state.peer_timeout_seconds": 4.0,
            "shared_state.batch_seconds": 0.002,
            "shared_state.sync_answer_seconds": 0.5,
            "shared_state.sync_max_waiting": 16,
        },
    ),
}
"""The ``llm-d`` value set sets every key of ``discovery.kubernetes`` to another value than pd-extproc's
default."""


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, helm: Path, tmp_path_factory: pytest.TempPathFactory):
    value_set = VALUE_SETS[request.param]
    docs = template(helm, tmp_path_factory.mktemp(request.param), value_set.values, value_set.sets)
    return value_set, Manifests(docs)


def test_helm_lint_strict_passes_for_every_value_set(helm: Path, tmp_path: Path) -> None:
    for name, value_set in VALUE_SETS.items():
        result = run_helm(
            helm, "lint", "--strict", str(CHART), *helm_args(tmp_path, value_set.values, value_set.sets)
        )
        assert result.returncode == 0, f"{name}:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(rendered, version: str) -> None:
    _, manifests = rendered
    assert kubernetes_problems(manifests.docs, version) == []


def test_rendered_config_passes_check_config_with_the_values(rendered, tmp_path: Path) -> None:
    """Every configuration key is rendered, with its name, and pd-extproc takes the file as it is."""
    value_set, manifests = rendered
    assert leaf_keys(yaml.safe_load(manifests.config)) == CONFIG_KEYS
    effective = effective_config(manifests, tmp_path)
    for dotted, expected in value_set.expect.items():
        assert lookup(effective, dotted) == expected, dotted


def test_the_defaults_are_pd_extprocs_but_where_the_readme_says(helm: Path, tmp_path: Path) -> None:
    """values.yaml holds pd-extproc's own defaults, except where docs/deploy/kubernetes.md says."""
    effective = effective_config(Manifests(template(helm, tmp_path, {})), tmp_path)
    defaults = as_dict(Config())
    differing = {key for key in CONFIG_KEYS if lookup(effective, key) != lookup(defaults, key)}
    assert differing == {
        "metrics_listen",
        "discovery.source",
        "discovery.kubernetes.namespaces",
        "handoff.prefill_via",
        "xds.serve_eds",
        "engine_metrics.enabled",
        "envoy_health.admin_url",
    }


def test_values_and_schema_offer_exactly_the_configuration_keys() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())

    def schema_keys(node: dict, prefix: str = "") -> set[str]:
        keys: set[str] = set()
        for name, sub in node["properties"].items():
            keys |= schema_keys(sub, f"{prefix}{name}.") if "properties" in sub else {prefix + name}
        return keys

    sections = {key.partition(".")[0] for key in CONFIG_KEYS}
    assert leaf_keys({k: v for k, v in values.items() if k in sections}) == CONFIG_KEYS
    assert {k for k in schema_keys(schema) if k.partition(".")[0] in sections} == CONFIG_KEYS


def test_check_config_refuses_a_bad_rendered_value(helm: Path, tmp_path: Path) -> None:
    """The check above can fail: a value the schema lets through but pd-extproc refuses."""
    docs = template(helm, tmp_path, {"routing": {"prefill_header": "x-gateway-destination-endpoint"}})
    path = tmp_path / "config.yaml"
    path.write_text(Manifests(docs).config)
    result = check_config(path)
    assert result.returncode == 2
    assert "routing.destination_header and routing.prefill_header must differ" in result.stderr


def test_rendered_envoy_bootstrap_validates(rendered, tmp_path: Path) -> None:
    _, manifests = rendered
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(manifests.envoy))
    result = validate_envoy(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pod_wiring(rendered) -> None:
    """Probes on pd-extproc's gRPC health and Envoy's /ready, ports as configured, both ConfigMaps
    mounted as folders (kubelet never updates a subPath), non-root with a read-only root."""
    value_set, manifests = rendered
    config = yaml.safe_load(manifests.config)
    envoy = manifests.envoy
    grpc_port, metrics_port = port_of(config["listen"]), port_of(config["metrics_listen"])
    extproc, proxy = manifests.container("pd-extproc"), manifests.container("envoy")
    assert extproc["readinessProbe"]["grpc"] == {"port": grpc_port, "service": "readiness"}
    assert extproc["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "liveness"}
    workers = typing.cast(int, value_set.values.get("workers", 1))
    more = range(1, workers)  # worker i on each port + i (docs/operations.md "Worker processes")
    assert {p["name"]: p["containerPort"] for p in extproc["ports"]} == {
        "extproc": grpc_port,
        "metrics": metrics_port,
        **{f"extproc-{i}": grpc_port + i for i in more},
        **{f"metrics-{i}": metrics_port + i for i in more},
    }
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    (endpoints,) = clusters["pd_extproc"]["load_assignment"]["endpoints"]
    assert [e["endpoint"]["address"]["socket_address"] for e in endpoints["lb_endpoints"]] == [
        {"address": "127.0.0.1", "port_value": grpc_port + i} for i in range(workers)
    ]
    listeners = {entry["name"]: entry for entry in envoy["static_resources"]["listeners"]}
    stats_port = listeners["stats"]["address"]["socket_address"]["port_value"]
    assert {p["name"]: p["containerPort"] for p in proxy["ports"]} == {
        "http": listeners["gateway"]["address"]["socket_address"]["port_value"],
        "envoy-stats": stats_port,
    }
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "envoy-stats"}
    stats_routes = listeners["stats"]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    assert {r["match"]["path"] for r in stats_routes["virtual_hosts"][0]["routes"]} == {
        "/ready",
        "/stats/prometheus",
    }
    assert envoy["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert extproc["args"][-4:] == ["--workers", str(workers), "--config", "/etc/pd-extproc/config.yaml"]
    assert proxy["args"][:2] == ["-c", "/etc/envoy/envoy.yaml"]
    volumes = {v["name"]: v for v in manifests.pod["volumes"]}
    for container, volume, folder in ((extproc, "config", "/etc/pd-extproc"), (proxy, "envoy", "/etc/envoy")):
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume]
        assert mount["mountPath"] == folder and "subPath" not in mount
        assert volumes[volume]["configMap"]["name"] in {f"{FULLNAME}-config", f"{FULLNAME}-envoy"}
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert extproc["image"] == proxy["image"] == f"pd-extproc:{app_version}"
    assert manifests.pod["securityContext"]["runAsNonRoot"] is True
    assert manifests.one("Deployment", FULLNAME)["spec"]["replicas"] == value_set.values.get(
        "replicaCount", 2
    )


def test_services_and_monitoring(rendered) -> None:
    value_set, manifests = rendered
    gateway = manifests.one("Service", FULLNAME)
    metrics = manifests.one("Service", f"{FULLNAME}-metrics")
    service_values = typing.cast(dict, value_set.values.get("service", {}))
    assert gateway["spec"]["type"] == service_values.get("type", "ClusterIP")
    assert [(p["name"], p["port"], p["targetPort"]) for p in gateway["spec"]["ports"]] == [
        ("http", service_values.get("port", 8080), "http")
    ]
    assert metrics["spec"]["type"] == "ClusterIP"
    workers = typing.cast(int, value_set.values.get("workers", 1))
    worker_metrics = ["metrics", *[f"metrics-{i}" for i in range(1, workers)]]  # every worker's
    assert [p["targetPort"] for p in metrics["spec"]["ports"]] == [*worker_metrics, "envoy-stats"]
    container_ports = {p["name"]: p["containerPort"] for p in manifests.container("pd-extproc")["ports"]}
    assert all(p["port"] == container_ports[p["targetPort"]] for p in metrics["spec"]["ports"][:workers])
    pod_labels = manifests.one("Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    for service in (gateway, metrics):
        assert service["spec"]["selector"].items() <= pod_labels.items()
    monitors = manifests.all("ServiceMonitor")
    monitoring = typing.cast(dict, value_set.values.get("serviceMonitor", {}))
    assert len(monitors) == (1 if monitoring.get("enabled") else 0)
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
        assert not monitor["spec"]["selector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
        assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
            *[(port, "/metrics") for port in worker_metrics],
            ("envoy-stats", "/stats/prometheus"),
        ]
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
    pdb = manifests.one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_shared_state_gets_its_nats_url_and_token_from_secrets_never_the_config_map(rendered) -> None:
    """The bundled NATS (natsServer) is its own pods, selected by nothing of the router's; the router's
    token comes from the chart's Secret, a user's URL and token from theirs (natsSecret)."""
    value_set, manifests = rendered
    bundled = typing.cast(dict, value_set.values.get("natsServer", {})).get("enabled", False)
    env = {e["name"]: e for e in manifests.pod["containers"][0].get("env", [])}
    nats = [d for d in manifests.all("Deployment") if d["metadata"]["name"] == f"{FULLNAME}-nats"]
    assert len(nats) == (1 if bundled else 0)
    for server in nats:
        secret = manifests.one("Secret", f"{FULLNAME}-nats")
        assert len(secret["data"]["token"]) > 32
        assert env["PD_EXTPROC_NATS_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{FULLNAME}-nats",
            "key": "token",
        }
        labels = server["spec"]["template"]["metadata"]["labels"]
        router = manifests.one("Deployment", FULLNAME)["spec"]["selector"]["matchLabels"]
        selectors = [
            router,
            *(
                s["spec"]["selector"]
                for s in manifests.all("Service")
                if s["metadata"]["name"] != f"{FULLNAME}-nats"
            ),
        ]
        selectors += [b["spec"]["selector"]["matchLabels"] for b in manifests.all("PodDisruptionBudget")]
        assert selectors and not any(sel.items() <= labels.items() for sel in selectors)
        assert manifests.one("Service", f"{FULLNAME}-nats")["spec"]["selector"].items() <= labels.items()
        assert "--auth" in server["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        yaml.safe_load(manifests.config)["shared_state"]["nats"]["token"] == ""
    )  # a ConfigMap holds no secret
    if not bundled:
        assert "PD_EXTPROC_NATS_TOKEN" not in env and "PD_EXTPROC_NATS_URL" not in env


def test_a_users_nats_secret_becomes_the_routers_environment(helm: Path, tmp_path: Path) -> None:
    values = {
        "shared_state": {"kind": "nats"},
        "natsSecret": {"name": "my-nats", "urlKey": "url", "tokenKey": "tok"},
    }
    pod = Manifests(template(helm, tmp_path, values)).pod
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in pod["containers"][0]["env"]}
    assert env == {
        "PD_EXTPROC_NATS_URL": {"name": "my-nats", "key": "url"},
        "PD_EXTPROC_NATS_TOKEN": {"name": "my-nats", "key": "tok"},
    }


def test_rbac_is_exactly_get_list_watch_on_pods_where_they_are_watched(rendered) -> None:
    value_set, manifests = rendered
    roles = manifests.all("Role") + manifests.all("ClusterRole")
    bindings = manifests.all("RoleBinding") + manifests.all("ClusterRoleBinding")
    account = manifests.one("ServiceAccount")["metadata"]["name"]
    assert manifests.pod["serviceAccountName"] == account
    discovery = typing.cast(dict, value_set.values.get("discovery", {}))
    if discovery.get("source") == "files":
        assert roles == [] and bindings == []
        assert manifests.pod["automountServiceAccountToken"] is False
        return
    assert manifests.pod["automountServiceAccountToken"] is True
    namespaces = discovery.get("kubernetes", {}).get("namespaces", [NAMESPACE])
    (role,), (binding,) = roles, bindings
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    if len(namespaces) == 1:
        assert (role["kind"], role["metadata"]["namespace"]) == ("Role", namespaces[0])
        assert binding["metadata"]["namespace"] == namespaces[0]
    else:
        assert role["kind"] == "ClusterRole" and "namespace" not in role["metadata"]
    assert binding["kind"] == f"{role['kind']}Binding"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": role["kind"],
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]


def test_the_envoy_bootstrap_is_the_shipped_ads_one_with_a_stats_listener(helm: Path, tmp_path: Path) -> None:
    """At the default values the chart's bootstrap is envoy/envoy-ads.yaml plus the stats listener and
    its admin cluster; tests/deploy/test_envoy_config.py keeps envoy-ads.yaml equal to envoy/envoy.yaml but
    for the endpoint source, so the chart follows both shipped files."""
    chart = Manifests(template(helm, tmp_path, {})).envoy
    admin = _without_stats(chart)
    assert chart == yaml.safe_load(SHIPPED_ADS_BOOTSTRAP.read_text())
    (endpoint,) = admin["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"] == chart["admin"]["address"]


def _without_stats(bootstrap: dict) -> dict:
    """Remove the chart's stats listener and admin cluster from ``bootstrap`` (in place); the cluster."""
    resources = bootstrap["static_resources"]
    (stats,) = [entry for entry in resources["listeners"] if entry["name"] == "stats"]
    (admin,) = [entry for entry in resources["clusters"] if entry["name"] == "envoy_admin"]
    resources["listeners"].remove(stats)
    resources["clusters"].remove(admin)
    return admin


@pytest.mark.parametrize("fail_open", [False, True])
def test_envoy_fail_open_is_the_documented_edit(helm: Path, tmp_path: Path, fail_open: bool) -> None:
    """``envoy.failOpen`` renders exactly what ``render_bootstrap(fail_open=True)`` does to the shipped
    file (the cli-set value set validates it with ``envoy --mode validate``)."""
    chart = Manifests(template(helm, tmp_path, {}, (f"envoy.failOpen={str(fail_open).lower()}",))).envoy
    _without_stats(chart)
    expected = yaml.safe_load(SHIPPED_ADS_BOOTSTRAP.read_text())
    if fail_open:
        make_fail_open(expected)
    assert chart == expected


@pytest.mark.parametrize("prefill_timeout", ["0.5", "120", "142.5", "400.25", f"{MAX_PREFILL_TIMEOUT:g}"])
def test_envoy_waits_for_a_prefill_leg_and_its_retry_within_the_idle_timeouts(
    helm: Path, tmp_path: Path, prefill_timeout: str
) -> None:
    """The kv-transfer-params handoff asks Envoy to wait 2 x prefill_timeout_seconds + margin for the
    body answer: the rendered max_message_timeout grants it (within Envoy's 1 h), and no stream or
    route idle timeout, of the gateway or of the prefill-leg listener, ends a request (or a prefill
    leg) waiting that long first."""

    def seconds(duration: str) -> float:
        return float(duration.removesuffix("s"))

    envoy = Manifests(
        template(helm, tmp_path, {}, (f"handoff.prefill_timeout_seconds={prefill_timeout}",))
    ).envoy
    listeners = {entry["name"]: entry for entry in envoy["static_resources"]["listeners"]}
    hcms = [
        listeners[name]["filter_chains"][0]["filters"][0]["typed_config"]
        for name in ("gateway", "prefill_leg")
    ]
    (ext_proc,) = [f for f in hcms[0]["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    cap = seconds(ext_proc["typed_config"]["max_message_timeout"])
    idle = [seconds(hcm["stream_idle_timeout"]) for hcm in hcms] + [
        seconds(route["route"]["idle_timeout"])
        for hcm in hcms
        for route in hcm["route_config"]["virtual_hosts"][0]["routes"]
        if "route" in route
    ]
    assert len(idle) == 5  # two listeners, two decode routes, the prefill-leg route
    assert 2 * float(prefill_timeout) + TIMEOUT_MARGIN_SECONDS <= cap <= 3600 and cap < min(idle)


def test_an_affinity_change_keeps_the_pods_other_changes_roll_them(helm: Path, tmp_path: Path) -> None:
    """``helm upgrade --set affinity.mode=...`` only rewrites the ConfigMap (applied live); any other
    configuration change alters the pod template, so the Deployment rolls the pods."""

    def render(*sets: str) -> Manifests:
        return Manifests(template(helm, tmp_path, {}, sets))

    base = render()
    live = render("affinity.mode=auto", "affinity.bonus=0.05", "affinity.auto.cross_group_gbps=40")
    assert live.config != base.config
    assert live.one("Deployment") == base.one("Deployment")
    for change in (
        "handoff.mode=kv-transfer-params",
        "routing.fallback_count=0",
        "routing.destination_header=x-d",
    ):
        assert (
            render(change).one("Deployment")["spec"]["template"] != base.one("Deployment")["spec"]["template"]
        ), change


@pytest.mark.parametrize(
    ("sets", "values", "expected"),
    [
        (("affinity.bonus=0.1",), {}, 0.1),
        (("affinity.bonus=.05",), {}, 0.05),
        (("affinity.bonus=1",), {}, 1.0),
        (("affinity.bonus=0",), {}, 0.0),
        (("affinity.bonus=1.0",), {}, 1.0),
        ((), {"affinity": {"bonus": 0.000001}}, 0.000001),
        ((), {"affinity": {"bonus": "0.25"}}, 0.25),
    ],
)
def test_the_bonus_is_accepted_as_users_type_it_and_rendered_as_a_number(
    helm: Path, tmp_path: Path, sets: tuple[str, ...], values: dict[str, object], expected: float
) -> None:
    bonus = yaml.safe_load(Manifests(template(helm, tmp_path, values, sets)).config)["affinity"]["bonus"]
    assert isinstance(bonus, int | float) and not isinstance(bonus, bool)
    assert bonus == expected


@pytest.mark.parametrize(
    ("sets", "values", "messages"),
    [
        (
            ("affinity.mode=sometimes",),
            {},
            ["at '/affinity/mode': value must be one of 'off', 'prefer', 'strict'"],
        ),
        (("affinity.bonus=2",), {}, ["at '/affinity/bonus'", "maximum: got 2, want 1"]),
        ((), {"affinity": {"bonus": 1.5}}, ["at '/affinity/bonus'", "maximum: got 1.5, want 1"]),
        (("affinity.bonus=1.01",), {}, ["at '/affinity/bonus'", "'1.01' does not match pattern"]),
        (("affinity.bonus=-0.1",), {}, ["at '/affinity/bonus'", "'-0.1' does not match pattern"]),
        (("affinity.bonus=lots",), {}, ["at '/affinity/bonus'", "'lots' does not match pattern"]),
        (("affinity.bouns=0.1",), {}, ["at '/affinity': additional properties 'bouns' not allowed"]),
        (("affinity.auto.same_group_gbps=0",), {}, ["at '/affinity/auto/same_group_gbps'"]),
        (("affinity.auto.wait_scale_ms=-1",), {}, ["at '/affinity/auto/wait_scale_ms'"]),
        (("affinity.auto.kv_bytes_per_token=-1",), {}, ["at '/affinity/auto/kv_bytes_per_token'"]),
        (("affinity.auto.head_dim=1.5",), {}, ["at '/affinity/auto/head_dim'"]),
        (("affinity.auto.gbps=10",), {}, ["at '/affinity/auto': additional properties 'gbps' not allowed"]),
        (("routing.fallback_count=17",), {}, ["at '/routing/fallback_count': maximum: got 17, want 16"]),
        (("routing.prefill_header=X-Pre",), {}, ["at '/routing/prefill_header'", "does not match pattern"]),
        (("handoff.mode=sidecars",), {}, ["at '/handoff/mode': value must be one of 'sidecar'"]),
        (("handoff.prefill_timeout_seconds=0",), {}, ["at '/handoff/prefill_timeout_seconds'"]),
        (("handoff.prefill_timeout_seconds=1795.5",), {}, ["at '/handoff/prefill_timeout_seconds'"]),
        (("handoff.prefill_timeout_seconds=1796",), {}, ["maximum: got 1,796, want 1,795"]),
        ((), {"handoff": {"prefill_timeout_seconds": 1795.01}}, ["maximum: got 1,795.01, want 1,795"]),
        (("handoff.prefill_via=http://127.0.0.1:10001/v1",), {}, ["at '/handoff/prefill_via'"]),
        (("listen=0.0.0.0:70000",), {}, ["at '/listen'", "does not match pattern"]),
        (
            ("discovery.source=dns",),
            {},
            ["at '/discovery/source': value must be one of 'kubernetes', 'files'"],
        ),
        (("discovery.kubernetes.namespaces={Engines}",), {}, ["at '/discovery/kubernetes/namespaces/0'"]),
        (("discovery.kubernetes.role_lable=x",), {}, ["additional properties 'role_lable' not allowed"]),
        (("discovery.kubernetes.preset=llm_d",), {}, ["value must be one of 'infernex', 'llm-d'"]),
        (("discovery.kubernetes.role_label=pd role",), {}, ["at '/discovery/kubernetes/role_label'"]),
        (("discovery.kubernetes.group_label=",), {}, ["at '/discovery/kubernetes/group_label'"]),
        (("discovery.kubernetes.decode_role=-decode",), {}, ["at '/discovery/kubernetes/decode_role'"]),
        (("discovery.kubernetes.prefill_port=70000",), {}, ["at '/discovery/kubernetes/prefill_port'"]),
        (
            (),
            {"discovery": {"kubernetes": {"decode_port": "8200"}}},
            ["at '/discovery/kubernetes/decode_port'"],
        ),
        (("discovery.kubernetes.decode_port=Decode",), {}, ["at '/discovery/kubernetes/decode_port'"]),
        (("xds.serve_eds=false",), {}, ["at '/xds/serve_eds': value must be true"]),
        (("xds.no_envoy_delay_seconds=60.5",), {}, ["at '/xds/no_envoy_delay_seconds'"]),
        ((), {"xds": {"no_envoy_delay_seconds": -1}}, ["at '/xds/no_envoy_delay_seconds'"]),
        (("tls.cert_file=/etc/tls/tls.crt",), {}, ["at '/tls/cert_file'"]),
        (("admin.debug_endpoints=yes",), {}, ["at '/admin/debug_endpoints'"]),
        (("affinty.mode=strict",), {}, ["additional properties 'affinty' not allowed"]),
        (("workers=0",), {}, ["at '/workers': minimum"]),
        (("workers=65",), {}, ["at '/workers': maximum"]),
    ],
)
def test_bad_values_are_refused_at_install_time(
    helm: Path, tmp_path: Path, sets: tuple[str, ...], values: dict[str, object], messages: list[str]
) -> None:
    assert_refused_by_schema(install_dry_run(helm, tmp_path, values, sets), messages)


def test_notes_say_how_to_reach_the_gateway(helm: Path, tmp_path: Path) -> None:
    sets = ("replicaCount=2", "engine_metrics.enabled=false")
    result = install_dry_run(helm, tmp_path, {}, sets)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.partition("NOTES:")[2]
    assert f"kubectl port-forward --namespace {NAMESPACE} service/{FULLNAME} 8080:8080" in notes
    assert f"http://{FULLNAME}.{NAMESPACE}.svc:8080/v1/" in notes
    assert "curl http://$GATEWAY/v1/chat/completions" in notes
    assert f"kubectl edit configmap --namespace {NAMESPACE} {FULLNAME}-config" in notes
    assert "2 replicas and engine_metrics.enabled false" in notes


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [({}, "/var/lib/pd-extproc/tokenizer"), ({"tokenizer": "/models/tok"}, "/models/tok")],
)
def test_a_tokenizer_volume_is_mounted_and_named_in_the_config(
    helm: Path, tmp_path: Path, prefix: dict[str, object], expected: str
) -> None:
    """The volume is mounted read-only into pd-extproc alone, its subPath the model's folder; the
    config's affinity.prefix.tokenizer is the mount path unless a value names another folder."""
    volume = {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    values = {
        "tokenizer": {"volume": volume, "subPath": "meta-llama/Llama-3.1-8B-Instruct"},
        "affinity": {"prefix": {"enabled": True, "source": "kv-events", **prefix}},
    }
    manifests = Manifests(template(helm, tmp_path, values))
    (mount,) = [m for m in manifests.container("pd-extproc")["volumeMounts"] if m["name"] == "tokenizer"]
    assert mount == {
        "name": "tokenizer",
        "mountPath": "/var/lib/pd-extproc/tokenizer",
        "readOnly": True,
        "subPath": "meta-llama/Llama-3.1-8B-Instruct",
    }
    assert all(m["name"] != "tokenizer" for m in manifests.container("envoy")["volumeMounts"])
    assert {"name": "tokenizer", **volume} in manifests.pod["volumes"]
    assert lookup(effective_config(manifests, tmp_path), "affinity.prefix.tokenizer") == expected


def test_without_a_tokenizer_volume_nothing_is_mounted(helm: Path, tmp_path: Path) -> None:
    manifests = Manifests(template(helm, tmp_path, {"affinity": {"prefix": {"cpu_tier_weight": "0.25"}}}))
    assert all(v["name"] != "tokenizer" for v in manifests.pod["volumes"])
    config = effective_config(manifests, tmp_path)
    assert lookup(config, "affinity.prefix.tokenizer") == ""
    assert lookup(config, "affinity.prefix.cpu_tier_weight") == 0.25
    assert lookup(config, "affinity.auto.cpu_tier_gbps") == 55.0
