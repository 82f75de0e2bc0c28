"""A forwarder between pd-extproc and Envoy's prefill-leg listener that can kill the prefill that just
answered, before pd-extproc sees the answer: the "prefill died after its leg" fault, on the dot.

pd-extproc sends its legs here (``handoff.prefill_via``); each is forwarded unchanged (path, body,
headers) to ``upstream`` (the listener), and its answer comes back unchanged. While :attr:`armed`,
the engine named by the leg's destination header is killed (SIGKILL of its process group) once its
answer is in, and only then is the answer passed on: the decode is handed KV held by a dead engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

DESTINATION = "x-gateway-destination-endpoint"
_HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection"})


@dataclass
class Interposer:
    """The running forwarder: ``url`` for ``prefill_via``; ``killed`` lists the addresses it killed."""

    runner: web.AppRunner
    url: str
    armed: bool = False
    killed: list[str] = field(default_factory=list)

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_interposer(upstream: str, kill: Callable[[str], None]) -> Interposer:
    """Forward to ``upstream`` (a base URL); ``kill(address)`` kills an engine when armed."""
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), auto_decompress=False)

    async def forward(request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with session.post(
            upstream + request.path_qs, data=await request.read(), headers=headers
        ) as answer:
            body = await answer.read()
            reply_headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
            status = answer.status
        if interposer.armed and status == 200:
            interposer.armed = False
            address = request.headers[DESTINATION]
            kill(address)
            interposer.killed.append(address)
        return web.Response(status=status, body=body, headers=reply_headers)

    async def close_session(_: web.Application) -> None:
        await session.close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/{tail:.*}", forward)
    app.on_cleanup.append(close_session)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    interposer = Interposer(runner, f"http://127.0.0.1:{runner.addresses[0][1]}")
    return interposer
