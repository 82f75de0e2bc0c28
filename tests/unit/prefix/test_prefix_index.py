"""The prefix index: prompt content, chained block hashes, the per-endpoint LRU, self-correction."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ext_proc.affinity import Candidate, Decision, Locality, Pool
from ext_proc.prefix.blocks import block_hashes, prompt_content
from ext_proc.prefix.correction import MIN_QUERY_TOKENS, MIN_SCALE, Interval, corrected_scale
from ext_proc.prefix.index import PrefixIndex
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.prefix.tracker import PrefixTracker

# ---------------------------------------------------------------- prompt content and hashing


def test_prompt_content_of_every_body_shape() -> None:
    chat = {"messages": [{"role": "system", "content": "abc"}, {"content": [{"text": "de"}, {"x": 1}]}]}
    assert prompt_content(chat) == "abcde"
    assert prompt_content({"prompt": "hello"}) == "hello"
    assert prompt_content({"prompt": ["ab", "cd"]}) == "abcd"
    assert prompt_content({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_content({"prompt": [[1, 2], [3]]}) == [1, 2, 3]
    assert prompt_content({"input": [{"role": "user", "content": "xy"}]}) == "xy"
    assert prompt_content({"input": "text"}) == "text"
    assert prompt_content({"model": "m"}) is None
    assert prompt_content({"prompt": []}) is None


def test_text_blocks_are_four_characters_a_token_and_only_full_blocks_count() -> None:
    text = "a" * 64 + "b" * 64 + "c" * 10
    hashes = block_hashes(text, 16, 100).tolist()
    assert len(hashes) == 2  # 64 characters a block; the partial tail is not cached
    assert block_hashes(text[:128] + "zzz", 16, 100).tolist() == hashes
    assert block_hashes("a" * 64 + "x" * 64, 16, 100).tolist()[:1] == hashes[:1]
    assert block_hashes("a" * 64 + "x" * 64, 16, 100)[1] != hashes[1]
    assert block_hashes(text, 16, 1).tolist() == hashes[:1]


def test_a_block_hash_stands_for_its_whole_prefix() -> None:
    a = block_hashes("x" * 64 + "y" * 64, 16, 10)
    b = block_hashes("z" * 64 + "y" * 64, 16, 10)
    assert a[1] != b[1]  # same second block, different first: different chains


def test_token_id_blocks_and_seeds() -> None:
    ids = list(range(40))
    hashes = block_hashes(ids, 16, 10).tolist()
    assert len(hashes) == 2
    assert block_hashes(ids[:32], 16, 10).tolist() == hashes
    assert block_hashes(ids, 16, 10, seed=1).tolist() != hashes  # another model: another chain


# ---------------------------------------------------------------- the index


def pool(*addresses: str) -> Pool:
    return Pool.of([Candidate(a, "g", 1000.0, 0, 0) for a in addresses])


def chain(*blocks: str) -> list[int]:
    return block_hashes("".join(b * 64 for b in blocks), 16, 1000).tolist()


def test_match_is_the_longest_held_prefix_per_endpoint() -> None:
    index = PrefixIndex(16)
    index.record(chain("a", "b", "c"), "p1", 1e6)
    index.record(chain("a", "b"), "p2", 1e6)
    index.record(chain("x"), "p3", 1e6)
    assert index.match(chain("a", "b", "c", "d")) == {"p1": 3, "p2": 2}
    assert index.match(chain("a", "z")) == {"p1": 1, "p2": 1}
    assert index.match(chain("q")) == {}
    assert index.match([]) == {}


def test_hits_align_with_the_pools_and_are_capped_at_the_prompt() -> None:
    index = PrefixIndex(16)
    index.record(chain("a", "b", "c"), "p1", 1e6)
    index.record(chain("a"), "d2", 1e6)
    matched = index.match(chain("a", "b", "c"))
    hits = index.hit_arrays.hits(matched, pool("p0", "p1"), pool("d1", "d2"), prompt_tokens=40)
    assert hits is not None
    assert hits.prefill.tolist() == [0, 40] and hits.decode.tolist() == [0, 16]
    assert (
        index.hit_arrays.hits(matched, pool("p0"), pool("d1"), 40) is None
    )  # nobody of these pools holds it
    assert index.hit_arrays.hits({}, pool("p1"), pool("d2"), 40) is None


def test_the_lru_keeps_capacity_over_block_tokens_blocks_and_evicts_the_oldest_prompt_tail_first() -> None:
    index = PrefixIndex(16)
    index.record(chain("a", "b", "c"), "p", 5 * 16)  # room for 5 blocks
    index.record(chain("x", "y"), "p", 5 * 16)
    assert index.blocks("p") == 5
    index.record(chain("z"), "p", 5 * 16)  # one more: the oldest prompt loses its tail block
    assert index.match(chain("a", "b", "c")) == {"p": 2}
    assert index.match(chain("x", "y")) == {"p": 2}
    index.record(chain("a", "b"), "p", 5 * 16)  # touched: now the most recent
    index.record(chain("w", "v"), "p", 5 * 16)
    assert index.match(chain("a", "b")) == {"p": 2}
    assert index.match(chain("x", "y")) == {}  # the least recent went first


def test_retain_forgets_endpoints_and_reuses_their_slots() -> None:
    index = PrefixIndex(16)
    index.record(chain("a"), "p1", 1e6)
    index.record(chain("a"), "p2", 1e6)
    index.retain({"p2"})
    assert index.match(chain("a")) == {"p2": 1}
    assert index.addresses == ["p2"]
    index.record(chain("b"), "p3", 1e6)
    assert index.match(chain("b")) == {"p3": 1} and index.match(chain("a")) == {"p2": 1}


def test_set_scale_shrinks_an_endpoints_capacity_now() -> None:
    index = PrefixIndex(16)
    index.record(chain("a", "b", "c", "d"), "p", 4 * 16)
    index.set_scale("p", 0.5, 4 * 16)
    assert index.scale("p") == 0.5 and index.blocks("p") == 2
    assert index.match(chain("a", "b", "c", "d")) == {"p": 2}  # the head stays
    assert index.scale("unknown") == 1.0


def test_an_endpoints_table_follows_its_capacity_down_and_up() -> None:
    index = PrefixIndex(16)
    index.record(chain(*"abcdefghijklmnopqrstuvwxyz" * 3), "p", 100 * 16)
    assert index.blocks("p") == 78 and len(index._lrus["p"].table) == 256  # at most half full
    index.set_scale("p", 0.05, 100 * 16)
    assert index.blocks("p") == 5 and len(index._lrus["p"].table) == 16
    index.set_scale("p", 1.0, 100 * 16)
    index.record(chain(*"ABCDEFGHIJKLMNOPQRSTUVWXYZ" * 3), "p", 100 * 16)
    assert index.blocks("p") == 83 and len(index._lrus["p"].table) == 256


class NaiveLru:
    """The index's contract, one ordered set per endpoint, matched by scanning."""

    def __init__(self) -> None:
        self.lrus: dict[str, OrderedDict[int, None]] = {}

    def record(self, hashes: list[int], address: str, keep: int) -> None:
        lru = self.lrus.setdefault(address, OrderedDict())
        for h in reversed(hashes):
            lru.pop(h, None)
            lru[h] = None
        while len(lru) > keep:
            lru.popitem(last=False)

    def match(self, hashes: list[int]) -> dict[str, int]:
        out = {}
        for address, lru in self.lrus.items():
            n = 0
            while n < len(hashes) and hashes[n] in lru:
                n += 1
            if n:
                out[address] = n
        return out


prompts = st.lists(st.sampled_from("abcdef"), min_size=0, max_size=8).map(lambda s: chain(*s))
operations = st.lists(
    st.tuples(prompts, st.sampled_from(["p1", "p2", "p3", "d1"]), st.integers(1, 12)), max_size=40
)


@settings(deadline=None)
@given(operations, prompts)
def test_the_index_matches_a_naive_lru_model(ops: list, probe: list[int]) -> None:
    index, naive = PrefixIndex(16), NaiveLru()
    for hashes, address, keep in ops:
        index.record(hashes, address, keep * 16)
        naive.record(hashes, address, keep)
        assert index.match(probe) == naive.match(probe)
    for address in naive.lrus:
        assert index.blocks(address) == len(naive.lrus[address])


@pytest.mark.parametrize("seed", range(6))
def test_the_index_matches_a_naive_lru_model_over_prompts_that_continue_earlier_ones(seed: int) -> None:
    """Held heads touched again (their old positions superseded), on endpoints that evict often,
    now and then, and never (whose positions kept are then numbered again)."""
    rng = random.Random(seed)
    keeps = {"p1": 3, "p2": 20, "d1": 10_000}  # blocks kept
    index, naive, prompts = PrefixIndex(16), NaiveLru(), [[]]
    for _ in range(300):
        before = rng.choice(prompts)
        prompts.append(before[: rng.randrange(61)] + rng.choices("abc", k=rng.randrange(31)))
        hashes, address = chain(*prompts[-1]), rng.choice(list(keeps))
        index.record(hashes, address, keeps[address] * 16)
        naive.record(hashes, address, keeps[address])
        for probe in (hashes, chain(*before)):
            assert index.match(probe) == naive.match(probe)
        assert index.blocks(address) == len(naive.lrus[address])


# Hashes that share a home slot in every table size: Fibonacci hashing's home is the top bits of the
# hash times an odd constant, so its inverse times a small m has home 0, and times -1 - m the last slot
# (probe runs that wrap). With -1 (the empty slots' stamp), 0 and int64's extremes, and random ones.
_INVERSE = pow(0x9E3779B97F4A7C15, -1, 2**64)


def _signed(value: int) -> int:
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


CRAFTED = (
    [_signed(_INVERSE * m) for m in range(1, 150)]
    + [_signed(_INVERSE * (2**64 - 1 - m)) for m in range(120)]
    + [-1, 0, -(2**63), 2**63 - 1]
    + [_signed(random.Random(7).getrandbits(64 * 127) >> (64 * i)) for i in range(127)]
)
assert len(set(CRAFTED)) == len(CRAFTED)
addresses, capacities = st.sampled_from(["p1", "p2", "d1"]), st.integers(1, 48)  # capacities in blocks
index_operations = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.text("abc", max_size=8), addresses, capacities, st.booleans()),
        st.tuples(st.just("scale"), addresses, st.sampled_from([0.05, 0.2, 0.5, 1.0]), capacities),
        st.tuples(st.just("retain"), st.sets(addresses)),
    ),
    max_size=60,
)


@settings(deadline=None, max_examples=200)
@given(index_operations, st.permutations(CRAFTED), st.lists(st.text("abc", max_size=8), max_size=4))
def test_the_index_matches_a_naive_lru_model_at_its_tables_edges(
    ops: list, keys: list[int], probes: list[str]
) -> None:
    """Blocks whose hashes share home slots (long probe runs, wrapping, deletions shifting entries
    back), the hash -1, capacities that grow and shrink (tables rebuilt both ways), positions numbered
    again, endpoints forgotten; chains as lists and as arrays. A block's hash is its whole prefix's."""
    node: dict[str, int] = {}

    def hashes(prompt: str) -> list[int]:
        return [node.setdefault(prompt[: n + 1], keys[len(node)]) for n in range(len(prompt))]

    index, naive, keep = PrefixIndex(16), NaiveLru(), {}
    for op in ops:
        if op[0] == "record":
            _, prompt, address, blocks, as_array = op
            chain = hashes(prompt)
            index.record(np.array(chain, dtype=np.int64) if as_array else chain, address, blocks * 16)
            keep[address] = max(1, int(blocks * index.scale(address)))
            naive.record(chain, address, keep[address])
        elif op[0] == "scale":
            _, address, scale, blocks = op
            index.set_scale(address, scale, blocks * 16)
            keep[address] = max(1, int(blocks * scale))
            naive.record([], address, keep[address])
        else:
            index.retain(op[1])
            naive.lrus = {a: lru for a, lru in naive.lrus.items() if a in op[1]}
            keep = {a: k for a, k in keep.items() if a in op[1]}
        for probe in [*probes, *(op[1:2] if op[0] == "record" else [])]:
            assert index.match(hashes(probe)) == naive.match(hashes(probe))
        assert sorted(index.addresses) == sorted(keep)
        for address, lru in naive.lrus.items():
            assert index.blocks(address) == len(lru)
            table = index._lrus[address].table
            assert (table[:, 1] != -1).sum() == len(lru) and 2 * len(lru) <= len(table)


@pytest.mark.parametrize("seed", range(8))
def test_the_index_matches_a_naive_lru_model_as_its_positions_wrap_and_are_numbered_again(seed: int) -> None:
    """Chains touched again and again (their old positions left in the ring) on an endpoint that holds
    all it is given, then evicts, in turns: rings filled to the last position, renumbered, grown."""
    rng = random.Random(seed)
    bases = [rng.choices("abcd", k=40) for _ in range(3)]
    index, naive = PrefixIndex(16), NaiveLru()
    keep = 10_000
    for step in range(600):
        if step % 50 == 0:
            keep = rng.choice([10_000, rng.randrange(1, 60)])
            index.set_scale("p", 1.0, keep * 16)
            naive.record([], "p", keep)
        hashes = chain(*rng.choice(bases)[: rng.randrange(1, 41)], *rng.choices("xy", k=rng.randrange(3)))
        index.record(hashes, "p", keep * 16)
        naive.record(hashes, "p", keep)
        assert index.match(hashes) == naive.match(hashes) and index.blocks("p") == len(naive.lrus["p"])
    for base in bases:
        assert index.match(chain(*base)) == naive.match(chain(*base))


WARM_THEN_USE = """
import numba, numpy as np
from ext_proc.prefix import index
kernels = {n: k for n, k in vars(index).items() if isinstance(k, numba.core.registry.CPUDispatcher)}
index.warm()
before = {n: len(k.signatures) for n, k in kernels.items()}
i = index.PrefixIndex(16)
for n in range(300):
    chain = np.arange(n, n + 1 + n % 40, dtype=np.int64)
    i.record(chain if n % 2 else chain.tolist(), f"e{n % 3}", 16 * (1 + n % 200))
    i.match(chain[:5])
    i.match(chain.tolist())
    i.set_scale("e1", 0.05 if n % 7 else 1.0, 16 * 200)
i.retain({"e0"})
print(len(kernels), min(before.values()), before == {n: len(k.signatures) for n, k in kernels.items()})
"""


def test_warm_compiles_every_kernel_the_index_calls() -> None:
    """After :func:`~ext_proc.prefix.index.warm` (in a fresh process), recording and matching (lists
    and arrays), growing, shrinking and renumbering compile nothing more."""
    result = subprocess.run(
        [sys.executable, "-c", WARM_THEN_USE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    kernels, fewest_signatures, unchanged = result.stdout.split()
    assert int(kernels) >= 8 and fewest_signatures == "1" and unchanged == "True"


# ---------------------------------------------------------------- self-correction


def test_no_evidence_no_correction() -> None:
    assert corrected_scale(0.7, Interval(0, 0, 1e6, 1e6)) == 0.7
    assert corrected_scale(0.7, Interval(1e4, 1e4, MIN_QUERY_TOKENS - 1, 0)) == 0.7


def test_optimistic_predictions_shrink_at_most_by_half_and_pessimistic_ones_grow_back() -> None:
    assert corrected_scale(1.0, Interval(1e4, 9e3, 1e4, 6e3)) == pytest.approx(6 / 9)
    assert corrected_scale(1.0, Interval(1e4, 9e3, 1e4, 0)) == 0.5
    assert corrected_scale(0.25, Interval(1e4, 3e3, 1e4, 6e3)) == 0.5
    assert corrected_scale(0.25, Interval(1e4, 0, 1e4, 6e3)) == 0.5
    assert corrected_scale(0.9, Interval(1e4, 3e3, 1e4, 9e3)) == 1.0
    assert corrected_scale(0.5, Interval(1e4, 5e3, 1e4, 5.4e3)) == 0.5  # within the margin
    assert corrected_scale(0.5, Interval(5e-324, 5e-324, 1e4, 0)) == 0.5  # less than a token: no evidence


@given(
    st.floats(MIN_SCALE, 1.0),
    st.floats(0, 1e6),
    st.floats(0, 1.0),
    st.floats(0, 1e7),
    st.floats(0, 1.0),
)
@example(1.0, 5e-324, 0.75, 4096.0, 0.75)  # a denormal placed count: its predicted rate rounds to 1
def test_the_scale_stays_in_its_bounds_and_moves_toward_the_engine(
    scale: float, placed: float, predicted: float, queries: float, hit: float
) -> None:
    seen = Interval(placed, predicted * placed, queries, hit * queries)
    new = corrected_scale(scale, seen)
    assert MIN_SCALE <= new <= 1.0
    if new < scale:
        assert predicted > hit
    if new > scale:
        assert predicted < hit


class Sink:
    def __init__(self) -> None:
        self.predicted: list[tuple] = []
        self.engine: list[tuple] = []

    def prefix_predicted(self, role: str, address: str, placed: int, hit: int) -> None:
        self.predicted.append((role, address, placed, hit))

    def prefix_engine(self, address: str, queries: float, hits: float, scale: float) -> None:
        self.engine.append((address, queries, hits, scale))


def test_the_tracker_records_both_engines_and_corrects_from_the_counters() -> None:
    sink = Sink()
    tracker = PrefixTracker(PrefixSettings(), sink)
    prefill = Candidate("p", "g", 64 * 100, 0, 0)
    decode = Candidate("d", "g", 64 * 100, 0, 0)
    body = {"model": "m", "messages": [{"role": "user", "content": "a" * 64 * 8}]}
    hashes = tracker.chain(body)
    assert len(hashes) == 8
    lookup = tracker.lookup(hashes, Pool.of([prefill]), Pool.of([decode]), 128)
    assert lookup.hits is None
    tracker.placed(lookup, Decision(prefill, decode, (), Locality.SAME_GROUP), 128)
    again = tracker.lookup(hashes, Pool.of([prefill]), Pool.of([decode]), 128)
    assert again.hits is not None and again.hits.prefill.tolist() == [128] == again.hits.decode.tolist()
    assert tracker.chain({**body, "model": "other"}).tolist() != hashes.tolist()
    for _ in range(40):  # the index predicts every prompt held whole; the engine finds none of it
        tracker.placed(again, Decision(prefill, decode, (), Locality.SAME_GROUP), 128)
    assert sink.predicted[-1] == ("decode", "d", 128, 128)
    tracker.observe("p", 0.0, 0.0)  # the first sample only sets the baseline
    for _ in range(40):
        tracker.placed(again, Decision(prefill, decode, (), Locality.SAME_GROUP), 128)
    tracker.observe("p", 40 * 128.0, 0.0)
    assert tracker.index.scale("p") == 0.5 and tracker.index.scale("d") == 1.0
    assert sink.engine == [("p", 40 * 128.0, 0.0, 0.5)]
    tracker.observe("p", 10.0, 0.0)  # counters went back: the engine restarted, a new baseline
    assert tracker.index.scale("p") == 0.5 and len(sink.engine) == 1
    tracker.retain({"d"})
    assert tracker.index.addresses == ["d"]
