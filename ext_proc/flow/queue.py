"""Flow control's queue, pure: priority bands, deficit round-robin on tokens between a band's flows.

No clock, no I/O: the caller says when a request arrived (seconds, any monotonic clock) and what it
costs (tokens). :meth:`FlowQueue.pop` takes from the highest band holding anything; within a band the
flows (one per fairness id) take turns by deficit round-robin (Shreedhar and Varghese): each turn
grants a flow :data:`QUANTUM_TOKENS` more credit, and the flow is served while its credit covers its
oldest request's cost, so over time every busy flow of a band gets the same tokens whatever its
requests' sizes or its arrival rate. Within a flow, first come first served. A flow that empties
leaves the band and forgets its credit: an idle flow saves nothing up.

The queue holds at most ``capacity`` requests in all bands together. A request arriving when it is
full takes the place of another (:meth:`push` returns that one, to be refused): the newest of the
flow holding the most tokens in the lowest band, when that band is below its own, or is its own band
and that flow holds more tokens than the arriving request's flow would with it (so a flood cannot
crowd a lighter tenant out of the queue: the buffer share of fair queuing, "longest queue drop");
otherwise the arriving request is refused.

A band tracks at most ``max_flows`` flows by name: while it holds that many, a waiter of another
flow joins the shared :data:`OVERFLOW_FLOW` instead (a client's fairness id is a label, never a way to
grow the state or to get a turn of its own).

Every operation costs O(flows of one band) at most: no scan of the queued requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

QUANTUM_TOKENS = 2048
"""Credit (tokens) a flow's turn adds: about one typical request, so flows alternate request by request
while their costs are alike."""

OVERFLOW_FLOW = "\x00overflow"
"""The flow shared by the waiters of a band's flows beyond ``max_flows`` (no header value can name it:
header values carry no NUL)."""


@dataclass(eq=False, slots=True)
class Waiter:
    """One queued request: its band, flow, cost, arrival and order.

    Its ``priority`` (its band), its ``flow`` (fairness id, bounded by the caller), its ``cost`` in
    tokens (>= 0), when it ``arrived`` (seconds) and its arrival ``order`` (set by
    :meth:`FlowQueue.push`). Compared by identity: two equal requests are two waiters."""

    priority: int
    flow: str
    cost: int
    arrived: float
    order: int = 0


@dataclass(slots=True)
class _Flow:
    """The waiters of one flow of a band, oldest first, and its credit (tokens)."""

    waiters: deque[Waiter] = field(default_factory=deque)
    credit: int = 0
    tokens: int = 0


@dataclass(slots=True)
class _Band:
    """One priority's flows, in turn order (``ring[0]`` has the turn); ``granted``: the flow at the head
    has had this turn's quantum already."""

    flows: dict[str, _Flow] = field(default_factory=dict)
    ring: deque[str] = field(default_factory=deque)
    granted: bool = False
    size: int = 0


@dataclass(frozen=True, slots=True)
class BandSummary:
    """One band's queue, as :meth:`FlowQueue.bands` sees it.

    ``size`` waiters in ``flows`` flows, the oldest arrived at ``oldest`` (seconds), and the ``largest``
    flows, most waiters first: ``(flow, waiters, tokens)`` each."""

    size: int
    flows: int
    oldest: float
    largest: tuple[tuple[str, int, int], ...]


class QueueFull(Exception):
    """The queue is full and holds no request to give its place to the arriving one."""


class FlowQueue:
    """Queued requests by band and flow (see the module docstring).

    ``capacity`` (>= 1): the most waiters in all bands together; ``max_flows`` (>= 1): the most named
    flows of one band."""

    __slots__ = ("_bands", "_order", "capacity", "max_flows", "size")

    def __init__(self, capacity: int, max_flows: int) -> None:
        if capacity < 1 or max_flows < 1:
            raise ValueError("capacity and max_flows must be >= 1")
        self.capacity = capacity
        self.max_flows = max_flows
        self.size = 0
        self._order = 0
        self._bands: dict[int, _Band] = {}

    def __len__(self) -> int:
        return self.size

    def push(self, waiter: Waiter) -> Waiter | None:
        """Queue ``waiter``; the waiter it displaced when the queue was full (to refuse), else ``None``.

        Its ``flow`` becomes :data:`OVERFLOW_FLOW` when its band already tracks ``max_flows`` others.

        Raises :class:`QueueFull` (nothing queued, nothing displaced) when the queue is full and holds no
        request to give its place (see the module docstring)."""
        displaced = None
        if self.size >= self.capacity:
            displaced = self._to_displace(waiter)
            if displaced is None:
                raise QueueFull
            self.remove(displaced)
        self._order += 1
        waiter.order = self._order
        band = self._bands.get(waiter.priority)
        if band is None:
            band = self._bands[waiter.priority] = _Band()
        flow = band.flows.get(waiter.flow)
        if flow is None and len(band.flows) - (OVERFLOW_FLOW in band.flows) >= self.max_flows:
            waiter.flow = OVERFLOW_FLOW
            flow = band.flows.get(waiter.flow)
        if flow is None:
            flow = band.flows[waiter.flow] = _Flow()
            band.ring.append(waiter.flow)
        flow.waiters.append(waiter)
        flow.tokens += waiter.cost
        band.size += 1
        self.size += 1
        return displaced

    def pop(self) -> Waiter | None:
        """Take the next waiter to dispatch; ``None`` when empty.

        From the highest band, by deficit round-robin between its flows."""
        if not self._bands:
            return None
        priority = max(self._bands)
        band = self._bands[priority]
        _skip_empty_rounds(band)
        while True:
            name = band.ring[0]
            flow = band.flows[name]
            if not band.granted:
                flow.credit += QUANTUM_TOKENS
                band.granted = True
            head = flow.waiters[0]
            if flow.credit >= head.cost:
                flow.credit -= head.cost
                flow.waiters.popleft()
                flow.tokens -= head.cost
                self._forget_if_empty(priority, band, name, flow)
                return head
            band.ring.rotate(-1)
            band.granted = False

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out wherever it is; ``False`` if it is not queued.

        Its client left, or it waited too long."""
        band = self._bands.get(waiter.priority)
        flow = None if band is None else band.flows.get(waiter.flow)
        if band is None or flow is None:
            return False
        try:
            flow.waiters.remove(waiter)
        except ValueError:
            return False
        flow.tokens -= waiter.cost
        self._forget_if_empty(waiter.priority, band, waiter.flow, flow)
        return True

    def oldest(self) -> Waiter | None:
        """The waiter that arrived first, of any band (the next to time out); ``None`` when empty."""
        heads = (f.waiters[0] for b in self._bands.values() for f in b.flows.values())
        return min(heads, key=lambda w: w.order, default=None)

    def lengths(self) -> dict[int, int]:
        """Waiters queued per band (priority), bands holding none left out."""
        return {priority: band.size for priority, band in self._bands.items()}

    def flow_counts(self) -> dict[int, int]:
        """Flows with a waiter queued, per band (priority)."""
        return {priority: len(band.flows) for priority, band in self._bands.items()}

    def bands(self, top: int) -> dict[int, BandSummary]:
        """What each band holding a waiter holds: see :class:`BandSummary`; its ``top`` largest flows.

        O(flows) per band, no scan of the waiters."""
        summaries = {}
        for priority, band in self._bands.items():
            heads = [flow.waiters[0] for flow in band.flows.values()]
            largest = sorted(band.flows.items(), key=lambda item: (-len(item[1].waiters), item[0]))[:top]
            summaries[priority] = BandSummary(
                band.size,
                len(band.flows),
                min(w.arrived for w in heads),
                tuple((name, len(flow.waiters), flow.tokens) for name, flow in largest),
            )
        return summaries

    def _forget_if_empty(self, priority: int, band: _Band, name: str, flow: _Flow) -> None:
        """Count one waiter less; drop the flow once empty (its credit with it), the band too."""
        band.size -= 1
        self.size -= 1
        if flow.waiters:
            return
        del band.flows[name]
        if band.ring[0] == name:
            band.ring.popleft()
            band.granted = False
        else:
            band.ring.remove(name)
        if not band.flows:
            del self._bands[priority]

    def _to_displace(self, waiter: Waiter) -> Waiter | None:
        """The waiter a full queue gives up for ``waiter``: the newest of the heaviest flow of the lowest
        band, if that band is below ``waiter``'s or that flow outweighs ``waiter``'s own with it."""
        lowest = min(self._bands)
        if lowest > waiter.priority:
            return None
        band = self._bands[lowest]
        name, heaviest = max(band.flows.items(), key=lambda item: item[1].tokens)
        if lowest == waiter.priority:
            own = band.flows.get(waiter.flow)
            if name == waiter.flow or heaviest.tokens <= (0 if own is None else own.tokens) + waiter.cost:
                return None
        return heaviest.waiters[-1]


def _skip_empty_rounds(band: _Band) -> None:
    """Grant every flow the rounds in which none could be served, at once.

    When no flow's credit, with the turns still due this round, covers its oldest waiter, the rounds
    until the first one can are granted together: the same order as granting them one by one, in
    O(flows) however large the costs are against the quantum."""
    rounds_needed = None
    for index, name in enumerate(band.ring):
        flow = band.flows[name]
        due = 0 if (index == 0 and band.granted) else QUANTUM_TOKENS
        short = flow.waiters[0].cost - flow.credit - due
        if short <= 0:
            return
        rounds = -(-short // QUANTUM_TOKENS)
        rounds_needed = rounds if rounds_needed is None else min(rounds_needed, rounds)
    if rounds_needed:
        for name in band.ring:
            band.flows[name].credit += rounds_needed * QUANTUM_TOKENS
