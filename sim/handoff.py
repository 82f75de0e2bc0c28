"""The PD handoff protocols between simulated engines, spoken over their HTTP ports under ``/sim/``.

vLLM NixlConnector / vllm-ascend MooncakeConnector ("prefill first", ``kv_transfer_params``): a
prefill engine that ends a ``do_remote_decode`` request at its length cap holds the request's KV
blocks (still counted in its KV usage) until a decode releases them or ``kv_hold_timeout_s`` passes
(:meth:`sim.engine.Engine.release_kv`). A decode given ``do_remote_prefill`` params reads the blocks
(``POST /sim/kv/read``), models the transfer, then releases them (``POST /sim/kv/release``): NIXL's
one-sided read plus its completion notification. Malformed params, blocks not held (unknown,
expired, another engine id) or an unreachable prefill raise :class:`~sim.engine.KvMissing`, so the
decode prefills locally, as vLLM recomputes on a KV load failure.

SGLang bootstrap: a prefill engine's HTTP port is also its bootstrap server. A decode registers
for the request's room once it has admitted the request (``POST /sim/bootstrap/register``, a long
poll answered when the room's prefill has computed the KV); the prefill request waits for that
registration before it is admitted (SGLang's bootstrap queue), holds its KV until the decode
reports the transfer done (``POST /sim/bootstrap/complete``), then answers. Either side gives up
after ``bootstrap_timeout_s``; a room left by one side fails the other at once.

Endpoint bodies are JSON; failures answer a vLLM error body (:func:`sim.protocol.error_response`):

* ``/sim/kv/read``, ``/sim/kv/release``: ``{"engine_id": str, "block_ids": [int]}`` → 200
  ``{"group": <prefill's pdGroupID>}`` when those blocks are held (and, for release, now freed),
  404 when not held, 400 for a malformed body;
* ``/sim/bootstrap/register``: ``{"room": int}`` → 200 ``{"prefill": "host:port", "group": str}``;
  404 on an engine that is not a prefill, 409 when the room has a decode already, 500 when the
  room's prefill failed, 504 when no prefill computed the room's KV in time;
* ``/sim/bootstrap/complete``: ``{"room": int}`` → 200 ``{}``, 404 when no KV of that room waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web

from sim.clock import SimClock
from sim.engine import Engine, EngineError, KvMissing, Pull, Sequence
from sim.kv import TransferResult, host_port
from sim.prefix import PromptBlocks
from sim.protocol import Bootstrap, error_response

log = logging.getLogger(__name__)

KV_READ, KV_RELEASE = "/sim/kv/read", "/sim/kv/release"
BOOTSTRAP_REGISTER, BOOTSTRAP_COMPLETE = "/sim/bootstrap/register", "/sim/bootstrap/complete"
PREFILL_MS_PARAM = "sim_prefill_ms"
"""Extra ``kv_transfer_params`` field (as vllm-ascend adds its own): the model ms the prefill request took
in the prefill engine, which the decode reports as ``x-sim-remote-prefill-ms``."""
PREFILL_CACHED_PARAM = "sim_prefill_cached_tokens"
"""Extra ``kv_transfer_params`` field: the prompt tokens the prefill found in its prefix cache, which the
decode reports as ``x-sim-prefill-cached-tokens``."""


class BootstrapError(RuntimeError):
    """A bootstrap rendezvous failed; the message says why."""


class BootstrapTimeout(BootstrapError):
    """The other side of a bootstrap rendezvous did not come within ``bootstrap_timeout_s``."""


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """Where a decode reads its KV cache from: a prefill's ``address``, engine id and block ids."""

    address: str
    engine_id: str
    block_ids: list[int]

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemoteKv:
        """Validate ``do_remote_prefill`` params as vLLM's connectors do; ``ValueError`` names the bad one."""
        host, port = params.get("remote_host"), params.get("remote_port")
        engine_id, block_ids = params.get("remote_engine_id"), params.get("remote_block_ids")
        if not isinstance(host, str) or not host:
            raise ValueError("remote_host is not a non-empty string")
        if type(port) is not int:
            raise ValueError("remote_port is not an integer")
        if not isinstance(block_ids, list) or not all(type(b) is int for b in block_ids):
            raise ValueError("remote_block_ids is not a list of integers")
        if not isinstance(engine_id, str):
            raise ValueError("remote_engine_id is not a string")
        return cls(host_port(host, port), engine_id, block_ids)


@dataclass(eq=False)
class Room:
    """One bootstrap room on a prefill engine: the rendezvous of a prefill request and its decode.

    ``registered`` is set once a decode registered, ``computed`` once the prefill's KV is ready,
    ``pulled`` once the decode's transfer completed; :meth:`fail` sets all three and ``failure``.
    """

    has_prefill: bool = False
    has_decode: bool = False
    failure: str | None = None
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    computed: asyncio.Event = field(default_factory=asyncio.Event)
    pulled: asyncio.Event = field(default_factory=asyncio.Event)

    def fail(self, reason: str) -> None:
        """End the rendezvous; every waiter wakes and raises ``reason`` (the first reason wins)."""
        if self.failure is None:
            self.failure = reason
        for event in (self.registered, self.computed, self.pulled):
            event.set()

    async def wait(self, event: asyncio.Event, clock: SimClock, timeout_s: float, what: str) -> None:
        """Wait up to ``timeout_s`` model seconds for ``event``; raise :class:`BootstrapTimeout`
        ("``what`` within ... s") after, or :class:`BootstrapError` if the room failed."""
        try:
            await clock.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            raise BootstrapTimeout(f"{what} within {timeout_s:g} model s") from None
        if self.failure is not None:
            raise BootstrapError(self.failure)


def _reason(data: Any) -> str:
    """The message of a vLLM error body, else the body itself."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))
    return repr(data)


class Handoff:
    """One engine's side of both protocols: its ``/sim/`` endpoints, the KV pulls its requests make
    (:meth:`nixl_pull`, :meth:`bootstrap_pull`), the prefill side of a bootstrap room
    (:meth:`prefill`), and the HTTP client session it (and the llm-d sidecar call) use.

    :meth:`open` before serving, :meth:`shutdown` when the server stops accepting, :meth:`close` last.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.session: aiohttp.ClientSession | None = None
        self._rooms: dict[int, Room] = {}
        engine.metrics.add_gauge(
            "sim:bootstrap_rooms",
            "Bootstrap rooms with a prefill or decode request waiting.",
            lambda: len(self._rooms),
        )

    def add_routes(self, app: web.Application) -> None:
        """Register the ``/sim/`` endpoints on ``app``."""
        app.router.add_post(KV_READ, self._kv_read)
        app.router.add_post(KV_RELEASE, self._kv_release)
        app.router.add_post(BOOTSTRAP_REGISTER, self._bootstrap_register)
        app.router.add_post(BOOTSTRAP_COMPLETE, self._bootstrap_complete)

    def open(self) -> None:
        """Create the client session (total timeout ``prefill_timeout_s`` wall seconds per call)."""
        timeout = aiohttp.ClientTimeout(total=self.engine.config.prefill_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    def shutdown(self) -> None:
        """Fail every open bootstrap room: no peer can reach this engine any more."""
        for room in self._rooms.values():
            room.fail(f"engine {self.engine.address} is shutting down")

    async def close(self) -> None:
        """Close the client session."""
        if self.session is not None:
            await self.session.close()

    # --- decode side: pulls ---------------------------------------------------------------------

    def nixl_pull(self, params: dict[str, Any]) -> Pull:
        """The pull of a ``do_remote_prefill`` request: validate ``params``, read the blocks from the
        prefill, model the transfer of the tokens the decode lacks, release the blocks. Raises
        :class:`KvMissing` (local prefill) when the params are malformed or the blocks unreadable."""

        async def pull(tokens: int) -> TransferResult:
            try:
                remote = RemoteKv.parse(params)
            except ValueError as exc:
                raise KvMissing(f"malformed kv_transfer_params: {exc}") from None
            body = {"engine_id": remote.engine_id, "block_ids": remote.block_ids}
            try:
                status, data = await self._post(remote.address, KV_READ, body)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                raise KvMissing(f"prefill {remote.address} unreachable: {exc!r}") from None
            if status != 200:
                raise KvMissing(f"prefill {remote.address}: {_reason(data)}")
            result = await self.engine.kv.pull(remote.address, tokens)
            await self._notify(remote.address, KV_RELEASE, body)
            prefill_ms, cached = params.get(PREFILL_MS_PARAM), params.get(PREFILL_CACHED_PARAM)
            known = isinstance(prefill_ms, int | float) and not isinstance(prefill_ms, bool)
            return replace(
                result,
                reported_group=data.get("group"),
                remote_prefill_ms=prefill_ms if known else None,
                remote_cached_tokens=cached if type(cached) is int else None,
            )

        return pull

    def bootstrap_pull(self, bootstrap: Bootstrap) -> Pull:
        """The pull of a decode request with SGLang bootstrap fields: register for the room at the
        bootstrap server and wait (up to ``bootstrap_timeout_s``) until the prefill computed the KV,
        model the transfer of the tokens the decode lacks, report it done. Raises :class:`EngineError`
        (the request fails) when the server is unreachable, the room fails or times out."""

        async def pull(tokens: int) -> TransferResult:
            server = host_port(bootstrap.host, bootstrap.port)
            timeout_s = self.engine.config.kv.bootstrap_timeout_s
            room = {"room": bootstrap.room}
            started = self.engine.clock.now()
            try:
                register = self._post(server, BOOTSTRAP_REGISTER, room, aiohttp.ClientTimeout())
                status, data = await self.engine.clock.wait_for(register, timeout_s)
            except TimeoutError:
                raise EngineError(
                    f"bootstrap room {bootstrap.room}: no KV from {server} within {timeout_s:g} model s"
                ) from None
            except (aiohttp.ClientError, ValueError) as exc:
                raise EngineError(f"bootstrap server {server} unreachable: {exc!r}") from None
            if status != 200:
                raise EngineError(f"bootstrap server {server}: {_reason(data)}")
            waited_ms = (self.engine.clock.now() - started) * 1e3  # the prefill, from this decode's view
            result = await self.engine.kv.pull(data["prefill"], tokens)
            await self._notify(server, BOOTSTRAP_COMPLETE, room)
            return replace(result, reported_group=data["group"], remote_prefill_ms=waited_ms)

        return pull

    async def _post(
        self, address: str, path: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout | None = None
    ) -> tuple[int, Any]:
        session = self.session
        assert session is not None
        async with session.post(
            f"http://{address}{path}", json=body, timeout=timeout or session.timeout
        ) as resp:
            return resp.status, await resp.json(content_type=None)

    async def _notify(self, address: str, path: str, body: dict[str, Any]) -> None:
        """Tell a prefill its KV was pulled; a failure is only logged (the prefill times the KV out)."""
        try:
            status, data = await self._post(address, path, body)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.warning("engine %s: %s on %s failed: %r", self.engine.address, path, address, exc)
            return
        if status != 200:
            log.warning("engine %s: %s on %s: %s", self.engine.address, path, address, _reason(data))

    # --- prefill side -----------------------------------------------------------------------------

    async def prefill(self, room_id: int, prompt_tokens: int, prefix: PromptBlocks | None = None) -> Sequence:
        """Serve the prefill request of bootstrap room ``room_id``: wait for its decode to register,
        prefill ``prompt_tokens`` tokens (one output token; ``prefix`` keys its prefix cache, see
        :meth:`sim.engine.Engine.submit`), hold the KV until the decode pulled it,
        free it. Returns the finished sequence; raises :class:`BootstrapError`, :class:`EngineError`,
        or ``ValueError`` when the prompt can never fit this engine's KV cache."""
        engine, timeout_s = self.engine, self.engine.config.kv.bootstrap_timeout_s
        async with self._prefill_room(room_id) as room:
            await room.wait(
                room.registered, engine.clock, timeout_s, f"no decode registered for bootstrap room {room_id}"
            )
            seq = engine.submit(prompt_tokens, 1, 1, prefix=prefix, hold_kv=True)
            try:
                await engine.wait_done(seq)
                room.computed.set()
                what = f"the decode of bootstrap room {room_id} did not pull the KV"
                await room.wait(room.pulled, engine.clock, timeout_s, what)
                engine.metrics.remote_prefills.inc()
            finally:
                engine.release_kv(seq)
                engine.abort(seq)
        return seq

    @contextlib.asynccontextmanager
    async def _prefill_room(self, room_id: int) -> AsyncIterator[Room]:
        room = self._room(room_id)
        if room.has_prefill:
            raise BootstrapError(f"bootstrap room {room_id} already has a prefill request")
        room.has_prefill = True
        try:
            yield room
        finally:
            if not room.computed.is_set():
                room.fail(f"the prefill request of bootstrap room {room_id} failed")
            self._drop(room_id, room)

    def _room(self, room_id: int) -> Room:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = Room()
        return room

    def _drop(self, room_id: int, room: Room) -> None:
        if self._rooms.get(room_id) is room:
            del self._rooms[room_id]

    # --- endpoints --------------------------------------------------------------------------------

    async def _kv_read(self, request: web.Request) -> web.Response:
        return await self._kv(request, release=False)

    async def _kv_release(self, request: web.Request) -> web.Response:
        return await self._kv(request, release=True)

    async def _kv(self, request: web.Request, release: bool) -> web.Response:
        engine = self.engine
        try:
            body = await request.json()
            engine_id, block_ids = body["engine_id"], body["block_ids"]
            seq = engine.held(engine_id, block_ids)
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"bad KV request: {exc!r}")
        if seq is None:
            if engine_id != engine.engine_id:
                return error_response(404, f"engine id {engine_id!r} is not {engine.address}'s")
            return error_response(404, f"{engine.address} holds no such KV blocks (unknown, expired, freed)")
        if release:
            engine.release_kv(seq)
        return web.json_response({"group": engine.config.group})

    async def _room_id(self, request: web.Request) -> int:
        """The ``room`` of a bootstrap request's body; ``ValueError`` if there is none."""
        body = await request.json()
        room_id = body.get("room") if isinstance(body, dict) else None
        if type(room_id) is not int:
            raise ValueError("the body needs an integer 'room'")
        return room_id

    async def _bootstrap_register(self, request: web.Request) -> web.Response:
        engine = self.engine
        if engine.config.role != "prefill":
            role = engine.config.role
            return error_response(404, f"{engine.address} is a {role} engine, without a bootstrap server")
        try:
            room_id = await self._room_id(request)
        except ValueError as exc:
            return error_response(400, str(exc))
        room = self._room(room_id)
        if room.has_decode:
            return error_response(409, f"bootstrap room {room_id} already has a decode")
        room.has_decode = True
        room.registered.set()
        what = f"no prefill request computed the KV of bootstrap room {room_id}"
        try:
            await room.wait(room.computed, engine.clock, engine.config.kv.bootstrap_timeout_s, what)
        except BootstrapError as exc:
            room.fail(f"the decode of bootstrap room {room_id} gave up: {exc}")
            if not room.has_prefill:
                self._drop(room_id, room)
            return error_response(504 if isinstance(exc, BootstrapTimeout) else 500, str(exc))
        return web.json_response({"prefill": engine.address, "group": engine.config.group})

    async def _bootstrap_complete(self, request: web.Request) -> web.Response:
        try:
            room_id = await self._room_id(request)
        except ValueError as exc:
            return error_response(400, str(exc))
        room = self._rooms.get(room_id)
        if room is None or not room.computed.is_set() or room.failure is not None:
            return error_response(404, f"no KV of bootstrap room {room_id} is waiting for its decode")
        room.pulled.set()
        return web.json_response({})
