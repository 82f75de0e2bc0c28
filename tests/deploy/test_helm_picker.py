"""The chart's picker mode (``mode: picker``) with the real Helm 4: pd-extproc alone as the endpoint
picker of the InferencePool the chart creates, for a gateway's own Envoy.

Checked: ``helm lint --strict`` and ``helm template`` over three picker value sets; the built-in kinds
against the Kubernetes schemas (``kubernetes-validate``); the InferencePool against the
``inference.networking.k8s.io/v1`` schema below (no package ships the GIE CRD); the DestinationRule
against Istio's (``@kubernetes-models/istio``, :mod:`istio_models`); the rendered configuration through
``pd-extproc check-config``, and exactly the documented keys differing from gateway mode; the objects
wired to one another; bad values refused at install time; the self-signed certificate served by
pd-extproc and kept across ``helm upgrade`` (``lookup`` against :mod:`helm_cluster`).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
from pathlib import Path

import jsonschema
import pytest
import yaml
from helm_chart import (
    CHART,
    FULLNAME,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    Manifests,
    assert_refused_by_schema,
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
from helm_cluster import HelmCluster
from istio_models import destination_rule_problems

from ext_proc.discovery.pool import view_pool

SERVICE_HOST = f"{FULLNAME}.{NAMESPACE}.svc"
GATEWAY_HEADER = "x-gateway-destination-endpoint"
MATCH = {"app": "vllm"}


@dataclasses.dataclass(frozen=True)
class PickerSet:
    """Picker-mode values (``mode: picker`` added), ``--set`` arguments, the effective configuration
    keys they must give (``check-config``'s output), and the provider they configure."""

    values: dict[str, object]
    sets: tuple[str, ...]
    expect: dict[str, object]
    pool: dict[str, object]
    """The InferencePool's spec fields the values give: matchLabels, targetPorts, failureMode."""
    rule: dict[str, object] | None = None
    """The DestinationRule's spec (provider istio), else None."""
    secret: str = ""
    """picker.tls.secretName."""

    @property
    def all_values(self) -> dict[str, object]:
        return {"mode": "picker", **self.values}


PICKER_SETS = {
    "picker": PickerSet(
        {"inferencePool": {"modelServers": {"matchLabels": MATCH}}},
        (),
        {"routing.fallback_count": 0, "health_listen": "0.0.0.0:9003", "listen": "0.0.0.0:9002"},
        {"matchLabels": MATCH, "targetPorts": [{"number": 8000}], "failureMode": "FailClose"},
    ),
    "picker-istio": PickerSet(
        {
            "replicaCount": 1,
            "listen": "0.0.0.0:9500",
            "health_listen": "0.0.0.0:9100",
            "inferencePool": {
                "modelServers": {"matchLabels": {"app": "vllm", "openfuyao.com/model": "llama-3"}},
                "targetPorts": [{"number": 8000}, {"number": 8200}],
            },
            "provider": {
                "name": "istio",
                "istio": {
                    "destinationRule": {
                        "trafficPolicy": {"connectionPool": {"http": {"http2MaxRequests": 1000}}}
                    }
                },
            },
            "picker": {"failureMode": "FailOpen"},
            "routing": {"fallback_count": 3},
            "handoff": {"mode": "kv-transfer-params"},
            "podLabels": {"team": "ml"},
            "serviceMonitor": {"enabled": True},
        },
        (),
        {
            "routing.fallback_count": 3,
            "health_listen": "0.0.0.0:9100",
            "listen": "0.0.0.0:9500",
            "handoff.mode": "kv-transfer-params",
        },
        {
            "matchLabels": {"app": "vllm", "openfuyao.com/model": "llama-3"},
            "targetPorts": [{"number": 8000}, {"number": 8200}],
            "failureMode": "FailOpen",
        },
        {
            "host": f"{SERVICE_HOST}.cluster.local",
            "trafficPolicy": {
                "tls": {"mode": "SIMPLE", "insecureSkipVerify": True},
                "connectionPool": {"http": {"http2MaxRequests": 1000}},
            },
        },
    ),
    "picker-own-secret": PickerSet(
        {},
        (
            "inferencePool.modelServers.matchLabels.app=vllm",
            "provider.name=istio",
            "provider.istio.destinationRule.host=epp.llm.svc.cluster.local",
            "picker.tls.secretName=picker-cert",
            "affinity.mode=strict",
        ),
        {"routing.fallback_count": 2, "affinity.mode": "strict"},
        {"matchLabels": MATCH, "targetPorts": [{"number": 8000}], "failureMode": "FailClose"},
        {
            "host": "epp.llm.svc.cluster.local",
            "trafficPolicy": {"tls": {"mode": "SIMPLE", "insecureSkipVerify": True}},
        },
        "picker-cert",
    ),
}

PICKER_KEYS = {
    "discovery.source": "inferencepool",
    "discovery.inferencepool.name": FULLNAME,
    "discovery.inferencepool.namespace": NAMESPACE,
    "handoff.prefill_via": "",
    "xds.serve_eds": False,
    "envoy_health.admin_url": "",
    "tls.cert_file": "/etc/pd-extproc-tls/tls.crt",
    "tls.key_file": "/etc/pd-extproc-tls/tls.key",
    "tls.client_ca_file": "",
}
"""What picker mode renders whatever the values say (docs/deploy/kubernetes.md "Picker mode"), besides
health_listen ("" becomes 0.0.0.0:9003) and, with provider none, routing.fallback_count 0."""


def render_picker(helm: Path, tmp_path: Path, picker: PickerSet) -> Manifests:
    return Manifests(template(helm, tmp_path, picker.all_values, picker.sets))


@pytest.fixture(scope="module", params=list(PICKER_SETS), ids=list(PICKER_SETS))
def picked(request: pytest.FixtureRequest, helm: Path, tmp_path_factory: pytest.TempPathFactory):
    picker = PICKER_SETS[request.param]
    return picker, render_picker(helm, tmp_path_factory.mktemp(request.param), picker)


def test_helm_lint_strict_passes_for_every_picker_set(helm: Path, tmp_path: Path) -> None:
    for name, picker in PICKER_SETS.items():
        args = helm_args(tmp_path, picker.all_values, picker.sets)
        result = run_helm(helm, "lint", "--strict", str(CHART), *args)
        assert result.returncode == 0, f"{name}:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_built_in_kinds_match_the_kubernetes_schemas(picked, version: str) -> None:
    _, manifests = picked
    assert kubernetes_problems(manifests.docs, version) == []


_PORT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            "additionalProperties": {
                                "type": "string",
                                "maxLength": 63,
                                "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
                            },
                        }
                    },
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {
                            "type": "string",
                            "maxLength": 253,
                            "pattern": "^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",  # noqa: E501
                        },
                        "kind": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 63,
                            "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
"""The InferencePool v1 schema, from GIE's CRD (``config/crd/bases/`` in its repository,
``inference.networking.k8s.io_inferencepools.yaml``: fields, types, bounds, enums, patterns),
stricter in two ways: unknown fields are refused (the API server would prune them silently) and the
picker reference is required (the chart's pool always has one). The CRD's two CEL rules are checked
in :func:`inference_pool_problems`."""


def inference_pool_problems(pool: dict) -> list[str]:
    """What the v1 schema and the CRD's CEL rules (distinct target ports; a port when the picker
    reference is a Service) find wrong in ``pool``."""
    validator = jsonschema.Draft7Validator(INFERENCE_POOL_V1)
    problems = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(pool)]
    spec = pool.get("spec", {})
    numbers = [port.get("number") for port in spec.get("targetPorts", [])]
    if len(set(numbers)) != len(numbers):
        problems.append("spec.targetPorts: port number must be unique")
    reference = spec.get("endpointPickerRef", {})
    if reference.get("kind", "Service") == "Service" and "port" not in reference:
        problems.append("spec.endpointPickerRef: port is required when kind is 'Service' or unspecified")
    return problems


def test_the_inference_pool_selects_the_model_servers_through_the_picker(picked) -> None:
    picker, manifests = picked
    pool = manifests.one("InferencePool")
    assert inference_pool_problems(pool) == []
    view = view_pool(pool)  # as pd-extproc's inferencepool source reads it
    assert view.problems == () and view.spec is not None
    assert view.spec.target_ports == tuple(port["number"] for port in picker.pool["targetPorts"])
    assert pool["metadata"]["name"] == FULLNAME
    assert pool["spec"]["selector"]["matchLabels"] == picker.pool["matchLabels"]
    assert pool["spec"]["targetPorts"] == picker.pool["targetPorts"]
    assert pool["spec"]["appProtocol"] == "http"
    reference = pool["spec"]["endpointPickerRef"]
    assert reference["failureMode"] == picker.pool["failureMode"]
    service = manifests.one("Service", reference["name"])
    (port,) = service["spec"]["ports"]
    assert (reference["kind"], reference["port"]["number"]) == ("Service", port["port"])
    labels = manifests.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not pool["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_destination_rule_has_istio_dial_the_picker_over_unverified_tls(picked) -> None:
    picker, manifests = picked
    rules = manifests.all("DestinationRule")
    assert [rule["spec"] for rule in rules] == ([picker.rule] if picker.rule else [])
    assert destination_rule_problems(rules) == [""] * len(rules)


def test_the_destination_rule_schema_can_refuse() -> None:
    """The Istio check above can fail: a mode Istio does not know, a flag that is no boolean."""
    rule = {
        "apiVersion": "networking.istio.io/v1",
        "kind": "DestinationRule",
        "metadata": {"name": "x"},
        "spec": {"host": "x", "trafficPolicy": {"tls": {"mode": "TLS", "insecureSkipVerify": "yes"}}},
    }
    (problem,) = destination_rule_problems([rule])
    assert "tls/mode" in problem and "insecureSkipVerify must be boolean" in problem


def test_the_rendered_config_is_the_pickers(picked, tmp_path: Path) -> None:
    """pd-extproc takes the rendered file; it names the chart's pool, has no prefill-leg listener,
    EDS or Envoy admin, serves TLS with the mounted certificate and health on the probed port."""
    picker, manifests = picked
    effective = effective_config(manifests, tmp_path)
    for dotted, expected in {**PICKER_KEYS, **picker.expect}.items():
        assert lookup(effective, dotted) == expected, dotted
    mounts = {m["name"]: m["mountPath"] for m in manifests.container("pd-extproc")["volumeMounts"]}
    assert os.path.dirname(effective["tls"]["cert_file"]) == mounts["tls"]
    assert os.path.dirname(effective["tls"]["key_file"]) == mounts["tls"]


def test_picker_mode_decides_exactly_the_documented_keys(helm: Path, tmp_path: Path) -> None:
    """Against the same values in gateway mode, the rendered configuration differs in the keys of
    PICKER_KEYS, health_listen and, with provider none only, routing.fallback_count."""
    for provider, extra in (("none", {"routing.fallback_count"}), ("istio", set())):
        values = {"inferencePool": {"modelServers": {"matchLabels": MATCH}}, "provider": {"name": provider}}
        gateway = effective_config(Manifests(template(helm, tmp_path, values)), tmp_path)
        picked_config = effective_config(
            Manifests(template(helm, tmp_path, {"mode": "picker", **values})), tmp_path
        )
        differing = {k for k in leaf_keys(gateway) if lookup(gateway, k) != lookup(picked_config, k)}
        assert differing == set(PICKER_KEYS) - {"tls.client_ca_file"} | {"health_listen"} | extra, provider


def test_the_picker_pod(picked) -> None:
    """pd-extproc alone; its gRPC port, health port and metrics port; kubelet probes the plaintext
    health port; the TLS Secret mounted read-only; the API token mounted (it watches the pool)."""
    picker, manifests = picked
    config = yaml.safe_load(manifests.config)
    pod = manifests.pod
    assert [c["name"] for c in pod["containers"]] == ["pd-extproc"]
    extproc = manifests.container("pd-extproc")
    health = port_of(config["health_listen"])
    assert {p["name"]: p["containerPort"] for p in extproc["ports"]} == {
        "extproc": port_of(config["listen"]),
        "health": health,
        "metrics": port_of(config["metrics_listen"]),
    }
    assert extproc["readinessProbe"]["grpc"] == {"port": health, "service": "readiness"}
    assert extproc["livenessProbe"]["grpc"] == {"port": health, "service": "liveness"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(volumes) == {"config", "tls", "tmp"}
    secret = picker.secret
    assert volumes["tls"]["secret"] == {"secretName": secret or f"{FULLNAME}-tls", "defaultMode": 0o440}
    secrets = manifests.all("Secret")
    assert [s["metadata"]["name"] for s in secrets] == ([] if secret else [f"{FULLNAME}-tls"])
    for rendered in secrets:
        assert rendered["type"] == "kubernetes.io/tls" and set(rendered["data"]) == {"tls.crt", "tls.key"}
    assert pod["automountServiceAccountToken"] is True
    assert {c["metadata"]["name"] for c in manifests.all("ConfigMap")} == {f"{FULLNAME}-config"}
    annotations = manifests.one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/envoy" not in annotations


def test_the_picker_services(picked) -> None:
    picker, manifests = picked
    config = yaml.safe_load(manifests.config)
    epp = manifests.one("Service", FULLNAME)
    assert epp["spec"]["type"] == "ClusterIP"
    assert epp["spec"]["ports"] == [
        {
            "name": "grpc-ext-proc",
            "port": port_of(config["listen"]),
            "targetPort": "extproc",
            "protocol": "TCP",
        }
    ]
    metrics = manifests.one("Service", f"{FULLNAME}-metrics")
    assert [p["name"] for p in metrics["spec"]["ports"]] == ["metrics"]
    labels = manifests.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    for service in (epp, metrics):
        assert service["spec"]["selector"].items() <= labels.items()
    for monitor in manifests.all("ServiceMonitor"):
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert len(manifests.all("ServiceMonitor")) == int("serviceMonitor" in picker.values)


def test_the_picker_may_read_pods_and_inference_pools_in_the_pools_namespace(picked) -> None:
    _, manifests = picked
    (role,), (binding,) = manifests.all("Role"), manifests.all("RoleBinding")
    assert manifests.all("ClusterRole") == []
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


@pytest.mark.parametrize(
    ("sets", "messages"),
    [
        ((), ["at '/inferencePool/modelServers/matchLabels': minProperties: got 0, want 1"]),
        (
            ("inferencePool.modelServers.matchLabels.app=vllm", "routing.destination_header=x-dest"),
            ["at '/routing/destination_header': value must be 'x-gateway-destination-endpoint'"],
        ),
        (
            ("inferencePool.modelServers.matchLabels.app=vllm", "service.type=LoadBalancer"),
            ["at '/service/type': value must be 'ClusterIP'"],
        ),
        (
            ("inferencePool.modelServers.matchLabels.app=-vllm",),
            ["at '/inferencePool/modelServers/matchLabels/app'"],
        ),
        (("inferencePool.modelServers.matchLabels.app=vllm", "provider.name=gke"), ["at '/provider/name'"]),
        (
            ("inferencePool.modelServers.matchLabels.app=vllm", "picker.failureMode=Open"),
            ["at '/picker/failureMode'"],
        ),
        (
            (
                "inferencePool.modelServers.matchLabels.app=vllm",
                "provider.istio.destinationRule.trafficPolicy.tls.mode=DISABLE",
            ),
            ["at '/provider/istio/destinationRule/trafficPolicy'"],
        ),
        (
            ("inferencePool.modelServers.matchLabels.app=vllm", "picker.tls.secretName=My_Cert"),
            ["at '/picker/tls/secretName'"],
        ),
        (
            ("inferencePool.modelServers.matchLabels.app=vllm", "tls.cert_file=/etc/tls.crt"),
            ["at '/tls/cert_file'"],
        ),
        (("inferencePool.modelServers.matchLabels.app=vllm", "mode=sidecar"), ["at '/mode'"]),
        (("inferencePool.modelServers.matchLabels.app=vllm", "workers=2"), ["at '/workers': value must"]),
    ],
)
def test_bad_picker_values_are_refused_at_install_time(
    helm: Path, tmp_path: Path, sets: tuple[str, ...], messages: list[str]
) -> None:
    assert_refused_by_schema(install_dry_run(helm, tmp_path, {"mode": "picker"}, sets), messages)


def test_targets_must_be_distinct_and_at_most_eight(helm: Path, tmp_path: Path) -> None:
    for ports in ([{"number": 8000}, {"number": 8000}], [{"number": 8000 + i} for i in range(9)], []):
        values = {
            "mode": "picker",
            "inferencePool": {"modelServers": {"matchLabels": MATCH}, "targetPorts": ports},
        }
        result = run_helm(helm, "template", RELEASE, str(CHART), *helm_args(tmp_path, values, ()))
        assert result.returncode != 0 and "at '/inferencePool/targetPorts'" in result.stderr, ports


def test_a_pool_selecting_the_picker_itself_is_refused(helm: Path, tmp_path: Path) -> None:
    values = {
        "mode": "picker",
        "inferencePool": {"modelServers": {"matchLabels": {"app.kubernetes.io/instance": RELEASE}}},
    }
    result = run_helm(helm, "template", RELEASE, str(CHART), *helm_args(tmp_path, values, ()))
    assert result.returncode != 0
    assert "inferencePool.modelServers.matchLabels selects the picker's own pods" in result.stderr


def test_notes_say_how_to_route_through_the_pool(helm: Path, tmp_path: Path) -> None:
    sets = ("inferencePool.modelServers.matchLabels.app=vllm", "provider.name=istio")
    result = install_dry_run(helm, tmp_path, {"mode": "picker"}, sets)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.partition("NOTES:")[2]
    assert f"the endpoint picker of the InferencePool {FULLNAME} (namespace {NAMESPACE})" in notes
    assert f"over TLS on the Service {FULLNAME}:9002" in notes
    assert f"with the DestinationRule {FULLNAME} (TLS, not verified); routing.fallback_count 2" in notes
    assert f"kind: InferencePool, name: {FULLNAME}" in notes


def _pem(secret: dict, key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def _helm_template_against(helm: Path, cluster: HelmCluster, tmp_path: Path, picker: PickerSet) -> Manifests:
    """``helm template --dry-run=server`` against ``cluster``: the chart's ``lookup`` reads it."""
    kubeconfig = cluster.kubeconfig(tmp_path, NAMESPACE)
    args = ["template", RELEASE, str(CHART), "--dry-run=server", "--disable-openapi-validation"]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    result = run_helm(helm, *args, *helm_args(tmp_path, picker.all_values, picker.sets), env=env)
    assert result.returncode == 0, result.stderr
    return Manifests([doc for doc in yaml.safe_load_all(result.stdout) if doc])


async def test_the_certificate_stays_the_same_across_upgrades(helm: Path, tmp_path: Path) -> None:
    """At install the cluster has no Secret: the chart generates a certificate. At an upgrade it reads
    the installed Secret back (``lookup``) and renders it unchanged; rendered without a cluster, every
    rendering generates a new one (so the check can fail)."""
    picker = PICKER_SETS["picker"]
    offline = render_picker(helm, tmp_path, picker)
    cluster = HelmCluster({(doc["apiVersion"], doc["kind"]) for doc in offline.docs})
    await cluster.start()
    try:
        installed = await asyncio.to_thread(_helm_template_against, helm, cluster, tmp_path, picker)
        secret = installed.one("Secret", f"{FULLNAME}-tls")
        cluster.put(secret, NAMESPACE, RELEASE)
        upgraded = await asyncio.to_thread(_helm_template_against, helm, cluster, tmp_path, picker)
    finally:
        await cluster.stop()
    assert upgraded.one("Secret", f"{FULLNAME}-tls")["data"] == secret["data"]
    assert offline.one("Secret", f"{FULLNAME}-tls")["data"]["tls.crt"] != secret["data"]["tls.crt"]
    assert render_picker(helm, tmp_path, picker).one("Secret")["data"] != offline.one("Secret")["data"]
    assert cluster.unexpected == []
