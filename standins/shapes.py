"""The gateway shapes of ``tests/deploy/gateway_shapes/``: Envoy bootstraps bound to a local run.

Each shape is an Envoy bootstrap as the gateways that run an InferencePool generate it (each file names its
sources and its differences in a header comment), bound to a local run by :func:`render_shape`.

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

:func:`shape_stack` runs a shape with engines behind it and ``pd-extproc serve`` as its picker, for
``tests/e2e/test_e2e_gateway_shapes.py`` and ``bench/gateway_shapes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import EndpointSpec
from sim.gateway import (
    Gateway,
    GatewayError,
    free_port,
    start_gateway,
    start_router_process,
    terminate,
    wait_router_ready,
)
from standins.backends import EchoBackend, ScriptedPrefill, start_backend, start_scripted_prefill
from standins.certs import self_signed

SHAPES_DIR = Path(__file__).resolve().parents[1] / "tests" / "deploy" / "gateway_shapes"
SHAPES = ("gie-standalone", "istio", "ai-gateway", "kgateway")
"""Every shape, by file name (without ``.yaml``)."""
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
CLUSTER_KIND = {
    "gie-standalone": "original_dst",
    "ai-gateway": "original_dst",
    "kgateway": "subset",
    "istio": "override_host",
}
"""How each shape's pool cluster reads pd-extproc's choice: ORIGINAL_DST and kgateway's subset load
balancer take one ``ip:port`` (header, ``envoy.lb`` metadata), Istio's override_host a list."""
KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}
PREFILL_ANSWER = json.dumps(
    {
        "id": "cmpl-prefill",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": KV_PARAMS,
    }
).encode()
"""What every prefill engine answers: a vLLM NixlConnector prefill's answer, one token and the params."""
GROUPS = {"prefill": ("a", "b"), "decode": ("a", "a", "b")}
"""The pdGroupID of each prefill and decode engine behind a shape."""


@dataclass(frozen=True)
class RenderedShape:
    """``shape`` bound to local ports: the bootstrap, the gateway listener's port and the admin's."""

    shape: str
    config: dict
    listen_port: int
    admin_port: int


def nodes(node: object) -> Iterator[object]:
    """``node`` and everything inside it, depth first."""
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from nodes(child)


def _address(socket: dict) -> str:
    return f"{socket['address']}:{socket['port_value']}"


def _bind(socket: dict, address: str) -> None:
    host, _, port = address.rpartition(":")
    socket["address"], socket["port_value"] = host, int(port)


def _sockets(node: object) -> Iterator[dict]:
    return (n["socket_address"] for n in nodes(node) if isinstance(n, dict) and "socket_address" in n)


def _replace(node: object, change: Callable[[object], object]) -> object:
    """A copy of ``node`` with every value ``v`` inside it replaced by ``change(v)``."""
    if isinstance(node, dict):
        return {key: _replace(change(value), change) for key, value in node.items()}
    if isinstance(node, list):
        return [_replace(change(value), change) for value in node]
    return node


def render_shape(shape: str, extproc_port: int, model_servers: list[str]) -> RenderedShape:
    """A gateway shape's bootstrap bound to free loopback ports, pd-extproc and ``model_servers``.

    ``tests/deploy/gateway_shapes/<shape>.yaml`` with the admin and every listener on free loopback ports,
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
        if any(isinstance(n, dict) and n.get("@type") == EXT_PROC_TYPE for n in nodes(listener)):
            listen_port = port
    pickers = {
        n["envoy_grpc"]["cluster_name"] for n in nodes(config) if isinstance(n, dict) and "envoy_grpc" in n
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
    return RenderedShape(shape, config, listen_port, admin_port)


def _nested(dotted: dict[str, object]) -> dict:
    """``{"a.b": 1}`` as the nested mapping a config file holds."""
    tree: dict = {}
    for key, value in dotted.items():
        *path, leaf = key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


@dataclass
class ShapeStack:
    """One shape's Envoy, the engines behind it (:data:`GROUPS`) and the pd-extproc it dials."""

    shape: str
    gateway: Gateway
    config: dict
    """The bootstrap Envoy runs."""
    prefills: list[ScriptedPrefill]
    decodes: list[EchoBackend]
    group_of: dict[str, str]
    folder: Path
    grpc_port: int
    admin_port: int
    base: dict[str, object]
    """pd-extproc's settings (dotted keys) unless :meth:`picker` is told otherwise."""
    router: subprocess.Popen | None = None
    running: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """The gateway's URL."""
        return self.gateway.url

    @property
    def admin_url(self) -> str:
        """pd-extproc's admin (``/metrics``, ``/debug/endpoints``)."""
        return f"http://127.0.0.1:{self.admin_port}"

    async def picker(self, changes: dict[str, object] | None = None, through_envoy: bool = True) -> None:
        """Have ``pd-extproc serve`` run with the base settings updated by ``changes``.

        ``changes``: dotted keys. It runs from a config file as a user would: (re)started only when they
        differ from the running ones, then waited for until it is ready and (``through_envoy``) answers
        through Envoy."""
        settings = {**self.base, **(changes or {})}
        if self.router is not None and settings == self.running:
            return
        self.stop_picker()
        path = self.folder / "pd-extproc.yaml"
        path.write_text(yaml.safe_dump(_nested(settings)), encoding="utf-8")
        log = self.folder / "pd-extproc.log"
        self.router = start_router_process(self.grpc_port, self.admin_port, [], log, ("--config", str(path)))
        self.running = settings
        await wait_router_ready(self.router, self.admin_port)
        if through_envoy:
            await self._answers()

    def stop_picker(self) -> None:
        """Stop pd-extproc (SIGTERM) if it runs."""
        if self.router is not None:
            terminate(self.router)
            self.router = None

    async def _answers(self, timeout: float = 15.0) -> None:
        """Wait until pd-extproc answers through Envoy (Envoy reconnects to a restarted picker): a
        malformed body is refused by pd-extproc itself, whatever the cluster does with addresses."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.post(f"{self.url}/v1/completions", data=b"{") as response:
                        if response.status == 400:
                            return
                await asyncio.sleep(0.1)
        raise GatewayError(
            f"{self.shape}: pd-extproc did not answer within {timeout:.0f} s:\n{self.gateway.log_tail()}"
        )

    def clear(self) -> None:
        """Forget what the engines recorded."""
        for prefill in self.prefills:
            prefill.legs.clear()
        for decode in self.decodes:
            decode.requests.clear()

    def served(self) -> list[dict]:
        """Every request the decodes served since :meth:`clear`, each with ``served_by``."""
        return [{**r, "served_by": d.address} for d in self.decodes for r in d.requests]

    def misrouted(self) -> int:
        """Requests the prefills received since :meth:`clear` (in ``sidecar`` mode none is a leg)."""
        return sum(len(p.legs) for p in self.prefills)


@contextlib.asynccontextmanager
async def shape_stack(
    shape: str, folder: Path, edit: Callable[[RenderedShape, list[str], list[str]], None] | None = None
) -> AsyncIterator[ShapeStack]:
    """Start engines, pd-extproc's files and Envoy in ``shape``; everything stops on exit.

    The engines are those of :data:`GROUPS` (scripted prefills answering :data:`PREFILL_ANSWER`, echo
    decodes), their EDS files for pd-extproc, a self-signed certificate for it, and Envoy in ``shape`` over
    all of them (``edit(rendered, prefill addresses, decode addresses)`` may change the rendered bootstrap
    first); ``folder`` (made if missing) holds the files. pd-extproc starts with :meth:`ShapeStack.picker`;
    everything stops on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    prefills = [await start_scripted_prefill(body=PREFILL_ANSWER) for _ in GROUPS["prefill"]]
    decodes = [await start_backend() for _ in GROUPS["decode"]]
    engines: list[ScriptedPrefill | EchoBackend] = [*prefills, *decodes]
    group_of = dict(zip([e.address for e in engines], GROUPS["prefill"] + GROUPS["decode"], strict=True))
    eds = {role: folder / f"{role}.yaml" for role in GROUPS}
    for role, members in (("prefill", prefills), ("decode", decodes)):
        specs = [EndpointSpec(e.address, group_of[e.address], None, True, "HEALTHY") for e in members]
        write_eds_file(eds[role], role, specs)
    pair = self_signed(folder / "tls")
    base: dict[str, object] = {
        "tls.cert_file": str(pair.cert),
        "tls.key_file": str(pair.key),
        "discovery.eds_files": [str(eds["prefill"]), str(eds["decode"])],
        "discovery.poll_interval_seconds": 0.1,
        "routing.pd_threshold_tokens": 0,  # short test prompts are disaggregated too
        # One address where the cluster reads the header (docs/deploy/gateways.md), the list elsewhere.
        "routing.fallback_count": 2 if CLUSTER_KIND[shape] == "override_host" else 0,
        "handoff.prefill_via": "",  # no prefill-leg listener exists behind these gateways
    }
    grpc_port = free_port()
    rendered = render_shape(shape, grpc_port, [e.address for e in engines])
    if edit is not None:
        edit(rendered, [p.address for p in prefills], [d.address for d in decodes])
    gateway = None
    stack = None
    try:
        gateway = await start_gateway(rendered.config, rendered.listen_port, rendered.admin_port)
        stack = ShapeStack(
            shape, gateway, rendered.config, prefills, decodes, group_of, folder, grpc_port, free_port(), base
        )
        yield stack
    finally:
        if stack is not None:
            stack.stop_picker()
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            await engine.stop()
