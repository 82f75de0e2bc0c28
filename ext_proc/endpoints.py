"""Endpoint sets as values: what a discovery source publishes and the registry and xDS read.

Pure and protobuf-free: an :class:`EndpointSpec` per endpoint, a :class:`ClusterEndpoints` per
cluster and source, the ``ip:port`` naming of endpoints and the merge of several sources' clusters.
The wire forms live with the sources: EDS files and protobufs in :mod:`ext_proc.discovery.eds`,
Kubernetes pods in :mod:`ext_proc.discovery.pods`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_DATA_PARALLEL_SIZE = 1024
"""The most data-parallel ranks an endpoint may declare (EDS metadata, pod annotation)."""


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """One endpoint as a discovery source declares it.

    ``address`` is ``"ip:port"`` (IPv6 as ``"[ip]:port"``); ``token_capacity``,
    ``bootstrap_port``, ``metrics_port``, ``kv_events_port`` and ``kv_events_replay_port`` are ``None``
    when the metadata does not set them; ``data_parallel_size`` is the engine's number of data-parallel
    ranks (1 when not set: rank ``r`` publishes its KV-cache events on the ports plus ``r``);
    ``healthy`` is true for ``HEALTHY`` and ``UNKNOWN`` health status; ``models`` the model names it
    serves (:mod:`ext_proc.models`), ``None`` when the source declares none: every model.
    """

    address: str
    group: str
    token_capacity: float | None
    healthy: bool
    health_status: str
    bootstrap_port: int | None = None
    metrics_port: int | None = None
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    data_parallel_size: int = 1
    models: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class ClusterEndpoints:
    """The endpoints of one cluster, as read from one source (``source``: a file, the pods, a pool)."""

    cluster_name: str
    endpoints: tuple[EndpointSpec, ...]
    source: str


def endpoint_address(ip: str, port: int) -> str:
    """The ``ip:port`` form pd-extproc names endpoints by (IPv6 in brackets: ``[ip]:port``)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def merge_clusters(clusters: Iterable[ClusterEndpoints]) -> dict[str, ClusterEndpoints]:
    """One :class:`ClusterEndpoints` per cluster name, in first-seen order.

    Clusters of the same name (several files) are joined, an address listed twice keeps its first
    entry, and ``source`` names every contributing source."""
    merged: dict[str, tuple[dict[str, EndpointSpec], list[str]]] = {}
    for cluster in clusters:
        specs, sources = merged.setdefault(cluster.cluster_name, ({}, []))
        sources.append(cluster.source)
        for spec in cluster.endpoints:
            specs.setdefault(spec.address, spec)
    return {
        name: ClusterEndpoints(name, tuple(specs.values()), ", ".join(sources))
        for name, (specs, sources) in merged.items()
    }
