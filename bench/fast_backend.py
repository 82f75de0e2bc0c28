"""A minimal OpenAI-shaped HTTP backend for overhead benchmarks: answers at once, prints its port.

Run: ``python bench/fast_backend.py [PORT]`` (0 or nothing = any free port). The first stdout
line is the bound port.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

ANSWER = (
    b'{"id":"cmpl-bench","object":"text_completion",'
    b'"choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}'
)


async def _complete(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")


async def _main(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _complete)
    app.router.add_post("/v1/chat/completions", _complete)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
