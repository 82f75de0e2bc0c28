"""Flow control's thin asyncio shell: requests wait here while the pool is saturated, then are dispatched.

The ordering is :mod:`ext_proc.flow.queue`'s, the band and flow :mod:`ext_proc.flow.classify`'s, the
engines' saturation rule :mod:`ext_proc.flow.saturation`'s; this module only holds the waiters'
futures and wakes them. The pool is saturated when every in-flight slot is taken
(``limits.max_inflight_requests``) or when the engines' own signals (``engine_metrics``) leave no
headroom. A request arriving while it is not, with nobody queued, takes a slot at once; otherwise a
sheddable one (negative priority) is answered 429 ``shed`` (it is so already while no more than
``reserved_requests`` of room is left), and the others queue (a full queue: 429
``queue_full``, or the newest of a lower band gives its place and gets that 429) and wait for a slot,
at most ``max_queue_seconds`` (then 503 ``queue_timeout``). Waiters are dispatched, best band first,
whenever a slot is given back and, with the engines' signals, every scrape interval; a client that goes
away (its stream cancelled) leaves the queue at once. The caller routes a dispatched request then: the
decision reads the load at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ext_proc.flow.classify import Objectives, flow_of
from ext_proc.flow.config import FlowControlConfig
from ext_proc.flow.metrics import FlowMetrics
from ext_proc.flow.queue import OVERFLOW_FLOW, BandSummary, FlowQueue, QueueFull, Waiter
from ext_proc.flow.saturation import headroom
from ext_proc.load import Admission
from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused
from ext_proc.refusal import refuse
from ext_proc.request import RequestInfo

DEBUG_FLOWS = 10
"""The most flows ``/debug/queue`` lists per band (the largest): never every fairness id."""


class EngineSignals(Protocol):
    """The engines' fresh samples, as the engine scraper holds them.

    ``version``: changes whenever a sample lands or may have gone stale;
    :meth:`fresh_samples`: ``(waiting, kv_usage)`` of each engine whose sample is fresh, per role
    (``prefill``, ``decode``)."""

    version: int

    def fresh_samples(self) -> dict[str, list[tuple[float, float]]]:
        """``(waiting, kv_usage)`` of each engine with a fresh sample, per role."""
        ...


@dataclass(frozen=True, slots=True)
class Labels:
    """What a request's headers say to flow control: its objective and fairness id (``None``: absent)."""

    objective: str | None = None
    fairness_id: str | None = None


@dataclass(frozen=True, slots=True)
class Ticket:
    """A queued request: await :meth:`FlowControl.wait` with it."""

    waiter: Waiter
    future: asyncio.Future[Refused | None]


class FlowControl:
    """Admits, queues and dispatches requests over ``admission``'s in-flight slots.

    ``config``: the ``flow_control`` section; ``retry_after``: the seconds a 429 or 503 tells the client
    to wait (``limits.retry_after_seconds``); ``engines``: the engines' samples (``None``: the in-flight
    limit alone); ``poll_seconds``: how often queued requests look at the engines' samples again;
    ``clock``: seconds, monotonic. Runs on the event loop; no lock."""

    def __init__(
        self,
        config: FlowControlConfig,
        admission: Admission,
        metrics: Metrics,
        retry_after: int,
        engines: EngineSignals | None = None,
        poll_seconds: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._admission = admission
        self._metrics = metrics
        self._retry_after = retry_after
        self._engines = engines
        self._poll = poll_seconds if engines is not None else config.max_queue_seconds
        self._clock = clock
        self._objectives = Objectives(config.objectives, config.objectives[config.default_objective])
        self._queue = FlowQueue(config.max_queued_requests, config.max_flows)
        self._futures: dict[Waiter, asyncio.Future[Refused | None]] = {}
        self._version = -1
        self._room: int | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.flow_metrics = FlowMetrics(metrics.registry, sorted(set(config.objectives.values())))
        self.flow_metrics.watch(self._queue.lengths, self._queue.flow_counts)
        admission.on_release = self.pump

    def engine_priority(self, objective: str | None) -> int | None:
        """The ``priority`` the engines get for a request of ``objective`` (``None``: the client's own).

        With ``flow_control.engine_priority``, the objective's priority negated (vLLM schedules lower
        values first; an unknown or absent objective: the default one's), else ``None``."""
        if not self._config.engine_priority:
            return None
        return -self._objectives.priority(objective)[0]

    def arrive(self, labels: Labels, info: RequestInfo) -> Ticket | Refused | None:
        """A read request asks to be routed: ``None`` (a slot taken), a refusal, or a :class:`Ticket`.

        ``None``: it holds an in-flight slot now; a ticket: wait with it (:meth:`wait`). ``labels``
        are its headers' objective and fairness id, ``info`` its estimated tokens (its cost in its
        band's fair share)."""
        priority, known = self._objectives.priority(labels.objective)
        if not known:
            self.flow_metrics.unknown_objective()
        self.pump()
        reserve = self._config.reserved_requests if priority < 0 else 0
        if not self._queue and self._take_slot(reserve):
            self.flow_metrics.dispatched(priority, 0.0)
            return None
        if priority < 0:
            self.flow_metrics.left(priority, "shed")
            return self._refuse(
                429, "the pool is saturated and this request's objective is sheddable: retry later", "shed"
            )
        cost = info.prompt_tokens + info.output_budget
        waiter = Waiter(priority, flow_of(labels.fairness_id), cost, self._clock())
        try:
            displaced = self._queue.push(waiter)
        except QueueFull:
            self.flow_metrics.left(priority, "queue_full")
            return self._full()
        if waiter.flow == OVERFLOW_FLOW:
            self.flow_metrics.overflowed()
        if displaced is not None:
            self.flow_metrics.left(displaced.priority, "displaced")
            self._settle(displaced, self._full())
        future: asyncio.Future[Refused | None] = asyncio.get_running_loop().create_future()
        self._futures[waiter] = future
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="flow-control")
        return Ticket(waiter, future)

    async def wait(self, ticket: Ticket) -> Refused | None:
        """Wait for the queued request's turn: ``None`` (it holds an in-flight slot now) or its 503.

        Cancelled (the client went away), it leaves the queue, or gives back the slot it was just
        dispatched with."""
        try:
            return await ticket.future
        except asyncio.CancelledError:
            waiter = ticket.waiter
            if self._queue.remove(waiter):
                self._futures.pop(waiter, None)
                self.flow_metrics.left(waiter.priority, "cancelled")
            elif ticket.future.done() and not ticket.future.cancelled() and ticket.future.result() is None:
                self._admission.release()  # dispatched as the client left: the slot goes to the next
            raise

    def waited(self, ticket: Ticket) -> float:
        """Seconds since ``ticket``'s request was queued (by the flow clock)."""
        return self._clock() - ticket.waiter.arrived

    def pump(self) -> None:
        """Dispatch queued requests, best band first, while the pool has room."""
        queue = self._queue
        while queue and self._take_slot():
            waiter = queue.pop()
            assert waiter is not None
            self.flow_metrics.dispatched(waiter.priority, self._clock() - waiter.arrived)
            if not self._settle(waiter, None):
                self._admission.release()

    def describe(self) -> dict[str, object]:
        """What ``/debug/queue`` shows (JSON): the bounds, the slots in flight, and each band's queue.

        Per configured band its objectives, queued requests, flows, oldest wait (seconds), largest flows
        (at most :data:`DEBUG_FLOWS`) and outcomes so far."""
        now = self._clock()
        config = self._config
        summaries = self._queue.bands(DEBUG_FLOWS)
        outcomes = self.flow_metrics.outcomes()
        objectives: dict[int, list[str]] = {}
        for name, priority in sorted(config.objectives.items()):
            objectives.setdefault(priority, []).append(name)
        bands = [
            _band_view(priority, names, summaries.get(priority), outcomes.get(priority, {}), now)
            for priority, names in sorted(objectives.items(), reverse=True)
        ]
        return {
            "enabled": True,
            "queued": len(self._queue),
            "max_queued_requests": config.max_queued_requests,
            "max_queue_seconds": config.max_queue_seconds,
            "max_flows": config.max_flows,
            "inflight": self._admission.inflight,
            "max_inflight_requests": self._admission.limit,
            "engine_room": self._room,
            "bands": bands,
        }

    async def close(self) -> None:
        """Stop the sweeper (the server is stopping); waiters left end with their streams."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    def _take_slot(self, reserve: int = 0) -> bool:
        """Take an in-flight slot if the pool has more than ``reserve`` room (the limit, then the
        engines' headroom)."""
        admission = self._admission
        if admission.limit and admission.inflight >= admission.limit - reserve:
            return False
        engines = self._engines
        if engines is not None:
            if engines.version != self._version:
                self._version = engines.version
                self._room = self._engine_room(engines)
            if self._room is not None:
                if self._room <= reserve:
                    return False
                self._room -= 1
        return admission.admit()

    def _engine_room(self, engines: EngineSignals) -> int | None:
        """The requests the engines can take before saturation: the least of the roles that have samples."""
        config = self._config
        depth, kv = config.queue_depth_threshold, config.kv_cache_threshold
        rooms = [headroom(samples, depth, kv) for samples in engines.fresh_samples().values()]
        return min((room for room in rooms if room is not None), default=None)

    def _settle(self, waiter: Waiter, outcome: Refused | None) -> bool:
        """Wake ``waiter`` with ``outcome``; ``False`` when nobody waits for it any more."""
        future = self._futures.pop(waiter, None)
        if future is None or future.done():
            return False
        future.set_result(outcome)
        return True

    async def _sweep(self) -> None:
        """While anything is queued: time out who waited ``max_queue_seconds``, and look at the engines'
        samples again every ``poll_seconds``."""
        limit = self._config.max_queue_seconds
        try:
            while self._queue:
                now = self._clock()
                while (oldest := self._queue.oldest()) is not None and now - oldest.arrived >= limit:
                    self._queue.remove(oldest)
                    self.flow_metrics.left(oldest.priority, "timeout")
                    self._settle(oldest, self._timed_out(now - oldest.arrived))
                self.pump()
                oldest = self._queue.oldest()
                if oldest is None:
                    break
                await asyncio.sleep(min(self._poll, oldest.arrived + limit - now))
        finally:
            self._sweeper = None

    def _full(self) -> Refused:
        return self._refuse(
            429,
            f"the pool is saturated and {self._config.max_queued_requests} requests are queued, the most "
            "flow control holds (flow_control.max_queued_requests): retry later",
            "queue_full",
        )

    def _timed_out(self, waited: float) -> Refused:
        return self._refuse(
            503,
            f"the pool stayed saturated for the {waited:.1f} s this request waited "
            f"(flow_control.max_queue_seconds {self._config.max_queue_seconds:g})",
            "queue_timeout",
        )

    def _refuse(self, status: int, message: str, code: str) -> Refused:
        return refuse(self._metrics, status, message, code, retry_after=self._retry_after)


def _band_view(
    priority: int, objectives: list[str], summary: BandSummary | None, outcomes: dict[str, int], now: float
) -> dict[str, object]:
    """One band's row of ``/debug/queue`` (``summary`` ``None``: nothing queued in it)."""
    largest = () if summary is None else summary.largest
    return {
        "priority": priority,
        "objectives": objectives,
        "queued": 0 if summary is None else summary.size,
        "flows": 0 if summary is None else summary.flows,
        "oldest_wait_seconds": None if summary is None else round(now - summary.oldest, 6),
        "largest_flows": [
            {"fairness_id": None if flow == OVERFLOW_FLOW else flow, "queued": queued, "tokens": tokens}
            for flow, queued, tokens in largest
        ],
        "outcomes": outcomes,
    }
