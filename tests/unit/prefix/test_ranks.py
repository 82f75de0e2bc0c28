"""Data-parallel ranks in the ``kv-events`` index: a publisher a rank, one rank credited and pinned."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ext_proc.affinity import Candidate, Decision, Locality, Pool
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.event_index import ROOT
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kv_events import BlockStored, EventBatch
from ext_proc.prefix.ranks import credited, credited_publisher, endpoint_of, publisher
from ext_proc.prefix.settings import KvEventsSettings, PrefixSettings

B = 4
DP = "10.0.0.1:8000"  # an engine of 4 data-parallel ranks
ONE = "10.0.0.2:8000"  # an engine of one


def tokens(*blocks: int) -> list[int]:
    return [b for b in blocks for _ in range(B)]


def stored(sequence: int, first_hash: int, *blocks: int) -> EventBatch:
    hashes = tuple(range(first_hash, first_hash + len(blocks)))
    return EventBatch(sequence, 0.0, None, (BlockStored(hashes, None, tuple(tokens(*blocks)), B),))


def source() -> KvEventSource:
    settings = PrefixSettings(B, 100, source="kv-events", kv_events=KvEventsSettings(recent_seconds=2.0))
    kv = KvEventSource(settings, Sink())
    kv.clock = lambda: 0.0
    return kv


class Sink:
    def prefix_predicted(self, role: str, address: str, placed: int, hit: int) -> None:
        pass

    def prefix_engine(self, address: str, queries: float, hits: float, scale: float) -> None:
        pass


def pools() -> tuple[Pool[Candidate], Pool[Candidate]]:
    dp, one = Candidate(DP, "g", 1000.0, 0, 0, 4), Candidate(ONE, "g", 1000.0, 0, 0)
    return Pool.of([dp, one]), Pool.of([dp, one])


def test_a_publisher_is_the_address_for_one_rank_else_the_address_and_its_rank() -> None:
    assert publisher(ONE, 0, 1) == ONE == endpoint_of(ONE)
    assert publisher(DP, 0, 4) == f"{DP}@dp0" and publisher(DP, 3, 4) == f"{DP}@dp3"
    assert endpoint_of(f"{DP}@dp3") == DP and endpoint_of("[::1]:8000@dp1") == "[::1]:8000"


def test_an_endpoint_of_several_ranks_is_credited_its_best_rank_only_when_pinned() -> None:
    matched = {ONE: 2, f"{DP}@dp0": 1, f"{DP}@dp2": 3, f"{DP}@dp3": 3}
    assert credited(matched, pinned=True) == ({ONE: 2, DP: 3}, {DP: 2})  # the lowest of the best
    assert credited(matched, pinned=False) == ({ONE: 2}, {})
    assert credited({ONE: 2}, pinned=True) == ({ONE: 2}, {})
    assert credited_publisher(DP, {DP: 2}) == f"{DP}@dp2" and credited_publisher(ONE, {DP: 2}) == ONE


@given(st.dictionaries(st.integers(0, 7), st.integers(1, 50), min_size=1))
def test_the_rank_credited_holds_the_most_and_is_the_lowest_of_those(held: dict[int, int]) -> None:
    blocks, ranks = credited({f"{DP}@dp{r}": n for r, n in held.items()}, pinned=True)
    best = max(held.values())
    assert blocks == {DP: best} and ranks == {DP: min(r for r, n in held.items() if n == best)}


def test_the_source_keeps_each_rank_apart_and_credits_and_records_the_pinned_one() -> None:
    kv = source()
    kv.index.apply(f"{DP}@dp1", stored(0, 100, 1, 2), 0.0, False)
    kv.index.apply(f"{DP}@dp2", stored(0, 200, 1), 0.0, False)
    kv.index.apply(ONE, stored(0, 300, 1), 0.0, False)
    prefills, decodes = pools()
    prompt = block_hashes(tokens(1, 2, 3), B, 100, ROOT)
    lookup = kv.lookup(prompt, prefills, decodes, 12, pinned=True)
    assert lookup.matched == {DP: 2, ONE: 1} and lookup.ranks == {DP: 1}
    assert lookup.hits is not None and lookup.hits.prefill.tolist() == [8, 4]
    unpinned = kv.lookup(prompt, prefills, decodes, 12)
    assert unpinned.matched == {ONE: 1} and unpinned.ranks == {}  # no rank can be promised
    dp, one = prefills.endpoints
    kv.placed(lookup, Decision(dp, one, (), Locality.SAME_GROUP), 12)  # pinned to rank 1 at DP
    assert kv.recent.match(prompt, 0.0) == {f"{DP}@dp1": 3, ONE: 3}
    kv.placed(unpinned, Decision(dp, one, (), Locality.SAME_GROUP), 12)  # rank unknown: not recorded
    other = block_hashes(tokens(7, 8), B, 100, ROOT)
    kv.placed(kv.lookup(other, prefills, decodes, 8), Decision(dp, one, (), Locality.SAME_GROUP), 8)
    assert kv.recent.match(other, 0.0) == {ONE: 2}
    kv.retain({ONE})  # the engine of several ranks left: each rank is forgotten
    assert kv.index.blocks() == {ONE: {"GPU": 1}} and kv.recent.match(prompt, 0.0) == {ONE: 3}


def test_a_cpu_tier_hit_is_read_from_the_rank_credited() -> None:
    kv = source()
    kv.index.apply(f"{DP}@dp0", stored(0, 100, 1, 2), 0.0, False)
    cpu = BlockStored((201, 202), None, tuple(tokens(1, 2)), B, None, "CPU")
    kv.index.apply(f"{DP}@dp1", EventBatch(0, 0.0, 1, (cpu,)), 0.0, False)
    kv.index.apply(
        f"{DP}@dp1", EventBatch(1, 0.0, 1, (BlockStored((203,), 202, tuple(tokens(3)), B),)), 0.0, False
    )
    prefills, decodes = pools()
    lookup = kv.lookup(block_hashes(tokens(1, 2, 3), B, 100, ROOT), prefills, decodes, 12, pinned=True)
    assert lookup.ranks == {DP: 1} and lookup.hits is not None and lookup.hits.prefill_cpu is not None
    assert lookup.hits.prefill.tolist() == [12, 0] and lookup.hits.prefill_cpu.tolist() == [12, 0]


def test_the_index_forgets_one_rank() -> None:
    kv = source()
    for rank in range(2):
        kv.index.apply(f"{DP}@dp{rank}", stored(0, 100 * rank, 1), 0.0, False)
    kv.index.forget(f"{DP}@dp1")
    kv.index.forget("never-watched")
    assert kv.index.blocks() == {f"{DP}@dp0": {"GPU": 1}}
