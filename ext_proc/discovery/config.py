"""The ``discovery`` section: where endpoints come from, and its checks (docs/configuration.md)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from ext_proc.checks import ConfigError
from ext_proc.discovery import SourceKind
from ext_proc.discovery.pods import (
    PRESETS,
    PodRules,
    Preset,
    RoleScheme,
    is_label_key,
    is_label_value,
    is_object_name,
)

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")
"""Kubernetes name syntax: a namespace (DNS label), a container port name (IANA service name,
which also needs a letter); label keys and values and object names: ``ext_proc.discovery.pods``."""


@dataclass(frozen=True)
class KubernetesConfig:
    """Pods as endpoints (``discovery.source: kubernetes``; docs/deploy/kubernetes.md).

    ``kubeconfig``: a kubeconfig file (relative to the config file's folder); ``""`` = ``$KUBECONFIG``,
    else the in-cluster service account. ``namespaces``: empty = the server's own (in-cluster) or the
    kubeconfig context's. The role and port keys left ``""`` take the ``preset``'s value
    (:meth:`scheme`); a port is a container port name or a number.
    """

    kubeconfig: str = ""
    namespaces: tuple[str, ...] = ()
    preset: Preset = Preset.INFERNEX
    role_label: str = ""
    prefill_role: str = ""
    decode_role: str = ""
    both_role: str = ""
    prefill_port: str | int = ""
    decode_port: str | int = ""
    group_label: str = "openfuyao.com/pdGroupID"
    capacity_annotation: str = "pd-extproc/token-capacity"
    bootstrap_port_annotation: str = "pd-extproc/bootstrap-port"
    metrics_port_annotation: str = "pd-extproc/metrics-port"
    kv_events_port_annotation: str = "pd-extproc/kv-events-port"
    kv_events_replay_port_annotation: str = "pd-extproc/kv-events-replay-port"
    data_parallel_size_annotation: str = "pd-extproc/data-parallel-size"
    models_annotation: str = "pd-extproc/models"

    def scheme(self) -> RoleScheme:
        """The preset's role scheme with each role and port key that is set here in its place."""
        preset = PRESETS[self.preset]
        names = [f.name for f in dataclasses.fields(RoleScheme)]
        return dataclasses.replace(preset, **{n: getattr(self, n) for n in names if getattr(self, n) != ""})

    def check(self) -> None:
        """Raise :class:`ConfigError` for a value Kubernetes would not accept or a duplicate.

        That is a namespace, label or annotation key, role or port Kubernetes would not accept, a
        namespace listed twice, or two roles with one value."""
        key = "discovery.kubernetes"
        for index, namespace in enumerate(self.namespaces):
            if not _NAMESPACE.fullmatch(namespace):
                raise ConfigError(f"{key}.namespaces: {namespace!r} is not allowed; use namespace names")
            if namespace in self.namespaces[:index]:
                raise ConfigError(f"{key}.namespaces: {namespace!r} is listed twice")
        scheme = self.scheme()
        keys = {
            "role_label": scheme.role_label,
            "group_label": self.group_label,
            "capacity_annotation": self.capacity_annotation,
            "bootstrap_port_annotation": self.bootstrap_port_annotation,
            "metrics_port_annotation": self.metrics_port_annotation,
            "kv_events_port_annotation": self.kv_events_port_annotation,
            "kv_events_replay_port_annotation": self.kv_events_replay_port_annotation,
            "data_parallel_size_annotation": self.data_parallel_size_annotation,
            "models_annotation": self.models_annotation,
        }
        for name, value in keys.items():
            if not is_label_key(value):
                raise ConfigError(
                    f"{key}.{name}: {value!r} is not allowed; use a Kubernetes label or annotation key "
                    "such as example.com/name"
                )
        roles = [scheme.prefill_role, scheme.decode_role, scheme.both_role]
        for name, value in zip(("prefill_role", "decode_role", "both_role"), roles, strict=True):
            if not is_label_value(value):
                raise ConfigError(f"{key}.{name}: {value!r} is not allowed; use a Kubernetes label value")
        if len(set(roles)) < 3:
            values = ", ".join(map(repr, roles))
            raise ConfigError(
                f"{key}.prefill_role, decode_role and both_role must differ (they are {values})"
            )
        for name in ("prefill_port", "decode_port"):
            port = getattr(scheme, name)
            if isinstance(port, int) and not 0 < port <= 65535:
                raise ConfigError(f"{key}.{name}: {port} is not allowed; use a port in 1..65535")
            if isinstance(port, str) and not (_PORT_NAME.fullmatch(port) and re.search("[a-z]", port)):
                raise ConfigError(
                    f"{key}.{name}: {port!r} is not allowed; use a container port name (lower-case letters, "
                    "digits and '-', at most 15, at least one letter) or a port number"
                )


@dataclass(frozen=True)
class InferencePoolConfig:
    """The InferencePool whose pods are the endpoints (``discovery.source: inferencepool``).

    See docs/deploy/kubernetes.md "Discovery from an InferencePool". Named as GIE's endpoint picker
    names it (``--pool-name``, ``--pool-namespace``).

    ``name``: the ``inference.networking.k8s.io/v1`` InferencePool's name, required with that source.
    ``namespace``: its namespace, which is also its pods'; ``""`` = the server's own (in-cluster) or
    the kubeconfig context's, as for ``discovery.kubernetes.namespaces``.
    """

    name: str = ""
    namespace: str = ""

    def check(self, required: bool) -> None:
        """Raise :class:`ConfigError` for a bad pool name or namespace, or a missing name.

        A name or namespace Kubernetes would not accept is refused, and so is no name when ``required``
        (the source is ``inferencepool``)."""
        key = "discovery.inferencepool"
        if required and not self.name:
            raise ConfigError(
                f"{key}.name: required with discovery.source inferencepool: the name of the InferencePool "
                "whose pods are the endpoints (flag --pool-name)"
            )
        if self.name and not is_object_name(self.name):
            raise ConfigError(
                f"{key}.name: {self.name!r} is not allowed; use a Kubernetes object name "
                "(lower-case letters, digits, '-' and '.', at most 253)"
            )
        if self.namespace and not _NAMESPACE.fullmatch(self.namespace):
            raise ConfigError(
                f"{key}.namespace: {self.namespace!r} is not allowed; use a namespace name, or an empty "
                "string for the server's own"
            )


@dataclass(frozen=True)
class DiscoveryConfig:
    """The ``discovery`` section: where endpoints come from.

    ``source``: files (the EDS files ``eds_files``), kubernetes (pods, ``kubernetes``) or
    inferencepool (the pods an InferencePool selects, ``inferencepool``, with the pod rules and API
    access of ``kubernetes``). Relative ``eds_files`` (and ``kubernetes.kubeconfig``) resolve against
    the folder of the config file's path as given (symlinks not followed: see
    :func:`ext_proc.config.load_config`)."""

    eds_files: tuple[str, ...] = ()
    prefill_cluster: str = "prefill"
    decode_cluster: str = "decode"
    metadata_namespace: str = "pd"
    poll_interval_seconds: float = 0.25
    source: SourceKind = SourceKind.FILES
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    inferencepool: InferencePoolConfig = field(default_factory=InferencePoolConfig)

    def pod_rules(self) -> PodRules:
        """How the ``kubernetes`` and ``inferencepool`` sources read a pod (``kubernetes``'s keys)."""
        kubernetes = self.kubernetes
        return PodRules(
            kubernetes.scheme(),
            kubernetes.group_label,
            kubernetes.capacity_annotation,
            kubernetes.bootstrap_port_annotation,
            self.prefill_cluster,
            self.decode_cluster,
            kubernetes.metrics_port_annotation,
            kubernetes.kv_events_port_annotation,
            kubernetes.kv_events_replay_port_annotation,
            kubernetes.data_parallel_size_annotation,
            kubernetes.models_annotation,
        )

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first out-of-range key of the section or its subsections."""
        if not self.poll_interval_seconds > 0:
            raise ConfigError("discovery.poll_interval_seconds: must be a number > 0")
        if self.prefill_cluster == self.decode_cluster:
            raise ConfigError("discovery.prefill_cluster and discovery.decode_cluster must differ")
        self.kubernetes.check()
        self.inferencepool.check(self.source is SourceKind.INFERENCEPOOL)
