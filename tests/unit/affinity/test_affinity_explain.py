"""Property tests of :func:`ext_proc.affinity.explain.explain` against the naive per-pair reference of
tests/unit/affinity/test_affinity_properties.py: every pair it lists is priced as docs/routing.md "The
exact rule" prices it, the list holds the cheapest pairs of all, the decision is ``choose``'s and its
pair is the cheapest."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from test_affinity_properties import (
    Keys,
    as_hits,
    choose,
    no_deadline,
    pair_cost,
    scenarios,
    tiered_scenarios,
)

from ext_proc.affinity import Candidate, Cost, Mode, NoPair, Policy, Pool
from ext_proc.affinity.explain import PairCost, explain


def _explained(scenario: tuple, limit: int):
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    pools = Pool.of(prefills), Pool.of(decodes)
    return explain(cost, *pools, policy, tiebreak, as_hits(hits), limit)


def _reference_costs(scenario: tuple) -> dict[tuple[int | None, int], int]:
    """Every allowed pair's documented cost, by pool positions (decode-only: the decode key)."""
    cost, prefills, decodes, policy, _, hits = scenario
    keys = Keys(cost, prefills, decodes, policy, hits)
    if not prefills:
        return {(None, j): keys.decode(d) for j, d in enumerate(decodes)}
    return {
        (i, j): c
        for i, p in enumerate(prefills)
        for j, d in enumerate(decodes)
        if (c := pair_cost(keys, p, d)) is not None
    }


@no_deadline
@given(st.one_of(scenarios(), tiered_scenarios()), st.integers(1, 12))
def test_the_listed_pairs_are_the_cheapest_priced_by_the_documented_rule(scenario: tuple, limit: int) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    explained = _explained(scenario, limit)
    reference = _reference_costs(scenario)
    for pair in explained.pairs:
        assert reference[(pair.prefill, pair.decode)] == pair.cost
        if pair.prefill is not None:
            assert pair.same_group == (prefills[pair.prefill].group == decodes[pair.decode].group)
    assert [p.cost for p in explained.pairs] == sorted(reference.values())[:limit]
    result = choose(cost, prefills, decodes, policy, tiebreak, hits)
    assert explained.decision == result
    if isinstance(result, NoPair):
        assert explained.chosen is None
        return
    assert explained.chosen is not None and explained.pairs
    assert explained.chosen.cost == explained.pairs[0].cost  # the decision's pair is a cheapest one
    assert explained.seconds == (policy.mode is Mode.AUTO and bool(prefills))


def test_the_terms_of_a_prefer_decision_and_its_spill_price() -> None:
    """Two groups; the prefill of ``a`` with its idle home decode, against the bonus of going out."""
    prefills = [Candidate("p-a", "a", 1000.0, 0, 0), Candidate("p-b", "b", 1000.0, 500, 0)]
    decodes = [Candidate("d-a", "a", 1000.0, 600, 0), Candidate("d-b", "b", 1000.0, 0, 0)]
    policy = Policy(Mode.PREFER, bonus=0.3)
    pools = Pool.of(prefills), Pool.of(decodes)
    tokens = [pool.tokens.copy() for pool in pools]
    explained = explain(Cost(100, 200), *pools, policy, 0)
    assert explained.prefill_keys == [100_000_000, 600_000_000]  # (0 + 100) / 1000, (500 + 100) / 1000
    assert explained.decode_keys == [800_000_000, 200_000_000]  # (600 + 200) / 1000, (0 + 200) / 1000
    assert explained.decode_away_keys == [1_100_000_000, 500_000_000]  # + the bonus 0.3
    assert explained.pairs[:2] == [PairCost(0, 1, False, 600_000_000), PairCost(1, 1, True, 800_000_000)]
    assert explained.chosen == explained.pairs[0]
    assert (explained.decision.prefill.address, explained.decision.decode.address) == ("p-a", "d-b")
    assert all((pool.tokens == before).all() for pool, before in zip(pools, tokens, strict=True))


def test_strict_lists_no_pair_across_groups_and_none_without_one() -> None:
    prefills = [Candidate("p", "a", 1000.0, 0, 0)]
    decodes = [Candidate("d", "b", 1000.0, 0, 0)]
    explained = explain(Cost(10, 20), Pool.of(prefills), Pool.of(decodes), Policy(Mode.STRICT), 0)
    assert isinstance(explained.decision, NoPair) and explained.pairs == [] and explained.chosen is None
    assert explained.decode_away_keys == [None]


def test_large_pools_list_only_the_limit() -> None:
    rng = np.random.default_rng(7)
    prefills = [Candidate(f"p{i}", f"g{i % 8}", 4096.0, int(rng.integers(4000)), 0) for i in range(256)]
    decodes = [Candidate(f"d{i}", f"g{i % 8}", 4096.0, int(rng.integers(4000)), 0) for i in range(256)]
    explained = explain(Cost(100, 200), Pool.of(prefills), Pool.of(decodes), Policy(Mode.AUTO), 0, limit=5)
    assert len(explained.pairs) == 5 and explained.chosen.cost == explained.pairs[0].cost
