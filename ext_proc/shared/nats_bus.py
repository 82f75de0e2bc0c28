"""The shared state's bus over a NATS server (``nats-py``): connect, reconnect, publish, subscribe.

One connection at a time, each made here: :meth:`NatsBus.start` starts the tries and waits for the first
one to end, :data:`START_WAIT_SECONDS` at most (a server that is down, refuses the credentials or does not
answer never holds up the replica's start); the tries go on, :data:`RETRY_SECONDS` apart and doubling to
:data:`MAX_RETRY_SECONDS`, until one connects. A connection that drops, or whose server stops answering
its pings (:data:`PING_SECONDS`, :data:`MAX_OUTSTANDING_PINGS`: a hung or cut-off server is noticed
within about 4 s), is closed and the tries begin again. ``nats-py``'s own reconnection is off: it
would retry a first connection forever inside ``connect``. Each connection subscribes anew and calls
``connected`` (the runner sends its whole state and asks its peers for theirs).

Publishes never wait: they go to an outbox that one task writes out; a publish while disconnected is not
buffered (the runner counts it dropped and sends the whole state again once connected). What the client
refuses to send (a message over the server's ``max_payload``: ``publish_error``; the connection lost
meanwhile: ``disconnected``) and what it throws away unread (messages arriving faster than they are
handled, beyond :data:`PENDING_MESSAGES` waiting: ``slow_consumer``) is reported to ``dropped`` (the
replica's :meth:`~ext_proc.shared.replica.ReplicaState.drop`: counted, logged once per cause). The connection
state is reported to ``state`` (a callback taking ``"connecting"``, ``"connected"`` or
``"disconnected"``). The log says when an outage begins (``cannot reach NATS`` at the start,
``disconnected from NATS``) and ends (``connected to NATS``, ``reconnected to NATS``), and each new
reason a try failed for meanwhile (a refused password, a server that does not answer), once; never a
password or token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoServersError, SlowConsumerError

from ext_proc.shared.config import NatsConfig, redacted
from ext_proc.shared.runner import Handler

log = logging.getLogger(__name__)

STATUS_HEADER = "Status"
"""The header of the server's status messages (peers send no headers)."""
START_WAIT_SECONDS = 2.0
"""How long :meth:`NatsBus.start` waits for the first try to end (the replica serves without NATS after)."""
CONNECT_TIMEOUT_SECONDS = 2.0
"""How long one try waits for the server's TCP handshake, then for its greeting."""
RETRY_SECONDS = 0.5
"""The wait before the first retry; it doubles after each failed try, to :data:`MAX_RETRY_SECONDS`."""
MAX_RETRY_SECONDS = 4.0
PING_SECONDS = 1.0
"""How often the client pings the server; :data:`MAX_OUTSTANDING_PINGS` unanswered end the connection."""
MAX_OUTSTANDING_PINGS = 3
PENDING_MESSAGES = 65_536
"""Messages of one subscription waiting to be handled at most; more are thrown away (``slow_consumer``)."""


Dropped = Callable[[str, str], None]
"""Where a bus reports a message it could not send or had to throw away: its reason, what happened."""


class NatsBus:
    """One replica's connection to the NATS server of ``config`` (module docstring)."""

    def __init__(self, config: NatsConfig, name: str, state: Callable[[str], None], dropped: Dropped) -> None:
        self._config = config
        self._name = name
        self._state = state
        self._dropped = dropped
        self._client: Client | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._outbox: list[tuple[str, bytes, str]] = []
        self._subscriptions: dict[str, Handler] = {}
        self._on_connect: Callable[[], None] = lambda: None
        self._ever_connected = False
        self._failure = ""
        """Why the last try failed (``""``: none since the last connection); logged when it changes."""
        self._last_error = ""
        """The last error ``nats-py`` reported (a try that reached no server says only that)."""
        self._closing = False
        self._tried = asyncio.Event()
        """Set once the first try is over, whatever its outcome."""

    @property
    def connected(self) -> bool:
        """Whether the client is connected now (a publish then reaches the server)."""
        client = self._client
        return client is not None and client.is_connected

    async def start(self, subscriptions: dict[str, Handler], connected: Callable[[], None]) -> None:
        """Start connecting and wait for the first try to end.

        Connecting is as the module docstring says; the wait is :data:`START_WAIT_SECONDS` at most.
        ``subscriptions`` are made at each connection, ``connected`` called after them."""
        self._subscriptions = dict(subscriptions)
        self._on_connect = connected
        self._state("connecting")
        self._reconnect()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._tried.wait(), START_WAIT_SECONDS)

    def _reconnect(self) -> None:
        """Start the tries, unless they run already or the bus is closing."""
        if not self._closing and (self._connecting is None or self._connecting.done()):
            self._connecting = asyncio.get_running_loop().create_task(self._keep_connecting())

    async def _keep_connecting(self) -> None:
        wait = RETRY_SECONDS
        while not await self._try_connect():
            self._tried.set()
            await asyncio.sleep(wait)
            wait = min(2 * wait, MAX_RETRY_SECONDS)

    async def _try_connect(self) -> bool:
        config = self._config
        client = Client()

        async def disconnected() -> None:
            if client is self._client and not self._closing:
                log.warning("shared state: disconnected from NATS: routing on what is known; reconnecting")
                self._state("disconnected")

        async def closed() -> None:  # for good: the tries begin again
            if client is self._client:
                self._reconnect()

        try:
            await client.connect(
                servers=[u.strip() for u in config.url.split(",") if u.strip()],
                name=self._name,
                no_echo=True,
                allow_reconnect=False,
                max_reconnect_attempts=1,  # each server twice a try, at once (0 would be: forever)
                reconnect_time_wait=0,
                connect_timeout=CONNECT_TIMEOUT_SECONDS,  # type: ignore[arg-type]
                ping_interval=PING_SECONDS,  # type: ignore[arg-type]
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                token=config.token or None,
                user_credentials=config.creds_file or None,
                tls=_tls_context(config),
                pending_size=0,
                error_cb=self._error,
                disconnected_cb=disconnected,
                closed_cb=closed,
            )
            for subject, handler in self._subscriptions.items():
                await client.subscribe(subject, cb=_callback(handler), pending_msgs_limit=PENDING_MESSAGES)
            if not client.is_connected:  # lost meanwhile, before its callbacks would have counted
                raise ConnectionError("the connection was lost while subscribing")
        except Exception as exc:  # every way a try fails: refused, auth, TLS, timeout, dropped meanwhile
            with contextlib.suppress(Exception):
                await client.close()  # what the try opened
            self._failed(exc)
            return False
        self._client, self._failure = client, ""
        log.info(
            "shared state: %s NATS at %s",
            "reconnected to" if self._ever_connected else "connected to",
            redacted(client.connected_url.geturl() if client.connected_url else config.url),
        )
        self._ever_connected = True
        self._tried.set()
        self._state("connected")
        self._on_connect()
        return True

    def _failed(self, exc: Exception) -> None:
        """Log a failed try when its reason is new (the first of an outage included)."""
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, NoServersError) and self._last_error:
            reason = self._last_error  # why the servers were not reached
        if reason == self._failure:
            return
        first, self._failure = not self._failure, reason
        url = redacted(self._config.url)
        if first and not self._ever_connected:
            log.warning(
                "shared state: cannot reach NATS at %s (%s): routing on this replica's own bookings; "
                "trying again in the background",
                url,
                reason,
            )
        else:
            log.warning("shared state: still no connection to NATS at %s (%s); trying again", url, reason)

    def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        """Queue ``payload`` for ``subject`` (answers on ``reply``); sent in order, dropped when offline."""
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
                reason = "publish_error" if client.is_connected else "disconnected"
                self._dropped(reason, f"a publish of {len(payload)} bytes on {subject} failed: {exc!r}")

    async def close(self) -> None:
        """Stop connecting, send what is queued and disconnect."""
        self._closing = True
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
        """The client's report of an error: a message it threw away (counted), or why a connection
        failed (kept for the log line of the try)."""
        if isinstance(exc, SlowConsumerError):
            self._dropped("slow_consumer", f"messages on {exc.subject} come faster than they are handled")
            return
        self._last_error = str(exc) or type(exc).__name__
        log.debug("shared state: NATS: %s", exc)


def _callback(handler: Handler) -> Callable[[Msg], object]:
    """Deliver a message's payload and reply subject to ``handler``; not the server's own status messages
    (a header ``Status``: the empty "503 no responders" it sends to the reply subject of a sync request
    that no peer was subscribed to hear, as when the first replica starts), which no peer sent."""

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
