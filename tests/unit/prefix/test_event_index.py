"""The event-fed prefix index, the recent placements and the ``kv-events`` prefix source (all pure)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.affinity import Candidate, Decision, Locality, Pool
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.event_index import ROOT, Applied, EventIndex, ReplayFrom
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kinds import KINDS
from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from ext_proc.prefix.recent import RecentPlacements
from ext_proc.prefix.settings import KvEventsSettings, PrefixSettings, PrefixSourceKind

B = 4  # tokens a block in these tests


def tokens(*blocks: int) -> list[int]:
    """Token ids of whole blocks, block ``b`` being ``B`` copies of ``b``."""
    return [b for b in blocks for _ in range(B)]


def chain(*blocks: int) -> list[int]:
    return block_hashes(tokens(*blocks), B, 1000, ROOT)


def stored(
    hashes: list[int], blocks: list[int], parent: int | None = None, medium: str | None = None
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens(*blocks)), B, None, medium)


def batch(sequence: int, *events: Event) -> EventBatch:
    return EventBatch(sequence, 0.0, 0, events)


def fed(*batches: EventBatch, address: str = "e1") -> EventIndex:
    index = EventIndex(B, stale_after=10.0, max_blocks=1000)
    for b in batches:
        assert isinstance(index.apply(address, b, 0.0, replayable=False), Applied)
    return index


def test_stored_blocks_match_a_request_chained_over_the_same_tokens() -> None:
    index = fed(batch(0, stored([101, 102], [1, 2])), batch(1, stored([103], [3], parent=102)))
    assert index.match(chain(1, 2, 3, 4), 0.0) == {"e1": 3}
    assert index.match(chain(1, 9), 0.0) == {"e1": 1}
    assert index.match(chain(2), 0.0) == {}  # a block's hash stands for its whole prefix
    assert index.blocks() == {"e1": {"GPU": 3}}


def test_the_engines_hash_form_does_not_matter() -> None:
    index = fed(batch(0, stored([b"\x01" * 32], [1]), stored([b"\x02" * 32], [2], parent=b"\x01" * 32)))
    assert index.match(chain(1, 2), 0.0) == {"e1": 2}


def test_blocks_that_cannot_be_indexed_are_dropped_by_reason() -> None:
    index = EventIndex(B, stale_after=10.0, max_blocks=2)
    index.apply("e2", batch(0, stored([9], [9])), 0.0, False)  # blocks of B tokens: the pool's size
    lora = BlockStored((1,), None, tuple(tokens(1)), B, 7, None)
    other_size = BlockStored((2,), None, (1,) * 8, 8, None, None)
    orphan = stored([3], [1], parent=999)
    applied = index.apply("e1", batch(0, lora, other_size, orphan, stored([4, 5, 6], [1, 2, 3])), 0.0, False)
    assert applied == Applied(Counter({"lora": 1, "block_size": 1, "orphan": 1, "full": 1}), None)
    assert index.match(chain(1, 2, 3), 0.0) == {"e1": 2}  # the first two blocks fitted


def sized(size: int, engine_hash: int, block: int) -> BlockStored:
    """A prompt's first block of ``size`` tokens, all ``block``."""
    return BlockStored((engine_hash,), None, (block,) * size, size, None, None)


def test_the_first_size_an_engine_reports_is_the_pools_and_another_is_dropped_until_it_is() -> None:
    index = EventIndex(16, stale_after=10.0, max_blocks=100)  # 16: the configuration's, until events come
    assert index.apply("e1", batch(0, sized(8, 1, 1)), 0.0, False) == Applied(Counter(), None)
    assert index.block_tokens == 8 and index.sizes.of("e1") == 8
    assert index.apply("e2", batch(0, sized(4, 2, 1)), 0.0, False) == Applied(
        Counter({"block_size": 1}), None
    )
    assert index.sizes.unusable() == {"e2": 4} and index.sizes.reporting(8) == 1
    assert index.match(block_hashes((1,) * 8, 8, 10, ROOT), 0.0) == {"e1": 1}
    index.forget("e1")  # the last engine of the pool's size: the next size reported becomes the pool's
    assert index.apply("e2", batch(1, sized(4, 2, 1)), 0.0, False) == Applied(Counter(), None)
    assert index.block_tokens == 4 and index.sizes.unusable() == {}
    assert index.match(block_hashes((1,) * 4, 4, 10, ROOT), 0.0) == {"e2": 1}


def test_the_only_engine_restarting_with_another_size_gives_the_pool_its_size() -> None:
    index = EventIndex(16, stale_after=10.0, max_blocks=100)
    index.apply("e1", batch(0, sized(16, 1, 1)), 0.0, False)
    index.apply("e1", batch(0, sized(32, 2, 1)), 0.0, False)  # back to 0: a restart, with 32-token blocks
    assert index.block_tokens == 32 and index.sizes.unusable() == {}
    assert index.match(block_hashes((1,) * 32, 32, 10, ROOT), 0.0) == {"e1": 1}


def test_removals_apply_per_tier_by_the_engines_hash() -> None:
    index = fed(
        batch(0, stored([1, 2], [1, 2]), stored([1, 2], [1, 2], medium="CPU")),
        batch(1, BlockRemoved((2,), None), BlockRemoved((77,), None)),  # 77: never stored, ignored
    )
    assert index.blocks() == {"e1": {"GPU": 1, "CPU": 2}}
    assert index.match(chain(1, 2), 0.0) == {"e1": 2}  # block 2 is still in the CPU tier
    index.apply("e1", batch(2, BlockRemoved((2,), "CPU")), 0.0, False)
    assert index.match(chain(1, 2), 0.0) == {"e1": 1}
    index.apply("e1", batch(3, AllBlocksCleared()), 0.0, False)
    assert index.match(chain(1), 0.0) == {} and index.blocks() == {"e1": {}}


def test_a_child_stored_in_another_tier_finds_its_parent() -> None:
    index = fed(batch(0, stored([1], [1]), stored([2], [2], parent=1, medium="CPU")))
    assert index.match(chain(1, 2), 0.0) == {"e1": 2}


def test_the_sequence_gap_asks_for_a_replay_when_one_can_be_asked_else_drops_the_entries() -> None:
    index = fed(batch(0, stored([1], [1])))
    assert index.apply("e1", batch(3, stored([2], [2])), 0.0, replayable=True) == ReplayFrom(1)
    assert index.expected("e1") == 1 and index.match(chain(2), 0.0) == {}  # nothing applied
    assert index.apply("e1", batch(3, stored([2], [2])), 0.0, replayable=False) == Applied(Counter(), "gap")
    assert index.match(chain(1), 0.0) == {} and index.match(chain(2), 0.0) == {"e1": 1}
    assert index.expected("e1") == 4


def test_a_sequence_going_back_is_a_restart_that_empties_the_endpoint() -> None:
    index = fed(batch(0, stored([1], [1])), batch(1, stored([2], [2])))
    assert index.apply("e1", batch(0, stored([3], [3])), 0.0, True) == Applied(Counter(), "restart")
    assert index.match(chain(1), 0.0) == {} and index.match(chain(3), 0.0) == {"e1": 1}
    index.apply("e1", batch(1), 0.0, True)
    went_back = index.apply("e1", batch(1), 0.0, True)
    assert went_back == ReplayFrom(0, "restart")  # went back, not to 0: ask it all
    assert index.expected("e1") is None and index.match(chain(3), 0.0) == {}


def test_joining_mid_stream_replays_from_the_start_or_takes_what_comes() -> None:
    index = EventIndex(B, 10.0, 100)
    assert index.apply("e1", batch(40, stored([1], [1])), 0.0, True) == ReplayFrom(0)
    assert index.apply("e1", batch(40, stored([1], [1])), 0.0, False) == Applied(Counter(), None)
    assert index.match(chain(1), 0.0) == {"e1": 1} and index.expected("e1") == 41


def test_an_endpoint_silent_past_the_bound_is_stale_and_holds_nothing() -> None:
    index = EventIndex(B, stale_after=10.0, max_blocks=100)
    index.watch("quiet", 0.0)
    index.apply("e1", batch(0, stored([1], [1])), 0.0, False)
    index.apply("e2", batch(0, stored([1], [1])), 5.0, False)
    assert index.match(chain(1), 10.0) == {"e1": 1, "e2": 1}
    assert index.match(chain(1), 12.0) == {"e2": 1}
    assert index.stale(12.0) == ["quiet", "e1"]
    index.apply("e1", batch(1), 12.0, False)  # publishes again: fresh, its blocks count again
    assert index.match(chain(1), 12.0) == {"e1": 1, "e2": 1}


def test_reset_and_retain_forget_endpoints() -> None:
    index = fed(batch(0, stored([1], [1])))
    index.apply("e2", batch(0, stored([1], [1])), 0.0, False)
    index.reset("e1")
    assert index.match(chain(1), 0.0) == {"e2": 1} and index.expected("e1") is None
    index.retain({"e1"})
    assert index.match(chain(1), 0.0) == {} and set(index.blocks()) == {"e1"}


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear"]), st.integers(0, 5), st.sampled_from([None, "CPU"])
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_the_index_holds_what_a_plain_model_of_the_events_holds(
    ops: list[tuple[str, int, str | None]],
) -> None:
    """Store block ``k`` as a prompt's first block (engine hash ``k``), remove it, or clear everything:
    the index matches a one-block chain exactly where a set of (tier, k) says it is held."""
    index = EventIndex(B, 10.0, 1000)
    model: set[tuple[str | None, int]] = set()
    for sequence, (op, k, medium) in enumerate(ops):
        event: Event
        if op == "store":
            event = stored([k], [k], medium=medium)
            model.add((medium, k))
        elif op == "remove":
            event = BlockRemoved((k,), medium)
            model.discard((medium, k))
        else:
            event = AllBlocksCleared()
            model.clear()
        index.apply("e", batch(sequence, event), 0.0, False)
    for k in range(6):
        held = any((m, k) in model for m in (None, "CPU"))
        assert index.match(chain(k), 0.0) == ({"e": 1} if held else {})
    assert sum(index.blocks().get("e", {}).values()) == len(model)


def test_recent_placements_count_for_their_seconds_only() -> None:
    recent = RecentPlacements(5.0)
    recent.record(chain(1, 2), "e1", 0.0)
    recent.record(chain(1), "e1", 3.0)
    recent.record(chain(1, 2, 3), "e2", 3.0)
    assert recent.match(chain(1, 2, 3), 4.0) == {"e1": 2, "e2": 3}
    assert recent.match(chain(1, 2, 3), 6.0) == {"e1": 1, "e2": 3}  # the first placement expired
    recent.retain({"e1"})
    assert recent.match(chain(1, 2, 3), 6.0) == {"e1": 1}
    assert recent.match(chain(1), 9.0) == {}


class Sink:
    def __init__(self) -> None:
        self.predicted: list[tuple[str, str, int, int]] = []

    def prefix_predicted(self, role: str, address: str, placed: int, hit: int) -> None:
        self.predicted.append((role, address, placed, hit))

    def prefix_engine(self, address: str, queries: float, hits: float, scale: float) -> None:
        raise AssertionError("the kv-events source corrects nothing")


def pool(*addresses: str) -> Pool:
    return Pool.of([Candidate(a, "g", 1000.0, 0, 0) for a in addresses])


def source(now: list[float]) -> tuple[KvEventSource, Sink]:
    sink = Sink()
    settings_ = PrefixSettings(B, 100, source="kv-events", kv_events=KvEventsSettings(recent_seconds=2.0))
    built = KINDS[PrefixSourceKind.KV_EVENTS](settings_, sink)
    assert isinstance(built, KvEventSource)
    built.clock = lambda: now[0]
    return built, sink


def test_the_source_reads_token_prompts_from_the_events_and_text_from_recent_placements() -> None:
    now = [0.0]
    kv, sink = source(now)
    kv.index.apply("p1", batch(0, stored([1, 2], [1, 2])), 0.0, False)
    body = {"model": "m", "prompt": tokens(1, 2, 3)}
    assert kv.chain(body).tolist() == chain(1, 2, 3).tolist()
    lookup = kv.lookup(kv.chain(body), pool("p1", "p2"), pool("d1"), prompt_tokens=12)
    assert lookup.matched == {"p1": 2}
    assert lookup.hits is not None and lookup.hits.prefill.tolist() == [8, 0]
    p2, d1 = pool("p2").endpoints[0], pool("d1").endpoints[0]
    kv.placed(lookup, Decision(p2, d1, (), Locality.SAME_GROUP), 12)
    assert sink.predicted == [("prefill", "p2", 12, 0), ("decode", "d1", 12, 0)]
    again = kv.lookup(kv.chain(body), pool("p1", "p2"), pool("d1"), 12)
    assert again.matched == {"p1": 2, "p2": 3, "d1": 3}  # the placement counts before its events come
    now[0] = 3.0
    assert kv.lookup(kv.chain(body), pool("p1"), pool("d1"), 12).matched == {"p1": 2}
    text = {"model": "m", "prompt": "x" * 64}
    assert kv.lookup(kv.chain(text), pool("p1"), pool("d1"), 16).matched == {}
    kv.placed(
        kv.lookup(kv.chain(text), pool("p1"), pool("d1"), 16), Decision(p2, d1, (), Locality.SAME_GROUP), 16
    )
    assert kv.lookup(kv.chain(text), pool("p2"), pool("d1"), 16).matched == {"p2": 4, "d1": 4}
    kv.observe("p1", 100.0, 50.0)  # no correction, no report
    kv.retain({"p1"})
    assert kv.lookup(kv.chain(text), pool("p2"), pool("d1"), 16).matched == {}


def test_with_the_default_block_tokens_the_source_routes_on_the_engines_128_token_blocks() -> None:
    """vLLM's CPU engines publish blocks of 128 tokens: the chain is hashed at their size, not at
    ``block_tokens`` (16 by default), and the hits are counted in their blocks."""
    sink = Sink()
    kv = KvEventSource(PrefixSettings(source="kv-events"), sink)
    kv.clock = lambda: 0.0
    prompt = [t for b in (1, 2, 3) for t in [b] * 128] + [7] * 5
    kv.index.apply(
        "p1", batch(0, BlockStored((11, 12), None, tuple(prompt[:256]), 128, None, None)), 0.0, False
    )
    body = {"model": "m", "prompt": prompt}
    assert kv.chain(body).tolist() == block_hashes(prompt, 128, 100, ROOT).tolist()
    lookup = kv.lookup(kv.chain(body), pool("p1", "p2"), pool("d1"), prompt_tokens=len(prompt))
    assert lookup.matched == {"p1": 2}
    assert lookup.hits is not None and lookup.hits.prefill.tolist() == [256, 0]
    p1, d1 = pool("p1").endpoints[0], pool("d1").endpoints[0]
    kv.placed(lookup, Decision(p1, d1, (), Locality.SAME_GROUP), len(prompt))
    assert sink.predicted == [("prefill", "p1", 389, 256), ("decode", "d1", 389, 0)]
    text = {"model": "m", "prompt": "x" * 4 * 128}  # one block of 128 4-character tokens
    kv.placed(
        kv.lookup(kv.chain(text), pool("p2"), pool("d1"), 128), Decision(p1, d1, (), Locality.SAME_GROUP), 128
    )
    assert kv.lookup(kv.chain(text), pool("p1"), pool("d1"), 128).matched == {"p1": 1, "d1": 1}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["e1", "e2", "e3"]), st.lists(st.integers(1, 4), max_size=4), st.floats(0, 3)
        ),
        max_size=20,
    ),
    st.sets(st.sampled_from(["e1", "e2", "e3"])),
)
def test_recent_placements_match_what_was_placed_within_the_window_and_leave_nothing_behind(
    placements: list[tuple[str, list[int], float]], kept: set[str]
) -> None:
    recent = RecentPlacements(2.0)
    now = 0.0
    log: list[tuple[float, str, list[int]]] = []
    for address, blocks, step in placements:
        now += step
        recent.record(chain(*blocks), address, now)
        log.append((now, address, blocks))
        for probe in ([1], [1, 2], [4, 4]):
            expected: dict[str, int] = {}
            for t, a, b in log:
                if t >= now - 2.0:
                    depth = next((i for i, (x, y) in enumerate(zip(b, probe, strict=False)) if x != y), None)
                    depth = min(len(b), len(probe)) if depth is None else depth
                    if depth:
                        expected[a] = max(expected.get(a, 0), depth)
            assert recent.match(chain(*probe), now) == expected
    recent.retain(kept)
    assert set(recent.match(chain(1), now)) <= kept
    recent.expire(now + 10)
    assert recent._stamps == {} and recent.match(chain(1), now + 10) == {}


def test_the_gpu_match_tells_a_cpu_tier_hit_apart() -> None:
    """e1 holds blocks 1-2 in GPU memory and 3-4 only in the CPU tier; e2 all in GPU memory."""
    index = fed(
        batch(0, stored([1, 2], [1, 2]), stored([3, 4], [3, 4], parent=2, medium="CPU")),
        batch(1, stored([2], [2], parent=1, medium="CPU")),  # also offloaded: still in GPU memory
    )
    index.apply("e2", batch(0, stored([1, 2, 3, 4], [1, 2, 3, 4], medium="HBM")), 0.0, False)
    hashes = chain(1, 2, 3, 4)
    matched = index.match(hashes, 0.0)
    assert matched == {"e1": 4, "e2": 4}
    assert index.match_gpu(hashes, matched) == {"e1": 2, "e2": 4}
    assert index.match_gpu(hashes, {"e2": 4}) is None  # every block of e2 in GPU memory
    index.apply("e1", batch(2, BlockRemoved((2,), None)), 0.0, False)  # evicted from GPU memory
    assert index.match_gpu(hashes, index.match(hashes, 0.0)) == {"e1": 1, "e2": 4}
    index.apply("e1", batch(3, BlockRemoved((3, 4), "CPU")), 0.0, False)
    assert index.match(hashes, 0.0)["e1"] == 2  # block 2 still held in the CPU tier
    index.apply("e1", batch(4, AllBlocksCleared()), 0.0, False)
    assert index.match_gpu(hashes, {"e1": 0, "e2": 4}) is None and index.match(hashes, 0.0) == {"e2": 4}


def test_the_source_hands_the_decision_the_cpu_tier_part_of_each_hit() -> None:
    now = [0.0]
    kv, _ = source(now)
    kv.index.apply(
        "p1", batch(0, stored([1], [1]), stored([2, 3], [2, 3], parent=1, medium="CPU")), 0.0, False
    )
    kv.index.apply("d1", batch(0, stored([1, 2, 3], [1, 2, 3])), 0.0, False)
    body = {"model": "m", "prompt": tokens(1, 2, 3)}
    lookup = kv.lookup(kv.chain(body), pool("p1", "p2"), pool("d1"), prompt_tokens=12)
    assert lookup.hits is not None
    assert lookup.hits.prefill.tolist() == [12, 0] and lookup.hits.decode.tolist() == [12]
    assert lookup.hits.prefill_cpu is not None and lookup.hits.decode_cpu is not None
    assert lookup.hits.prefill_cpu.tolist() == [8, 0] and lookup.hits.decode_cpu.tolist() == [0]
    p1, d1 = pool("p1").endpoints[0], pool("d1").endpoints[0]
    kv.placed(lookup, Decision(p1, d1, (), Locality.SAME_GROUP), 12)  # now in p1's GPU memory too
    again = kv.lookup(kv.chain(body), pool("p1", "p2"), pool("d1"), 12)
    assert again.hits is not None and again.hits.prefill_cpu is not None
    assert again.hits.prefill_cpu.tolist() == [0, 0]
    kv.index.apply("p1", batch(1, BlockRemoved((2, 3), "CPU")), 0.0, False)
    gpu_only = kv.lookup(kv.chain(body), pool("p2"), pool("d1"), 12)
    assert gpu_only.hits is not None and gpu_only.hits.prefill_cpu is None  # no tier holds a block now


def test_an_adapters_token_chain_matches_its_own_placements_never_the_base_models_blocks() -> None:
    """The index holds the base model's blocks (an adapter's, with a ``lora_id``, are dropped); an
    adapter's request chains its token ids from the adapter's seed: no credit from the base model's
    blocks, credit from the adapter's own recent placements, and none of them for the base model."""
    now = [0.0]
    kv, _ = source(now)
    kv.index.apply("p1", batch(0, stored([1, 2], [1, 2])), 0.0, False)
    lora = kv.index.apply("p2", batch(0, BlockStored((9,), None, tuple(tokens(1)), B, 3, None)), 0.0, False)
    assert isinstance(lora, Applied) and lora.dropped == Counter({"lora": 1})
    base, sql = {"model": "base", "prompt": tokens(1, 2, 3)}, {"model": "sql-lora", "prompt": tokens(1, 2, 3)}
    assert kv.chain(base, adapter=False).tolist() == chain(1, 2, 3).tolist()
    assert kv.lookup_prompt(base, None, pool("p1", "p2"), pool("d1"), 12).matched == {"p1": 2}
    looked = kv.lookup_prompt(sql, None, pool("p1", "p2"), pool("d1"), 12, adapter=True)
    assert looked is not None and looked.matched == {}
    p2, d1 = pool("p2").endpoints[0], pool("d1").endpoints[0]
    kv.placed(looked, Decision(p2, d1, (), Locality.SAME_GROUP), 12)
    again = kv.lookup_prompt(sql, None, pool("p1", "p2"), pool("d1"), 12, adapter=True)
    assert again is not None and again.matched == {"p2": 3, "d1": 3}
    assert kv.lookup_prompt(base, None, pool("p1", "p2"), pool("d1"), 12).matched == {"p1": 2}
