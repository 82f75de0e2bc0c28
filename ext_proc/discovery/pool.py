"""InferencePool objects → what the ``inferencepool`` discovery source needs: the pure rules.

An InferencePool (Gateway API Inference Extension, ``inference.networking.k8s.io/v1``) names its
member pods with ``spec.selector.matchLabels`` (every pair must match; only pods of the pool's own
namespace) and their ports with ``spec.targetPorts[].number`` (1 to 8 distinct ports). As GIE's
endpoint picker does, every target port of a member pod is an endpoint of its own,
``podIP:port`` (GIE: one engine rank per port, e.g. data-parallel ranks of one pod). The
``endpointPickerRef`` names the picker the gateway calls (this server, when it is configured right);
it is only reported. Objects are the JSON the API server sends (camelCase keys), as dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ext_proc.discovery.pods import is_label_key, is_label_value

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"
"""Where the API server serves InferencePools: ``/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}``."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a usable pool says: its ``matchLabels`` (sorted by key) and its target ports (in its order)."""

    match_labels: tuple[tuple[str, str], ...]
    target_ports: tuple[int, ...]

    def label_selector(self) -> str:
        """The Kubernetes label selector of the member pods, e.g. ``app=vllm,model=llama``."""
        return ",".join(f"{key}={value}" for key, value in self.match_labels)


@dataclass(frozen=True, slots=True)
class PoolView:
    """What one InferencePool object stands for.

    ``spec`` when it is usable, else ``None`` and ``problems`` say why; a usable pool's ``problems``
    are parts that were ignored. ``picker`` describes its ``endpointPickerRef`` for log lines."""

    spec: PoolSpec | None
    problems: tuple[str, ...] = ()
    picker: str = "none"


def view_pool(pool: Mapping[str, Any]) -> PoolView:
    """``pool`` (an API server's InferencePool JSON, as a dict) as the source uses it.

    Not usable: being deleted (a deletion timestamp), no ``matchLabels`` (the API requires at least
    one pair; an empty selector would take every pod of the namespace), a label key or value that is
    not Kubernetes label syntax, no valid target port. A target port that is not a number in
    1..65535 is ignored with a problem; a repeated one counts once.
    """
    metadata = pool.get("metadata") or {}
    spec = pool.get("spec") or {}
    picker = _picker(spec.get("endpointPickerRef"))
    if metadata.get("deletionTimestamp"):
        return PoolView(None, ("it is being deleted",), picker)
    problems: list[str] = []
    labels = _match_labels(spec.get("selector"), problems)
    ports = _target_ports(spec.get("targetPorts"), problems)
    if labels is None or not ports:
        return PoolView(None, tuple(problems), picker)
    return PoolView(PoolSpec(labels, ports), tuple(problems), picker)


def _match_labels(selector: object, problems: list[str]) -> tuple[tuple[str, str], ...] | None:
    labels = selector.get("matchLabels") if isinstance(selector, Mapping) else None
    if not isinstance(labels, Mapping) or not labels:
        problems.append("spec.selector.matchLabels is missing or empty (it would select every pod)")
        return None
    bad = [
        f"{key}={value!r}"
        for key, value in labels.items()
        if not (
            isinstance(key, str) and is_label_key(key) and isinstance(value, str) and is_label_value(value)
        )
    ]
    if bad:
        problems.append(f"spec.selector.matchLabels has invalid labels: {', '.join(bad)}")
        return None
    return tuple(sorted(labels.items()))


def _target_ports(target_ports: object, problems: list[str]) -> tuple[int, ...]:
    if not isinstance(target_ports, list) or not target_ports:
        problems.append("spec.targetPorts is missing or empty")
        return ()
    ports: list[int] = []
    for entry in target_ports:
        number = entry.get("number") if isinstance(entry, Mapping) else None
        if type(number) is not int or not 0 < number <= 65535:
            problems.append(f"spec.targetPorts entry {entry!r} is not a port number in 1..65535; ignored")
        elif number not in ports:
            ports.append(number)
    if not ports:
        problems.append("spec.targetPorts has no valid port")
    return tuple(ports)


def _picker(ref: object) -> str:
    """``endpointPickerRef`` in words: ``Service name:port (FailClose)``, ``none`` when absent."""
    if not isinstance(ref, Mapping):
        return "none"
    kind = ref.get("kind") or "Service"
    port = ref.get("port")
    number = port.get("number") if isinstance(port, Mapping) else None
    where = f"{ref.get('name', '?')}:{number}" if number is not None else str(ref.get("name", "?"))
    return f"{kind} {where} ({ref.get('failureMode') or 'FailClose'})"
