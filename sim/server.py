"""aiohttp front end of one simulated engine: the vLLM OpenAI server plus the llm-d decode sidecar.

Generation requests take one of four paths, chosen as real PD deployments do:

* ``kv_transfer_params.do_remote_decode`` (roles prefill/both): prefill, return one token and
  ``kv_transfer_params`` for the decode (vLLM NixlConnector);
* ``kv_transfer_params.do_remote_prefill`` (roles decode/both): pull the KV cache from
  ``remote_host:remote_port``, then decode;
* header ``x-prefiller-host-port`` (roles decode/both): call that prefill engine over HTTP first,
  like the llm-d sidecar, then pull from it;
* otherwise: prefill locally and decode.

Every response carries headers describing what happened; for streams they go out before the
first chunk, once the request is admitted and its KV cache is in place:

* ``x-sim-engine`` (this engine's ``host:port``), ``x-sim-group``, ``x-sim-role``,
  ``x-sim-time-scale``;
* ``x-sim-kv-transfer``: ``same_group`` | ``cross_group`` | ``none`` (no pull by this engine);
* ``x-sim-kv-transfer-ms``: the pull's duration in model ms (``0.0`` without a pull);
* ``x-sim-queue-ms``: model ms waiting for a batch slot and KV blocks;
* ``x-sim-remote-prefill-ms``: model ms the sidecar's call to the prefill engine took (sidecar path only);
* with a pull: ``x-sim-prefill-engine`` (``host:port`` pulled from) and ``x-sim-prefill-group``
  (its EDS group, or ``unknown``); ``x-sim-warning`` when it is in no EDS file (then counted as
  ``cross_group``) or when EDS disagrees with the group the prefill reported itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web

from sim.clock import SimClock
from sim.config import EngineConfig
from sim.engine import ABORTED, Engine, EngineError, Sequence
from sim.kv import GroupMap, SharedLink
from sim.metrics import CONTENT_TYPE
from sim.protocol import (
    GenerateRequest,
    RequestError,
    Shaper,
    error_body,
    parse_generate,
    sse,
    token_text,
    usage,
)

log = logging.getLogger(__name__)

PREFILLER_HEADER = "x-prefiller-host-port"
H_ENGINE, H_GROUP, H_ROLE = "x-sim-engine", "x-sim-group", "x-sim-role"
H_KV, H_KV_MS = "x-sim-kv-transfer", "x-sim-kv-transfer-ms"
H_PREFILL, H_PREFILL_GROUP = "x-sim-prefill-engine", "x-sim-prefill-group"
H_QUEUE_MS, H_TIME_SCALE, H_WARNING = "x-sim-queue-ms", "x-sim-time-scale", "x-sim-warning"
H_REMOTE_PREFILL_MS = "x-sim-remote-prefill-ms"


@dataclass
class _State:
    session: aiohttp.ClientSession | None = None


ENGINE_KEY = web.AppKey("sim_engine", Engine)
_STATE_KEY = web.AppKey("sim_state", _State)


def _error(status: int, message: str, headers: dict[str, str], param: str | None = None) -> web.Response:
    err_type = "BadRequestError" if status == 400 else "InternalServerError"
    return web.json_response(error_body(message, status, err_type, param), status=status, headers=headers)


def _headers(engine: Engine) -> dict[str, str]:
    return {
        H_ENGINE: engine.address,
        H_GROUP: engine.config.group,
        H_ROLE: engine.config.role,
        H_KV: "none",
        H_KV_MS: "0.0",
        H_TIME_SCALE: repr(engine.clock.time_scale),
    }


def _handoff_params(engine: Engine, seq: Sequence) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine.engine_id,
        "remote_block_ids": engine.block_ids(seq),
        "remote_host": engine.host,
        "remote_port": engine.port,
        "tp_size": 1,
    }


async def _call_prefill(
    request: web.Request, req: GenerateRequest, prefiller: str, headers: dict[str, str]
) -> tuple[str | None, web.Response | None]:
    """The sidecar's prefill call: ``(prefill's self-reported group, None)`` or ``(None, error)``."""
    body = dict(req.body)
    body.pop("stream_options", None)
    body.pop("sim_output_tokens", None)
    body.update(stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    forward = {k: v for k, v in request.headers.items() if k.lower() in ("x-request-id", "authorization")}
    session = request.app[_STATE_KEY].session
    assert session is not None
    try:
        async with session.post(f"http://{prefiller}{request.path}", json=body, headers=forward) as resp:
            data = await resp.read()
            if resp.status != 200:
                headers[H_PREFILL] = prefiller
                return None, web.Response(
                    status=resp.status, body=data, headers=headers, content_type=resp.content_type
                )
            params = json.loads(data).get("kv_transfer_params")
            reported = resp.headers.get(H_GROUP)
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
        headers[H_PREFILL] = prefiller
        return None, _error(502, f"prefill {prefiller} failed: {exc!r}", headers)
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None, _error(502, f"prefill {prefiller} returned no kv_transfer_params", headers)
    return reported, None


async def _pull_source(
    request: web.Request, engine: Engine, req: GenerateRequest, headers: dict[str, str]
) -> tuple[str | None, str | None, web.Response | None]:
    """Where to pull the KV from: ``(address or None for a local prefill, prefill's own group
    report, None)``, or ``(None, None, error response)`` for a role/parameter mismatch."""
    role = engine.config.role
    params = req.kv_transfer_params or {}
    handoff, remote = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    prefiller = request.headers.get(PREFILLER_HEADER)
    bad = None
    if handoff and (remote or role == "decode"):
        bad = f"a {role} engine cannot serve do_remote_decode here"
    elif (remote or prefiller) and role == "prefill":
        bad = "a prefill engine cannot pull a remote KV cache"
    elif remote:
        host, port = params.get("remote_host"), params.get("remote_port")
        if isinstance(host, str) and host and isinstance(port, int):
            return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}"), None, None
        bad = "do_remote_prefill needs remote_host and remote_port"
    elif prefiller and not handoff:
        started = engine.clock.now()
        reported, failure = await _call_prefill(request, req, prefiller, headers)
        headers[H_REMOTE_PREFILL_MS] = f"{(engine.clock.now() - started) * 1e3:.4f}"
        return (None, None, failure) if failure is not None else (prefiller, reported, None)
    if bad is not None:
        return None, None, _error(400, bad, headers, "kv_transfer_params")
    return None, None, None


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    headers = _headers(engine)
    try:
        req = parse_generate(await request.read(), chat, engine.config.timing)
    except RequestError as exc:
        return _error(400, str(exc), headers, exc.param)
    pull_from, reported, failure = await _pull_source(request, engine, req, headers)
    if failure is not None:
        return failure
    pull = partial(engine.kv.pull, pull_from, req.prompt_tokens) if pull_from is not None else None
    try:
        seq = engine.submit(req.prompt_tokens, req.max_tokens, req.output_tokens, pull)
    except ValueError as exc:
        return _error(400, str(exc), headers, "max_tokens")
    try:
        await seq.ready.wait()
        if seq.error is not None:
            return _error(502 if pull_from else 500, f"request failed: {seq.error}", headers)
        _describe(seq, headers, reported)
        shaper = Shaper.new(chat, seq.request_id, req.model or engine.config.model)
        if req.stream:
            return await _stream(request, engine, seq, req, shaper, headers)
        try:
            await engine.wait_done(seq)
        except EngineError as exc:
            return _error(500, f"request failed: {exc}", headers)
        body = shaper.full(
            token_text(0, seq.generated), seq.finish_reason, usage(req.prompt_tokens, seq.generated)
        )
        if (req.kv_transfer_params or {}).get("do_remote_decode"):
            body["kv_transfer_params"] = _handoff_params(engine, seq)
            engine.metrics.remote_prefills.inc()
        return web.json_response(body, headers=headers)
    finally:
        engine.abort(seq)  # no-op unless the client went away or something failed


def _describe(seq: Sequence, headers: dict[str, str], reported_group: str | None) -> None:
    t = seq.transfer
    headers[H_KV] = t.kind
    headers[H_KV_MS] = f"{t.model_ms:.4f}"
    if seq.admitted_at is not None:
        headers[H_QUEUE_MS] = f"{(seq.admitted_at - seq.arrival) * 1e3:.4f}"
    if t.prefill_address is None:
        return
    headers[H_PREFILL] = t.prefill_address
    headers[H_PREFILL_GROUP] = t.prefill_group if t.prefill_group is not None else "unknown"
    if t.prefill_group is None:
        headers[H_WARNING] = f"prefill {t.prefill_address} is in no EDS file; treated as cross_group"
    elif reported_group is not None and reported_group != t.prefill_group:
        headers[H_WARNING] = f"prefill reports group {reported_group!r} but EDS says {t.prefill_group!r}"


async def _stream(
    request: web.Request,
    engine: Engine,
    seq: Sequence,
    req: GenerateRequest,
    shaper: Shaper,
    headers: dict[str, str],
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):  # client gone, or this engine killed: nobody to tell
        await _write_events(resp, engine, seq, req, shaper)
    return resp


async def _write_events(
    resp: web.StreamResponse, engine: Engine, seq: Sequence, req: GenerateRequest, shaper: Shaper
) -> None:
    with_usage, interval = req.include_usage, engine.config.timing.stream_interval
    if req.chat:
        await resp.write(sse(shaper.chunk(None, None, with_usage, role=True)))
    sent, finish_sent = 0, False
    while True:
        generated, done = seq.generated, seq.done
        if generated > sent and (done or generated - sent >= interval):
            finish = seq.finish_reason if done else None
            await resp.write(sse(shaper.chunk(token_text(sent, generated), finish, with_usage)))
            sent, finish_sent = generated, finish is not None
        if done:
            break
        seq.progress.clear()
        await seq.progress.wait()
    if seq.state == ABORTED:
        message = f"request failed: {seq.error or 'aborted'}"
        await resp.write(sse(error_body(message, 500, "InternalServerError")))
    else:
        if not finish_sent:
            await resp.write(sse(shaper.chunk("", seq.finish_reason, with_usage)))
        if with_usage:
            await resp.write(sse(shaper.usage_chunk(usage(req.prompt_tokens, seq.generated))))
    await resp.write(sse("[DONE]"))
    await resp.write_eof()


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _models(request: web.Request) -> web.Response:
    config = request.app[ENGINE_KEY].config
    model = {
        "id": config.model,
        "object": "model",
        "created": 0,
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.timing.max_model_len,
    }
    return web.json_response({"object": "list", "data": [model]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _lifecycle(app: web.Application) -> Any:
    engine, state = app[ENGINE_KEY], app[_STATE_KEY]
    timeout = aiohttp.ClientTimeout(total=engine.config.prefill_timeout_s)
    state.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
    await engine.start()
    yield
    await engine.stop()
    await state.session.close()


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving ``engine``; the engine loop runs while the app runs."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app[_STATE_KEY] = _State()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.cleanup_ctx.append(_lifecycle)
    return app


@dataclass
class RunningEngine:
    """A started engine: its :class:`Engine` and HTTP runner. ``address`` is ``"host:port"``."""

    engine: Engine
    runner: web.AppRunner

    @property
    def address(self) -> str:
        """``"host:port"`` the engine advertises (bound port included)."""
        return self.engine.address

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return self.engine.port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.address}"

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (up to ``shutdown_timeout_s``), stop."""
        await self.runner.cleanup()

    async def kill(self) -> None:
        """Die like a crashed node: refuse new connections, reset open ones, fail what is in flight."""
        for site in list(self.runner.sites):
            await site.stop()
        server = self.runner.server
        for handler in list(server.connections if server is not None else ()):
            if handler.transport is not None:
                handler.transport.abort()
        await self.engine.stop()
        await self.runner.cleanup()


async def start_engine(
    config: EngineConfig,
    *,
    clock: SimClock | None = None,
    link: SharedLink | None = None,
    groups: GroupMap | None = None,
) -> RunningEngine:
    """Bind ``config.host:config.port`` (0 = ephemeral) and serve; raise ``OSError`` if it cannot."""
    engine = Engine(config, clock=clock, link=link, groups=groups)
    access_log = logging.getLogger("sim.access") if config.access_log else None
    runner = web.AppRunner(
        build_app(engine), access_log=access_log, shutdown_timeout=config.shutdown_timeout_s
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
    except BaseException:
        await runner.cleanup()
        raise
    engine.port = runner.addresses[0][1]
    return RunningEngine(engine, runner)
