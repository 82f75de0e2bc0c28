"""The shared-state seam: the :class:`SharedState` protocol and its kinds.

``local`` (:class:`LocalState`, the default) shares nothing: a replica routes on its own bookings.
``nats`` (:class:`BusState` over :class:`~ext_proc.shared.nats_bus.NatsBus`) shares every booking and
placement with the peer replicas of its ``subject_prefix`` and applies theirs. The router calls
:meth:`SharedState.placed` after each placement; the bookings reach the shared state through the
registry's watch (:meth:`~ext_proc.registry.Registry.watch`); the decision reads the registry's load
arrays as always and never knows which share of a number came from a peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ext_proc.prefix.blocks import Chain
from ext_proc.prefix.kinds import PrefixSource
from ext_proc.prefix.lookup import Holder
from ext_proc.registry import Registry
from ext_proc.shared.config import SharedStateConfig, SharedStateKind
from ext_proc.shared.replica import ReplicaState, SharingSink
from ext_proc.shared.runner import Bus, SharedRunner
from ext_proc.shared.slots import rank_of, slot_wait


class SharedState(Protocol):
    """What the server asks of the shared state."""

    def placed(self, chain: Chain, holders: Sequence[Holder]) -> None:
        """This replica placed the prompt of ``chain`` on ``holders``."""
        ...

    def decision_wait(self) -> float | None:
        """Seconds a request waits for this replica's decision slot before it is routed.

        ``None``: no slots (off, or no peer to take turns with); 0.0: this replica's slot is open."""
        ...

    async def start(self) -> None:
        """Connect and learn the peers' state (bounded wait); never fails for want of the bus."""
        ...

    async def stop(self) -> None:
        """Send what is pending and disconnect."""
        ...

    def describe(self) -> dict[str, object]:
        """What ``/debug/endpoints`` shows of it: kind, this replica's name, connection, peers."""
        ...


class LocalState:
    """Nothing shared (``shared_state.kind: local``)."""

    def placed(self, chain: Chain, holders: Sequence[Holder]) -> None:
        """Nothing to tell: there are no peers."""

    def decision_wait(self) -> float | None:
        """No peers to take turns with: no slots."""
        return None

    async def start(self) -> None:
        """Nothing to connect to."""

    async def stop(self) -> None:
        """Nothing to close."""

    def describe(self) -> dict[str, object]:
        """Its kind only (``/debug/shared``)."""
        return {"kind": SharedStateKind.LOCAL.value}


class BusState:
    """Bookings and placements shared over ``bus`` (:class:`ReplicaState` driven by :class:`SharedRunner`)."""

    def __init__(
        self, kind: str, replica: ReplicaState, bus: Bus, config: SharedStateConfig, sink: SharingSink
    ) -> None:
        self.kind = kind
        self.replica = replica
        self.slot_seconds = config.decision_slot_ms / 1000
        self.runner = SharedRunner(
            replica,
            bus,
            sink,
            config.nats.subject_prefix,
            config.heartbeat_seconds,
            config.batch_seconds,
            config.sync_wait_seconds,
            config.sync_answer_seconds,
            config.sync_max_waiting,
        )

    def placed(self, chain: Chain, holders: Sequence[Holder]) -> None:
        """Queue the placement of ``chain`` on ``holders`` for the next batch."""
        self.replica.placed(chain, holders)

    def decision_wait(self) -> float | None:
        """Seconds to this replica's next decision slot among itself and its live peers (:mod:`.slots`).

        ``None`` with ``decision_slot_ms`` 0 or no peer heard from; timed on the replica's wall clock."""
        if not self.slot_seconds or not self.replica.peers.peers:
            return None
        rank, count = rank_of(self.replica.name, self.replica.peers.peers)
        return slot_wait(self.replica.wall(), rank, count, self.slot_seconds)

    async def start(self) -> None:
        """Connect, learn the peers' state and start the heartbeats (:meth:`SharedRunner.start`)."""
        await self.runner.start()

    async def stop(self) -> None:
        """Stop the heartbeats and disconnect."""
        await self.runner.stop()

    def describe(self) -> dict[str, object]:
        """Its kind, replica name, connection, sync and each peer's sequence, silence and endpoints."""
        now = self.replica.clock()
        return {
            "kind": self.kind,
            "replica": self.replica.name,
            "connected": self.runner.bus.connected,
            "synced": self.runner.synced,
            "peers": {
                name: {"seq": p.seq, "silent_seconds": round(now - p.seen, 3), "endpoints": len(p.loads)}
                for name, p in self.replica.peers.peers.items()
            },
        }


class SharedMetrics(SharingSink, Protocol):
    """The metrics the shared state reports to (:class:`ext_proc.metrics.Metrics` is one)."""

    def shared_connection(self, state: str) -> None:
        """The bus is now ``connected``, ``connecting`` or ``disconnected``."""
        ...

    def watch_peers(self, count: Callable[[], float]) -> None:
        """Report ``count()``, the peer replicas heard from within the timeout, when scraped."""
        ...


def build_shared_state(
    config: SharedStateConfig,
    registry: Registry,
    prefix: Callable[[], PrefixSource | None],
    metrics: SharedMetrics,
) -> SharedState:
    """The shared state ``config`` names, watching ``registry`` (not started: :meth:`SharedState.start`)."""
    if config.kind is SharedStateKind.LOCAL:
        return LocalState()
    from ext_proc.shared.nats_bus import NatsBus  # nats-py is loaded only where it is used

    replica = ReplicaState(registry, prefix, metrics, config.peer_timeout_seconds)
    metrics.watch_peers(lambda: len(replica.peers.peers))
    bus = NatsBus(config.nats, replica.name, metrics.shared_connection, replica.drop)
    return BusState(config.kind.value, replica, bus, config, metrics)
