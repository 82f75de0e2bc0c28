"""The shared state's shell: a :class:`ReplicaState` driven over a bus, on the event loop.

Subjects (``P`` the configured ``subject_prefix``): ``P.state`` carries every replica's batches,
``P.sync`` the sync requests of replicas that (re)connect, ``P.inbox.<replica>`` the answers to one.
:class:`SharedRunner` sends a batch ``batch_seconds`` after a booking or placement finds nothing
pending (so one batch carries everything placed meanwhile), a full batch every ``heartbeat_seconds``
and whenever the bus (re)connects, and forgets silent peers at each heartbeat. Nothing on the request
path waits for the bus: while it is down, batches are dropped (counted) and the heartbeat after the
reconnection sends the whole state again.

Sync requests are answered at most once per ``answer_seconds`` (``shared_state.sync_answer_seconds``):
the first after a quiet spell at once, the ones that arrive within ``answer_seconds`` of an answer
together (coalesced: the state is built once and sent to each of their reply subjects) when that time
is up, at most ``max_waiting`` (``shared_state.sync_max_waiting``) reply subjects at a time (beyond
them a request is refused: not answered). So a flood of sync requests, a buggy or hostile peer asking
again and again, costs each replica one answer built per ``answer_seconds``, sent once to each reply
subject waiting, and never holds back a replica that starts: its answer comes within
``answer_seconds`` of its request, inside its ``sync_wait_seconds`` (the configuration's check keeps
the one within the other). Each request is counted by outcome (``sink.shared_sync_request``:
``answered``, ``coalesced``, ``refused``).

Faults never end a subscription nor the heartbeats: an exception while a peer's message is applied
(``apply_error``), this replica's sync answer is built (``answer_error``) or one of its batches is
built (``send_error``) is caught, counted as a dropped message of that reason and logged once per
cause at WARNING, with its traceback (:meth:`ReplicaState.drop`).

A bus is anything with :class:`Bus`'s three methods:
:class:`~ext_proc.shared.nats_bus.NatsBus`, or :class:`MemoryHub`'s buses within one process (tests
and the trace replay, with a modelled delay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from ext_proc.shared.replica import ReplicaState, SharingSink
from ext_proc.shared.wire import Batch, IndexPart, Message, SyncRequest

log = logging.getLogger(__name__)

Handler = Callable[[bytes, str], None]
"""What a subscription calls with each message: its payload and its reply subject (``""``: none)."""
SYNC_QUIET_SECONDS = 0.1
"""A starting replica stops waiting for sync answers once none came for this long (after the first)."""


class Bus(Protocol):
    """A publish/subscribe transport (NATS, or in process)."""

    @property
    def connected(self) -> bool:
        """Whether a publish now reaches the peers."""
        ...

    async def start(self, subscriptions: dict[str, Handler], connected: Callable[[], None]) -> None:
        """Subscribe and start connecting; never waits for the transport.

        ``subscriptions``: subject → handler, kept across reconnections; ``connected`` is called at each
        (re)connection. Returns at once when the transport is not reachable yet (it keeps trying)."""
        ...

    def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        """Send ``payload`` on ``subject`` (asking for answers on ``reply``); never waits."""
        ...

    async def close(self) -> None:
        """Send what is buffered and disconnect."""
        ...


class SharedRunner:
    """Drives ``replica`` over ``bus`` with the ``shared_state`` timings (module docstring)."""

    def __init__(
        self,
        replica: ReplicaState,
        bus: Bus,
        sink: SharingSink,
        subject_prefix: str,
        heartbeat_seconds: float,
        batch_seconds: float,
        sync_wait_seconds: float,
        answer_seconds: float,
        max_waiting: int,
    ) -> None:
        self.replica = replica
        self.bus = bus
        self._sink = sink
        self.state_subject = f"{subject_prefix}.state"
        self.sync_subject = f"{subject_prefix}.sync"
        self.inbox = f"{subject_prefix}.inbox.{replica.name}"
        self._heartbeat_seconds = heartbeat_seconds
        self._batch_seconds = batch_seconds
        self._sync_wait_seconds = sync_wait_seconds
        self._scheduled: asyncio.TimerHandle | asyncio.Handle | None = None
        self._beat: asyncio.Task[None] | None = None
        self._answered = asyncio.Event()
        self._last_answer = 0.0
        self._answer_seconds = answer_seconds
        self._max_waiting = max_waiting
        self._next_answer = 0.0
        """When the next sync answer may go (the event loop's clock)."""
        self._waiting: dict[str, None] = {}
        """The reply subjects of the sync requests coalesced into the next answer, in arrival order."""
        self._answer_later: asyncio.TimerHandle | None = None
        self._refused = False
        """Whether a refused sync request was logged (the first only is)."""
        self.synced = False
        """Whether a peer answered this replica's sync request (``False``: none yet, or no peer)."""

    async def start(self) -> None:
        """Subscribe, learn the peers' state, then send heartbeats.

        The wait for the peers' state is ``sync_wait_seconds`` at most; heartbeats go until :meth:`stop`."""
        self.replica.on_change = self._schedule
        subscriptions = {
            self.state_subject: self._receive,
            self.sync_subject: self._receive,
            self.inbox: self._answer,
        }
        await self.bus.start(subscriptions, self._connected)
        self._beat = asyncio.get_running_loop().create_task(self._heartbeats())
        if self.bus.connected:
            await self._wait_for_sync()

    async def stop(self) -> None:
        """Stop the heartbeats, send what is pending and close the bus."""
        self.replica.on_change = None
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        if self._scheduled is not None:
            self._scheduled.cancel()
        if self._answer_later is not None:
            self._answer_later.cancel()
        self._flush()
        await self.bus.close()

    def _connected(self) -> None:
        """At each (re)connection: the whole state to the peers, and theirs asked for."""
        self._send_batch(full=True)
        self._send(self.sync_subject, self.replica.sync_request(), "sync_request", reply=self.inbox)

    async def _wait_for_sync(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._sync_wait_seconds
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._answered.wait(), self._sync_wait_seconds)
            while loop.time() < deadline and loop.time() - self._last_answer < SYNC_QUIET_SECONDS:
                await asyncio.sleep(SYNC_QUIET_SECONDS / 2)

    def _schedule(self) -> None:
        if self._scheduled is None:
            loop = asyncio.get_running_loop()
            if self._batch_seconds:
                self._scheduled = loop.call_later(self._batch_seconds, self._flush)
            else:
                self._scheduled = loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = None
        if self.replica.pending:
            self._send_batch(full=False)

    def _send_batch(self, full: bool) -> None:
        """Send the next batch (all of this replica's loads when ``full``); a fault is counted
        (``send_error``), never raised."""
        try:
            payload = self.replica.batch(full=full)
        except Exception as exc:  # a bug must not end the heartbeats nor the connection's callback
            self.replica.drop("send_error", "building a batch failed", exc)
            return
        self._send(self.state_subject, payload, "batch")

    def _send(self, subject: str, payload: bytes, kind: str, reply: str = "") -> None:
        if not self.bus.connected:
            self._sink.shared_dropped("disconnected")
            return
        self.bus.publish(subject, payload, reply)
        self._sink.shared_sent(kind, len(payload))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_seconds)
            try:
                self.replica.expire()
            except Exception as exc:  # a bug here must not end the heartbeats: counted, tried next beat
                self.replica.drop("send_error", "forgetting silent peers failed", exc)
            self._send_batch(full=True)

    def _apply(self, payload: bytes) -> Message | None:
        """:meth:`ReplicaState.receive`; a fault is counted (``apply_error``) and gives ``None``."""
        try:
            return self.replica.receive(payload)
        except Exception as exc:  # a bug, or a message the decoder passed that cannot be applied
            self.replica.drop("apply_error", f"applying a message of {len(payload)} bytes failed", exc)
            return None

    def _receive(self, payload: bytes, reply: str) -> None:
        if isinstance(self._apply(payload), SyncRequest) and reply:
            self._asked(reply)

    def _asked(self, reply: str) -> None:
        """A sync request asking for answers on ``reply``: answered now, coalesced into the next answer,
        or refused (module docstring)."""
        loop = asyncio.get_running_loop()
        if self._answer_later is None and loop.time() >= self._next_answer:
            self._sink.shared_sync_request("answered")
            self._send_answer([reply])
            return
        if reply not in self._waiting and len(self._waiting) >= self._max_waiting:
            self._sink.shared_sync_request("refused")
            if not self._refused:
                self._refused = True
                log.warning(
                    "shared state: a sync request refused: %d wait for an answer already (a flood of them); "
                    "later ones are only counted",
                    len(self._waiting),
                )
            return
        self._sink.shared_sync_request("coalesced")
        self._waiting[reply] = None
        if self._answer_later is None:
            self._answer_later = loop.call_at(self._next_answer, self._answer_waiting)

    def _answer_waiting(self) -> None:
        self._answer_later = None
        replies, self._waiting = list(self._waiting), {}
        self._send_answer(replies)

    def _send_answer(self, replies: list[str]) -> None:
        """This replica's state, built once, to each of ``replies``; the next answer ``answer_seconds``
        later at the earliest."""
        self._next_answer = asyncio.get_running_loop().time() + self._answer_seconds
        try:
            answer = self.replica.sync_answer()
        except Exception as exc:
            self.replica.drop(
                "answer_error", f"building the answer to {len(replies)} sync requests failed", exc
            )
            return
        for reply in replies:
            for part in answer:
                self._send(reply, part, "sync_answer")

    def _answer(self, payload: bytes, reply: str) -> None:
        """A message on this replica's inbox: a peer's answer to its sync request, unless dropped."""
        if isinstance(self._apply(payload), Batch | IndexPart):
            self.synced = True
            self._last_answer = asyncio.get_running_loop().time()
            self._answered.set()


class MemoryHub:
    """Buses within one process, delivering as NATS does.

    What one publishes reaches the others' subscriptions ``delay_seconds`` later (0: on the next turn of
    the event loop), never its own (as NATS with ``no_echo``), and in the order it was published (as NATS
    keeps one connection's messages in order), even when several are due at the same instant (the event
    loop's timers alone do not keep that order)."""

    def __init__(self, delay_seconds: float = 0.0) -> None:
        self.delay_seconds = delay_seconds
        self._buses: list[MemoryBus] = []
        self._due: deque[tuple[float, Handler, bytes, str]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def bus(self) -> MemoryBus:
        """A new bus on this hub."""
        bus = MemoryBus(self)
        self._buses.append(bus)
        return bus

    def deliver(self, sender: MemoryBus, subject: str, payload: bytes, reply: str) -> None:
        """Hand ``payload`` to every other connected bus subscribed to ``subject``, after the delay."""
        loop = asyncio.get_running_loop()
        for bus in self._buses:
            handler = bus.subscriptions.get(subject)
            if bus is not sender and handler is not None and bus.connected:
                if self.delay_seconds:
                    self._due.append((loop.time() + self.delay_seconds, handler, payload, reply))
                else:
                    loop.call_soon(handler, payload, reply)
        if self._due and self._timer is None:
            self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        due = self._due[0][0]
        self._timer = loop.call_at(due, self._drain, due)

    def _drain(self, until: float) -> None:
        """Hand over every message due by ``until`` (this timer's time), in publishing order; then wait for
        the next one's time."""
        self._timer = None
        while self._due and self._due[0][0] <= until:
            _, handler, payload, reply = self._due.popleft()
            handler(payload, reply)
        if self._due:
            self._arm(asyncio.get_running_loop())


class MemoryBus:
    """One replica's bus on a :class:`MemoryHub`."""

    def __init__(self, hub: MemoryHub) -> None:
        self._hub = hub
        self.subscriptions: dict[str, Handler] = {}
        self.connected = False

    async def start(self, subscriptions: dict[str, Handler], connected: Callable[[], None]) -> None:
        """Subscribe ``subscriptions`` and connect at once (``connected`` called)."""
        self.subscriptions = dict(subscriptions)
        self.connected = True
        connected()

    def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        """Send ``payload`` on ``subject`` to the hub's other buses."""
        self._hub.deliver(self, subject, payload, reply)

    async def close(self) -> None:
        """Disconnect: nothing more is delivered to this bus."""
        self.connected = False
