"""The chart's monitoring objects with the real Helm: the PrometheusRule (only where the cluster serves
``monitoring.coreos.com/v1`` and ``prometheusRule.enabled``), the Grafana dashboard ConfigMap and the KEDA
ScaledObjects of the autoscaling signals, against the files of ``charts/pd-extproc/monitoring/``, the
Kubernetes schemas (``kubernetes-validate``, for the built-in kinds) and the names pd-extproc exports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helm_chart import (
    CHART,
    FULLNAME,
    KUBE_VERSIONS,
    NAMESPACE,
    Manifests,
    helm_args,
    install_dry_run,
    kubernetes_problems,
    run_helm,
    template,
)
from promql_names import metric_names, pd_extproc_names

MONITORING = CHART / "monitoring"
OPERATOR = ("monitoring.coreos.com/v1",)
KEDA = {
    "keda": {
        "enabled": True,
        "prometheusAddress": "http://prometheus-operated.monitoring.svc:9090",
        "authenticationRef": "prometheus-auth",
        "prefill": {"scaleTargetRef": {"name": "vllm-prefill"}, "maxReplicaCount": 4, "threshold": 8192.5},
        "decode": {
            "scaleTargetRef": {"name": "vllm-decode-a", "kind": "StatefulSet", "apiVersion": "apps/v1"},
            "group": "a",
            "minReplicaCount": 2,
        },
    }
}
EVERYTHING = {
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "grafanaDashboard": {"enabled": True, "namespace": "grafana", "annotations": {"grafana_folder": "LLM"}},
    **KEDA,
}


def alerts(groups: list[dict]) -> list[str]:
    return [rule["alert"] for group in groups for rule in group["rules"]]


def test_nothing_by_default_even_with_the_operator(helm: Path, tmp_path: Path) -> None:
    kinds = {doc["kind"] for doc in template(helm, tmp_path, {}, api_versions=OPERATOR)}
    assert not kinds & {"PrometheusRule", "ScaledObject", "ServiceMonitor"}
    configmaps = Manifests(template(helm, tmp_path, {})).all("ConfigMap")
    assert f"{FULLNAME}-dashboard" not in {c["metadata"]["name"] for c in configmaps}


def test_the_prometheus_rule_is_the_rule_file_where_the_operator_serves_it(
    helm: Path, tmp_path: Path
) -> None:
    values = {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}
    assert Manifests(template(helm, tmp_path, values)).all("PrometheusRule") == []  # no operator
    rule = Manifests(template(helm, tmp_path, values, api_versions=OPERATOR)).one("PrometheusRule")
    assert rule["metadata"]["name"] == FULLNAME
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((MONITORING / "pd-extproc-rules.yaml").read_text())


def test_the_install_notes_say_when_no_prometheus_rule_was_made(helm: Path, tmp_path: Path) -> None:
    result = install_dry_run(helm, tmp_path, {"prometheusRule": {"enabled": True}})
    assert result.returncode == 0, result.stderr
    assert "does not serve monitoring.coreos.com/v1" in result.stdout
    assert "does not serve" not in install_dry_run(helm, tmp_path, {}).stdout


def test_disabled_alerts_are_left_out_and_a_misspelt_one_is_refused(helm: Path, tmp_path: Path) -> None:
    file_alerts = alerts(yaml.safe_load((MONITORING / "pd-extproc-rules.yaml").read_text())["groups"])
    values = {"prometheusRule": {"enabled": True, "disabledAlerts": ["PdExtprocNoHealthyPrefill"]}}
    rule = Manifests(template(helm, tmp_path, values, api_versions=OPERATOR)).one("PrometheusRule")
    assert alerts(rule["spec"]["groups"]) == [a for a in file_alerts if a != "PdExtprocNoHealthyPrefill"]
    values = {"prometheusRule": {"enabled": True, "disabledAlerts": ["PdExtprocNoHealthyPrefil"]}}
    args = ["template", "gw", str(CHART), "--api-versions", OPERATOR[0], *helm_args(tmp_path, values, ())]
    result = run_helm(helm, *args)
    assert result.returncode != 0
    assert "prometheusRule.disabledAlerts: PdExtprocNoHealthyPrefil is none of the alerts" in result.stderr


def test_the_dashboard_config_map_carries_the_dashboard_for_the_sidecar(helm: Path, tmp_path: Path) -> None:
    values = {
        "grafanaDashboard": {
            "enabled": True,
            "namespace": "grafana",
            "annotations": {"grafana_folder": "LLM"},
        }
    }
    config_map = Manifests(template(helm, tmp_path, values)).one("ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads((MONITORING / "pd-extproc-dashboard.json").read_text())
    assert json.loads(config_map["data"]["pd-extproc.json"]) == shipped


def test_keda_scales_each_role_on_its_booked_tokens_from_this_release(helm: Path, tmp_path: Path) -> None:
    manifests = Manifests(template(helm, tmp_path, {"serviceMonitor": {"enabled": True}, **KEDA}))
    metrics_service = manifests.one("Service", f"{FULLNAME}-metrics")["metadata"]["name"]
    prefill = manifests.one("ScaledObject", f"{FULLNAME}-prefill")["spec"]
    decode = manifests.one("ScaledObject", f"{FULLNAME}-decode")["spec"]
    assert prefill["scaleTargetRef"] == {"name": "vllm-prefill"}
    assert decode["scaleTargetRef"] == {
        "name": "vllm-decode-a",
        "kind": "StatefulSet",
        "apiVersion": "apps/v1",
    }
    assert (prefill["minReplicaCount"], prefill["maxReplicaCount"]) == (1, 4)
    assert (decode["minReplicaCount"], decode["maxReplicaCount"]) == (2, 8)
    for spec, role, threshold, group in (
        (prefill, "prefill", "8192.5", ""),
        (decode, "decode", "65536", ', group="a"'),
    ):
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["authenticationRef"] == {"name": "prometheus-auth"}
        metadata = trigger["metadata"]
        assert metadata["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
        assert metadata["threshold"] == threshold
        assert metadata["query"] == (
            f'sum(pd_extproc_pool_booked_tokens{{namespace="{NAMESPACE}", service="{metrics_service}", '
            f'role="{role}"{group}}})'
        )
        assert metric_names(metadata["query"]) <= pd_extproc_names()


def test_keda_takes_a_query_of_its_own_and_leaves_out_a_role_without_a_target(
    helm: Path, tmp_path: Path
) -> None:
    query = 'max(pd_extproc_pool_queued_requests{role="prefill"})'
    values = {
        "keda": {**KEDA["keda"], "prefill": {"scaleTargetRef": {"name": "p"}, "query": query, "threshold": 4}}
    }
    values["keda"]["decode"] = {"scaleTargetRef": {"name": ""}}
    (scaled,) = Manifests(template(helm, tmp_path, values)).all("ScaledObject")
    assert scaled["spec"]["triggers"][0]["metadata"] == {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
        "query": query,
        "threshold": "4",
    }


@pytest.mark.parametrize(
    ("keda", "message"),
    [
        ({"enabled": True, "prefill": {"scaleTargetRef": {"name": "p"}}}, "set keda.prometheusAddress"),
        ({"enabled": True, "prometheusAddress": "http://p:9090"}, "set keda.prefill.scaleTargetRef.name"),
    ],
)
def test_keda_without_an_address_or_a_target_is_refused(
    helm: Path, tmp_path: Path, keda: dict, message: str
) -> None:
    result = run_helm(helm, "template", "gw", str(CHART), *helm_args(tmp_path, {"keda": keda}, ()))
    assert result.returncode != 0
    assert message in result.stderr


def test_everything_on_lints_and_matches_the_kubernetes_schemas(helm: Path, tmp_path: Path) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), *helm_args(tmp_path, EVERYTHING, ()))
    assert result.returncode == 0, result.stdout + result.stderr
    docs = template(helm, tmp_path, EVERYTHING, api_versions=OPERATOR)
    assert {"PrometheusRule", "ScaledObject", "ServiceMonitor"} <= {doc["kind"] for doc in docs}
    for version in KUBE_VERSIONS:
        assert kubernetes_problems(docs, version) == []
