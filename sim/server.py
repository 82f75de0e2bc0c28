"""aiohttp front end of one simulated engine.

The vLLM OpenAI server, the llm-d decode sidecar and the engines' PD handoff protocols (:mod:`sim.handoff` has
the protocols and the ``/sim/`` endpoints).

A generation request takes the first of these paths that applies:

* ``kv_transfer_params.do_remote_decode`` (roles prefill/both): prefill and return one token. With
  ``kv_connector`` ``nixl`` (vLLM 0.32 ``nixl/pull_scheduler.py``), whether that token is the
  length cap or a stop, the non-streaming response carries ``kv_transfer_params`` for the decode
  (``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``, ``remote_block_ids`` per KV
  cache group (``[[...]]``), ``remote_host``, ``remote_port``, ``tp_size``, ``dcp_size``, ``pp_size``,
  ``remote_num_tokens``, ``remote_blocks_expiry_time``, ``transfer_mode`` and ``remote_request_id``:
  the ``X-Request-Id`` header, else a random id) and the engine holds the KV blocks under a
  ``kv_lease_s`` lease the decode's heartbeats renew. With ``mooncake`` (vLLM's upstream
  MooncakeConnector) the answer has no ``kv_transfer_params``; the KV is held under the request's
  ``transfer_id`` (none without one) for ``mooncake_abort_timeout_s``, and only when the token is
  the length cap;
* SGLang's ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` on a prefill engine: wait for
  the room's decode to register, prefill, hold the KV until the decode pulled it, answer the one
  token; 500 when no decode comes within ``bootstrap_timeout_s``;
* ``kv_transfer_params.do_remote_prefill`` (roles decode/both): read the KV cache from the prefill
  (``nixl``: at ``remote_host:remote_port``, heartbeating while it waits; ``mooncake``: from the
  bootstrap server ``remote_bootstrap_addr``, by ``transfer_id``), then decode. Malformed params:
  prefill locally (``x-sim-kv-transfer: none`` and ``x-sim-warning``). Blocks that prefill does not
  hold or an unreachable prefill, by ``kv_load_failure_policy``: ``fail`` answers as vLLM 0.32 does
  (HTTP 500 ``Internal server error``, or a 200 stream whose only event is that error), ``recompute``
  prefills locally;
* SGLang's bootstrap fields on a decode engine: register at the bootstrap server
  ``bootstrap_host:bootstrap_port`` (a prefill engine's HTTP port), pull once the room's prefill has
  computed the KV, then decode; 502 before any byte is streamed when that fails or times out.
  Engines of role both ignore the bootstrap fields;
* header ``x-prefiller-host-port`` (roles decode/both): call that prefill engine over HTTP first,
  like the llm-d sidecar, then read from it as for ``do_remote_prefill``;
* otherwise: prefill locally and decode.

Every response carries headers describing what happened; for streams they go out before the
first chunk, once the request is admitted and its KV cache is in place:

* ``x-sim-engine`` (this engine's ``host:port``), ``x-sim-group``, ``x-sim-role``,
  ``x-sim-time-scale``;
* ``x-sim-kv-transfer``: ``same_group`` | ``cross_group`` | ``none`` (no pull by this engine);
* ``x-sim-kv-transfer-ms``: the pull's duration in model ms (``0.0`` without a pull);
* ``x-sim-queue-ms``: model ms waiting for a batch slot and KV blocks;
* ``x-sim-cached-tokens``: prompt tokens this engine found in its prefix cache (neither computed nor
  pulled; 0 without ``--enable-prefix-caching``); ``x-sim-prefill-cached-tokens``: the same at the
  remote prefill, when its ``kv_transfer_params`` (or Mooncake pull answer) say so;
* ``x-sim-remote-prefill-ms``: model ms of the remote prefill as this decode can tell: the sidecar's
  call to the prefill engine (sidecar path), the prefill engine's own time from arrival to answer
  (``kv_transfer_params.sim_prefill_ms``, which the prefill adds), or the wait for the bootstrap room's
  KV (SGLang); absent when the decode prefilled locally;
* with a pull: ``x-sim-prefill-engine`` (``host:port`` pulled from) and ``x-sim-prefill-group``
  (its EDS group, or ``unknown``);
* ``x-sim-warning``: why a KV load failed and the engine prefilled locally instead; or, with a
  pull, that the prefill is in no EDS file (then counted as ``cross_group``) or that EDS disagrees
  with the group the prefill reported itself.

``POST /reset_prefix_cache`` empties the prefix cache as vLLM's does (200), or answers 409 while blocks
are in use. With ``EngineConfig.kv_events`` the engine publishes its prefix cache's KV-cache events on
vLLM's wire (:mod:`sim.kv_events`), one batch per change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from ext_proc.handoff.body import prefill_leg_body
from ext_proc.prefix.blocks import prompt_content
from sim.clock import SimClock
from sim.config import EngineConfig
from sim.engine import ABORTED, Engine, EngineError, Hold, KvLoadError, Pull, Sequence
from sim.handoff import PREFILL_CACHED_PARAM, PREFILL_MS_PARAM, BootstrapError, Handoff
from sim.kv import GroupMap, SharedLink
from sim.kv_events import Publisher
from sim.metrics import CONTENT_TYPE
from sim.prefix import PromptBlocks
from sim.protocol import (
    GenerateRequest,
    RequestError,
    Shaper,
    error_body,
    error_response,
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
H_CACHED, H_PREFILL_CACHED = "x-sim-cached-tokens", "x-sim-prefill-cached-tokens"

ENGINE_KEY = web.AppKey("sim_engine", Engine)
HANDOFF_KEY = web.AppKey("sim_handoff", Handoff)


def _headers(engine: Engine) -> dict[str, str]:
    return {
        H_ENGINE: engine.address,
        H_GROUP: engine.config.group,
        H_ROLE: engine.config.role,
        H_KV: "none",
        H_KV_MS: "0.0",
        H_TIME_SCALE: repr(engine.clock.time_scale),
    }


def _handoff_params(engine: Engine, seq: Sequence, request_id: str) -> dict[str, Any]:
    """What a vLLM 0.32 NIXL prefill answers (``NixlConnectorScheduler.request_finished``), one KV
    cache group, no parallelism; plus :data:`~sim.handoff.PREFILL_MS_PARAM` and
    :data:`~sim.handoff.PREFILL_CACHED_PARAM`."""
    took_ms = ((seq.finished_at or engine.clock.now()) - seq.arrival) * 1e3
    return {
        PREFILL_MS_PARAM: round(took_ms, 4),
        PREFILL_CACHED_PARAM: seq.cached_tokens,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(seq.held_block_ids)],
        "remote_engine_id": engine.engine_id,
        "remote_request_id": request_id,
        "remote_host": engine.host,
        "remote_port": engine.port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": seq.prompt_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }


def _hold(engine: Engine, req: GenerateRequest, request_id: str) -> Hold | None:
    """How a prefill keeps a ``do_remote_decode`` request's KV for its decode, if it does (see the
    module docstring): NIXL under ``request_id``, Mooncake under the ``transfer_id``."""
    if not req.remote_decode:
        return None
    kv = engine.config.kv
    if kv.kv_connector == "nixl":
        return Hold(request_id, kv.kv_lease_s)
    transfer_id = (req.kv_transfer_params or {}).get("transfer_id")
    if req.stops or not isinstance(transfer_id, str) or not transfer_id:
        if not req.stops:
            log.warning("engine %s: missing transfer_id in kv_transfer_params from router", engine.address)
        return None
    return Hold(transfer_id, kv.mooncake_abort_timeout_s)


async def _call_prefill(
    request: web.Request, req: GenerateRequest, prefiller: str, headers: dict[str, str]
) -> tuple[dict[str, Any] | None, web.Response | None]:
    """The sidecar's prefill call: ``(kv_transfer_params, None)`` or ``(None, error response)``.

    The same prefill leg the gateway's kv-transfer-params handoff sends (one protocol, one definition),
    without ``sim_output_tokens``: the sidecar's prefill always hands the KV cache over."""
    body = prefill_leg_body({k: v for k, v in req.body.items() if k != "sim_output_tokens"})
    forward = {k: v for k, v in request.headers.items() if k.lower() in ("x-request-id", "authorization")}
    forward["Content-Type"] = "application/json"
    session = request.app[HANDOFF_KEY].session
    assert session is not None
    try:
        async with session.post(f"http://{prefiller}{request.path}", data=body, headers=forward) as resp:
            data = await resp.read()
            if resp.status != 200:
                headers[H_PREFILL] = prefiller
                return None, web.Response(
                    status=resp.status, body=data, headers=headers, content_type=resp.content_type
                )
            params = json.loads(data).get("kv_transfer_params")
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
        headers[H_PREFILL] = prefiller
        return None, error_response(502, f"prefill {prefiller} failed: {exc!r}", headers)
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None, error_response(502, f"prefill {prefiller} returned no kv_transfer_params", headers)
    return params, None


def _role_error(
    role: str, req: GenerateRequest, prefiller: str | None, headers: dict[str, str]
) -> web.Response | None:
    """A 400 response when this engine's role cannot serve the request's handoff, else ``None``."""
    if req.remote_decode and (req.remote_prefill or role == "decode"):
        bad = f"a {role} engine cannot serve do_remote_decode here"
    elif (req.remote_prefill or prefiller) and role == "prefill":
        bad = "a prefill engine cannot pull a remote KV cache"
    else:
        return None
    return error_response(400, bad, headers, "kv_transfer_params")


@dataclass(frozen=True, slots=True)
class PullSource:
    """How a request gets its KV cache.

    ``pull`` (``None``: prefill locally) and, for a NIXL pull, the ``nixl`` params its heartbeats name."""

    pull: Pull | None = None
    nixl: dict[str, Any] | None = None


async def _pull_source(
    request: web.Request, engine: Engine, req: GenerateRequest, headers: dict[str, str]
) -> PullSource | web.Response:
    """How the request gets its KV cache, or the error response when the sidecar's prefill call failed."""
    handoff = request.app[HANDOFF_KEY]
    prefiller = request.headers.get(PREFILLER_HEADER)
    if req.remote_prefill:
        assert req.kv_transfer_params is not None
        if engine.config.kv.kv_connector == "mooncake":
            return PullSource(handoff.mooncake_pull(req.kv_transfer_params))
        return PullSource(handoff.nixl_pull(req.kv_transfer_params), req.kv_transfer_params)
    if req.bootstrap is not None and engine.config.role == "decode":
        return PullSource(handoff.bootstrap_pull(req.bootstrap))
    if prefiller and not req.remote_decode:
        started = engine.clock.now()
        params, failure = await _call_prefill(request, req, prefiller, headers)
        headers[H_REMOTE_PREFILL_MS] = f"{(engine.clock.now() - started) * 1e3:.4f}"
        if params is None:
            assert failure is not None
            return failure
        return PullSource(handoff.nixl_pull(params), params)
    return PullSource()


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    headers = _headers(engine)
    try:
        req = parse_generate(await request.read(), chat, engine.config.timing)
    except RequestError as exc:
        return error_response(400, str(exc), headers, exc.param)
    config = engine.config
    if config.strict_model and req.model is not None and req.model != config.model:
        return error_response(404, f"The model `{req.model}` does not exist.", headers, "model")
    role = config.role
    failure = _role_error(role, req, request.headers.get(PREFILLER_HEADER), headers)
    if failure is not None:
        return failure
    if req.bootstrap is not None and role == "prefill" and not req.remote_decode:
        return await _bootstrap_prefill(request, engine, req, headers)
    source = await _pull_source(request, engine, req, headers)
    if isinstance(source, web.StreamResponse):
        return source
    pull = source.pull
    request_id = request.headers.get("X-Request-Id") or f"sim-{uuid.uuid4().hex}"
    hold = _hold(engine, req, request_id)
    try:
        seq = engine.submit(
            req.prompt_tokens,
            req.max_tokens,
            req.output_tokens,
            pull,
            prefix=_prompt_blocks(engine, req),
            stops=req.stops,
            hold=hold,
            priority=req.priority,
        )
    except ValueError as exc:
        return error_response(400, str(exc), headers, "max_tokens")
    try:
        await _admitted(request.app[HANDOFF_KEY], seq, source.nixl)
        if isinstance(seq.error, KvLoadError):
            return await _generation_error(request, req, headers)
        if seq.error is not None:
            return error_response(502 if pull else 500, f"request failed: {seq.error}", headers)
        _describe(seq, headers)
        return await _respond(request, engine, seq, req, headers, request_id)
    finally:
        engine.abort(seq)  # no-op unless the client went away or something failed


def _prompt_blocks(engine: Engine, req: GenerateRequest) -> PromptBlocks | None:
    """What the engine's prefix cache keys ``req`` by (``None`` when caching is off or there is no prompt)."""
    timing = engine.config.timing
    content = prompt_content(req.body) if timing.enable_prefix_caching else None
    return PromptBlocks(content, timing.block_size) if content else None


async def _admitted(handoff: Handoff, seq: Sequence, nixl: dict[str, Any] | None) -> None:
    """Wait until ``seq``'s KV cache is in place (or it failed); with ``nixl`` params, heartbeating."""
    if nixl is None:
        await seq.ready.wait()
        return
    async with handoff.heartbeats(nixl):
        await seq.ready.wait()


GENERATION_ERROR = "Internal server error"
"""vLLM 0.32's ``GenerationError`` message: what a request whose KV load failed gets (policy ``fail``)."""


async def _generation_error(
    request: web.Request, req: GenerateRequest, headers: dict[str, str]
) -> web.StreamResponse:
    """What vLLM answers for a request that finished with reason ``error``: HTTP 500 (non-streaming), or
    a 200 stream with that error as its only event, then ``[DONE]``."""
    if not req.stream:
        return error_response(500, GENERATION_ERROR, headers)
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        await resp.write(sse(error_body(GENERATION_ERROR, 500, "InternalServerError")))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
    return resp


async def _bootstrap_prefill(
    request: web.Request, engine: Engine, req: GenerateRequest, headers: dict[str, str]
) -> web.StreamResponse:
    """The prefill request of an SGLang bootstrap room (see :meth:`sim.handoff.Handoff.prefill`)."""
    assert req.bootstrap is not None
    try:
        seq = await request.app[HANDOFF_KEY].prefill(
            req.bootstrap.room, req.prompt_tokens, _prompt_blocks(engine, req)
        )
    except (BootstrapError, EngineError) as exc:
        return error_response(500, f"request failed: {exc}", headers)
    except ValueError as exc:
        return error_response(400, str(exc), headers)
    _describe(seq, headers)
    return await _respond(request, engine, seq, req, headers)


async def _respond(
    request: web.Request,
    engine: Engine,
    seq: Sequence,
    req: GenerateRequest,
    headers: dict[str, str],
    request_id: str = "",
) -> web.StreamResponse:
    """Stream ``seq``, or wait for it and answer the whole completion, with ``kv_transfer_params``
    when it is a NIXL prefill leg whose KV is held for the decode (under ``request_id``)."""
    shaper = Shaper.new(req.chat, seq.request_id, req.model or engine.config.model)
    if req.stream:
        return await _stream(request, engine, seq, req, shaper, headers)
    try:
        await engine.wait_done(seq)
    except EngineError as exc:
        return error_response(500, f"request failed: {exc}", headers)
    body = shaper.full(
        token_text(0, seq.generated), seq.finish_reason, usage(req.prompt_tokens, seq.generated)
    )
    if req.remote_decode and seq.held_block_ids:
        if engine.config.kv.kv_connector == "nixl":
            body["kv_transfer_params"] = _handoff_params(engine, seq, request_id)
        engine.metrics.remote_prefills.inc()
    return web.json_response(body, headers=headers)


def _describe(seq: Sequence, headers: dict[str, str]) -> None:
    t = seq.transfer
    headers[H_KV] = t.kind
    headers[H_KV_MS] = f"{t.model_ms:.4f}"
    if t.remote_prefill_ms is not None:  # the sidecar's own measure of its call, when set, stays
        headers.setdefault(H_REMOTE_PREFILL_MS, f"{t.remote_prefill_ms:.4f}")
    if seq.admitted_at is not None:
        headers[H_QUEUE_MS] = f"{(seq.admitted_at - seq.arrival) * 1e3:.4f}"
    headers[H_CACHED] = str(seq.cached_tokens)
    if t.remote_cached_tokens is not None:
        headers[H_PREFILL_CACHED] = str(t.remote_cached_tokens)
    if seq.warning is not None:
        headers[H_WARNING] = " ".join(seq.warning.split())  # one header line
    if t.prefill_address is None:
        return
    headers[H_PREFILL] = t.prefill_address
    headers[H_PREFILL_GROUP] = t.prefill_group if t.prefill_group is not None else "unknown"
    if t.prefill_group is None:
        headers[H_WARNING] = f"prefill {t.prefill_address} is in no EDS file; treated as cross_group"
    elif t.reported_group is not None and t.reported_group != t.prefill_group:
        headers[H_WARNING] = f"prefill reports group {t.reported_group!r} but EDS says {t.prefill_group!r}"


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


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    if request.app[ENGINE_KEY].scheduler.cache.reset():
        return web.Response(status=200)
    return web.Response(status=409, text="blocks are in use")


async def _lifecycle(app: web.Application) -> Any:
    engine, handoff = app[ENGINE_KEY], app[HANDOFF_KEY]
    handoff.open()
    await engine.start()
    yield
    await engine.stop()
    await handoff.close()


async def _shutdown(app: web.Application) -> None:
    app[HANDOFF_KEY].shutdown()


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving ``engine``.

    The aiohttp application serving ``engine`` (OpenAI API, ``/health``, ``/metrics``,
    ``/reset_prefix_cache`` and the ``/sim/`` handoff endpoints); the engine loop runs while the app runs."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    handoff = app[HANDOFF_KEY] = Handoff(engine)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    handoff.add_routes(app)
    app.on_shutdown.append(_shutdown)
    app.cleanup_ctx.append(_lifecycle)
    return app


async def drop_connections(runner: web.AppRunner) -> None:
    """Stop listening and reset every open connection of ``runner``.

    What a crashed node looks like to its clients (a graceful stop would let in-flight requests finish)."""
    for site in list(runner.sites):
        await site.stop()
    server = runner.server
    for handler in list(server.connections if server is not None else ()):
        if handler.transport is not None:
            handler.transport.abort()


@dataclass
class RunningEngine:
    """A started engine.

    Its :class:`Engine`, HTTP runner and KV-event publisher (``None``: none). ``address`` is
    ``"host:port"``."""

    engine: Engine
    runner: web.AppRunner
    publisher: Publisher | None = None
    _replays: asyncio.Task[None] | None = None

    @property
    def kv_events_port(self) -> int | None:
        """The KV-event PUB socket's port (``None``: the engine publishes none)."""
        return None if self.publisher is None else self.publisher.port

    @property
    def kv_events_replay_port(self) -> int | None:
        """The KV-event replay socket's port (``None``: the engine publishes none, or has no replay)."""
        return None if self.publisher is None else self.publisher.replay_port or None

    async def _close_publisher(self) -> None:
        if self._replays is not None:
            self._replays.cancel()
            await asyncio.gather(self._replays, return_exceptions=True)
        if self.publisher is not None:
            self.publisher.close()

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
        await self._close_publisher()

    async def kill(self) -> None:
        """Die like a crashed node: refuse new connections, reset open ones, fail what is in flight."""
        await drop_connections(self.runner)
        await self.engine.stop()
        await self.runner.cleanup()
        await self._close_publisher()


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
    events = config.kv_events
    if events is None:
        return RunningEngine(engine, runner)
    try:
        publisher = Publisher(
            events.encoding,
            events.replay_port is not None,
            events.hashes,
            config.host,
            events.port,
            events.replay_port or 0,
        )
    except BaseException:
        await runner.cleanup()
        raise
    engine.scheduler.cache.events = lambda batch: publisher.publish(*batch)
    return RunningEngine(engine, runner, publisher, publisher.start())
