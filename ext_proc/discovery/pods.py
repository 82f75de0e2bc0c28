"""Kubernetes pods → endpoints: the pure rules of the ``kubernetes`` discovery source.

A pod is an endpoint of the prefill cluster, of the decode cluster, or of both, as its role label
says, at its pod IP and the container port its role names. Only a routable pod counts: phase
``Running``, condition ``Ready`` true, a pod IP, no deletion timestamp, and in a LeaderWorkerSet
only the leader (worker-index label absent or ``"0"``). Its group is the group label's value
(missing = group ``""``); optional annotations declare its token capacity (tokens), its SGLang
bootstrap port, the ports of its ``/metrics``, KV-cache event publisher and replay socket, its
number of data-parallel ranks, and the models it serves (comma-separated names; absent: every model;
one that is not valid leaves the pod out: it would otherwise be sent every model's requests). Pods
are the JSON objects the API server sends (camelCase keys), as dicts.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ext_proc.endpoints import MAX_DATA_PARALLEL_SIZE, ClusterEndpoints, EndpointSpec, endpoint_address
from ext_proc.models import ModelNameError, check_models

LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
"""Label LeaderWorkerSet puts on every pod of a group: ``"0"`` on the leader."""

_PORT_NUMBER = re.compile(r"[0-9]{1,5}")
_COUNT = re.compile(r"[0-9]{1,4}")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def is_object_name(name: str) -> bool:
    """Kubernetes object name syntax (a DNS subdomain: lower-case, digits, '-' and '.', at most 253)."""
    return bool(_DNS_SUBDOMAIN.fullmatch(name))


def is_label_key(key: str) -> bool:
    """Kubernetes label or annotation key syntax: a name, optionally after a DNS-subdomain prefix and '/'."""
    prefix, slash, name = key.rpartition("/")
    return bool(_LABEL_NAME.fullmatch(name)) and (not slash or is_object_name(prefix))


def is_label_value(value: str) -> bool:
    """Kubernetes label value syntax: empty, or a name of at most 63 characters."""
    return not value or bool(_LABEL_NAME.fullmatch(value))


class Preset(enum.StrEnum):
    """Whose labelling conventions the role label, its values and the ports follow by default."""

    INFERNEX = "infernex"
    LLM_D = "llm-d"


@dataclass(frozen=True, slots=True)
class RoleScheme:
    """How a deployment labels roles and names ports (what a :class:`Preset` fixes).

    A pod whose ``role_label`` is ``prefill_role`` is a prefill endpoint, ``decode_role`` a decode
    endpoint, ``both_role`` (when not ``""``) both. A port is a container port name or a number.
    """

    role_label: str
    prefill_role: str
    decode_role: str
    both_role: str
    prefill_port: str | int
    decode_port: str | int

    def role_values(self) -> tuple[str, ...]:
        """The role label values that make a pod an endpoint, in prefill, decode, both order."""
        return tuple(v for v in (self.prefill_role, self.decode_role, self.both_role) if v)

    def label_selector(self) -> str:
        """The Kubernetes label selector of the pods with one of :meth:`role_values`."""
        return f"{self.role_label} in ({','.join(self.role_values())})"


PRESETS: dict[Preset, RoleScheme] = {
    # InferNex (openFuyao): roles prefill / decode, ports named as its charts name them.
    Preset.INFERNEX: RoleScheme(
        "openfuyao.com/pdRole", "prefill", "decode", "", "prefill-port", "decode-port"
    ),
    # llm-d: prefill / decode / both; its gateway targets port 8000 (a decode pod's sidecar, a
    # prefill pod's vLLM).
    Preset.LLM_D: RoleScheme("llm-d.ai/role", "prefill", "decode", "both", 8000, 8000),
}


@dataclass(frozen=True, slots=True)
class PodRules:
    """Everything :func:`view_pod` needs to read a pod.

    The role scheme, the group label, the annotation names, and the names of the clusters the
    registry knows as prefill and decode.

    ``target_ports`` (an InferencePool's ``targetPorts``), when not empty, replaces the scheme's
    ports: a pod is one endpoint per port number, in this order, in each cluster its role names.
    """

    scheme: RoleScheme
    group_label: str
    capacity_annotation: str
    bootstrap_port_annotation: str
    prefill_cluster: str
    decode_cluster: str
    metrics_port_annotation: str = "pd-extproc/metrics-port"
    kv_events_port_annotation: str = "pd-extproc/kv-events-port"
    kv_events_replay_port_annotation: str = "pd-extproc/kv-events-replay-port"
    data_parallel_size_annotation: str = "pd-extproc/data-parallel-size"
    models_annotation: str = "pd-extproc/models"
    target_ports: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PodView:
    """What one pod contributes: its endpoints, and what is wrong with it.

    ``endpoints`` as ``(cluster name, spec)`` pairs, empty when the pod is not routable;
    ``problems``, misconfigurations worth a warning (a missing port, an annotation that is not valid
    and so is ignored)."""

    endpoints: tuple[tuple[str, EndpointSpec], ...]
    problems: tuple[str, ...] = ()


def view_pod(pod: Mapping[str, Any], rules: PodRules) -> PodView:
    """The endpoints ``pod`` (an API server's pod JSON, as a dict) stands for under ``rules``.

    Every endpoint of a routable pod is ``HEALTHY``; a pod that is not routable, or whose role label
    is missing or has another value (:func:`has_role`), has none. A role whose port cannot be found
    yields no endpoint and a problem; an invalid annotation is ignored with a problem, except the models
    annotation: the pod then has no endpoint (and a problem). With
    ``rules.target_ports``, each role has an endpoint at each of them (no container port is looked up).
    """
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    status = pod.get("status") or {}
    roles = _roles(labels.get(rules.scheme.role_label), rules)
    if not roles or not _routable(metadata, labels, status):
        return PodView(())
    problems: list[str] = []
    annotations = metadata.get("annotations") or {}
    capacity = _capacity(annotations.get(rules.capacity_annotation), rules.capacity_annotation, problems)
    bootstrap = _port(
        annotations.get(rules.bootstrap_port_annotation), rules.bootstrap_port_annotation, problems
    )
    metrics_port = _port(
        annotations.get(rules.metrics_port_annotation), rules.metrics_port_annotation, problems
    )
    kv_events_port = _port(
        annotations.get(rules.kv_events_port_annotation), rules.kv_events_port_annotation, problems
    )
    replay_port = _port(
        annotations.get(rules.kv_events_replay_port_annotation),
        rules.kv_events_replay_port_annotation,
        problems,
    )
    size = _size(
        annotations.get(rules.data_parallel_size_annotation), rules.data_parallel_size_annotation, problems
    )
    models_text = annotations.get(rules.models_annotation)
    try:
        names = None if models_text is None else [n.strip() for n in models_text.split(",")]
        models = None if names is None else check_models(names, rules.models_annotation)
    except ModelNameError as exc:
        return PodView((), (f"annotation {exc}: the pod is left out",))
    ip = status["podIP"]
    group = labels.get(rules.group_label, "")
    endpoints: list[tuple[str, EndpointSpec]] = []
    for cluster, port in roles:
        numbers = rules.target_ports
        if not numbers:
            number = _port_number(pod.get("spec") or {}, port)
            if number is None:
                problems.append(f"no container port named {port!r} (the {cluster} port)")
                continue
            numbers = (number,)
        for number in numbers:
            address = endpoint_address(ip, number)
            spec = EndpointSpec(
                address,
                group,
                capacity,
                True,
                "HEALTHY",
                bootstrap,
                metrics_port,
                kv_events_port,
                replay_port,
                size,
                models,
            )
            endpoints.append((cluster, spec))
    return PodView(tuple(endpoints), tuple(problems))


def has_role(pod: Mapping[str, Any], rules: PodRules) -> bool:
    """Whether ``pod``'s role label holds one of the scheme's role values (routable or not)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(_roles(labels.get(rules.scheme.role_label), rules))


def _roles(role: object, rules: PodRules) -> tuple[tuple[str, str | int], ...]:
    """``(cluster name, port)`` of each cluster a pod of role label value ``role`` belongs to."""
    scheme = rules.scheme
    prefill = (rules.prefill_cluster, scheme.prefill_port)
    decode = (rules.decode_cluster, scheme.decode_port)
    if role == scheme.prefill_role:
        return (prefill,)
    if role == scheme.decode_role:
        return (decode,)
    if scheme.both_role and role == scheme.both_role:
        return (prefill, decode)
    return ()


def _routable(metadata: Mapping[str, Any], labels: Mapping[str, str], status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions") or ()
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return (
        status.get("phase") == "Running"
        and ready
        and bool(status.get("podIP"))
        and not metadata.get("deletionTimestamp")
        and labels.get(LWS_WORKER_INDEX, "0") == "0"
    )


def _port_number(spec: Mapping[str, Any], port: str | int) -> int | None:
    """``port`` itself when it is a number, else the ``containerPort`` of the container port so named."""
    if isinstance(port, int):
        return port
    for container in spec.get("containers") or ():
        for declared in container.get("ports") or ():
            if declared.get("name") == port:
                return declared.get("containerPort")
    return None


def _capacity(text: str | None, name: str, problems: list[str]) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if value > 0 and math.isfinite(value):
        return value
    problems.append(f"annotation {name}={text!r} is not a token capacity (a number > 0); ignored")
    return None


def _port(text: str | None, name: str, problems: list[str]) -> int | None:
    if text is None:
        return None
    if _PORT_NUMBER.fullmatch(text) and 0 < int(text) <= 65535:
        return int(text)
    problems.append(f"annotation {name}={text!r} is not a port in 1..65535; ignored")
    return None


def _size(text: str | None, name: str, problems: list[str]) -> int:
    if text is None:
        return 1
    if _COUNT.fullmatch(text) and 1 <= int(text) <= MAX_DATA_PARALLEL_SIZE:
        return int(text)
    problems.append(f"annotation {name}={text!r} is not a rank count in 1..{MAX_DATA_PARALLEL_SIZE}; ignored")
    return 1


def cluster_endpoints(views: Iterable[PodView], rules: PodRules, source: str) -> list[ClusterEndpoints]:
    """The prefill and the decode cluster of ``views``, in that order, each possibly empty.

    Their endpoints are in the order of ``views``; ``source`` names where they came from, for log
    lines."""
    specs: dict[str, list[EndpointSpec]] = {rules.prefill_cluster: [], rules.decode_cluster: []}
    for view in views:
        for cluster, spec in view.endpoints:
            specs[cluster].append(spec)
    return [ClusterEndpoints(name, tuple(endpoints), source) for name, endpoints in specs.items()]
