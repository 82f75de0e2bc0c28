"""Pod JSON as the Kubernetes API server sends it (camelCase keys), for the discovery tests."""

from __future__ import annotations

from typing import Any

from ext_proc.discovery.pods import PRESETS, PodRules, Preset

ROLE = "openfuyao.com/pdRole"
GROUP = "openfuyao.com/pdGroupID"

INFERNEX_RULES = PodRules(
    PRESETS[Preset.INFERNEX],
    GROUP,
    "pd-extproc/token-capacity",
    "pd-extproc/bootstrap-port",
    "prefill",
    "decode",
)
"""The pod rules of the ``infernex`` preset with the default annotations and cluster names."""


def pod(
    name: str = "decode-0",
    role: str | None = "decode",
    ip: str | None = "10.0.0.1",
    *,
    group: str | None = "g1",
    namespace: str = "default",
    phase: str = "Running",
    ready: str | None = "True",
    ports: dict[str, int] | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
    role_label: str = ROLE,
) -> dict[str, Any]:
    """A pod of one ``engine`` container, as the API server sends it.

    ``ports`` maps container port names to numbers (default: InferNex's ``prefill-port`` 8000 and
    ``decode-port`` 8200)."""
    all_labels = dict(labels or {})
    if role is not None:
        all_labels[role_label] = role
    if group is not None:
        all_labels[GROUP] = group
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": f"uid-{namespace}-{name}",
        "resourceVersion": "1",
        "labels": all_labels,
    }
    if annotations is not None:
        metadata["annotations"] = annotations
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    declared = {"prefill-port": 8000, "decode-port": 8200} if ports is None else ports
    status: dict[str, Any] = {"phase": phase}
    if ready is not None:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": ready},
        ]
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "vllm",
                    "ports": [
                        {"name": n, "containerPort": p, "protocol": "TCP"} for n, p in declared.items()
                    ],
                }
            ]
        },
        "status": status,
    }


_DEFAULT_PICKER = {"name": "llama-epp", "port": {"number": 9002}}


def inference_pool(
    name: str = "llama",
    labels: dict[str, object] | None = None,
    ports: list[int] | None = None,
    *,
    namespace: str = "default",
    picker: dict[str, object] | None = _DEFAULT_PICKER,
) -> dict[str, Any]:
    """An ``inference.networking.k8s.io/v1`` InferencePool as the API server sends it.

    ``labels``: its ``spec.selector.matchLabels`` (default ``app: vllm``), ``ports`` its ``targetPorts``
    (default 8000), ``picker`` its ``endpointPickerRef`` (``None``: absent)."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "vllm"} if labels is None else labels},
        "targetPorts": [{"number": p} for p in ([8000] if ports is None else ports)],
    }
    if picker is not None:
        spec["endpointPickerRef"] = picker
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "resourceVersion": "1",
            "generation": 1,
        },
        "spec": spec,
        "status": {},
    }
