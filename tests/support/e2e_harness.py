"""End-to-end stack for tests: real backends, the real pd-extproc server, the real Envoy binary."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from builders import endpoint

from ext_proc.app import RunningServer, start_server
from ext_proc.config import load_config
from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import EndpointSpec
from sim.gateway import (
    SHIPPED_ADS_BOOTSTRAP,
    SHIPPED_BOOTSTRAP,
    Gateway,
    free_port,
    render_bootstrap,
    start_gateway,
)
from standins.backends import EchoBackend, start_backend


@dataclass
class Stack:
    """Everything one end-to-end test talks to."""

    gateway: Gateway
    server: RunningServer
    prefills: dict[str, EchoBackend]
    decodes: dict[str, EchoBackend]
    group_of: dict[str, str]
    prefill_eds: Path
    decode_eds: Path

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.server.admin_port}"

    def write_decodes(self, specs: list[EndpointSpec]) -> None:
        write_eds_file(self.decode_eds, "decode", specs)


@dataclass
class Gatewayed:
    """pd-extproc and Envoy over two EDS files."""

    gateway: Gateway
    server: RunningServer
    prefill_eds: Path
    decode_eds: Path

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.server.admin_port}"


@contextlib.asynccontextmanager
async def gateway_over(
    tmp_path: Path,
    prefills: list[EndpointSpec],
    decodes: list[EndpointSpec],
    settings: dict[str, object] | None = None,
    response_headers: bool = False,
    edit: Callable[[dict], None] | None = None,
    ads: bool = False,
    full_duplex: bool = False,
) -> AsyncIterator[Gatewayed]:
    """Write the EDS files, start the server (config ``settings``, dotted keys; ``handoff.prefill_via``
    defaults to the rendered Envoy's prefill-leg listener) and the real Envoy (its rendered
    bootstrap changed by ``edit``, if given). ``ads``: pd-extproc serves the endpoints it reads
    to Envoy (``xds.serve_eds``, ``envoy/envoy-ads.yaml``) instead of Envoy reading the files;
    ``full_duplex``: the ext_proc filter in the GIE gateways' FULL_DUPLEX_STREAMED modes."""
    prefill_eds, decode_eds = tmp_path / "prefill.yaml", tmp_path / "decode.yaml"
    write_eds_file(prefill_eds, "prefill", prefills)
    write_eds_file(decode_eds, "decode", decodes)
    prefill_leg_port = free_port()
    config = load_config(
        None,
        {
            "handoff.prefill_via": f"http://127.0.0.1:{prefill_leg_port}",
            "routing.pd_threshold_tokens": 0,  # the tests' short prompts are disaggregated too
            **(settings or {}),
            **({"xds.serve_eds": True} if ads else {}),
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "discovery.eds_files": [str(prefill_eds), str(decode_eds)],
            "discovery.poll_interval_seconds": 0.1,
        },
        environ={},
    )
    server = await start_server(config)
    listen = free_port()
    bootstrap = render_bootstrap(
        listen_port=listen,
        admin_port=free_port(),
        extproc_port=server.grpc_port,
        decode_eds_path=str(decode_eds),
        prefill_eds_path=str(prefill_eds),
        prefill_leg_port=prefill_leg_port,
        response_headers=response_headers,
        full_duplex=full_duplex,
        template=SHIPPED_ADS_BOOTSTRAP if ads else SHIPPED_BOOTSTRAP,
    )
    if edit is not None:
        edit(bootstrap)
    gateway = None
    try:
        gateway = await start_gateway(
            bootstrap, listen, int(bootstrap["admin"]["address"]["socket_address"]["port_value"])
        )
        yield Gatewayed(gateway, server, prefill_eds, decode_eds)
    finally:
        if gateway is not None:
            gateway.stop()
        await server.stop(grace=0.5)


@contextlib.asynccontextmanager
async def stack(
    tmp_path: Path,
    prefill_groups: list[str],
    decode_groups: list[str],
    mode: str = "prefer",
    bonus: float = 0.3,
    capacities: dict[int, float] | None = None,
    response_headers: bool = False,
    settings: dict[str, object] | None = None,
    full_duplex: bool = False,
) -> AsyncIterator[Stack]:
    """Start one backend per listed group entry (prefills then decodes), the server (more config
    ``settings``, dotted keys) and Envoy (``full_duplex``: in the GIE gateways' body modes)."""
    prefills = [await start_backend() for _ in prefill_groups]
    decodes = [await start_backend() for _ in decode_groups]
    capacities = capacities or {}
    prefill_specs = [endpoint(b.address, g) for b, g in zip(prefills, prefill_groups, strict=True)]
    decode_specs = [
        endpoint(b.address, g, capacities.get(i))
        for i, (b, g) in enumerate(zip(decodes, decode_groups, strict=True))
    ]
    settings = {"affinity.mode": mode, "affinity.bonus": bonus, **(settings or {})}
    try:
        async with gateway_over(
            tmp_path, prefill_specs, decode_specs, settings, response_headers, full_duplex=full_duplex
        ) as g:
            group_of = {
                b.address: grp
                for b, grp in zip(prefills + decodes, prefill_groups + decode_groups, strict=True)
            }
            yield Stack(
                g.gateway,
                g.server,
                {b.address: b for b in prefills},
                {b.address: b for b in decodes},
                group_of,
                g.prefill_eds,
                g.decode_eds,
            )
    finally:
        for backend in prefills + decodes:
            await backend.stop()


def raw_http(port: int, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as is on a new loopback connection to ``port``; the status and body of the
    answer, which must be JSON (the connection must be closed after it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split()[1]), body


async def busy_endpoints(session: aiohttp.ClientSession, admin_url: str) -> list[dict]:
    """The ``/debug/endpoints`` rows of pd-extproc at ``admin_url`` that still carry load."""
    async with session.get(f"{admin_url}/debug/endpoints") as response:
        return [row for row in await response.json() if row["active_tokens"] or row["active_requests"]]


async def wait_idle(session: aiohttp.ClientSession, admin_url: str, deadline: float = 10.0) -> list[dict]:
    """Poll until no endpoint has load left (Envoy closes ext_proc streams asynchronously, after the
    client has its answer); return the rows still busy after ``deadline`` seconds (``[]`` when idle)."""
    end = time.monotonic() + deadline
    while (busy := await busy_endpoints(session, admin_url)) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return busy
