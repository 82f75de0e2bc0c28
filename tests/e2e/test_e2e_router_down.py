"""pd-extproc down, crashed or restarting, through the real Envoy with pd-extproc as a process
(docs/operations.md "Reliability"): a routed generation outlives a router SIGKILL, a request nobody
routed gets 503 ``routing_unavailable`` (or, with the fail-open edit, a decode chosen by Envoy), client
routing headers never reach override_host, SIGTERM still drains, and a restarted router's load view
converges to its own requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from builders import endpoint
from polling import until

from ext_proc.discovery.eds import write_eds_file
from sim.gateway import (
    Gateway,
    free_port,
    render_bootstrap,
    start_gateway,
    start_router_process,
    terminate,
    wait_router_ready,
)
from standins.backends import EchoBackend, start_backend

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 8}
STREAMS = 6
PIECES = 3
"""Content chunks of one backend stream (standins/backends.py), each after the request's delay."""


@dataclass
class RouterDown:
    """Envoy over two decode backends, with pd-extproc as a process that can be killed and restarted."""

    gateway: Gateway
    decodes: dict[str, EchoBackend]
    eds_files: list[str]
    grpc_port: int
    admin_port: int
    log: Path
    router: subprocess.Popen | None = None

    async def start_router(self) -> None:
        """Start pd-extproc on the same ports as every earlier one and wait until it routes."""
        self.router = start_router_process(self.grpc_port, self.admin_port, self.eds_files, self.log)
        await wait_router_ready(self.router, self.admin_port)

    def signal_router(self, signum: signal.Signals) -> int:
        """Send ``signum`` to pd-extproc and wait for it to exit; its exit code."""
        assert self.router is not None
        self.router.send_signal(signum)
        return self.router.wait(20)

    async def load(self, session: aiohttp.ClientSession) -> int:
        """Requests in flight on the decodes, as the running pd-extproc counts them."""
        async with session.get(f"http://127.0.0.1:{self.admin_port}/debug/endpoints") as response:
            return sum(row["active_requests"] for row in await response.json() if row["role"] == "decode")


@contextlib.asynccontextmanager
async def router_down_stack(tmp_path: Path, fail_open: bool = False) -> AsyncIterator[RouterDown]:
    """Two decode backends (no prefill), Envoy from the shipped bootstrap (with the fail-open edit if
    ``fail_open``); pd-extproc is not started."""
    decodes = [await start_backend() for _ in range(2)]
    prefill_eds, decode_eds = tmp_path / "prefill.yaml", tmp_path / "decode.yaml"
    write_eds_file(prefill_eds, "prefill", [])
    write_eds_file(decode_eds, "decode", [endpoint(b.address, "a") for b in decodes])
    grpc_port, listen, admin = free_port(), free_port(), free_port()
    bootstrap = render_bootstrap(
        listen_port=listen,
        admin_port=admin,
        extproc_port=grpc_port,
        prefill_leg_port=free_port(),
        decode_eds_path=str(decode_eds),
        prefill_eds_path=str(prefill_eds),
        fail_open=fail_open,
    )
    gateway = await start_gateway(bootstrap, listen, admin)
    stack = RouterDown(
        gateway,
        {b.address: b for b in decodes},
        [str(prefill_eds), str(decode_eds)],
        grpc_port,
        free_port(),
        tmp_path / "router.log",
    )
    try:
        yield stack
    finally:
        if stack.router is not None:
            terminate(stack.router)
        gateway.stop()
        for backend in decodes:
            await backend.stop()


@dataclass
class Generation:
    """One streaming chat request: the chunks received so far, its routing as the backend saw it."""

    chunks: int = 0
    done: bool = False
    served_by: str = ""
    destination: str = ""


async def generate(
    session: aiohttp.ClientSession, url: str, delay_ms: int, headers: dict[str, str] | None = None
) -> Generation:
    """Stream one chat completion through the gateway, ``delay_ms`` before each backend chunk; raise on
    a non-200 answer or a cut stream (the client's ``APIConnectionError``)."""
    generation = Generation()
    sent = {"x-test-delay-ms": str(delay_ms), **(headers or {})}
    async with session.post(f"{url}/v1/chat/completions", json=CHAT, headers=sent) as response:
        assert response.status == 200, await response.text()
        generation.served_by = response.headers["x-served-by"]
        generation.destination = response.headers["x-seen-destination"]
        assert response.headers["x-seen-prefiller"] == ""
        async for line in response.content:
            if line.strip() == b"data: [DONE]":
                generation.done = True
            elif line.startswith(b"data: "):
                generation.chunks += 1
    return generation


async def _count(session: aiohttp.ClientSession, stack: RouterDown, expected: int) -> bool:
    return await stack.load(session) == expected


async def _refused(session: aiohttp.ClientSession, stack: RouterDown, headers: dict[str, str]) -> dict:
    """POST a chat request that must get Envoy's 503 ``routing_unavailable``; its error object."""
    url = f"{stack.gateway.url}/v1/chat/completions"
    async with session.post(url, json=CHAT, headers=headers) as response:
        assert (response.status, response.headers["Content-Type"]) == (503, "application/json")
        error = json.loads(await response.read())["error"]
    assert (error["code"], error["type"]) == ("routing_unavailable", "service_unavailable")
    return error


async def test_a_router_crash_leaves_routed_generations_running_and_a_restart_converges(tmp_path):
    async with router_down_stack(tmp_path) as stack, aiohttp.ClientSession() as session:
        await stack.start_router()
        old = [asyncio.create_task(generate(session, stack.gateway.url, 2500)) for _ in range(STREAMS)]
        await until(lambda: _count(session, stack, STREAMS))
        # every generation has reached its decode (routed and forwarded) before the crash
        await until(lambda: sum(len(b.requests) for b in stack.decodes.values()) == STREAMS)
        assert stack.signal_router(signal.SIGKILL) == -signal.SIGKILL
        # Down: nothing is routed, a spoofed destination included, and no backend sees the request.
        served = sum(len(b.requests) for b in stack.decodes.values())
        spoof = {
            "x-gateway-destination-endpoint": next(iter(stack.decodes)),
            "x-prefiller-host-port": "10.9.9.9:2",
        }
        assert "not forwarded" in (await _refused(session, stack, spoof))["message"]
        assert sum(len(b.requests) for b in stack.decodes.values()) == served == STREAMS
        # Restarted: it routes again and counts only what it routed, while the old generations run on.
        await stack.start_router()
        fresh = asyncio.create_task(generate(session, stack.gateway.url, 300))
        await until(lambda: _count(session, stack, 1))
        assert not any(task.done() for task in old), "the old generations ended before the check"
        assert (await fresh).destination.split(",")[0] in stack.decodes
        for generation in await asyncio.gather(*old):
            assert (generation.chunks, generation.done) == (PIECES, True)
            assert generation.served_by == generation.destination.split(",")[0]
        await until(lambda: _count(session, stack, 0))


async def test_sigterm_drains_every_generation_in_flight(tmp_path):
    async with router_down_stack(tmp_path) as stack, aiohttp.ClientSession() as session:
        await stack.start_router()
        tasks = [asyncio.create_task(generate(session, stack.gateway.url, 600)) for _ in range(STREAMS)]
        await until(lambda: _count(session, stack, STREAMS))
        assert await asyncio.to_thread(stack.signal_router, signal.SIGTERM) == 0
        for generation in await asyncio.gather(*tasks):
            assert (generation.chunks, generation.done) == (PIECES, True)


async def test_fail_open_serves_without_the_router_and_through_its_restart(tmp_path):
    async with router_down_stack(tmp_path, fail_open=True) as stack, aiohttp.ClientSession() as session:
        named = next(iter(stack.decodes))
        spoof = {"x-gateway-destination-endpoint": named, "x-prefiller-host-port": "10.9.9.9:2"}
        for _ in range(4):  # never started: Envoy's fallback policy picks; the client's headers are gone
            generation = await generate(session, stack.gateway.url, 0, spoof)
            assert generation.done and generation.served_by in stack.decodes
            assert generation.destination == ""
        await stack.start_router()
        steady: list[tuple[bool, Generation]] = []  # (sent and ended while no router ran, generation)
        down = False

        async def keep_requesting() -> None:
            while True:
                sent_down = down
                generation = await generate(session, stack.gateway.url, 0)
                steady.append((sent_down and down, generation))
                await asyncio.sleep(0.02)

        def while_down() -> list[Generation]:
            return [generation for unrouted, generation in steady if unrouted]

        load = asyncio.create_task(keep_requesting())
        try:
            await until(lambda: len(steady) >= 3)
            assert stack.signal_router(signal.SIGKILL) == -signal.SIGKILL
            down = True
            await until(lambda: len(while_down()) >= 3)  # served while the router is down
            down = False
            await stack.start_router()
            restarted = len(steady)
            await until(lambda: any(g.destination for _, g in steady[restarted:]))  # routed again
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
        assert all(g.done for _, g in steady)
        assert [g.destination for g in while_down()] == [""] * len(while_down())  # none routed
