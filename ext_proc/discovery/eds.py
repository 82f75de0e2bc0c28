"""Parse Envoy path-based EDS files: one ``DiscoveryResponse`` holding one ``ClusterLoadAssignment``.

The files are the very ones Envoy reads for its EDS clusters, so they are validated with Envoy's
own protobuf schema (``xds-protos``) and with Envoy's own rule that a path-based EDS file holds
exactly one resource. Our extra data lives in the endpoint metadata under
``filter_metadata.<namespace>``: ``pdGroupID`` (string), ``token_capacity`` (tokens, > 0) and
``bootstrap_port`` (the port of an SGLang prefill engine's KV bootstrap server, 1..65535) and
``metrics_port`` (the port of the engine's Prometheus ``/metrics`` when it is not the serving port),
``kv_events_port`` and ``kv_events_replay_port`` (the ports of the engine's KV-cache event publisher and
replay socket, when not the configured ones) and ``data_parallel_size`` (the engine's data-parallel
ranks, 1..1024, default 1: rank ``r`` publishes on those ports plus ``r``) and ``models`` (the model
names the endpoint serves, a list of strings; absent: every model; :mod:`ext_proc.models`).
The values parsed into and rendered from (:class:`~ext_proc.endpoints.EndpointSpec`,
:class:`~ext_proc.endpoints.ClusterEndpoints`) are protobuf-free, in :mod:`ext_proc.endpoints`.
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format, struct_pb2

from ext_proc.endpoints import MAX_DATA_PARALLEL_SIZE, ClusterEndpoints, EndpointSpec, endpoint_address
from ext_proc.models import check_models

_CANDIDATE_STATUSES = frozenset(
    {health_check_pb2.HealthStatus.UNKNOWN, health_check_pb2.HealthStatus.HEALTHY}
)
CLA_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
_PORT_KEYS = ("bootstrap_port", "metrics_port", "kv_events_port", "kv_events_replay_port")
"""The port metadata keys, each the :class:`EndpointSpec` field of its name."""


class EdsError(ValueError):
    """An EDS file that cannot be used; the message names the file and what is wrong."""


def _host_port(lb_endpoint: endpoint_pb2.LbEndpoint) -> str:
    socket = lb_endpoint.endpoint.address.socket_address
    if not socket.address or not socket.port_value:
        raise ValueError("endpoint.address.socket_address needs both address and port_value")
    if not 0 < socket.port_value <= 65535:
        raise ValueError(f"port_value {socket.port_value} is out of range 1..65535")
    try:
        ipaddress.ip_address(socket.address)
    except ValueError:
        raise ValueError(f"address {socket.address!r} is not an IP address (EDS endpoints must be)") from None
    return endpoint_address(socket.address, socket.port_value)


def _port(fields: Mapping[str, struct_pb2.Value], name: str, namespace: str) -> int | None:
    """The integer port in 1..65535 under ``name``, ``None`` when absent; raises ``ValueError``."""
    if name not in fields:
        return None
    value = fields[name]
    number = value.number_value if value.WhichOneof("kind") == "number_value" else -1.0
    if not (number.is_integer() and 0 < number <= 65535):
        raise ValueError(f"metadata {namespace}.{name} must be an integer port in 1..65535")
    return int(number)


def _size(fields: Mapping[str, struct_pb2.Value], name: str, namespace: str) -> int:
    """The rank count (1..:data:`MAX_DATA_PARALLEL_SIZE`) under ``name``, 1 when absent; ``ValueError``."""
    if name not in fields:
        return 1
    value = fields[name]
    number = value.number_value if value.WhichOneof("kind") == "number_value" else -1.0
    if not (number.is_integer() and 1 <= number <= MAX_DATA_PARALLEL_SIZE):
        raise ValueError(f"metadata {namespace}.{name} must be an integer in 1..{MAX_DATA_PARALLEL_SIZE}")
    return int(number)


def _models(fields: Mapping[str, struct_pb2.Value], namespace: str) -> tuple[str, ...] | None:
    """The model names under ``models`` (a list of strings), ``None`` when absent; raises ``ValueError``."""
    if "models" not in fields:
        return None
    value = fields["models"]
    if value.WhichOneof("kind") != "list_value":
        raise ValueError(f"metadata {namespace}.models must be a list of model names")
    names = [v.string_value if v.WhichOneof("kind") == "string_value" else v for v in value.list_value.values]
    return check_models(names, f"metadata {namespace}.models")


def _pd_metadata(lb_endpoint: endpoint_pb2.LbEndpoint, namespace: str) -> dict[str, Any]:
    """The :class:`EndpointSpec` fields the metadata under ``namespace`` sets; raises ``ValueError``."""
    fields = (
        lb_endpoint.metadata.filter_metadata[namespace].fields
        if namespace in (lb_endpoint.metadata.filter_metadata)
        else {}
    )
    group = ""
    capacity: float | None = None
    if "pdGroupID" in fields:
        value = fields["pdGroupID"]
        if value.WhichOneof("kind") != "string_value":
            raise ValueError(f"metadata {namespace}.pdGroupID must be a string")
        group = value.string_value
    if "token_capacity" in fields:
        value = fields["token_capacity"]
        if value.WhichOneof("kind") != "number_value" or not (
            value.number_value > 0 and math.isfinite(value.number_value)
        ):
            raise ValueError(f"metadata {namespace}.token_capacity must be a finite number > 0")
        capacity = value.number_value
    ports = {name: _port(fields, name, namespace) for name in _PORT_KEYS}
    size = _size(fields, "data_parallel_size", namespace)
    models = _models(fields, namespace)
    return {"group": group, "token_capacity": capacity, **ports, "data_parallel_size": size, "models": models}


def parse_cluster_load_assignment(
    cla: endpoint_pb2.ClusterLoadAssignment, namespace: str, source: str
) -> ClusterEndpoints:
    """Convert a ``ClusterLoadAssignment`` into :class:`ClusterEndpoints`; raise :class:`EdsError`."""
    if not cla.cluster_name:
        raise EdsError(f"{source}: ClusterLoadAssignment has no cluster_name")
    endpoints: list[EndpointSpec] = []
    seen: set[str] = set()
    for locality_index, locality in enumerate(cla.endpoints):
        for index, lb_endpoint in enumerate(locality.lb_endpoints):
            where = f"{source}: endpoints[{locality_index}].lb_endpoints[{index}]"
            try:
                address = _host_port(lb_endpoint)
                metadata = _pd_metadata(lb_endpoint, namespace)
            except ValueError as exc:
                raise EdsError(f"{where}: {exc}") from None
            if address in seen:
                raise EdsError(f"{where}: duplicate endpoint {address}")
            seen.add(address)
            status = lb_endpoint.health_status
            endpoints.append(
                EndpointSpec(
                    address=address,
                    healthy=status in _CANDIDATE_STATUSES,
                    health_status=health_check_pb2.HealthStatus.Name(status),
                    **metadata,
                )
            )
    return ClusterEndpoints(cla.cluster_name, tuple(endpoints), source)


def load_eds_file(path: str | Path, namespace: str = "pd") -> ClusterEndpoints:
    """Read and validate one EDS file: :func:`parse_eds` of :func:`read_eds_file`."""
    return parse_eds(read_eds_file(path), path, namespace)


def read_eds_file(path: str | Path) -> bytes:
    """The raw bytes of an EDS file; :class:`EdsError` ``"<path>: cannot read: ..."`` if unreadable."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise EdsError(f"{path}: cannot read: {exc}") from None


def parse_eds(content: bytes, path: str | Path, namespace: str = "pd") -> ClusterEndpoints:
    """Validate ``content``, the bytes of the EDS file at ``path`` (YAML; JSON if it ends in ``.json``).

    Raises :class:`EdsError` with the file name and the precise problem: not UTF-8, not a
    ``DiscoveryResponse``, not exactly one ``ClusterLoadAssignment``, bad address or metadata.
    """
    path = Path(path)
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EdsError(f"{path}: cannot read: {exc}") from None
    try:
        document = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise EdsError(f"{path}: not valid YAML/JSON: {exc}") from None
    if not isinstance(document, dict):
        raise EdsError(f"{path}: expected a DiscoveryResponse mapping, got {type(document).__name__}")
    response = discovery_pb2.DiscoveryResponse()
    try:
        json_format.ParseDict(document, response)
    except json_format.ParseError as exc:
        raise EdsError(f"{path}: not a valid DiscoveryResponse: {exc}") from None
    if len(response.resources) != 1:
        raise EdsError(
            f"{path}: a path-based EDS file must hold exactly one ClusterLoadAssignment, "
            f"found {len(response.resources)} resources"
        )
    resource = response.resources[0]
    if resource.type_url != CLA_TYPE_URL:
        raise EdsError(f"{path}: resource type is {resource.type_url!r}, expected {CLA_TYPE_URL!r}")
    cla = endpoint_pb2.ClusterLoadAssignment()
    resource.Unpack(cla)
    return parse_cluster_load_assignment(cla, namespace, str(path))


def render_cla(cluster_name: str, endpoints: Iterable[EndpointSpec], namespace: str = "pd") -> dict:
    """The ``ClusterLoadAssignment`` declaring ``endpoints``, as a dict (JSON/YAML-ready, no ``@type``).

    The endpoints are in one locality, with their health status and metadata under
    ``filter_metadata.<namespace>``; the inverse of :func:`parse_cluster_load_assignment`."""
    lb_endpoints = []
    for spec in endpoints:
        host, _, port = spec.address.rpartition(":")
        metadata: dict[str, object] = {"pdGroupID": spec.group}
        if spec.token_capacity is not None:
            metadata["token_capacity"] = spec.token_capacity
        for name in _PORT_KEYS:
            if getattr(spec, name) is not None:
                metadata[name] = getattr(spec, name)
        if spec.data_parallel_size != 1:
            metadata["data_parallel_size"] = spec.data_parallel_size
        if spec.models is not None:
            metadata["models"] = list(spec.models)
        lb_endpoints.append(
            {
                "endpoint": {
                    "address": {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}
                },
                "health_status": spec.health_status,
                "metadata": {"filter_metadata": {namespace: metadata}},
            }
        )
    return {"cluster_name": cluster_name, "endpoints": [{"lb_endpoints": lb_endpoints}]}


def cluster_load_assignment(
    cluster: ClusterEndpoints, namespace: str = "pd"
) -> endpoint_pb2.ClusterLoadAssignment:
    """``cluster`` as the protobuf Envoy takes over xDS (:func:`render_cla`)."""
    return json_format.ParseDict(
        render_cla(cluster.cluster_name, cluster.endpoints, namespace), endpoint_pb2.ClusterLoadAssignment()
    )


def render_eds(cluster_name: str, endpoints: list[EndpointSpec], namespace: str = "pd") -> dict:
    """The ``DiscoveryResponse`` document (a dict, JSON/YAML-ready) declaring ``endpoints``."""
    return {
        "version_info": "1",
        "resources": [{"@type": CLA_TYPE_URL, **render_cla(cluster_name, endpoints, namespace)}],
    }


def write_eds_file(
    path: str | Path, cluster_name: str, endpoints: list[EndpointSpec], namespace: str = "pd"
) -> None:
    """Write an EDS file atomically (temporary file + rename), as Envoy expects updates to arrive."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(render_eds(cluster_name, endpoints, namespace), indent=1), encoding="utf-8")
    tmp.replace(path)
