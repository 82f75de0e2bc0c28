"""The gateway shapes of ``tests/gateway_shapes/``: Envoy bootstraps as the gateways that run an
InferencePool generate them (each file names its sources and its differences in a header comment),
bound to a local run by :func:`render_shape`.

A shape file is a complete, valid Envoy bootstrap. Its structure is what the renderer relies on, so
keep it when editing a shape:
- the admin and every listener have a ``socket_address``; the one listener whose HTTP filters hold an
  ``envoy.filters.http.ext_proc`` config is the gateway's;
- the picker clusters are the clusters named by some ``envoy_grpc.cluster_name`` (listener-level or
  per-route): their endpoints are pd-extproc;
- any other cluster endpoint on the admin's address follows the admin (the GIE shape's stats cluster);
- every other cluster with endpoints is a model-server pool: it lists exactly one endpoint, a template,
  repeated once per model server with its address, and with every string equal to the template's
  ``ip:port`` (endpoint metadata) replaced by that server's; a list holding the template's ``ip:port``
  anywhere in the file (a route's subset hint) becomes the list of every model server's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from ext_proc.gateway import free_port

SHAPES_DIR = Path(__file__).parent / "gateway_shapes"
SHAPES = ("gie-standalone", "istio", "ai-gateway", "kgateway")
"""Every shape, by file name (without ``.yaml``)."""
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"


@dataclass(frozen=True)
class RenderedShape:
    """A shape bound to local ports: the bootstrap, the gateway listener's port and the admin's."""

    config: dict
    listen_port: int
    admin_port: int


def _nodes(node: object) -> Iterator[object]:
    """``node`` and everything inside it, depth first."""
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from _nodes(child)


def _address(socket: dict) -> str:
    return f"{socket['address']}:{socket['port_value']}"


def _bind(socket: dict, address: str) -> None:
    host, _, port = address.rpartition(":")
    socket["address"], socket["port_value"] = host, int(port)


def _sockets(node: object) -> Iterator[dict]:
    return (n["socket_address"] for n in _nodes(node) if isinstance(n, dict) and "socket_address" in n)


def _replace(node: object, change: Callable[[object], object]) -> object:
    """A copy of ``node`` with every value ``v`` inside it replaced by ``change(v)``."""
    if isinstance(node, dict):
        return {key: _replace(change(value), change) for key, value in node.items()}
    if isinstance(node, list):
        return [_replace(change(value), change) for value in node]
    return node


def render_shape(shape: str, extproc_port: int, model_servers: list[str]) -> RenderedShape:
    """``tests/gateway_shapes/<shape>.yaml`` with the admin and every listener on free loopback ports,
    the picker clusters on pd-extproc's ``127.0.0.1:extproc_port`` and each pool cluster's template
    endpoint replaced by ``model_servers`` (``ip:port`` each, in order). Nothing else changes."""
    config = yaml.safe_load((SHAPES_DIR / f"{shape}.yaml").read_text(encoding="utf-8"))
    admin_socket = config["admin"]["address"]["socket_address"]
    old_admin, admin_port = _address(admin_socket), free_port()
    _bind(admin_socket, f"127.0.0.1:{admin_port}")
    listen_port = 0
    for listener in config["static_resources"]["listeners"]:
        port = free_port()
        _bind(listener["address"]["socket_address"], f"127.0.0.1:{port}")
        if any(isinstance(n, dict) and n.get("@type") == EXT_PROC_TYPE for n in _nodes(listener)):
            listen_port = port
    pickers = {
        n["envoy_grpc"]["cluster_name"] for n in _nodes(config) if isinstance(n, dict) and "envoy_grpc" in n
    }
    templates = []
    for cluster in config["static_resources"]["clusters"]:
        sockets = list(_sockets(cluster.get("load_assignment", {})))
        if cluster["name"] in pickers:
            for socket in sockets:
                _bind(socket, f"127.0.0.1:{extproc_port}")
        elif sockets and all(_address(s) == old_admin for s in sockets):
            for socket in sockets:
                _bind(socket, f"127.0.0.1:{admin_port}")
        elif sockets:
            (locality,) = cluster["load_assignment"]["endpoints"]
            (template,) = locality["lb_endpoints"]
            templates.append(_address(template["endpoint"]["address"]["socket_address"]))
            locality["lb_endpoints"] = [
                _replace(copy.deepcopy(template), lambda v, t=templates[-1], s=server: s if v == t else v)
                for server in model_servers
            ]
            for endpoint, server in zip(locality["lb_endpoints"], model_servers, strict=True):
                _bind(endpoint["endpoint"]["address"]["socket_address"], server)
    config = _replace(
        config, lambda v: list(model_servers) if isinstance(v, list) and any(x in templates for x in v) else v
    )
    if not listen_port:
        raise ValueError(f"shape {shape}: no listener has an ext_proc filter")
    return RenderedShape(config, listen_port, admin_port)
