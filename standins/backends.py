"""Small real HTTP backends for end-to-end tests: OpenAI-shaped answers that say who served.

Each backend answers ``/v1/completions``, ``/v1/chat/completions`` (streaming or not) and
``GET /v1/models``, and reports its own address and the routing headers it received, both in
response headers (``x-served-by``, ``x-seen-destination``, ``x-seen-prefiller``) and in the JSON.
A request header ``x-test-delay-ms`` makes it wait before answering (per chunk when streaming).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from dataclasses import dataclass, field

from aiohttp import web

from sim.server import drop_connections

BACKEND = web.AppKey("backend", "EchoBackend")
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body a backend reads (aiohttp's default is 1 MiB; engines take long-context bodies)."""


@dataclass
class EchoBackend:
    """A running echo backend that records every request it serves.

    ``requests`` records the path, seen routing headers, ``x-request-id`` and JSON body (POST only; ``raw``:
    its bytes as received, ``size``: their number) of every request served. A completion is recorded at once
    but answered only while ``answering`` is set (it is, unless a test clears it)."""

    runner: web.AppRunner
    address: str
    requests: list[dict] = field(default_factory=list)
    answering: asyncio.Event = field(default_factory=asyncio.Event)

    async def stop(self) -> None:
        """Stop serving and release the port."""
        await self.runner.cleanup()


def _seen(request: web.Request) -> dict[str, str]:
    return {
        "x-served-by": request.app[BACKEND].address,
        "x-seen-destination": request.headers.get("x-gateway-destination-endpoint", ""),
        "x-seen-prefiller": request.headers.get("x-prefiller-host-port", ""),
    }


async def _completion(request: web.Request) -> web.StreamResponse:
    backend = request.app[BACKEND]
    raw = await request.read()
    body = json.loads(raw)
    seen = _seen(request)
    backend.requests.append(
        {
            "path": request.path,
            **seen,
            "x-request-id": request.headers.get("x-request-id"),
            "body": body,
            "raw": raw,
            "size": len(raw),
            "headers": dict(request.headers),
        }
    )
    await backend.answering.wait()
    delay = float(request.headers.get("x-test-delay-ms", "0")) / 1000
    chat = request.path.endswith("chat/completions")
    created = int(time.time())
    pieces = ["Hello", " from", " " + request.app[BACKEND].address]
    if not body.get("stream"):
        await asyncio.sleep(delay)
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": "stop", "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        payload = {
            "id": "cmpl-test",
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": body.get("model", "test"),
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            "seen": seen,
        }
        return web.json_response(payload, headers=seen)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **seen})
    await response.prepare(request)
    try:
        for piece in pieces:
            await asyncio.sleep(delay)
            choice = {"index": 0, "finish_reason": None}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            chunk = {
                "id": "cmpl-test",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": body.get("model", "test"),
                "choices": [choice],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:  # the client went away mid-stream: what the abort tests provoke
        pass
    return response


async def _models(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    seen = _seen(request)
    backend.requests.append({"path": request.path, **seen})
    data = {"object": "list", "data": [{"id": "test", "object": "model", "created": 0, "owned_by": "test"}]}
    return web.json_response(data, headers=seen)


async def start_backend(middlewares: tuple = ()) -> EchoBackend:
    """Start an echo backend on an ephemeral loopback port.

    ``middlewares``: aiohttp middlewares in front of its handlers."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=list(middlewares))
    backend = EchoBackend(web.AppRunner(app, access_log=None), "")
    backend.answering.set()
    app[BACKEND] = backend
    app.router.add_post("/v1/completions", _completion)
    app.router.add_post("/v1/chat/completions", _completion)
    app.router.add_get("/v1/models", _models)
    await backend.runner.setup()
    await web.TCPSite(backend.runner, "127.0.0.1", 0).start()
    backend.address = f"127.0.0.1:{backend.runner.addresses[0][1]}"
    return backend


@dataclass
class ScriptedPrefill:
    """A prefill engine stand-in with a fixed answer: ``status`` and ``body`` after ``delay`` seconds.

    ``legs`` records each request's headers (lower-case names) and JSON body; ``cancelled`` counts
    requests whose client went away before the answer.
    """

    runner: web.AppRunner
    address: str
    status: int
    body: bytes
    delay: float
    legs: list[tuple[dict[str, str], dict]] = field(default_factory=list)
    cancelled: int = 0

    async def stop(self) -> None:
        """Stop serving and release the port."""
        await self.runner.cleanup()

    async def kill(self) -> None:
        """Die like a crashed node: stop listening and reset every open connection."""
        await drop_connections(self.runner)


SCRIPTED = web.AppKey("scripted", ScriptedPrefill)


async def _scripted(request: web.Request) -> web.Response:
    prefill = request.app[SCRIPTED]
    prefill.legs.append(({k.lower(): v for k, v in request.headers.items()}, await request.json()))
    try:
        await asyncio.sleep(prefill.delay)
    except asyncio.CancelledError:
        prefill.cancelled += 1
        raise
    return web.Response(status=prefill.status, body=prefill.body, content_type="application/json")


async def start_scripted_prefill(
    status: int = 200, body: bytes = b"{}", delay: float = 0.0
) -> ScriptedPrefill:
    """Start a :class:`ScriptedPrefill` on an ephemeral loopback port."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    prefill = ScriptedPrefill(runner, "", status, body, delay)
    app[SCRIPTED] = prefill
    app.router.add_post("/v1/completions", _scripted)
    app.router.add_post("/v1/chat/completions", _scripted)
    await prefill.runner.setup()
    await web.TCPSite(prefill.runner, "127.0.0.1", 0).start()
    prefill.address = f"127.0.0.1:{prefill.runner.addresses[0][1]}"
    return prefill


@dataclass
class BrokenEngine:
    """A TCP server standing in for a broken engine (see :func:`start_broken_engine`).

    ``requests`` counts the request heads it read."""

    server: asyncio.Server
    address: str
    requests: int = 0

    async def stop(self) -> None:
        """Close the server and wait until it is closed."""
        self.server.close()
        await self.server.wait_closed()


GARBAGE = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 this is not HTTP \xff\xfe\r\n\r\n"
"""What a ``garbage`` engine answers: bytes no HTTP parser accepts (a TLS hello's start, then noise)."""


async def start_broken_engine(kind: str) -> BrokenEngine:
    """Start a :class:`BrokenEngine` on an ephemeral loopback port.

    ``hang`` reads each request head and never answers (until the peer closes); ``garbage`` answers
    :data:`GARBAGE` and closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            engine.requests += 1
            if kind == "garbage":
                writer.write(GARBAGE)
                await writer.drain()
            else:
                while await reader.read(65536):  # until the peer gives up
                    pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    engine = BrokenEngine(server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    return engine


@dataclass
class KeepAliveEngine:
    """An HTTP/1.1 engine stand-in that keeps idle connections like uvicorn, resetting late reuse.

    - like uvicorn (vLLM's and SGLang's HTTP server), it is done with a connection ``keepalive`` seconds
      after its last answer on it;
    - the race it reproduces: uvicorn closes the idle connection at that moment while a client that
      pooled it writes its next request, which meets a closed socket: the client sees the connection
      reset, with no answer;
    - on loopback the close usually wins by a hair, so to make the crossing happen every time it does not
      close at expiry: it resets the connection when a request arrives on it after ``keepalive`` seconds
      (the kernel answers data for a closed socket with a reset too);
    - every answer is ``body`` (JSON, status 200); ``served`` and ``resets`` count answered and reset
      requests, ``connections`` the connections accepted.
    """

    server: asyncio.Server
    address: str
    keepalive: float
    body: bytes
    served: int = 0
    resets: int = 0
    connections: int = 0

    async def stop(self) -> None:
        """Close the server and wait until it is closed."""
        self.server.close()
        await self.server.wait_closed()


async def start_keepalive_engine(keepalive: float, body: bytes) -> KeepAliveEngine:
    """Start a :class:`KeepAliveEngine` on an ephemeral loopback port."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        engine.connections += 1
        answered_at: float | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if answered_at is not None and time.monotonic() - answered_at >= keepalive:
                    engine.resets += 1
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(engine.body), engine.body)
                )
                await writer.drain()
                engine.served += 1
                answered_at = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    engine = KeepAliveEngine(server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}", keepalive, body)
    return engine


VLLM_GENERATION_ERROR = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
}
"""What vLLM 0.32 answers when its decode cannot load the KV cache (``kv_load_failure_policy:
fail``), measured on real engines (``bench/vllm_kv_failure.py``)."""
VLLM_ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
"""What vLLM 0.32 answers once its engine core is dead (``EngineDeadError``, ``vllm/v1/engine/exceptions.py``;
its exception handler answers it with ``create_error_response``, a stream's generator as its error event)."""


def _failing_kv_pulls(error: dict[str, object]):  # type: ignore[no-untyped-def]
    """The middleware that answers every request carrying ``kv_transfer_params`` with vLLM's ``error``."""

    @web.middleware
    async def fail(request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
        if request.method != "POST":
            return await handler(request)
        body = await request.json()
        if "kv_transfer_params" not in body:
            return await handler(request)
        request.app[BACKEND].requests.append(
            {"path": request.path, "body": body, "headers": dict(request.headers)}
        )
        if not body.get("stream"):
            return web.json_response(error, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        if request.path.endswith("chat/completions"):  # vLLM announces the role before it fails
            role = {
                "id": "chatcmpl-1",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            }
            await response.write(b"data: " + json.dumps(role).encode() + b"\n\n")
        await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    return fail


async def start_kv_failing_decode(error: dict[str, object] = VLLM_GENERATION_ERROR) -> EchoBackend:
    """A decode that cannot load any KV cache, answering as vLLM 0.32 does.

    A request carrying ``kv_transfer_params`` gets HTTP 500 with ``error`` (non-streaming) or HTTP 200
    whose events are that error, then ``[DONE]`` (streaming; a chat stream announces the role first);
    any other request is served as by :func:`start_backend`. ``error``: :data:`VLLM_GENERATION_ERROR`
    (a failed pull), or :data:`VLLM_ENGINE_DEAD` (a decode whose engine core died). Its ``requests``
    record every request."""
    return await start_backend((_failing_kv_pulls(error),))


@dataclass
class BootstrapServer:
    """A vLLM Mooncake bootstrap server stand-in.

    ``GET /query`` answers ``status`` and ``body`` (``MooncakeBootstrapServer.query``'s shape by default);
    ``queries`` counts the queries."""

    runner: web.AppRunner
    port: int
    status: int
    body: bytes
    queries: int = 0

    async def stop(self) -> None:
        """Stop serving and release the port."""
        await self.runner.cleanup()


BOOTSTRAP = web.AppKey("bootstrap", BootstrapServer)


async def _query(request: web.Request) -> web.Response:
    server = request.app[BOOTSTRAP]
    server.queries += 1
    return web.Response(status=server.status, body=server.body, content_type="application/json")


async def start_bootstrap_server(engine_ids: dict[int, str], status: int = 200) -> BootstrapServer:
    """Start a :class:`BootstrapServer` listing ``engine_ids`` (data-parallel rank → engine id)."""
    answer = {
        str(rank): {"engine_id": e, "worker_addr": {"0": {"0": "127.0.0.1:1"}}}
        for rank, e in engine_ids.items()
    }
    app = web.Application()
    runner = web.AppRunner(app, access_log=None)
    server = BootstrapServer(runner, 0, status, json.dumps(answer).encode())
    app[BOOTSTRAP] = server
    app.router.add_get("/query", _query)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.port = runner.addresses[0][1]
    return server
