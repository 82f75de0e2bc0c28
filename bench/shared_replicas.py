"""Gateway replicas that share their bookings and placements over the real shared-state seam, in virtual time.

:class:`SharedReplicas` is :class:`~prefix_peers.Replicas` (requests taking turns among pd-extproc
routers) whose every router runs the shipped seam of ``shared_state``: a
:class:`~ext_proc.shared.replica.ReplicaState` watching its registry and prefix source, driven by a
:class:`~ext_proc.shared.runner.SharedRunner` (batches ``batch_seconds`` after a change, heartbeats, peer
expiry) over a :class:`~ext_proc.shared.runner.MemoryHub` bus, which hands every message to the other
replicas ``delay_seconds`` later (the sync delay: NATS and the network). Every message is encoded and
decoded on the wire format; only the sockets are left out. On the benchmark's virtual-time loop
(:mod:`sim.virtual`) the hub's delay, the batches and the heartbeats are timers like the engines', so
they run in model time: a 2 ms sync delay is 2 ms of the engines' time.

The replicas share one process, so their prompt hashing (:mod:`ext_proc.prefix.blocks`'s per-process
key) is the same, as ``shared_state.nats.hash_key`` makes it across processes. They all start before the
first request and wait for no peer (``sync_wait_seconds`` 0): all start empty. Each keeps its own
tally of what it sent, received and dropped (:class:`Tally`). With decision slots
(``shared_state.decision_slot_ms``, :mod:`ext_proc.shared.slots`) a request waits for its replica's
slot on the router's own wait, timed by the same virtual clock as the replicas' wall clocks (no skew).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from bench.prefix_peers import PdExtproc, Replicas
from ext_proc.shared.config import SharedStateConfig
from ext_proc.shared.kinds import BusState
from ext_proc.shared.replica import ReplicaState
from ext_proc.shared.runner import MemoryHub
from sim.virtual import VirtualClock

DEFAULT_SYNC_DELAY_SECONDS = 0.002
"""The replay's default sync delay (``--sync-delay-ms 2``)."""
SHARING = replace(SharedStateConfig(), sync_wait_seconds=0.0)
"""``shared_state`` at its defaults (1 s heartbeats, 5 s peer timeout, 20 ms batches), no sync wait."""


@dataclass
class Tally:
    """What one replica's shared state sent, received, dropped and made of its peers' sync requests.

    Sent and received: messages and bytes, by kind; dropped: by reason; sync requests: by outcome. A
    :class:`~ext_proc.shared.replica.SharingSink`."""

    sent: Counter[str] = field(default_factory=Counter)
    sent_bytes: int = 0
    received: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    sync_requests: Counter[str] = field(default_factory=Counter)

    def shared_sent(self, kind: str, size: int) -> None:
        """Count one message of ``kind`` sent, ``size`` bytes."""
        self.sent[kind] += 1
        self.sent_bytes += size

    def shared_received(self, kind: str, size: int, lag_seconds: float | None) -> None:
        """Count one message of ``kind`` received (``size`` and ``lag_seconds`` are not kept)."""
        self.received[kind] += 1

    def shared_dropped(self, reason: str) -> None:
        """Count one message dropped for ``reason``."""
        self.dropped[reason] += 1

    def shared_sync_request(self, outcome: str) -> None:
        """Count one peer's sync request by its ``outcome``."""
        self.sync_requests[outcome] += 1


class SharedReplicas(Replicas):
    """``routers`` taking turns, sharing their state over one in-memory hub.

    The hub: one :class:`MemoryHub` of ``delay_seconds`` (module docstring); :meth:`start` before the first
    request, :meth:`stop` after the last. A request takes :meth:`next_in_turn` and places itself there
    (with ``config.decision_slot_ms``, after waiting for that replica's slot)."""

    def __init__(
        self,
        routers: Sequence[PdExtproc],
        delay_seconds: float = DEFAULT_SYNC_DELAY_SECONDS,
        config: SharedStateConfig = SHARING,
    ) -> None:
        super().__init__(routers)
        self.replicas = list(routers)
        self.waits: list[float] = []
        """Seconds each request waited for its replica's decision slot (``decision_slot_ms``)."""
        self.hub = MemoryHub(delay_seconds)
        self.tallies = [Tally() for _ in routers]
        self.states: list[BusState] = []
        clock = VirtualClock()
        for i, (replica, tally) in enumerate(zip(routers, self.tallies, strict=True)):
            router, live = replica.router, replica.live
            state = ReplicaState(
                router.registry,
                lambda live=live: live.prefix,
                tally,
                config.peer_timeout_seconds,
                f"replica-{i}",
                clock=clock.now,
                wall=clock.now,
            )
            shared = BusState("memory", state, self.hub.bus(), config, tally)
            live.shared = shared
            self.states.append(shared)

    async def next_in_turn(self) -> PdExtproc:
        """The next replica in turn, once its decision slot came (at once with slots off).

        The wait is the shipped one, :meth:`Router.decision_turn <ext_proc.router.Router.decision_turn>`."""
        self._turn += 1
        replica = self.replicas[self._turn % len(self.replicas)]
        self.waits.append(await replica.router.decision_turn())
        return replica

    async def start(self) -> None:
        """Start every replica's runner (each subscribes and sends its first full batch)."""
        await asyncio.gather(*(s.start() for s in self.states))

    async def stop(self) -> None:
        """Stop every replica's runner (pending batches sent, buses closed)."""
        await asyncio.gather(*(s.stop() for s in self.states))

    def totals(self) -> Tally:
        """The replicas' tallies added up."""
        total = Tally()
        for t in self.tallies:
            total.sent.update(t.sent)
            total.sent_bytes += t.sent_bytes
            total.received.update(t.received)
            total.dropped.update(t.dropped)
        return total
