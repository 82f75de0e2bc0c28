"""One replica's side of the shared state, free of any bus: what it tells its peers, what it applies.

:class:`ReplicaState` watches this replica's own charges and releases (:meth:`Registry.watch
<ext_proc.registry.Registry.watch>`) and its prefix source's placements (:meth:`placed`), and turns them
into :mod:`~ext_proc.shared.wire` messages (:meth:`batch`, :meth:`sync_answer`); it applies the peers'
messages (:meth:`receive`) to the registry's endpoints (their ``peer_tokens`` and ``peer_requests``) and
to the prefix source (:meth:`~ext_proc.prefix.kinds.PrefixSource.learned`), and forgets silent peers
(:meth:`expire`). A bus (:mod:`ext_proc.shared.runner`) decides when to send and carries the bytes;
nothing here waits, and the request path only marks an endpoint changed or appends a placement.

What a message may not do: a message that does not decode, a batch of a sender this replica already
heard newer from, or of a new sender while :attr:`PeerLoads.max_peers
<ext_proc.shared.peers.PeerLoads.max_peers>` peers are heard from, is dropped and counted by reason
(:meth:`drop`), the first of each reason logged; load on an endpoint this replica does not know is
kept (discovery may lag behind a peer's) and applied once the endpoint is known; a placement of another
prompt hashing (``fingerprint``) or on an endpoint not known is not applied (counted). A replica's own
messages (NATS may echo them) are ignored.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ext_proc.prefix.blocks import Chain
from ext_proc.prefix.kinds import PrefixSource
from ext_proc.prefix.lookup import Holder
from ext_proc.prefix.ranks import RANK_MARK
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.registry import EndpointState, Registry
from ext_proc.shared import wire
from ext_proc.shared.peers import Key, PeerLoads

log = logging.getLogger(__name__)

MAX_PENDING_PLACEMENTS = 4096
"""Placements kept for the next batch at most; more (the bus is slower than the requests) are dropped."""


class SharingSink(Protocol):
    """Where the shared state reports (:class:`ext_proc.metrics.Metrics` is one)."""

    def shared_sent(self, kind: str, size: int) -> None:
        """One message of ``kind``, ``size`` bytes, was sent."""
        ...

    def shared_received(self, kind: str, size: int, lag_seconds: float | None) -> None:
        """One peer message of ``kind`` was applied; ``lag_seconds`` since its stamp (batches only)."""
        ...

    def shared_dropped(self, reason: str) -> None:
        """One message (or placement) was not applied or not sent, for ``reason``."""
        ...

    def shared_sync_request(self, outcome: str) -> None:
        """One peer's sync request was ``answered``, ``coalesced`` or ``refused``."""
        ...


def replica_name() -> str:
    """A name for this process, new at every start: host, process id and a random part (<= 64 chars)."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"


class ReplicaState:
    """This replica's shared state (module docstring).

    ``registry``: the endpoints whose loads are shared. ``prefix``: the prefix source in force (read at
    each use: a reload replaces it). ``sink``: the metrics. ``timeout_seconds``: a peer silent this long is
    forgotten. ``clock`` (monotonic seconds) times the peers' silence, ``wall`` (seconds since the epoch)
    stamps the batches (the receivers' sync lag) and
    times the decision slots (:mod:`ext_proc.shared.slots`)."""

    def __init__(
        self,
        registry: Registry,
        prefix: Callable[[], PrefixSource | None],
        sink: SharingSink,
        timeout_seconds: float,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.name = name or replica_name()
        self.registry = registry
        self.peers = PeerLoads(timeout_seconds)
        self._prefix = prefix
        self._sink = sink
        self.clock = clock
        self.wall = wall
        self._seq = 0
        self._dirty: dict[tuple[str, str], EndpointState] = {}
        self._placements: list[wire.Placed] = []
        self._fingerprint: tuple[tuple[PrefixSettings, int] | None, int] = (None, 0)
        self._pools = (registry.prefill_pool, registry.decode_pool)
        self._logged: set[str] = set()
        self.on_change: Callable[[], None] | None = None
        """Called once when something is pending after nothing was (the bus schedules a batch)."""
        registry.watch(self.booked)

    # -- this replica's side ------------------------------------------------------------------------

    def booked(self, state: EndpointState) -> None:
        """``state``'s own load changed (a charge or a release of this replica's)."""
        if not self._dirty and not self._placements and self.on_change is not None:
            self.on_change()
        self._dirty[state.role.value, state.address] = state

    def placed(self, chain: Chain, holders: Sequence[Holder]) -> None:
        """This replica placed the prompt of ``chain`` on ``holders`` (its prefix source's record)."""
        if not holders or not len(chain):
            return
        if len(self._placements) >= MAX_PENDING_PLACEMENTS:
            self.drop("backlog", "placements pile up faster than the bus takes them")
            return
        if not self._dirty and not self._placements and self.on_change is not None:
            self.on_change()
        self._placements.append(wire.Placed(tuple(holders), chain[: wire.MAX_CHAIN_BLOCKS]))

    @property
    def pending(self) -> bool:
        """Whether a batch has something to say."""
        return bool(self._dirty or self._placements)

    def batch(self, full: bool = False) -> bytes:
        """The next batch to publish: changed loads and new placements.

        The endpoints whose own load changed since the last (``full``: every endpoint this replica
        charges), and the placements since the last. Both are then cleared."""
        states = self._charged() if full else list(self._dirty.values())
        placements, self._placements, self._dirty = tuple(self._placements), [], {}
        return self._encode(states, full, placements)

    def _charged(self) -> list[EndpointState]:
        return [s for s in self.registry.endpoints() if s.own_requests or s.own_tokens]

    def _encode(
        self, states: Sequence[EndpointState], full: bool, placements: tuple[wire.Placed, ...]
    ) -> bytes:
        loads = tuple(wire.Load(s.role.value, s.address, s.own_tokens, s.own_requests) for s in states)
        batch = wire.Batch(self.name, self._seq, self.wall(), full, self.fingerprint(), loads, placements)
        self._seq += 1
        return wire.encode_batch(batch)

    def sync_request(self) -> bytes:
        """The message a starting replica sends its peers (they answer with :meth:`sync_answer`)."""
        return wire.encode_sync_request(wire.SyncRequest(self.name))

    def sync_answer(self) -> list[bytes]:
        """The answer to a peer's sync request: a full batch, then the prefix index, oldest blocks first."""
        answer = [self._encode(self._charged(), True, ())]  # what is pending goes to every peer later
        prefix = self._prefix()
        if prefix is None:
            return answer
        step, print_ = wire.MAX_CHAIN_BLOCKS, self.fingerprint()
        for name, capacity, held in prefix.snapshot():
            parts = [held[i : i + step] for i in range(0, len(held), step)]
            for part in reversed(parts):  # the least recently used part first: the last one learned wins
                answer.append(wire.encode_index_part(wire.IndexPart(self.name, print_, name, capacity, part)))
        return answer

    def fingerprint(self) -> int:
        """What identifies the prompt hashing in force (0: none).

        The prefix source's kind, the block size it hashes at now (``kv-events``: the engines' events give
        it) and the blocks of a prompt."""
        prefix = self._prefix()
        if prefix is None:
            return 0
        hashing = (prefix.settings, prefix.block_tokens)
        if self._fingerprint[0] != hashing:
            settings = prefix.settings
            self._fingerprint = (hashing, wire.fingerprint(settings.source, hashing[1], settings.max_blocks))
        return self._fingerprint[1]

    # -- the peers' side ----------------------------------------------------------------------------

    def receive(self, payload: bytes) -> wire.Message | None:
        """Apply one message from the bus.

        Returns the peer's message it held (a :class:`~ext_proc.shared.wire.SyncRequest` is for the bus to
        answer, :meth:`sync_answer`), or ``None`` when it was dropped (counted by reason) or is this
        replica's own."""
        try:
            message = wire.decode(payload)
        except wire.WireError as exc:
            self.drop(exc.reason, str(exc))
            return None
        if message.replica == self.name:
            return None
        if isinstance(message, wire.SyncRequest):
            self._sink.shared_received("sync_request", len(payload), None)
            return message
        if isinstance(message, wire.IndexPart):
            self._sink.shared_received("index", len(payload), None)
            self._learn(message.fingerprint, message.chain, ((message.name, message.capacity),))
            return message
        peers = self.peers
        if message.replica not in peers.peers and len(peers.peers) >= peers.max_peers:
            self.drop("too_many_peers", f"{message.replica}: {peers.max_peers} peers are heard from already")
            return None
        changed = peers.apply(message, self.clock())
        if changed is None:
            self.drop("stale", f"batch {message.seq} of {message.replica}: not newer than the last applied")
            return None
        self._sink.shared_received("batch", len(payload), max(0.0, self.wall() - message.sent))
        self._apply(changed)
        for placed in message.placements:
            self._learn(message.fingerprint, placed.chain, placed.holders)
        return message

    def expire(self) -> None:
        """Forget the silent peers and apply the loads of new endpoints.

        The silent peers' charges go with them; the loads applied are those of endpoints that discovery
        brought since the last call (their peers' charges may have arrived before them)."""
        pools = (self.registry.prefill_pool, self.registry.decode_pool)
        if pools != self._pools:
            self._pools = pools
            self._apply(set(self.peers.totals()))
        gone, changed = self.peers.expire(self.clock())
        if gone:
            log.warning(
                "shared state: no word from %s for %.0f s: their bookings are dropped",
                ", ".join(gone),
                self.peers.timeout_seconds,
            )
        self._apply(changed)

    def _apply(self, keys: set[Key]) -> None:
        for role, address in keys:
            state = self.registry.find(role, address)
            if state is not None:
                state.set_peer_load(*self.peers.total((role, address)))

    def _learn(self, print_: int, chain: Chain, holders: Sequence[Holder]) -> None:
        prefix = self._prefix()
        if prefix is None or print_ != self.fingerprint():
            self.drop("hashing", "a placement hashed otherwise (another prefix source or block size)")
            return
        known = [h for h in holders if self._known(h[0])]
        if len(known) < len(holders):
            self.drop("unknown_endpoint", f"a placement on {[h[0] for h in holders]}: not all are known here")
        if known and len(chain):
            prefix.learned(chain, known)

    def _known(self, name: str) -> bool:
        address = name.partition(RANK_MARK)[0]
        return any(self.registry.find(role, address) is not None for role in ("prefill", "decode"))

    def drop(self, reason: str, detail: str, cause: BaseException | None = None) -> None:
        """Count one message (or part) not applied or not sent for ``reason``.

        Counted in ``sink.shared_dropped``; the first of each cause is logged at WARNING: of each reason,
        and of each type of ``cause`` (an exception, whose traceback the line carries)."""
        self._sink.shared_dropped(reason)
        key = reason if cause is None else f"{reason}/{type(cause).__name__}"
        if key not in self._logged:
            self._logged.add(key)
            log.warning(
                "shared state: a message dropped (%s): %s; later ones are only counted",
                reason,
                detail,
                exc_info=cause,
            )
