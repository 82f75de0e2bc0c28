"""The recent placements against a naive reference.

They keep their blocks in compiled open-addressing tables (:mod:`ext_proc.prefix.table`); the
reference keeps a log of the placements and answers what the recent placements answered when they
kept Python sets: a chain's leading blocks placed per endpoint in the last seconds."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.prefix.recent import RecentPlacements


def leading(chain: Sequence[int], held: set[int]) -> int:
    depth = 0
    while depth < len(chain) and chain[depth] in held:
        depth += 1
    return depth


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
import numba
from ext_proc.prefix import event_source, recent
from ext_proc.prefix.blocks import block_hashes
kernels = {n: k for n, k in vars(recent).items() if isinstance(k, numba.core.registry.CPUDispatcher)}
event_source.warm()
before = {n: len(k.signatures) for n, k in kernels.items()}
placed = recent.RecentPlacements(2.0)
for n in range(200):
    chain = block_hashes(list(range(n, n + 1 + n % 60)), 1, 100)
    placed.record(chain if n % 2 else chain.tolist(), f"e{n % 3}", n / 10)
    placed.match(chain[:5], n / 10)
    placed.match(chain.tolist(), n / 10)
print(len(kernels), min(before.values()), before == {n: len(k.signatures) for n, k in kernels.items()})
"""


def test_warm_compiles_every_kernel_the_recent_placements_call() -> None:
    """After :func:`~ext_proc.prefix.event_source.warm` (in a fresh process), recording (arrays and
    lists), matching, expiring and rebuilding the recent placements' tables compile nothing more."""
    result = subprocess.run(
        [sys.executable, "-c", WARM_THEN_USE], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    kernels, fewest_signatures, unchanged = result.stdout.split()
    assert int(kernels) >= 6 and fewest_signatures == "1" and unchanged == "True"
