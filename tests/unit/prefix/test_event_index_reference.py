"""The event-fed index and the recent placements against naive references.

Both keep their blocks in compiled open-addressing tables (:mod:`ext_proc.prefix.table`); the
references keep Python sets and answer what the sources answered when they did the same: a chain's
leading blocks held per endpoint, in any tier and in the GPU tiers, and per tier the blocks held."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.event_index import GPU_TIERS, ROOT, EventIndex
from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from ext_proc.prefix.recent import RecentPlacements

B = 2  # tokens a block
MAX_BLOCKS = 24  # blocks kept per endpoint: small, so "full" happens


def ours(path: Sequence[int]) -> list[int]:
    """Our chained hashes of the blocks of ``path`` (block ``b``: ``B`` copies of token ``b``)."""
    return block_hashes([b for b in path for _ in range(B)], B, 1000, ROOT).tolist()


def engine(path: Sequence[int]) -> str:
    """The engine's hash of the last block of ``path`` (any value naming the path does)."""
    return "/".join(map(str, path))


def leading(chain: Sequence[int], held: set[int]) -> int:
    depth = 0
    while depth < len(chain) and chain[depth] in held:
        depth += 1
    return depth


class NaiveEvents:
    """Per endpoint, (tier, engine hash) → our hash: held where any entry says so."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[tuple[str, str], int]] = {}

    def store(self, address: str, path: tuple[int, ...], start: int, tier: str) -> None:
        stored = self.stored.setdefault(address, {})
        if start and not any(k[1] == engine(path[:start]) for k in stored):  # an orphan
            return
        for j, h in enumerate(ours(path)[start:], start + 1):
            key = (tier, engine(path[:j]))
            if key in stored:
                continue
            if len(stored) == MAX_BLOCKS:
                return
            stored[key] = h

    def remove(self, address: str, paths: list[tuple[int, ...]], tier: str) -> None:
        for path in paths:
            self.stored.get(address, {}).pop((tier, engine(path)), None)

    def match(self, chain: list[int]) -> dict[str, int]:
        depth = {a: leading(chain, set(s.values())) for a, s in self.stored.items()}
        return {a: n for a, n in depth.items() if n}

    def match_gpu(self, chain: list[int], matched: dict[str, int]) -> dict[str, int] | None:
        tiered = [a for a in matched if any(t not in GPU_TIERS for t, _ in self.stored[a])]
        if not tiered:
            return None
        gpu = {
            a: leading(chain, {h for (t, _), h in self.stored[a].items() if t in GPU_TIERS}) for a in tiered
        }
        return {a: gpu.get(a, n) for a, n in matched.items()}

    def blocks(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for address, stored in self.stored.items():
            tiers = counts.setdefault(address, {})
            for tier, _ in stored:
                tiers[tier] = tiers.get(tier, 0) + 1
        return counts


_PATH = st.lists(st.integers(1, 3), min_size=1, max_size=6).map(tuple)
_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "store", "remove", "clear"]),
        st.sampled_from(["e1", "e2"]),
        _PATH,
        st.integers(1, 6),
        st.sampled_from(["GPU", "CPU", "HBM"]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_EVENTS, st.lists(_PATH, min_size=1, max_size=4))
def test_the_event_index_answers_what_a_naive_model_of_its_events_answers(
    events: list[tuple[str, str, tuple[int, ...], int, str]], probes: list[tuple[int, ...]]
) -> None:
    """Runs of blocks stored with their parents (orphans too), removed, cleared, in three tiers on two
    endpoints, past the blocks an endpoint keeps: after every batch, the matches of every probe in any
    tier and in the GPU tiers, and the blocks per tier, are the naive model's."""
    index = EventIndex(B, stale_after=10.0, max_blocks=MAX_BLOCKS)
    naive = NaiveEvents()
    sequences = {"e1": 0, "e2": 0}
    for op, address, path, run, tier in events:
        start = max(0, len(path) - run)
        medium = None if tier == "GPU" else tier
        event: Event
        if op == "store":
            parent = engine(path[:start]) if start else None
            tokens = tuple(b for b in path[start:] for _ in range(B))
            hashes = tuple(engine(path[:j]) for j in range(start + 1, len(path) + 1))
            event = BlockStored(hashes, parent, tokens, B, None, medium)
            naive.store(address, path, start, tier)
        elif op == "remove":
            prefixes = [path[:j] for j in range(start + 1, len(path) + 1)]
            event = BlockRemoved(tuple(engine(p) for p in prefixes), medium)
            naive.remove(address, prefixes, tier)
        else:
            event = AllBlocksCleared()
            naive.stored.pop(address, None)
        index.apply(address, EventBatch(sequences[address], 0.0, 0, (event,)), 0.0, replayable=False)
        sequences[address] += 1
        for probe in probes:
            chain = ours(probe)
            matched = index.match(block_hashes([b for b in probe for _ in range(B)], B, 1000, ROOT), 0.0)
            assert matched == naive.match(chain)
            assert index.match(chain, 0.0) == matched  # as Python ints too
            assert index.match_gpu(chain, matched) == naive.match_gpu(chain, matched)
        assert {a: t for a, t in index.blocks().items() if t} == {
            a: t for a, t in naive.blocks().items() if t
        }


def test_a_block_placed_only_before_the_window_is_not_held_beside_later_ones() -> None:
    """The endpoint's table still has the expired block (it is dropped when the table is rebuilt)."""
    recent = RecentPlacements(2.0)
    recent.record([5, 7], "e1", 0.0)
    recent.record([6], "e1", 1.0)
    recent.record([5], "e2", 1.0)
    assert recent.match([5, 7], 2.5) == {"e2": 1} and recent.match([6], 2.5) == {"e1": 1}
    recent.record([5], "e1", 2.5)
    assert recent.match([5, 7], 2.5) == {"e1": 1, "e2": 1}


_HASHES = st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=12, unique=True)


@settings(max_examples=200, deadline=None)
@given(
    _HASHES,
    st.lists(
        st.tuples(
            st.sampled_from(["record", "record", "record", "retain"]),
            st.sampled_from(["e1", "e2", "e1@dp1"]),
            st.lists(st.integers(0, 11), max_size=40),
            st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.5, 2.5]),
        ),
        max_size=40,
    ),
    st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=10), min_size=1, max_size=4),
)
def test_recent_placements_answer_what_a_naive_log_of_them_answers(
    pool: list[int],
    ops: list[tuple[str, str, list[int], float]],
    probes: list[list[int]],
) -> None:
    """Any hash sequences (not only chains: a block held need not follow a held one), placed at
    repeated and advancing times on endpoints and ranks, some endpoints retained: every probe matches,
    as of each step, the leading blocks a naive log of the unexpired placements holds (long sequences
    fill the tables, which are rebuilt without their expired blocks)."""
    seconds = 2.0
    recent = RecentPlacements(seconds)
    log: list[tuple[float, str, set[int]]] = []
    now = 0.0
    for op, address, picks, step in ops:
        now += step
        hashes = [pool[i % len(pool)] for i in picks]
        if op == "record":
            recent.record(hashes, address, now)
            if hashes:
                log.append((now, address, set(hashes)))
        else:
            recent.retain({address.partition("@")[0]})
            log = [p for p in log if p[1].partition("@")[0] == address.partition("@")[0]]
        for probe in probes:
            chain = [pool[i % len(pool)] for i in probe]
            held: dict[str, set[int]] = {}
            for when, where, blocks in log:
                if when >= now - seconds:
                    held.setdefault(where, set()).update(blocks)
            expected = {a: leading(chain, blocks) for a, blocks in held.items()}
            assert recent.match(chain, now) == {a: n for a, n in expected.items() if n}
    recent.expire(now + seconds + 1)
    assert recent.match([pool[0]], now + seconds + 1) == {} and recent._stamps == {}


WARM_THEN_USE = """
import numba, numpy as np
from ext_proc.prefix import event_index, event_source, recent, table
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
kernels = {
    (m.__name__, n): k
    for m in (table, event_index, recent)
    for n, k in vars(m).items()
    if isinstance(k, numba.core.registry.CPUDispatcher)
}
event_source.warm()
before = {n: len(k.signatures) for n, k in kernels.items()}
index, placed = event_index.EventIndex(1, 10.0, 1000), recent.RecentPlacements(2.0)
for n in range(200):
    ids = tuple(range(n, n + 1 + n % 60))
    stored = BlockStored(ids, None, ids, 1, None, "CPU" if n % 3 else None)
    index.apply("e", EventBatch(2 * n, 0.0, 0, (stored,)), 0.0, False)
    chain = block_hashes(list(ids), 1, 100)
    index.match_gpu(chain, index.match(chain, 0.0))
    index.match(chain.tolist(), 0.0)
    placed.record(chain if n % 2 else chain.tolist(), f"e{n % 3}", n / 10)
    placed.match(chain[:5], n / 10)
    placed.match(chain.tolist(), n / 10)
    last = AllBlocksCleared() if n % 50 == 49 else BlockRemoved(ids[: n % 7], stored.medium)
    index.apply("e", EventBatch(2 * n + 1, 0.0, 0, (last,)), 0.0, False)
print(len(kernels), min(before.values()), before == {n: len(k.signatures) for n, k in kernels.items()})
"""


def test_warm_compiles_every_kernel_the_sources_tables_call() -> None:
    """After :func:`~ext_proc.prefix.event_source.warm` (in a fresh process), applying events (growing
    and shrinking the tables), matching (arrays and lists) and recording, expiring and rebuilding the
    recent placements compile nothing more."""
    result = subprocess.run(
        [sys.executable, "-c", WARM_THEN_USE], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    kernels, fewest_signatures, unchanged = result.stdout.split()
    assert int(kernels) >= 10 and fewest_signatures == "1" and unchanged == "True"
