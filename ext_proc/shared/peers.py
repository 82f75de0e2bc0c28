"""The peers' in-flight load as one replica knows it: applied from their batches, aged out (pure).

:class:`PeerLoads` keeps, per peer replica, the last charges it reported per endpoint (``(role,
address)``), the sequence of its last batch and when that arrived (this replica's monotonic clock, in
seconds). A batch replaces what it names: a full batch everything of its sender, a partial one the
endpoints it lists. A batch whose sequence is not newer than the last applied of its sender is stale
(NATS delivers one publisher's messages in order, so only a repeat is); after a gap the partial batch
is applied all the same (its values are absolute) and the sender's next full batch mends the rest. A
peer silent for ``timeout_seconds`` is forgotten, with its charges: a replica that died or was cut off
holds nothing here after that. The totals per endpoint are the sums over the peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ext_proc.shared.wire import Batch

Key = tuple[str, str]
"""An endpoint: (role, address)."""


@dataclass(slots=True)
class Peer:
    """What one peer replica reported, and when it arrived.

    ``loads`` (tokens, requests) by endpoint, its last ``seq`` and ``sent`` (its wall clock), and ``seen``
    (this replica's monotonic clock when it arrived)."""

    seq: int
    seen: float
    sent: float
    loads: dict[Key, tuple[int, int]] = field(default_factory=dict)


class PeerLoads:
    """The peers' charges per endpoint (module docstring); at most ``max_peers`` peers at once."""

    def __init__(self, timeout_seconds: float, max_peers: int = 64) -> None:
        self.timeout_seconds = timeout_seconds
        self.max_peers = max_peers
        self.peers: dict[str, Peer] = {}
        self._totals: dict[Key, tuple[int, int]] = {}

    def apply(self, batch: Batch, now: float) -> set[Key] | None:
        """Apply one peer's ``batch``; the endpoints whose totals it may change.

        ``batch`` arrived at ``now``. ``None`` instead of the endpoints when it is stale (not newer than
        its sender's last) or its sender would be one peer too many."""
        peer = self.peers.get(batch.replica)
        if peer is None:
            if len(self.peers) >= self.max_peers:
                return None
            peer = self.peers[batch.replica] = Peer(batch.seq, now, batch.sent)
        elif batch.seq <= peer.seq:
            return None
        peer.seq, peer.seen, peer.sent = batch.seq, now, batch.sent
        changed = {(x.role, x.address) for x in batch.loads}
        if batch.full:
            changed.update(peer.loads)
            peer.loads = {}
        for x in batch.loads:
            if x.tokens or x.requests:
                peer.loads[x.role, x.address] = (x.tokens, x.requests)
            else:
                peer.loads.pop((x.role, x.address), None)
        self._sum(changed)
        return changed

    def expire(self, now: float) -> tuple[list[str], set[Key]]:
        """Forget the peers silent for ``timeout_seconds``.

        Silent by ``now``; returns their names, and the endpoints whose totals changed."""
        gone = [n for n, p in self.peers.items() if now - p.seen > self.timeout_seconds]
        changed: set[Key] = set()
        for name in gone:
            changed.update(self.peers.pop(name).loads)
        self._sum(changed)
        return gone, changed

    def total(self, key: Key) -> tuple[int, int]:
        """The peers' (tokens, requests) in flight on endpoint ``key``."""
        return self._totals.get(key, (0, 0))

    def totals(self) -> dict[Key, tuple[int, int]]:
        """Every endpoint some peer charges, with the peers' (tokens, requests) in flight there."""
        return dict(self._totals)

    def _sum(self, keys: set[Key]) -> None:
        for key in keys:
            tokens = requests = 0
            for peer in self.peers.values():
                t, r = peer.loads.get(key, (0, 0))
                tokens += t
                requests += r
            if tokens or requests:
                self._totals[key] = (tokens, requests)
            else:
                self._totals.pop(key, None)
