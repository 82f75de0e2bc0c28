"""Subscribers to the engines' KV-cache events: the shell that feeds the ``kv-events`` prefix source.

While the prefix source in force is of the ``kv-events`` kind (it has an
:class:`~ext_proc.prefix.event_sink.EventFeed`: its settings and the :class:`EventSink` it is fed
through, which the subscribers ask for each time, as a reload may swap it), one task per
publisher of a known engine (prefill or decode, healthy or not: a cache outlives a health flap; by
address, and by data-parallel rank for an engine of several: :mod:`ext_proc.prefix.ranks`) holds a
ZMQ SUB socket on ``tcp://<engine ip>:<port>`` (the endpoint's ``kv_events_port`` metadata or pod
annotation, else ``affinity.prefix.kv_events.port``; plus the rank) and applies each message to the
sink (the source's :mod:`~ext_proc.prefix.event_index`). Every ``interval`` seconds the set of
subscribers follows the registry: engines that joined get one, engines that left lose theirs (and
their entries, through the prefix source's ``retain`` when discovery changes; a rank an engine no
longer has, here). When the index
answers a gap with :class:`~ext_proc.prefix.event_index.ReplayFrom` the task asks the engine's replay
socket (a DEALER on its ``kv_events_replay_port``, else ``replay_port``, plus the rank) for the
batches from there on, applies them, then goes on with the live ones: those numbered after the batch
that asked the replay but covered by it are duplicates, dropped (one numbered at most that batch means
the sequence went back, an engine restart: it is applied); a replay that fails or times out drops the
engine's entries instead and, for ``REPLAY_BACKOFF_SECONDS``, no replay is asked of it again.

The index learns each engine's block size from its events (:mod:`ext_proc.prefix.block_sizes`); an
engine whose size is not the pool's has its blocks dropped (counted ``block_size``), which is logged
once (a WARNING naming the engine, its size and the pool's) and listed by :meth:`KvEventSubscribers.report`.

Bad input never stops routing: a message that does not decode is counted (``garbled``) and dropped;
the SUB socket keeps at most ``kv_events.queue_batches`` messages (ZeroMQ drops the rest, which the
sequence shows as a gap); the task yields to the event loop after every message, so a flooding engine
costs its share of the loop, not the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple

import zmq
import zmq.asyncio

from ext_proc.metrics import Metrics
from ext_proc.prefix.event_index import Applied, ReplayFrom
from ext_proc.prefix.event_sink import EventFeed, EventSink
from ext_proc.prefix.kv_events import DecodeError, EventBatch, decode_message, decode_replay
from ext_proc.prefix.ranks import publisher
from ext_proc.prefix.settings import KvEventsSettings
from ext_proc.registry import EndpointState, Registry

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_SECONDS = 2.0
"""How long a replay may pause between two answers before it counts as failed."""
REPLAY_BACKOFF_SECONDS = 60.0
"""How long no replay is asked of an engine whose last one failed."""
MAX_PORT = 65535
"""The highest TCP port: a rank whose port would pass it is not subscribed to."""


class Target(NamedTuple):
    """Where one engine publishes: ``host`` (an IP; IPv6 in brackets), its PUB and replay ports (0: none)."""

    host: str
    port: int
    replay_port: int


def targets(endpoints: Iterable[EndpointState], settings: KvEventsSettings) -> dict[str, Target]:
    """Where each publisher of ``endpoints`` publishes, by publisher name (:mod:`ext_proc.prefix.ranks`).

    An endpoint's ports are its ``kv_events_port`` and ``kv_events_replay_port``, else ``settings``';
    its data-parallel rank ``r`` publishes on both plus ``r`` (vLLM's offset; a replay port of 0 stays
    0), and a rank whose port would pass 65535 is left out."""
    wanted: dict[str, Target] = {}
    for state in endpoints:
        host = state.address.rpartition(":")[0]
        port = state.kv_events_port or settings.port
        replay = state.kv_events_replay_port or settings.replay_port
        size = state.data_parallel_size
        for rank in range(min(size, MAX_PORT + 1 - port)):
            replay_port = replay + rank if replay and replay + rank <= MAX_PORT else 0
            wanted[publisher(state.address, rank, size)] = Target(host, port + rank, replay_port)
    return wanted


class KvEventSubscribers:
    """The subscribers of one server; ``clock`` (seconds, monotonic) is the index's clock.

    ``feed``: the feed of the prefix source in force (``None``: it takes no events; e.g.
    :meth:`ext_proc.live.LiveParts.events`)."""

    def __init__(
        self,
        registry: Registry,
        feed: Callable[[], EventFeed | None],
        metrics: Metrics,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._feed = feed
        self._metrics = metrics
        self._interval = interval
        self._clock = clock
        self._context: zmq.asyncio.Context | None = None  # made with the first subscriber
        self._tasks: dict[str, tuple[Target, asyncio.Task[None]]] = {}
        self._no_replay_until: dict[str, float] = {}
        self._told: set[tuple[str, int, int]] = set()  # (publisher, its size, the pool's): logged once
        metrics.watch_kv_events(self._blocks, self._stale_count)

    async def run(self) -> None:
        """Follow the registry every ``interval`` seconds until cancelled; the subscribers end with it."""
        try:
            while True:
                self.tick()
                await asyncio.sleep(self._interval)
        finally:
            tasks = [task for _, task in self._tasks.values()]
            self._tasks.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # a failed one's error, too, is taken
            if self._context is not None:
                self._context.destroy(linger=0)

    @property
    def addresses(self) -> list[str]:
        """The engines subscribed to."""
        return list(self._tasks)

    def tick(self) -> None:
        """Make the subscribers follow the registry and the prefix source.

        Subscribe to every known engine without a subscriber (again, when its subscriber failed);
        stop those of engines that left (or whose ports changed); stop all while the prefix source is not
        ``kv-events``."""
        feed = self._feed()
        wanted = {} if feed is None else targets(self._registry.endpoints(), feed.settings)
        for address, (target, task) in list(self._tasks.items()):
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error(
                    "the KV-event subscriber of %s failed (restarted)", address, exc_info=task.exception()
                )
            if wanted.get(address) != target or task.done():
                task.cancel()
                del self._tasks[address]
                if feed is not None and address not in wanted:  # e.g. a rank the engine no longer has
                    feed.sink.forget(address)
        now = self._clock()
        for address, target in wanted.items():
            if address not in self._tasks:
                task = asyncio.get_running_loop().create_task(
                    self._subscribe(address, target), name=f"kv-events {address}"
                )
                self._tasks[address] = (target, task)
            if feed is not None:
                feed.sink.watch(address, now)

    def _sink(self) -> EventSink | None:
        feed = self._feed()
        return None if feed is None else feed.sink

    def _blocks(self) -> dict[str, dict[str, int]]:
        sink = self._sink()
        return {} if sink is None else sink.blocks()

    def _stale_count(self) -> int:
        sink = self._sink()
        if sink is None:
            return 0
        now = self._clock()
        return sum(1 for address in self._tasks if sink.is_stale(address, now))

    async def _subscribe(self, address: str, target: Target) -> None:
        feed = self._feed()
        queue = feed.settings.queue_batches if feed is not None else 1000
        sub = self._socket(zmq.SUB, target.host, target.port)
        sub.setsockopt(zmq.RCVHWM, queue)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        log.info("subscribed to the KV-cache events of %s on port %d", address, target.port)
        trigger: int | None = None  # the live batch that asked the last replay, until one past it is applied
        try:
            while True:
                frames = await sub.recv_multipart()
                self._metrics.kv_events_received(address)
                batch = self._decode(address, frames)
                if batch is not None:
                    trigger = await self._take(address, target, batch, trigger)
                await asyncio.sleep(0)  # a flood shares the loop
        finally:
            sub.close(linger=0)

    def _decode(self, address: str, frames: list[bytes]) -> EventBatch | None:
        try:
            batch = decode_message(frames)
        except DecodeError as exc:
            self._metrics.kv_events_dropped(address, "garbled")
            log.warning("dropped a KV-event message from %s: %s", address, exc)
            return None
        for kind, count in Counter(type(e).__name__ for e in batch.events).items():
            self._metrics.kv_events_decoded(address, kind, count)
        if batch.skipped:
            self._metrics.kv_events_dropped(address, "unknown_type", len(batch.skipped))
        return batch

    async def _take(self, address: str, target: Target, batch: EventBatch, trigger: int | None) -> int | None:
        """Apply one live batch, replaying first when the index asks; the new ``trigger``.

        ``trigger``: the sequence of the live batch that asked the last replay (``None``: a live batch
        was applied since). The live stream comes in order, so a batch numbered after ``trigger`` and
        before the index's next expected one was covered by the replay (a duplicate, dropped), and one
        numbered ``trigger`` or less comes from an engine that restarted since (applied: a restart)."""
        sink = self._sink()
        if sink is None:
            return trigger
        expected = sink.expected(address)
        if trigger is not None and expected is not None and trigger < batch.sequence < expected:
            self._metrics.kv_events_dropped(address, "duplicate")
            return trigger
        now = self._clock()
        replayable = target.replay_port > 0 and now >= self._no_replay_until.get(address, 0.0)
        result = sink.apply(address, batch, now, replayable)
        if isinstance(result, ReplayFrom):
            self._reset(address, result.reset)
            ok = await self._replay(address, target, result.sequence, sink)
            self._metrics.kv_events_replay(address, "ok" if ok else "failed")
            if not ok:
                self._no_replay_until[address] = self._clock() + REPLAY_BACKOFF_SECONDS
            expected = sink.expected(address)
            if expected is None or batch.sequence >= expected:  # the replay did not cover it
                self._count(address, sink.apply(address, batch, self._clock(), replayable=False))
            return batch.sequence
        self._count(address, result)
        return None  # the live stream is past the replay

    async def _replay(self, address: str, target: Target, start: int, sink: EventSink) -> bool:
        """Ask for the batches from ``start`` on and apply them; whether the end marker came."""
        dealer = self._socket(zmq.DEALER, target.host, target.replay_port)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_SECONDS)
                batch = decode_replay(frames)
                if batch is None:
                    return True
                self._count(address, sink.apply(address, batch, self._clock(), replayable=False))
        except (TimeoutError, DecodeError, zmq.ZMQError) as exc:
            log.warning(
                "the replay of %s's KV-cache events from %d failed: %s", address, start, exc or "timeout"
            )
            return False
        finally:
            dealer.close(linger=0)

    def _count(self, address: str, applied: Applied | ReplayFrom) -> None:
        if not isinstance(applied, Applied):
            return
        for reason, count in applied.dropped.items():
            self._metrics.kv_events_dropped(address, reason, count)
        if applied.dropped.get("block_size"):
            self._tell_size(address)
        self._reset(address, applied.reset)

    def _tell_size(self, address: str) -> None:
        """Log once that ``address``'s blocks are of another size than the pool's (and so not indexed)."""
        sink = self._sink()
        if sink is None:
            return
        sizes = sink.sizes
        size = sizes.of(address)
        if size is None:
            return
        told = (address, size, sizes.tokens)
        if told in self._told:
            return
        self._told.add(told)
        log.warning(
            "the KV-cache events of %s are of %d-token blocks, the pool's of %d (the first size heard, "
            "which %d publisher(s) report): its blocks are not indexed, so its cache steers no request; "
            "give every engine of the pool the same block size",
            address,
            size,
            sizes.tokens,
            sizes.reporting(sizes.tokens),
        )

    def report(self) -> dict[str, object] | None:
        """The ``kv-events`` source's block sizes, in tokens (``None`` with another prefix source).

        ``block_tokens``: the pool's, which a request's chain is hashed at; ``unusable``: each publisher
        whose events report another size, with it (their blocks are not indexed)."""
        sink = self._sink()
        if sink is None:
            return None
        sizes = sink.sizes
        return {"block_tokens": sizes.tokens, "unusable": sizes.unusable()}

    def _reset(self, address: str, reason: str | None) -> None:
        """Count and log a drop of ``address``'s entries for ``reason`` (``None``: none)."""
        if reason is not None:
            self._metrics.kv_events_reset(address, reason)
            log.info("dropped the index entries of %s: %s", address, reason)

    def _socket(self, kind: int, host: str, port: int) -> zmq.asyncio.Socket:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        socket = self._context.socket(kind)
        if host.startswith("["):
            socket.setsockopt(zmq.IPV6, 1)
        socket.connect(f"tcp://{host}:{port}")
        return socket
