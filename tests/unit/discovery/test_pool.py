"""The pure InferencePool rules of the inferencepool discovery source (ext_proc.discovery.pool)."""

from __future__ import annotations

import pytest

from ext_proc.discovery.pool import PoolSpec, PoolView, view_pool
from standins.kube_objects import inference_pool


def test_a_pool_gives_its_match_labels_sorted_and_its_target_ports_in_order() -> None:
    pool = inference_pool("llama", {"model": "llama", "app": "vllm"}, [8001, 8000])
    view = view_pool(pool)
    assert view.spec == PoolSpec((("app", "vllm"), ("model", "llama")), (8001, 8000))
    assert view.problems == ()
    assert view.spec.label_selector() == "app=vllm,model=llama"


def test_the_endpoint_picker_ref_is_described() -> None:
    assert view_pool(inference_pool()).picker == "Service llama-epp:9002 (FailClose)"
    ref = {"name": "picker", "kind": "Service", "port": {"number": 9002}, "failureMode": "FailOpen"}
    assert view_pool(inference_pool(picker=ref)).picker == "Service picker:9002 (FailOpen)"
    assert view_pool(inference_pool(picker={"name": "x", "group": "example.com", "kind": "Epp"})).picker == (
        "Epp x (FailClose)"
    )
    assert view_pool(inference_pool(picker=None)).picker == "none"


def test_a_repeated_target_port_counts_once() -> None:
    assert view_pool(inference_pool(ports=[8000, 8000, 8001])).spec == PoolSpec(
        (("app", "vllm"),), (8000, 8001)
    )


@pytest.mark.parametrize(
    "entry", [{"number": 0}, {"number": 65536}, {"number": "8000"}, {"number": True}, {}, 8000]
)
def test_a_bad_target_port_is_ignored_with_a_problem(entry: object) -> None:
    pool = inference_pool()
    pool["spec"]["targetPorts"] = [{"number": 8000}, entry]
    view = view_pool(pool)
    assert view.spec == PoolSpec((("app", "vllm"),), (8000,))
    assert view.problems == (f"spec.targetPorts entry {entry!r} is not a port number in 1..65535; ignored",)


def test_a_pool_without_a_valid_target_port_is_not_usable() -> None:
    pool = inference_pool()
    pool["spec"]["targetPorts"] = [{"number": -1}]
    assert view_pool(pool) == PoolView(
        None,
        (
            "spec.targetPorts entry {'number': -1} is not a port number in 1..65535; ignored",
            "spec.targetPorts has no valid port",
        ),
        "Service llama-epp:9002 (FailClose)",
    )


TARGET_PORTS_MISSING = "spec.targetPorts is missing or empty"
MATCH_LABELS_MISSING = "spec.selector.matchLabels is missing or empty (it would select every pod)"


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        *(("targetPorts", ports, TARGET_PORTS_MISSING) for ports in (None, [], "8000")),
        *(
            ("selector", selector, MATCH_LABELS_MISSING)
            for selector in (
                None,
                {},
                {"matchLabels": {}},
                {"matchLabels": None},
                {"matchLabels": ["a"]},
                "app=x",
            )
        ),
    ],
)
def test_a_pool_without_target_ports_or_match_labels_is_not_usable(
    field: str, value: object, problem: str
) -> None:
    pool = inference_pool()
    pool["spec"][field] = value
    view = view_pool(pool)
    assert view.spec is None
    assert view.problems == (problem,)


@pytest.mark.parametrize(
    "labels", [{"app": "a b"}, {"bad key": "x"}, {"app": 3}, {"app": "x,y=z"}, {"Example.com/app": "x"}]
)
def test_match_labels_must_be_kubernetes_labels(labels: dict) -> None:
    view = view_pool(inference_pool(labels=labels))
    assert view.spec is None
    assert view.problems[0].startswith("spec.selector.matchLabels has invalid labels: ")


def test_an_empty_label_value_is_a_valid_label() -> None:
    assert view_pool(inference_pool(labels={"app": ""})).spec.label_selector() == "app="


def test_a_pool_being_deleted_is_not_usable() -> None:
    pool = inference_pool()
    pool["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert view_pool(pool) == PoolView(None, ("it is being deleted",), "Service llama-epp:9002 (FailClose)")


def test_an_empty_object_is_not_usable() -> None:
    view = view_pool({})
    assert view.spec is None
    assert len(view.problems) == 2
