"""A minimal OpenAI-shaped HTTP backend for overhead benchmarks; prints its port.

Non-streaming requests are answered at once. A streaming request (``"stream": true``) gets its
headers and one chunk at once, then is held open for ``x-hold-ms`` milliseconds (header) before
``data: [DONE]``: how the benchmark keeps many streams in flight.
GETs of ``/health``, ``/v1/models`` and ``/[get_]model_info``, ``/[get_]server_info`` answer what SGLang's
model gateway (``smg``) asks of a worker before it routes to it.
Run: ``python -m bench.fast_backend [PORT]`` (0 or nothing = any free port).
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

ANSWER = (
    b'{"id":"cmpl-bench","object":"text_completion",'
    b'"choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}'
)
CHUNK = b'data: {"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":"ok"}]}\n\n'


async def _complete(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    if b'"stream"' not in raw or not json.loads(raw).get("stream"):  # parse long bodies only when needed
        return web.Response(body=ANSWER, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(CHUNK)
    await asyncio.sleep(float(request.headers.get("x-hold-ms", "0")) / 1000)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _info(request: web.Request) -> web.Response:
    """What a gateway's worker checks ask: health, the served model, the server's info."""
    if request.path == "/v1/models":
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})
    return web.json_response({"model_path": "bench", "is_generation": True})


async def _main(port: int) -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)  # bodies up to what Envoy buffers, and more
    app.router.add_post("/v1/completions", _complete)
    app.router.add_post("/v1/chat/completions", _complete)
    for path in (
        "/health",
        "/v1/models",
        "/model_info",
        "/server_info",
        "/get_model_info",
        "/get_server_info",
    ):
        app.router.add_get(path, _info)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
