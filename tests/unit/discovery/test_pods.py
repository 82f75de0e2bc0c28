"""The pure pod → endpoint rules of the kubernetes discovery source (ext_proc.discovery.pods)."""

from __future__ import annotations

import dataclasses

import pytest
from builders import endpoint

from ext_proc.discovery.pods import (
    LWS_WORKER_INDEX,
    PRESETS,
    PodView,
    Preset,
    cluster_endpoints,
    has_role,
    is_label_key,
    is_label_value,
    is_object_name,
    view_pod,
)
from ext_proc.endpoints import ClusterEndpoints
from standins.kube_objects import INFERNEX_RULES as INFERNEX
from standins.kube_objects import pod

LLM_D = dataclasses.replace(INFERNEX, scheme=PRESETS[Preset.LLM_D])


def endpoints(view: PodView) -> list[tuple[str, str]]:
    return [(cluster, spec.address) for cluster, spec in view.endpoints]


# --- a routable pod ----------------------------------------------------------------------------


def test_a_ready_decode_pod_is_a_decode_endpoint_at_its_named_port() -> None:
    assert view_pod(pod("d0", "decode", "10.0.0.1"), INFERNEX) == PodView(
        (("decode", endpoint("10.0.0.1:8200")),)
    )


def test_a_ready_prefill_pod_is_a_prefill_endpoint_at_its_named_port() -> None:
    assert view_pod(pod("p0", "prefill", "10.0.0.2"), INFERNEX) == PodView(
        (("prefill", endpoint("10.0.0.2:8000")),)
    )


def test_an_ipv6_pod_ip_is_bracketed() -> None:
    assert endpoints(view_pod(pod(ip="fd00::7"), INFERNEX)) == [("decode", "[fd00::7]:8200")]


def test_the_cluster_names_and_group_label_come_from_the_rules() -> None:
    rules = dataclasses.replace(INFERNEX, group_label="rack", prefill_cluster="pf", decode_cluster="dc")
    view = view_pod(pod("p", "prefill", labels={"rack": "r7"}), rules)
    assert view.endpoints == (("pf", endpoint("10.0.0.1:8000", group="r7")),)


# --- which pods are routable ---------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["Pending", "Succeeded", "Failed", "Unknown", ""])
def test_only_running_pods_are_endpoints(phase: str) -> None:
    assert view_pod(pod(phase=phase), INFERNEX) == PodView(())


@pytest.mark.parametrize("ready", ["False", "Unknown", None])
def test_only_pods_whose_ready_condition_is_true_are_endpoints(ready: str | None) -> None:
    assert view_pod(pod(ready=ready), INFERNEX) == PodView(())


def test_a_true_condition_other_than_ready_does_not_count() -> None:
    unready = pod(ready=None)
    unready["status"]["conditions"] = [{"type": "ContainersReady", "status": "True"}]
    assert view_pod(unready, INFERNEX) == PodView(())


@pytest.mark.parametrize("ip", [None, ""])
def test_a_pod_without_an_ip_is_not_an_endpoint(ip: str | None) -> None:
    assert view_pod(pod(ip=ip), INFERNEX) == PodView(())


def test_a_pod_being_deleted_is_not_an_endpoint() -> None:
    assert view_pod(pod(deleting=True), INFERNEX) == PodView(())


@pytest.mark.parametrize(("index", "routed"), [(None, True), ("0", True), ("1", False), ("7", False)])
def test_of_a_leader_worker_set_only_the_leader_is_an_endpoint(index: str | None, routed: bool) -> None:
    labels = {} if index is None else {LWS_WORKER_INDEX: index}
    assert bool(view_pod(pod(labels=labels), INFERNEX).endpoints) is routed


def test_an_empty_object_is_not_an_endpoint() -> None:
    assert view_pod({}, INFERNEX) == PodView(())


# --- roles --------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [None, "", "router", "both", "Decode"])
def test_a_pod_without_a_known_role_is_not_an_endpoint(role: str | None) -> None:
    assert view_pod(pod(role=role), INFERNEX) == PodView(())


def test_the_role_label_is_the_schemes() -> None:
    assert view_pod(pod(role="decode", role_label="llm-d.ai/role"), INFERNEX) == PodView(())
    llm_d_pod = pod(role="decode", role_label="llm-d.ai/role")
    assert endpoints(view_pod(llm_d_pod, LLM_D)) == [("decode", "10.0.0.1:8000")]


def test_a_both_pod_is_an_endpoint_of_both_clusters_each_at_its_port() -> None:
    rules = dataclasses.replace(LLM_D, scheme=dataclasses.replace(LLM_D.scheme, decode_port=8200))
    both = pod("b0", "both", "10.0.0.3", role_label="llm-d.ai/role", group=None)
    assert view_pod(both, rules) == PodView(
        (("prefill", endpoint("10.0.0.3:8000", group="")), ("decode", endpoint("10.0.0.3:8200", group="")))
    )


# --- ports --------------------------------------------------------------------------------------


def test_a_port_given_as_a_number_needs_no_container_port() -> None:
    rules = dataclasses.replace(INFERNEX, scheme=dataclasses.replace(INFERNEX.scheme, decode_port=9000))
    assert endpoints(view_pod(pod(ports={}), rules)) == [("decode", "10.0.0.1:9000")]


def test_a_named_port_is_looked_up_in_every_container() -> None:
    sidecar = pod()
    sidecar["spec"]["containers"].insert(
        0, {"name": "proxy", "ports": [{"name": "http", "containerPort": 80}]}
    )
    sidecar["spec"]["containers"][1]["ports"] = [{"name": "decode-port", "containerPort": 8300}]
    assert endpoints(view_pod(sidecar, INFERNEX)) == [("decode", "10.0.0.1:8300")]


def test_a_missing_named_port_gives_no_endpoint_and_a_problem() -> None:
    assert view_pod(pod(ports={"http": 80}), INFERNEX) == PodView(
        (), ("no container port named 'decode-port' (the decode port)",)
    )


def test_a_both_pod_missing_one_port_keeps_the_other_role() -> None:
    both = pod("b0", "both", role_label="llm-d.ai/role")
    rules = dataclasses.replace(LLM_D, scheme=dataclasses.replace(LLM_D.scheme, prefill_port="p-port"))
    view = view_pod(both, rules)
    assert endpoints(view) == [("decode", "10.0.0.1:8000")]
    assert view.problems == ("no container port named 'p-port' (the prefill port)",)


# --- target ports (an InferencePool's) ----------------------------------------------------------


def test_target_ports_replace_the_schemes_port_one_endpoint_each_in_their_order() -> None:
    rules = dataclasses.replace(INFERNEX, target_ports=(8002, 8000))
    assert endpoints(view_pod(pod(ports={}), rules)) == [
        ("decode", "10.0.0.1:8002"),
        ("decode", "10.0.0.1:8000"),
    ]


def test_target_ports_of_a_both_pod_are_in_both_clusters() -> None:
    rules = dataclasses.replace(LLM_D, target_ports=(8000, 8001))
    both = pod(
        "b0", "both", "10.0.0.3", role_label="llm-d.ai/role", annotations={"pd-extproc/token-capacity": "9"}
    )
    view = view_pod(both, rules)
    assert endpoints(view) == [
        ("prefill", "10.0.0.3:8000"),
        ("prefill", "10.0.0.3:8001"),
        ("decode", "10.0.0.3:8000"),
        ("decode", "10.0.0.3:8001"),
    ]
    assert {spec.token_capacity for _, spec in view.endpoints} == {9.0}  # each rank: the pod's annotation
    assert view.problems == ()


def test_target_ports_still_need_a_routable_pod_with_a_role() -> None:
    rules = dataclasses.replace(INFERNEX, target_ports=(8000,))
    assert view_pod(pod(ready="False"), rules) == PodView(())
    assert view_pod(pod(role="router"), rules) == PodView(())


@pytest.mark.parametrize(
    ("role", "known"), [("prefill", True), ("decode", True), ("both", False), (None, False)]
)
def test_has_role_is_about_the_label_alone(role: str | None, known: bool) -> None:
    assert has_role(pod(role=role, ready="False"), INFERNEX) is known
    assert has_role({}, INFERNEX) is False


SYNTAX = [
    *((is_label_key, key, True) for key in ("app", "example.com/app", "a.b-c_d")),
    *(
        (is_label_key, key, False)
        for key in ("Example.com/app", "example.com/", "/app", "a/b/c", "has space", "x" * 64)
    ),
    *((is_label_value, value, True) for value in ("", "v1.2_x-y")),
    *((is_label_value, value, False) for value in ("-v", "a b", "x" * 64)),
    *((is_object_name, name, True) for name in ("pool", "llama3.pool-1")),
    *((is_object_name, name, False) for name in ("Pool", "pool.", "", "a" * 254)),
]


@pytest.mark.parametrize(("check", "text", "valid"), SYNTAX)
def test_kubernetes_name_syntax(check, text: str, valid: bool) -> None:
    assert check(text) is valid


# --- group and annotations -------------------------------------------------------------------


def test_a_pod_without_the_group_label_is_in_group_empty() -> None:
    assert view_pod(pod(group=None), INFERNEX).endpoints[0][1].group == ""


@pytest.mark.parametrize(("text", "capacity"), [("200000", 200000.0), ("1.5e5", 150000.0), ("0.5", 0.5)])
def test_a_token_capacity_annotation_sets_the_capacity(text: str, capacity: float) -> None:
    view = view_pod(pod(annotations={"pd-extproc/token-capacity": text}), INFERNEX)
    assert view == PodView((("decode", endpoint("10.0.0.1:8200", capacity=capacity)),))


@pytest.mark.parametrize("text", ["", "lots", "0", "-5", "inf", "nan", "20k"])
def test_an_invalid_token_capacity_annotation_is_ignored_with_a_problem(text: str) -> None:
    view = view_pod(pod(annotations={"pd-extproc/token-capacity": text}), INFERNEX)
    assert view == PodView(
        (("decode", endpoint("10.0.0.1:8200")),),
        (f"annotation pd-extproc/token-capacity={text!r} is not a token capacity (a number > 0); ignored",),
    )


@pytest.mark.parametrize(("text", "port"), [("8998", 8998), ("1", 1), ("65535", 65535)])
def test_a_bootstrap_port_annotation_sets_the_bootstrap_port(text: str, port: int) -> None:
    view = view_pod(pod("p", "prefill", annotations={"pd-extproc/bootstrap-port": text}), INFERNEX)
    assert view == PodView((("prefill", endpoint("10.0.0.1:8000", bootstrap_port=port)),))


@pytest.mark.parametrize("text", ["", "0", "65536", "123456", "x", "+1", " 1", "1.0", "-1", "٣"])
def test_an_invalid_bootstrap_port_annotation_is_ignored_with_a_problem(text: str) -> None:
    view = view_pod(pod("p", "prefill", annotations={"pd-extproc/bootstrap-port": text}), INFERNEX)
    assert view == PodView(
        (("prefill", endpoint("10.0.0.1:8000")),),
        (f"annotation pd-extproc/bootstrap-port={text!r} is not a port in 1..65535; ignored",),
    )


def test_the_annotation_names_come_from_the_rules() -> None:
    rules = dataclasses.replace(
        INFERNEX, capacity_annotation="cap", bootstrap_port_annotation="boot", metrics_port_annotation="mp"
    )
    annotations = {"cap": "10", "boot": "9", "mp": "9100", "pd-extproc/token-capacity": "20"}
    view = view_pod(pod("p", "prefill", annotations=annotations), rules)
    spec = dataclasses.replace(endpoint("10.0.0.1:8000", capacity=10.0, bootstrap_port=9), metrics_port=9100)
    assert view.endpoints == (("prefill", spec),)


def test_a_metrics_port_annotation_sets_the_metrics_port_and_a_bad_one_is_a_problem() -> None:
    view = view_pod(pod(annotations={"pd-extproc/metrics-port": "9100"}), INFERNEX)
    assert view == PodView((("decode", dataclasses.replace(endpoint("10.0.0.1:8200"), metrics_port=9100)),))
    view = view_pod(pod(annotations={"pd-extproc/metrics-port": "http"}), INFERNEX)
    assert view == PodView(
        (("decode", endpoint("10.0.0.1:8200")),),
        ("annotation pd-extproc/metrics-port='http' is not a port in 1..65535; ignored",),
    )


def test_a_kv_events_port_annotation_sets_the_kv_events_port() -> None:
    view = view_pod(pod(annotations={"pd-extproc/kv-events-port": "5600"}), INFERNEX)
    assert view == PodView((("decode", dataclasses.replace(endpoint("10.0.0.1:8200"), kv_events_port=5600)),))
    rules = dataclasses.replace(INFERNEX, kv_events_port_annotation="kv")
    view = view_pod(pod(annotations={"kv": "x"}), rules)
    assert view.problems == ("annotation kv='x' is not a port in 1..65535; ignored",)


def test_replay_port_and_data_parallel_size_annotations_set_them_and_bad_ones_are_problems() -> None:
    annotations = {"pd-extproc/kv-events-replay-port": "5700", "pd-extproc/data-parallel-size": "4"}
    view = view_pod(pod(annotations=annotations), INFERNEX)
    declared = dataclasses.replace(
        endpoint("10.0.0.1:8200"), kv_events_replay_port=5700, data_parallel_size=4
    )
    assert view == PodView((("decode", declared),))
    rules = dataclasses.replace(
        INFERNEX, kv_events_replay_port_annotation="r", data_parallel_size_annotation="dp"
    )
    view = view_pod(pod(annotations={"r": "0", "dp": "0"}), rules)
    assert view == PodView(
        (("decode", endpoint("10.0.0.1:8200")),),
        (
            "annotation r='0' is not a port in 1..65535; ignored",
            "annotation dp='0' is not a rank count in 1..1024; ignored",
        ),
    )
    assert view_pod(pod(annotations={"dp": "1025"}), rules).problems[0].startswith("annotation dp='1025'")


def test_annotations_of_a_pod_that_is_not_routable_raise_no_problem() -> None:
    bad = pod(ready="False", annotations={"pd-extproc/token-capacity": "lots"})
    assert view_pod(bad, INFERNEX) == PodView(())


# --- presets and assembly ------------------------------------------------------------------


def test_the_presets() -> None:
    infernex, llm_d = PRESETS[Preset.INFERNEX], PRESETS[Preset.LLM_D]
    assert infernex.label_selector() == "openfuyao.com/pdRole in (prefill,decode)"
    assert (infernex.prefill_port, infernex.decode_port) == ("prefill-port", "decode-port")
    assert llm_d.label_selector() == "llm-d.ai/role in (prefill,decode,both)"
    assert (llm_d.prefill_port, llm_d.decode_port) == (8000, 8000)


def test_cluster_endpoints_keeps_the_views_order_and_always_names_both_clusters() -> None:
    views = [
        view_pod(pod("d1", "decode", "10.0.0.2"), INFERNEX),
        view_pod(pod("p1", "prefill", "10.0.0.3"), INFERNEX),
        view_pod(pod("d0", "decode", "10.0.0.1"), INFERNEX),
    ]
    assert cluster_endpoints(views, INFERNEX, "kubernetes") == [
        ClusterEndpoints("prefill", (endpoint("10.0.0.3:8000"),), "kubernetes"),
        ClusterEndpoints("decode", (endpoint("10.0.0.2:8200"), endpoint("10.0.0.1:8200")), "kubernetes"),
    ]
    assert cluster_endpoints([], INFERNEX, "k") == [
        ClusterEndpoints("prefill", (), "k"),
        ClusterEndpoints("decode", (), "k"),
    ]


def test_a_models_annotation_names_the_served_models_and_a_bad_one_leaves_the_pod_out() -> None:
    view = view_pod(pod(annotations={"pd-extproc/models": "llama, llama-sql,llama"}), INFERNEX)
    assert view == PodView(
        (("decode", dataclasses.replace(endpoint("10.0.0.1:8200"), models=("llama", "llama-sql"))),)
    )
    for bad in ("", "llama,,sql", "m" * 600):
        view = view_pod(pod(annotations={"pd-extproc/models": bad}), INFERNEX)
        assert view.endpoints == () and view.problems[0].startswith("annotation pd-extproc/models")
        assert view.problems[0].endswith("the pod is left out")
