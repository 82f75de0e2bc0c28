"""The PD handoff protocols between simulated engines, spoken over their HTTP ports under ``/sim/``.

vLLM NixlConnector / vllm-ascend MooncakeConnector ("prefill first", ``kv_transfer_params``; vLLM 0.32
``nixl/pull_scheduler.py``): a prefill engine that ends a ``do_remote_decode`` request (at its length
cap or on a stop: both hand off) holds the request's KV blocks (still counted in its KV usage) under
its ``remote_request_id`` for a ``kv_lease_s`` lease, which each heartbeat of the waiting decode
(``POST /sim/kv/heartbeat``, every lease/6) extends to 2/3 of a lease from then, until a decode
releases them (:meth:`sim.engine.Engine.release_kv`). A decode given ``do_remote_prefill`` params
reads the blocks (``POST /sim/kv/read``), models the transfer, then releases them (``POST
/sim/kv/release``): NIXL's one-sided read plus its completion notification.

vLLM's upstream MooncakeConnector (concurrent; vLLM 0.32 ``mooncake/mooncake_connector.py``): a
prefill engine's HTTP port is also its bootstrap server (``GET /query``: ``{"0": {"engine_id",
"worker_addr"}}``); it holds a ``do_remote_decode`` request's KV under its ``transfer_id`` for
``mooncake_abort_timeout_s`` when it ends at its length cap (a stop hands nothing off), and answers
without ``kv_transfer_params``. A decode given ``{do_remote_prefill, transfer_id,
remote_bootstrap_addr, remote_engine_id}`` queries the bootstrap server, checks the engine id, waits
for the transfer's KV (``POST /sim/mooncake/pull``, up to ``mooncake_abort_timeout_s``), models the
transfer and releases the blocks.

Malformed params raise :class:`~sim.engine.KvMissing` (the decode prefills locally, as vLLM ignores
invalid params); blocks not held (unknown, expired, another engine id) or an unreachable prefill raise
:class:`~sim.engine.KvLoadFailed`: the decode's ``kv_load_failure_policy`` decides (``fail``: the
request fails; ``recompute``: local prefill).

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
* ``/sim/kv/heartbeat``: ``{"engine_id": str, "request_ids": [str]}`` → 200 ``{"renewed": n}``;
* ``GET /query`` (prefill or both): the Mooncake bootstrap server's engine map; 404 on a decode;
* ``/sim/mooncake/pull``: ``{"engine_id": str, "transfer_id": str}`` → 200 ``{"group": str,
  "block_ids": [int]}`` once the transfer's KV is held, 404 when it is not within
  ``mooncake_abort_timeout_s`` or the engine id is not this engine's;
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
from sim.engine import Engine, EngineError, Hold, KvLoadFailed, KvMissing, Pull, Sequence
from sim.kv import TransferResult, host_port
from sim.prefix import PromptBlocks
from sim.protocol import Bootstrap, error_response

log = logging.getLogger(__name__)

KV_READ, KV_RELEASE, KV_HEARTBEAT = "/sim/kv/read", "/sim/kv/release", "/sim/kv/heartbeat"
MOONCAKE_QUERY, MOONCAKE_PULL = "/query", "/sim/mooncake/pull"
BOOTSTRAP_REGISTER, BOOTSTRAP_COMPLETE = "/sim/bootstrap/register", "/sim/bootstrap/complete"
PREFILL_CACHED_PARAM = "sim_prefill_cached_tokens"
"""Extra ``kv_transfer_params`` field (and field of a Mooncake pull's answer): the prompt tokens the
prefill found in its prefix cache, which the decode reports as ``x-sim-prefill-cached-tokens``."""
PREFILL_MS_PARAM = "sim_prefill_ms"
"""Extra ``kv_transfer_params`` field (as vllm-ascend adds its own): the model ms the prefill request took
in the prefill engine, which the decode reports as ``x-sim-remote-prefill-ms``."""


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
        """Validate NIXL ``do_remote_prefill`` params as vLLM's connector does.

        ``ValueError`` names the bad one. ``remote_block_ids`` is a list per KV cache group (vLLM 0.32:
        ``[[1, 2]]``); a flat list of integers (earlier vLLM) is one group."""
        host, port = params.get("remote_host"), params.get("remote_port")
        engine_id, block_ids = params.get("remote_engine_id"), params.get("remote_block_ids")
        if not isinstance(host, str) or not host:
            raise ValueError("remote_host is not a non-empty string")
        if type(port) is not int:
            raise ValueError("remote_port is not an integer")
        per_group = isinstance(block_ids, list) and all(isinstance(g, list) for g in block_ids)
        groups = block_ids if per_group else [block_ids]
        if not block_ids or not all(isinstance(g, list) and all(type(b) is int for b in g) for g in groups):
            raise ValueError("remote_block_ids is not a list (per KV cache group) of lists of integers")
        if not isinstance(engine_id, str):
            raise ValueError("remote_engine_id is not a string")
        return cls(host_port(host, port), engine_id, [b for group in groups for b in group])


@dataclass(frozen=True, slots=True)
class MooncakeRemote:
    """Where a Mooncake decode pulls from.

    The prefill's bootstrap ``address`` (``host:port``), its engine id and the request's ``transfer_id``."""

    address: str
    engine_id: str
    transfer_id: str

    @classmethod
    def parse(cls, params: dict[str, Any]) -> MooncakeRemote:
        """Validate Mooncake ``do_remote_prefill`` params.

        Validate Mooncake ``do_remote_prefill`` params (``transfer_id``, ``remote_engine_id``,
        ``remote_bootstrap_addr`` as ``http://host:port``); ``ValueError`` names the bad one."""
        for name in ("transfer_id", "remote_engine_id", "remote_bootstrap_addr"):
            if not isinstance(params.get(name), str) or not params[name]:
                raise ValueError(f"{name} is not a non-empty string")
        url = params["remote_bootstrap_addr"]
        if not url.startswith("http://") or "/" in url[len("http://") :]:
            raise ValueError("remote_bootstrap_addr is not http://host:port")
        return cls(url[len("http://") :], params["remote_engine_id"], params["transfer_id"])


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
        """Wait up to ``timeout_s`` model seconds for ``event``.

        Raise :class:`BootstrapTimeout` ("``what`` within ... s") after, or :class:`BootstrapError` if the
        room failed."""
        try:
            await clock.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            raise BootstrapTimeout(f"{what} within {timeout_s:g} model s") from None
        if self.failure is not None:
            raise BootstrapError(self.failure)


def _prefill_ms(data: dict[str, Any]) -> float | None:
    """The prefill's own time (:data:`PREFILL_MS_PARAM`) in ``data``, if it reported one."""
    prefill_ms = data.get(PREFILL_MS_PARAM)
    known = isinstance(prefill_ms, int | float) and not isinstance(prefill_ms, bool)
    return prefill_ms if known else None


def _prefill_cached(data: dict[str, Any]) -> int | None:
    """The prefill's prefix-cache hit (:data:`PREFILL_CACHED_PARAM`) in ``data``, if it reported one."""
    cached = data.get(PREFILL_CACHED_PARAM)
    return cached if type(cached) is int else None


def _reason(data: Any) -> str:
    """The message of a vLLM error body, else the body itself."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))
    return repr(data)


class Handoff:
    """One engine's side of both protocols.

    Its ``/sim/`` endpoints, the KV pulls its requests make (:meth:`nixl_pull`, :meth:`bootstrap_pull`), the
    prefill side of a bootstrap room (:meth:`prefill`), and the HTTP client session it (and the llm-d sidecar
    call) use.

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
        app.router.add_post(KV_HEARTBEAT, self._kv_heartbeat)
        app.router.add_get(MOONCAKE_QUERY, self._mooncake_query)
        app.router.add_post(MOONCAKE_PULL, self._mooncake_pull)
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
        """The pull of a ``do_remote_prefill`` request.

        Validate ``params``, read the blocks from the prefill, model the transfer of the tokens the decode
        lacks, release the blocks. Raises :class:`KvMissing` when the params are malformed,
        :class:`KvLoadFailed` when the blocks are unreadable."""

        async def pull(tokens: int) -> TransferResult:
            try:
                remote = RemoteKv.parse(params)
            except ValueError as exc:
                raise KvMissing(f"malformed kv_transfer_params: {exc}") from None
            body = {"engine_id": remote.engine_id, "block_ids": remote.block_ids}
            try:
                status, data = await self._post(remote.address, KV_READ, body)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                raise KvLoadFailed(f"prefill {remote.address} unreachable: {exc!r}") from None
            if status != 200:
                raise KvLoadFailed(f"prefill {remote.address}: {_reason(data)}")
            result = await self.engine.kv.pull(remote.address, tokens)
            await self._notify(remote.address, KV_RELEASE, body)
            return replace(
                result,
                reported_group=data.get("group"),
                remote_prefill_ms=_prefill_ms(params),
                remote_cached_tokens=_prefill_cached(params),
            )

        return pull

    @contextlib.asynccontextmanager
    async def heartbeats(self, params: dict[str, Any]) -> AsyncIterator[None]:
        """Renew the prefill's lease on its KV while the body runs.

        While the body runs (a NIXL decode request waiting for its pull), renew the prefill's lease
        on its KV every ``kv_lease_s / 6`` model seconds (vLLM 0.32 ``_heartbeat_interval``); params
        without ``remote_request_id`` or a valid remote get none, as in vLLM."""
        request_id = params.get("remote_request_id")
        try:
            remote = RemoteKv.parse(params)
        except ValueError:
            remote = None
        if remote is None or not isinstance(request_id, str):
            yield
            return
        body = {"engine_id": remote.engine_id, "request_ids": [request_id]}
        interval, address = self.engine.config.kv.kv_lease_s / 6, remote.address

        async def beat() -> None:
            while True:
                await self.engine.clock.sleep(interval)
                await self._notify(address, KV_HEARTBEAT, body)

        task = asyncio.get_running_loop().create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def mooncake_pull(self, params: dict[str, Any]) -> Pull:
        """The pull of a Mooncake ``do_remote_prefill`` request.

        Validate ``params``, query the prefill's bootstrap server for the engine id, wait for the
        transfer's KV, model the transfer of the tokens the decode lacks, release the blocks. Raises
        :class:`KvMissing` (malformed params) or :class:`KvLoadFailed` (engine id unknown there, prefill
        unreachable, no KV in time)."""

        async def pull(tokens: int) -> TransferResult:
            try:
                remote = MooncakeRemote.parse(params)
            except ValueError as exc:
                raise KvMissing(f"malformed kv_transfer_params: {exc}") from None
            address, abort_s = remote.address, self.engine.config.kv.mooncake_abort_timeout_s
            try:
                status, engines = await self._request("GET", address, MOONCAKE_QUERY, None)
                known = (
                    status == 200
                    and isinstance(engines, dict)
                    and any(
                        isinstance(e, dict) and e.get("engine_id") == remote.engine_id
                        for e in engines.values()
                    )
                )
                if not known:
                    raise KvLoadFailed(
                        f"remote engine_id {remote.engine_id} not found from bootstrap server {address}"
                    )
                body = {"engine_id": remote.engine_id, "transfer_id": remote.transfer_id}
                wait = self._request("POST", address, MOONCAKE_PULL, body, aiohttp.ClientTimeout())
                status, data = await self.engine.clock.wait_for(wait, abort_s + 60)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                raise KvLoadFailed(f"prefill {address} unreachable: {exc!r}") from None
            if status != 200:
                raise KvLoadFailed(f"prefill {address}: {_reason(data)}")
            result = await self.engine.kv.pull(address, tokens)
            release = {"engine_id": remote.engine_id, "block_ids": data["block_ids"]}
            await self._notify(address, KV_RELEASE, release)
            return replace(
                result,
                reported_group=data.get("group"),
                remote_prefill_ms=_prefill_ms(data),
                remote_cached_tokens=_prefill_cached(data),
            )

        return pull

    def bootstrap_pull(self, bootstrap: Bootstrap) -> Pull:
        """The pull of a decode request with SGLang bootstrap fields.

        Register for the room at the bootstrap server and wait (up to ``bootstrap_timeout_s``) until the
        prefill computed the KV, model the transfer of the tokens the decode lacks, report it done. Raises
        :class:`EngineError` (the request fails) when the server is unreachable, the room fails or times
        out."""

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
        return await self._request("POST", address, path, body, timeout)

    async def _request(
        self,
        method: str,
        address: str,
        path: str,
        body: dict[str, Any] | None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> tuple[int, Any]:
        session = self.session
        assert session is not None
        async with session.request(
            method, f"http://{address}{path}", json=body, timeout=timeout or session.timeout
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
        """Serve the prefill request of bootstrap room ``room_id``.

        Wait for its decode to register, prefill ``prompt_tokens`` tokens (one output token; ``prefix``
        keys the prefix cache, see :meth:`sim.engine.Engine.submit`), hold the KV until the decode pulled
        it, free it. Returns the finished sequence; raises :class:`BootstrapError`, :class:`EngineError`,
        or ``ValueError`` when the prompt can never fit this engine's KV cache."""
        engine, timeout_s = self.engine, self.engine.config.kv.bootstrap_timeout_s
        async with self._prefill_room(room_id) as room:
            await room.wait(
                room.registered, engine.clock, timeout_s, f"no decode registered for bootstrap room {room_id}"
            )
            seq = engine.submit(prompt_tokens, 1, 1, prefix=prefix, hold=Hold(f"room-{room_id}", timeout_s))
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

    async def _kv_heartbeat(self, request: web.Request) -> web.Response:
        """Extend the lease of each held request to 2/3 of a lease from now (vLLM 0.32
        ``_lease_extension``)."""
        engine = self.engine
        try:
            body = await request.json()
            engine_id, request_ids = body["engine_id"], body["request_ids"]
            keys = [key for key in request_ids if isinstance(key, str)]
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"bad heartbeat: {exc!r}")
        if engine_id != engine.engine_id:
            return error_response(404, f"engine id {engine_id!r} is not {engine.address}'s")
        extension = engine.config.kv.kv_lease_s * 2 / 3
        return web.json_response({"renewed": sum(engine.renew(key, extension) for key in keys)})

    async def _mooncake_query(self, request: web.Request) -> web.Response:
        engine = self.engine
        if engine.config.role == "decode":
            return error_response(404, f"{engine.address} is a decode engine, without a bootstrap server")
        worker = {"0": {"0": engine.address}}
        return web.json_response({"0": {"engine_id": engine.engine_id, "worker_addr": worker}})

    async def _mooncake_pull(self, request: web.Request) -> web.Response:
        engine = self.engine
        try:
            body = await request.json()
            engine_id, transfer_id = body["engine_id"], body["transfer_id"]
            if not isinstance(transfer_id, str):
                raise TypeError("transfer_id is not a string")
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"bad pull: {exc!r}")
        if engine_id != engine.engine_id:
            return error_response(404, f"engine id {engine_id!r} is not {engine.address}'s")
        seq = await engine.wait_held(transfer_id, engine.config.kv.mooncake_abort_timeout_s)
        if seq is None:
            return error_response(404, f"{engine.address} holds no KV of transfer {transfer_id!r}")
        took_ms = ((seq.finished_at or engine.clock.now()) - seq.arrival) * 1e3
        held = {
            "group": engine.config.group,
            "block_ids": list(seq.held_block_ids),
            PREFILL_MS_PARAM: took_ms,
            PREFILL_CACHED_PARAM: seq.cached_tokens,
        }
        return web.json_response(held)

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
