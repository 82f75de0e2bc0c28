"""End-to-end stack for tests: real backends, the real pd-extproc server, the real Envoy binary."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from backends import EchoBackend, start_backend

from ext_proc.app import RunningServer, start_server
from ext_proc.config import load_config
from ext_proc.discovery.eds import EndpointSpec, write_eds_file
from ext_proc.gateway import Gateway, free_port, render_bootstrap, start_gateway


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


@contextlib.asynccontextmanager
async def stack(
    tmp_path: Path,
    prefill_groups: list[str],
    decode_groups: list[str],
    mode: str = "prefer",
    bonus: float = 0.3,
    capacities: dict[int, float] | None = None,
    response_headers: bool = False,
) -> AsyncIterator[Stack]:
    """Start one backend per listed group entry (prefills then decodes), the server and Envoy."""
    prefills = [await start_backend() for _ in prefill_groups]
    decodes = [await start_backend() for _ in decode_groups]
    capacities = capacities or {}
    prefill_eds, decode_eds = tmp_path / "prefill.yaml", tmp_path / "decode.yaml"
    write_eds_file(
        prefill_eds,
        "prefill",
        [
            EndpointSpec(b.address, g, None, True, "HEALTHY")
            for b, g in zip(prefills, prefill_groups, strict=True)
        ],
    )
    write_eds_file(
        decode_eds,
        "decode",
        [
            EndpointSpec(b.address, g, capacities.get(i), True, "HEALTHY")
            for i, (b, g) in enumerate(zip(decodes, decode_groups, strict=True))
        ],
    )
    config = load_config(
        None,
        {
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "discovery.eds_files": [str(prefill_eds), str(decode_eds)],
            "discovery.poll_interval_seconds": 0.1,
            "affinity.mode": mode,
            "affinity.bonus": bonus,
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
        response_headers=response_headers,
    )
    gateway = None
    try:
        gateway = await start_gateway(
            bootstrap, listen, int(bootstrap["admin"]["address"]["socket_address"]["port_value"])
        )
        group_of = {
            b.address: g for b, g in zip(prefills + decodes, prefill_groups + decode_groups, strict=True)
        }
        yield Stack(
            gateway,
            server,
            {b.address: b for b in prefills},
            {b.address: b for b in decodes},
            group_of,
            prefill_eds,
            decode_eds,
        )
    finally:
        if gateway is not None:
            gateway.stop()
        await server.stop(grace=0.5)
        for backend in prefills + decodes:
            await backend.stop()
