"""The shared state's bus over a NATS server (``nats-py``): connect, reconnect, publish, subscribe.

The connection keeps trying: the first connection every ``retry_seconds`` (doubling to 5 s) until the
server answers, then ``nats-py``'s own reconnection, forever. Publishes never wait: they go to an outbox
that one task writes out; a publish while disconnected is not buffered (the runner counts it dropped and
sends the whole state again once connected). The connection state is reported to ``state`` (a callback
taking ``"connecting"``, ``"connected"`` or ``"disconnected"``), the first failure of each outage logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from ext_proc.shared.config import NatsConfig
from ext_proc.shared.runner import Handler

log = logging.getLogger(__name__)

STATUS_HEADER = "Status"
"""The header of the server's status messages (peers send no headers)."""
RECONNECT_SECONDS = 0.5
MAX_RETRY_SECONDS = 5.0


class NatsBus:
    """One replica's connection to the NATS server of ``config`` (module docstring)."""

    def __init__(self, config: NatsConfig, name: str, state: Callable[[str], None]) -> None:
        self._config = config
        self._name = name
        self._state = state
        self._client: Client | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._outbox: list[tuple[str, bytes, str]] = []
        self._subscriptions: dict[str, Handler] = {}
        self._on_connect: Callable[[], None] = lambda: None

    @property
    def connected(self) -> bool:
        client = self._client
        return client is not None and client.is_connected

    async def start(self, subscriptions: dict[str, Handler], connected: Callable[[], None]) -> None:
        """Connect (one try now, then in the background until it works) and subscribe."""
        self._subscriptions = dict(subscriptions)
        self._on_connect = connected
        self._state("connecting")
        if not await self._try_connect(first=True):
            self._connecting = asyncio.get_running_loop().create_task(self._keep_connecting())

    async def _keep_connecting(self) -> None:
        wait = RECONNECT_SECONDS
        while not await self._try_connect(first=False):
            await asyncio.sleep(wait)
            wait = min(2 * wait, MAX_RETRY_SECONDS)

    async def _try_connect(self, first: bool) -> bool:
        config = self._config
        try:
            client = await nats.connect(
                servers=[u.strip() for u in config.url.split(",") if u.strip()],
                name=self._name,
                no_echo=True,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=RECONNECT_SECONDS,  # type: ignore[arg-type]
                connect_timeout=2,
                token=config.token or None,
                user_credentials=config.creds_file or None,
                tls=_tls_context(config),
                pending_size=0,
                error_cb=self._error,
                disconnected_cb=self._disconnected,
                reconnected_cb=self._reconnected,
            )
        except Exception as exc:  # every way a first connection fails: refused, auth, TLS, timeout
            if first:
                log.warning(
                    "shared state: cannot reach NATS at %s (%s): routing on this replica's own bookings; "
                    "trying again in the background",
                    _safe(config.url),
                    exc or type(exc).__name__,
                )
            return False
        for subject, handler in self._subscriptions.items():
            await client.subscribe(subject, cb=_callback(handler))
        self._client = client
        log.info(
            "shared state: connected to NATS at %s",
            _safe(client.connected_url.geturl() if client.connected_url else config.url),
        )
        self._state("connected")
        self._on_connect()
        return True

    def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        self._outbox.append((subject, payload, reply))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        while self._outbox:
            subject, payload, reply = self._outbox.pop(0)
            client = self._client
            if client is None:
                continue
            try:
                await client.publish(subject, payload, reply=reply)
            except Exception as exc:  # disconnected meanwhile, or too large for the server
                log.debug("shared state: a publish on %s failed: %s", subject, exc)

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.flush(timeout=1)
            with contextlib.suppress(Exception):
                await client.close()
        self._state("disconnected")

    async def _error(self, exc: Exception) -> None:
        log.debug("shared state: NATS: %s", exc)

    async def _disconnected(self) -> None:
        if self._client is not None:
            log.warning("shared state: disconnected from NATS: routing on what is known; reconnecting")
            self._state("disconnected")

    async def _reconnected(self) -> None:
        log.info("shared state: reconnected to NATS")
        self._state("connected")
        self._on_connect()


def _callback(handler: Handler) -> Callable[[Msg], object]:
    async def deliver(msg: Msg) -> None:
        if msg.headers and STATUS_HEADER in msg.headers:
            return  # the server's word, not a peer's: "503 no responders" to a sync request nobody heard
        handler(msg.data, msg.reply)

    return deliver


def _tls_context(config: NatsConfig) -> ssl.SSLContext | None:
    tls = config.tls
    if not (tls.ca or tls.cert or any(u.strip().startswith("tls://") for u in config.url.split(","))):
        return None
    context = ssl.create_default_context(cafile=tls.ca or None)
    if tls.cert:
        context.load_cert_chain(tls.cert, tls.key)
    return context


def _safe(url: str) -> str:
    """``url`` without its password or token (for the log)."""
    parts = []
    for one in url.split(","):
        scheme, sep, rest = one.strip().partition("://")
        parts.append(f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else one)
    return ",".join(parts)
