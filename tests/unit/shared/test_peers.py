"""The peers' loads: batches replace what they name, stale ones are refused, silent peers age out."""

from __future__ import annotations

from ext_proc.shared.peers import PeerLoads
from ext_proc.shared.wire import Batch, Load

P, D = ("prefill", "10.0.0.1:80"), ("decode", "10.0.1.1:80")


def batch(replica: str, seq: int, loads: list[tuple[tuple[str, str], int, int]], full: bool = False) -> Batch:
    return Batch(replica, seq, 0.0, full, 0, tuple(Load(k[0], k[1], t, r) for k, t, r in loads), ())


def test_totals_sum_the_peers_and_a_partial_batch_replaces_only_what_it_names() -> None:
    peers = PeerLoads(5.0)
    assert peers.apply(batch("a", 0, [(P, 100, 1), (D, 300, 1)], full=True), 0.0) == {P, D}
    peers.apply(batch("b", 0, [(D, 50, 2)], full=True), 0.0)
    assert peers.total(D) == (350, 3) and peers.total(P) == (100, 1)
    assert peers.apply(batch("a", 1, [(P, 0, 0)]), 0.1) == {P}
    assert peers.total(P) == (0, 0) and peers.total(D) == (350, 3)
    assert P not in peers.totals()


def test_a_full_batch_drops_what_it_leaves_out() -> None:
    peers = PeerLoads(5.0)
    peers.apply(batch("a", 0, [(P, 100, 1), (D, 300, 1)], full=True), 0.0)
    assert peers.apply(batch("a", 1, [(D, 200, 1)], full=True), 0.0) == {P, D}
    assert peers.totals() == {D: (200, 1)}


def test_a_repeated_or_older_batch_is_stale() -> None:
    peers = PeerLoads(5.0)
    peers.apply(batch("a", 3, [(P, 100, 1)], full=True), 0.0)
    assert peers.apply(batch("a", 3, [(P, 999, 9)]), 0.0) is None
    assert peers.apply(batch("a", 2, [(P, 999, 9)]), 0.0) is None
    assert peers.total(P) == (100, 1)
    assert peers.apply(batch("a", 9, [(P, 10, 1)]), 0.0) == {P}  # after a gap: absolute values apply


def test_a_silent_peer_is_forgotten_with_its_load() -> None:
    peers = PeerLoads(5.0)
    peers.apply(batch("a", 0, [(P, 100, 1)], full=True), 0.0)
    peers.apply(batch("b", 0, [(P, 7, 1)], full=True), 4.0)
    assert peers.expire(5.0) == ([], set())
    assert peers.expire(5.5) == (["a"], {P})
    assert peers.total(P) == (7, 1) and list(peers.peers) == ["b"]


def test_peers_beyond_the_bound_are_refused() -> None:
    peers = PeerLoads(5.0, max_peers=2)
    assert peers.apply(batch("a", 0, [(P, 1, 1)]), 0.0) is not None
    assert peers.apply(batch("b", 0, [(P, 1, 1)]), 0.0) is not None
    assert peers.apply(batch("c", 0, [(P, 1, 1)]), 0.0) is None
    assert peers.total(P) == (2, 2)
