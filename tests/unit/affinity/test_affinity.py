"""Unit tests for the pure routing decision :func:`ext_proc.affinity.choose`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import count

import numpy as np
import pytest

import ext_proc.affinity as affinity
from ext_proc.affinity import (
    Candidate,
    Cost,
    Decision,
    Locality,
    Mode,
    NoPair,
    NoPairReason,
    Policy,
    Pool,
    choose,
)
from ext_proc.affinity.decide import ticks

FREE = Cost(prefill_tokens=0, decode_tokens=0)
_ids = count()


def ep(
    group: str = "g1",
    tokens: int = 0,
    cap: float = 1000.0,
    reqs: int = 0,
    name: str | None = None,
) -> Candidate:
    """An endpoint; with the default capacity ``u = tokens / 1000`` at zero cost."""
    address = name if name is not None else f"10.0.0.{next(_ids)}:8000"
    return Candidate(
        address=address, group=group, token_capacity=cap, active_tokens=tokens, active_requests=reqs
    )


def policy(mode: Mode, bonus: float = 0.3, fallbacks: int = 2) -> Policy:
    return Policy(mode=mode, bonus=bonus, fallback_count=fallbacks)


def decide(
    prefills: Sequence[Candidate],
    decodes: Sequence[Candidate],
    mode: Mode = Mode.PREFER,
    bonus: float = 0.3,
    fallbacks: int = 2,
    cost: Cost = FREE,
    tiebreak: int = 0,
) -> Decision:
    """``choose`` that must succeed."""
    result = choose(cost, Pool.of(prefills), Pool.of(decodes), policy(mode, bonus, fallbacks), tiebreak)
    assert isinstance(result, Decision), result
    return result


def reject(
    prefills: Sequence[Candidate],
    decodes: Sequence[Candidate],
    mode: Mode = Mode.PREFER,
    tiebreak: int = 0,
) -> NoPair:
    """``choose`` that must reject."""
    result = choose(FREE, Pool.of(prefills), Pool.of(decodes), policy(mode), tiebreak)
    assert isinstance(result, NoPair), result
    return result


ALL_MODES = pytest.mark.parametrize("mode", list(Mode))


# ---------------------------------------------------------------- API and rejections


def test_package_exports_choose_and_every_model_type() -> None:
    expected = {"choose", "Candidate", "Cost", "Decision", "Locality", "Mode", "Policy", "Pool"}
    expected |= {"Endpoint", "NoPairReason", "NoPair", "AutoModel", "Estimate", "Hits", "Lacks"}
    assert set(affinity.__all__) == expected
    assert all(hasattr(affinity, name) for name in affinity.__all__)


@ALL_MODES
def test_no_decodes_rejects_with_no_decode_endpoint(mode: Mode) -> None:
    rejection = reject([ep("g1")], [], mode)
    assert rejection.reason is NoPairReason.NO_DECODE_ENDPOINT
    assert "decode" in rejection.message


def test_no_endpoints_at_all_rejects_with_no_decode_endpoint() -> None:
    assert reject([], [], Mode.STRICT).reason is NoPairReason.NO_DECODE_ENDPOINT


def test_strict_rejects_when_no_prefill_group_has_decodes() -> None:
    rejection = reject([ep("a"), ep("b")], [ep("c"), ep("d")], Mode.STRICT)
    assert rejection.reason is NoPairReason.NO_SAME_GROUP_DECODE
    assert "'a'" in rejection.message and "'b'" in rejection.message
    assert "strict" in rejection.message


@pytest.mark.parametrize("mode", [Mode.OFF, Mode.PREFER])
def test_non_strict_modes_route_across_groups_when_prefill_group_has_no_decodes(mode: Mode) -> None:
    prefill, decode = ep("a"), ep("c")
    result = decide([prefill], [decode], mode)
    assert (result.prefill, result.decode, result.locality) == (prefill, decode, Locality.CROSS_GROUP)


# ---------------------------------------------------------------- decode-only routing


@ALL_MODES
def test_no_prefills_routes_decode_only_in_every_mode(mode: Mode) -> None:
    decodes = [ep("a", 500), ep("b", 100), ep("a", 300)]
    result = decide([], decodes, mode, fallbacks=2)
    assert result.prefill is None
    assert result.locality is Locality.DECODE_ONLY
    assert result.decode is decodes[1]
    assert result.fallbacks == (decodes[2], decodes[0])  # ranked by u over all decodes, as in off


def test_decode_only_ignores_the_bonus() -> None:
    decodes = [ep("", 200), ep("g", 100)]
    assert decide([], decodes, Mode.PREFER, bonus=1.0).decode is decodes[1]


# ---------------------------------------------------------------- prefill choice


def test_prefill_with_lowest_utilisation_wins() -> None:
    prefills = [ep("g1", 700), ep("g1", 200), ep("g1", 400)]
    assert decide(prefills, [ep("g1")]).prefill is prefills[1]


def test_prefill_utilisation_uses_capacity_not_raw_tokens() -> None:
    small = ep("g1", 300, cap=1000.0)  # u = 0.3
    big = ep("g1", 1000, cap=8000.0)  # u = 0.125 despite more tokens
    assert decide([small, big], [ep("g1")]).prefill is big


def test_prefill_cost_steers_a_big_prompt_away_from_a_small_endpoint() -> None:
    small = ep("g1", 0, cap=1000.0)
    big = ep("g1", 500, cap=4000.0)
    decodes = [ep("g1")]
    assert decide([small, big], decodes, cost=Cost(100, 100)).prefill is small  # 0.1 < 0.15
    assert decide([small, big], decodes, cost=Cost(900, 900)).prefill is big  # 0.9 > 0.35


def test_strict_prefill_only_among_groups_with_decodes() -> None:
    idle_orphan = ep("orphan", 0)
    busy = ep("g1", 900)
    result = decide([idle_orphan, busy], [ep("g1", 500)], Mode.STRICT)
    assert result.prefill is busy
    assert result.locality is Locality.SAME_GROUP


@pytest.mark.parametrize("mode", [Mode.OFF, Mode.PREFER])
def test_non_strict_prefill_choice_ignores_decode_groups(mode: Mode) -> None:
    idle_orphan = ep("orphan", 0)
    result = decide([idle_orphan, ep("g1", 900)], [ep("g1", 500)], mode)
    assert result.prefill is idle_orphan


def demo_shape(a_prefill: int, b_prefill: int, a_decode: int, b_decode: int) -> tuple[list, list]:
    """The demo's shape: rack-a 2 prefills + 3 decodes, rack-b 1 prefill + 2 decodes of half the
    capacity, with those in-flight tokens on each prefill and decode of the group."""
    prefills = [ep("a", a_prefill, name="pa0"), ep("a", a_prefill, name="pa1"), ep("b", b_prefill, name="pb")]
    decodes = [ep("a", a_decode) for _ in range(3)] + [ep("b", b_decode, cap=500.0) for _ in range(2)]
    return prefills, decodes


@pytest.mark.parametrize("mode", [Mode.PREFER, Mode.STRICT])
def test_a_lone_prefill_before_small_decodes_does_not_outweigh_their_headroom(mode: Mode) -> None:
    """r(a) = (2/3) / (3/4) = 8/9: rack-a's prefills' 300 tokens in flight weigh 0.267, rack-b's idle
    prefill 0; with decodes at 0.1 (rack-a) and 0.386 (rack-b) rack-a's pair costs 0.367 < 0.386
    (unweighed, 0.4 > 0.386: rack-b's prefill would win)."""
    prefills, decodes = demo_shape(300, 0, 100, 193)
    result = decide(prefills, decodes, mode)
    assert result.prefill.group == "a" and result.decode.group == "a"
    assert decide(prefills, decodes, Mode.OFF).prefill.address == "pb"


@pytest.mark.parametrize("mode", [Mode.PREFER, Mode.STRICT])
def test_idle_prefills_weigh_alike_whatever_their_group(mode: Mode) -> None:
    """Only the tokens in flight are weighed by r(g) (here 1/2 and 2), not the prompt itself: on an
    idle cluster every prefill ties and the rotation reaches each."""
    prefills = [ep("a", name="pa"), ep("b", name="pb"), ep("b", name="pc")]
    decodes = [ep("a"), ep("a"), ep("b")]
    picks = {
        decide(prefills, decodes, mode, cost=Cost(100, 200), tiebreak=t).prefill.address for t in range(6)
    }
    assert picks == {"pa", "pb", "pc"}


@pytest.mark.parametrize("mode", [Mode.PREFER, Mode.STRICT])
@pytest.mark.parametrize("better", ["a", "b"])
def test_at_the_decode_balanced_split_the_decode_headroom_decides(mode: Mode, better: str) -> None:
    """Requests split by decode capacity (3/4 to rack-a's two prefills, 1/4 to rack-b's one) load
    them 300 and 200: alike once scaled, so the group with the better decode gets the request."""
    prefills, decodes = demo_shape(
        300, 200, 100 if better == "a" else 120, 55
    )  # decode u: a 0.1|0.12, b 0.11
    assert decide(prefills, decodes, mode).prefill.group == better


def test_groups_of_one_shape_keep_the_plain_utilisation() -> None:
    """r = 1 when every group holds the same share of both pools: the less loaded prefill wins."""
    prefills = [ep("a", 100), ep("b", 0, name="idle")]
    decodes = [ep("a", 100), ep("b", 140)]
    assert decide(prefills, decodes).prefill.address == "idle"  # 0 + 0.14 < 0.1 + 0.1


# ---------------------------------------------------------------- off


def test_off_picks_global_minimum_ignoring_groups() -> None:
    decodes = [ep("g1", 100), ep("g2", 50), ep("g1", 60)]
    result = decide([ep("g1")], decodes, Mode.OFF, bonus=1.0)
    assert result.decode is decodes[1]
    assert result.locality is Locality.CROSS_GROUP


def test_off_reports_same_group_locality_when_minimum_is_in_group() -> None:
    decodes = [ep("g2", 100), ep("g1", 50)]
    assert decide([ep("g1")], decodes, Mode.OFF).locality is Locality.SAME_GROUP


# ---------------------------------------------------------------- prefer


def test_prefer_exactly_at_the_bonus_keeps_the_same_group() -> None:
    same, other = ep("g1", 500), ep("g2", 200)  # 0.5 == 0.2 + 0.3
    result = decide([ep("g1")], [other, same], Mode.PREFER, bonus=0.3)
    assert result.decode is same
    assert result.locality is Locality.SAME_GROUP


def test_prefer_at_the_bonus_survives_float_rounding() -> None:
    # 0.6 + 0.3 == 0.8999999999999999 < 0.9 in binary floating point.
    same, other = ep("g1", 900), ep("g2", 600)
    assert decide([ep("g1")], [other, same], Mode.PREFER, bonus=0.3).decode is same


def test_prefer_just_above_the_bonus_spills_to_the_other_group() -> None:
    same = ep("g1", 500_001, cap=1_000_000.0)  # 0.500001 > 0.2 + 0.3
    other = ep("g2", 200_000, cap=1_000_000.0)
    result = decide([ep("g1")], [same, other], Mode.PREFER, bonus=0.3)
    assert result.decode is other
    assert result.locality is Locality.CROSS_GROUP


def test_prefer_with_zero_bonus_keeps_the_same_group_on_an_exact_tie() -> None:
    other, same = ep("g2", 400), ep("g1", 400)
    assert decide([ep("g1")], [other, same], Mode.PREFER, bonus=0.0).decode is same


def test_prefer_with_zero_bonus_takes_a_strictly_better_other_group() -> None:
    same, other = ep("g1", 401), ep("g2", 400)
    assert decide([ep("g1")], [same, other], Mode.PREFER, bonus=0.0).decode is other


def test_prefer_with_bonus_one_keeps_an_overloaded_same_group_decode() -> None:
    same, other = ep("g1", 1200), ep("g2", 200)  # 1.2 == 0.2 + 1.0
    assert decide([ep("g1")], [same, other], Mode.PREFER, bonus=1.0).decode is same


def test_prefer_with_bonus_one_still_spills_beyond_it() -> None:
    same, other = ep("g1", 1250), ep("g2", 200)  # 1.25 > 0.2 + 1.0
    assert decide([ep("g1")], [same, other], Mode.PREFER, bonus=1.0).decode is other


def test_prefer_spills_when_the_same_group_has_no_decode() -> None:
    decodes = [ep("g2", 700), ep("g3", 300)]
    result = decide([ep("g1")], decodes, Mode.PREFER, bonus=1.0)
    assert result.decode is decodes[1]
    assert result.locality is Locality.CROSS_GROUP


def test_prefer_picks_the_best_same_group_decode_not_the_first() -> None:
    decodes = [ep("g1", 400), ep("g1", 100), ep("g2", 0)]
    assert decide([ep("g1")], decodes, Mode.PREFER).decode is decodes[1]


def test_prefer_fallbacks_rank_same_group_with_the_bonus() -> None:
    s1, s2 = ep("g1", 350, name="s1"), ep("g1", 600, name="s2")
    c1, c2 = ep("g2", 100, name="c1"), ep("g2", 320, name="c2")
    # effective scores: s1 0.35 - 0.3 = 0.05, c1 0.10, s2 0.6 - 0.3 = 0.30, c2 0.32 (no bonus).
    result = decide([ep("g1")], [c2, s2, c1, s1], Mode.PREFER, bonus=0.3, fallbacks=3)
    assert [result.decode, *result.fallbacks] == [s1, c1, s2, c2]


def test_prefer_fallback_ties_on_effective_score_favour_the_same_group() -> None:
    other, same = ep("g2", 100, name="other"), ep("g1", 400, name="same")  # both score 0.1
    best = ep("g1", 0, name="best")
    result = decide([ep("g1")], [other, best, same], Mode.PREFER, bonus=0.3, fallbacks=2)
    assert result.fallbacks == (same, other)


# ---------------------------------------------------------------- strict


def test_strict_keeps_the_group_even_when_another_is_idle() -> None:
    same, idle = ep("g1", 990), ep("g2", 0)
    result = decide([ep("g1")], [idle, same], Mode.STRICT)
    assert result.decode is same
    assert result.locality is Locality.SAME_GROUP


def test_strict_fallbacks_stay_in_the_group_and_may_be_fewer() -> None:
    s1, s2 = ep("g1", 300), ep("g1", 100)
    others = [ep("g2", 0), ep("g3", 0)]
    result = decide([ep("g1")], [*others, s1, s2], Mode.STRICT, fallbacks=3)
    assert result.decode is s2
    assert result.fallbacks == (s1,)


@ALL_MODES
def test_single_group_cluster_always_stays_in_group(mode: Mode) -> None:
    decodes = [ep("only", 300), ep("only", 100), ep("only", 200)]
    result = decide([ep("only", 50)], decodes, mode, fallbacks=2)
    assert result.decode is decodes[1]
    assert result.fallbacks == (decodes[2], decodes[0])
    assert result.locality is Locality.SAME_GROUP


# ---------------------------------------------------------------- missing pdGroupID


def test_missing_group_is_the_empty_group_and_matches_only_itself() -> None:
    prefill = ep("", 0)
    ungrouped, grouped = ep("", 800), ep("g1", 0)
    strict = decide([prefill], [grouped, ungrouped], Mode.STRICT)
    assert strict.decode is ungrouped
    assert strict.locality is Locality.SAME_GROUP
    assert decide([prefill], [grouped, ungrouped], Mode.PREFER, bonus=0.3).decode is grouped


def test_strict_rejects_ungrouped_prefill_when_only_grouped_decodes_exist() -> None:
    rejection = reject([ep("")], [ep("g1")], Mode.STRICT)
    assert rejection.reason is NoPairReason.NO_SAME_GROUP_DECODE
    assert "''" in rejection.message


# ---------------------------------------------------------------- heterogeneous capacity and cost


def test_decode_utilisation_not_raw_tokens_decides() -> None:
    small = ep("g1", 400, cap=1000.0)  # u = 0.4
    big = ep("g1", 2000, cap=10000.0)  # u = 0.2 with five times the tokens
    assert decide([ep("g1")], [small, big], Mode.OFF).decode is big


def test_decode_cost_makes_a_big_request_avoid_a_nearly_full_endpoint() -> None:
    nearly_full = ep("g1", 900, cap=1000.0)  # 0.9 at zero cost
    roomy = ep("g1", 9500, cap=10000.0)  # 0.95 at zero cost
    decodes = [nearly_full, roomy]
    assert decide([ep("g1")], decodes, Mode.OFF, cost=Cost(0, 0)).decode is nearly_full
    # 2000 tokens: (900 + 2000) / 1000 = 2.9 versus (9500 + 2000) / 10000 = 1.15
    assert decide([ep("g1")], decodes, Mode.OFF, cost=Cost(0, 2000)).decode is roomy


def test_decode_uses_decode_tokens_and_prefill_uses_prefill_tokens() -> None:
    p_small, p_big = ep("g1", 0, cap=1000.0), ep("g1", 100, cap=2000.0)
    d_small, d_big = ep("g1", 0, cap=1000.0), ep("g1", 100, cap=2000.0)
    # prefill cost 50: 0.05 vs 0.075; decode cost 500: 0.5 vs 0.3
    result = decide([p_small, p_big], [d_small, d_big], Mode.OFF, cost=Cost(50, 500))
    assert (result.prefill, result.decode) == (p_small, d_big)


# ---------------------------------------------------------------- ties


def test_equal_utilisation_goes_to_fewer_active_requests() -> None:
    busy, quiet = ep("g1", 500, reqs=9), ep("g1", 500, reqs=2)
    for tiebreak in range(4):
        assert decide([ep("g1")], [busy, quiet], Mode.OFF, tiebreak=tiebreak).decode is quiet


def test_prefill_tie_goes_to_fewer_active_requests() -> None:
    busy, quiet = ep("g1", 500, reqs=3), ep("g1", 500, reqs=1)
    assert decide([busy, quiet], [ep("g1")], tiebreak=0).prefill is quiet


def test_utilisations_within_float_noise_count_as_tied() -> None:
    a = ep("g1", 7, cap=10.0, reqs=5)  # 0.7
    b = ep("g1", 7, cap=10.000000000001, reqs=1)  # 0.7 - 7e-14
    assert decide([ep("g1")], [b, a], Mode.OFF).decode is b
    c = ep("g1", 7, cap=9.999999999999, reqs=1)  # 0.7 + 7e-14, still tied: fewer requests wins
    assert decide([ep("g1")], [a, c], Mode.OFF).decode is c


def test_a_real_utilisation_difference_beats_fewer_requests() -> None:
    lower = ep("g1", 500_000, cap=1_000_000.0, reqs=50)
    higher = ep("g1", 500_001, cap=1_000_000.0, reqs=0)
    assert decide([ep("g1")], [higher, lower], Mode.OFF).decode is lower


@ALL_MODES
def test_tiebreak_rotation_spreads_picks_over_all_tied_decodes(mode: Mode) -> None:
    tied = [ep("g1", 300, reqs=1) for _ in range(4)]
    decodes = [ep("g1", 300, reqs=2), *tied, ep("g1", 900)]
    picks = Counter(decide([ep("g1")], decodes, mode, tiebreak=t).decode.address for t in range(8))
    assert picks == Counter({c.address: 2 for c in tied})


def test_tiebreak_rotation_spreads_prefill_picks() -> None:
    tied = [ep("g1", 100) for _ in range(3)]
    picks = {decide([*tied, ep("g1", 200)], [ep("g1")], tiebreak=t).prefill for t in range(3)}
    assert picks == set(tied)


def test_equal_tiebreak_gives_equal_pick() -> None:
    prefills, tied = [ep("g1")], [ep("g1", 300) for _ in range(5)]
    first = decide(prefills, tied, Mode.OFF, tiebreak=7)
    again = decide(prefills, tied, Mode.OFF, tiebreak=7)
    assert first == again
    assert first.decode is tied[7 % 5]


def test_fallbacks_continue_the_rotation_through_a_tie_class() -> None:
    tied = [ep("g1", 300, name=f"t{i}") for i in range(4)]
    result = decide([ep("g1")], tied, Mode.OFF, fallbacks=3, tiebreak=2)
    assert [c.address for c in (result.decode, *result.fallbacks)] == ["t2", "t3", "t0", "t1"]


def test_tie_at_the_fallback_boundary_rotates_with_the_tiebreak() -> None:
    best = ep("g1", 0, name="best")
    tied = [ep("g1", 500, name=f"t{i}") for i in range(3)]
    for tiebreak, expected in [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t0")]:
        result = decide([ep("g1")], [*tied, best], Mode.OFF, fallbacks=1, tiebreak=tiebreak)
        assert result.decode is best
        assert [c.address for c in result.fallbacks] == [expected]


# ---------------------------------------------------------------- fallbacks


def test_fallbacks_are_the_next_best_in_order_and_distinct() -> None:
    decodes = [ep("g1", t) for t in (500, 100, 400, 200, 300)]
    result = decide([ep("g1")], decodes, Mode.OFF, fallbacks=3)
    assert result.decode is decodes[1]
    assert result.fallbacks == (decodes[3], decodes[4], decodes[2])
    assert len({c.address for c in (result.decode, *result.fallbacks)}) == 4


def test_fallback_count_zero_gives_no_fallbacks() -> None:
    result = decide([ep("g1")], [ep("g1", 100), ep("g1", 200)], Mode.OFF, fallbacks=0)
    assert result.fallbacks == ()


def test_fallbacks_are_capped_by_the_decodes_available() -> None:
    decodes = [ep("g1", 100), ep("g2", 200)]
    result = decide([ep("g1")], decodes, Mode.OFF, fallbacks=5)
    assert result.fallbacks == (decodes[1],)


def test_single_decode_gives_no_fallbacks() -> None:
    only = ep("g1", 100)
    result = decide([ep("g1")], [only], Mode.PREFER, fallbacks=3)
    assert (result.decode, result.fallbacks) == (only, ())


@pytest.mark.parametrize(("tiebreak", "first"), [(0, "d0"), (1, "d202"), (2, "d0")])
def test_large_pools_rank_like_a_full_sort(tiebreak: int, first: str) -> None:
    # 300 decodes take the heap path. Endpoints i, i+101 and i+202 share their tokens, and i and
    # i+202 also their active_requests, so every load level holds a tie of two.
    decodes = [ep("g1", (i * 37) % 101, reqs=(i // 101) % 2, name=f"d{i}") for i in range(300)]
    result = decide([ep("g1")], decodes, Mode.OFF, fallbacks=4, tiebreak=tiebreak)
    chosen = [result.decode, *result.fallbacks]
    assert result.decode.address == first
    ranked = sorted(decodes, key=lambda c: (c.active_tokens, c.active_requests))
    assert [(c.active_tokens, c.active_requests) for c in chosen] == [
        (c.active_tokens, c.active_requests) for c in ranked[:5]
    ]
    assert len({c.address for c in chosen}) == 5


# ---------------------------------------------------------------- determinism


@ALL_MODES
def test_same_inputs_give_the_same_decision(mode: Mode) -> None:
    prefills = [ep(g, t) for g, t in [("a", 100), ("b", 100), ("a", 300)]]
    decodes = [ep(g, t) for g, t in [("a", 200), ("b", 200), ("b", 50), ("a", 200)]]
    cost = Cost(10, 30)
    pools = Pool.of(prefills), Pool.of(decodes)
    first = choose(cost, *pools, policy(mode), 3)
    for _ in range(3):
        assert choose(cost, *pools, policy(mode), 3) == first
        assert choose(cost, Pool.of(tuple(prefills)), Pool.of(tuple(decodes)), policy(mode), 3) == first


@ALL_MODES
def test_inputs_are_not_mutated(mode: Mode) -> None:
    prefills, decodes = [ep("a", 1), ep("b", 2)], [ep("b", 3), ep("a", 4)]
    before = (list(prefills), list(decodes))
    pools = Pool.of(prefills), Pool.of(decodes)
    arrays = [(p.tokens.copy(), p.requests.copy(), p.capacity.copy()) for p in pools]
    choose(Cost(5, 9), *pools, policy(mode), 1)
    assert (prefills, decodes) == before
    for pool, (tokens, requests, capacity) in zip(pools, arrays, strict=True):
        assert (pool.tokens.tolist(), pool.requests.tolist()) == (tokens.tolist(), requests.tolist())
        assert pool.capacity.tolist() == capacity.tolist()


# ---------------------------------------------------------------- pools (the array form)


def test_pool_of_copies_the_loads_into_index_aligned_arrays() -> None:
    a, b, c = ep("g1", 10, cap=100.0, reqs=1), ep("g2", 20, cap=200.0, reqs=2), ep("g1", 30, reqs=3)
    pool = Pool.of([a, b, c])
    assert (pool.endpoints, pool.size) == ((a, b, c), 3)
    assert (pool.tokens.dtype, pool.requests.dtype, pool.capacity.dtype) == (np.int64, np.int64, np.float64)
    assert (pool.tokens.tolist(), pool.requests.tolist()) == ([10, 20, 30], [1, 2, 3])
    assert pool.capacity.tolist() == [100.0, 200.0, 1000.0]
    assert {g: m.tolist() for g, m in pool.members.items()} == {"g1": [0, 2], "g2": [1]}
    assert list(pool.members) == ["g1", "g2"]  # order of first appearance
    assert {g: m.tolist() for g, m in pool.in_group.items()} == {"g1": [1.0, 0.0, 1.0], "g2": [0.0, 1.0, 0.0]}


def test_pool_groups_masks_and_group_order() -> None:
    pool = Pool.of([ep("g1"), ep("g2"), ep("g1"), ep("g3")])
    assert pool.groups == ("g1", "g2", "g3")
    assert pool.in_group["g1"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert pool.outside["g1"].tolist() == [False, True, False, True]
    assert pool.group_order.tolist() == [0, 2, 1, 3]
    assert pool.group_starts.tolist() == [0, 2, 3]
    x = np.array([5.0, 1.0, 2.0, 7.0])
    assert np.minimum.reduceat(x[pool.group_order], pool.group_starts).tolist() == [2.0, 1.0, 7.0]


def test_pool_slots_in_another_pool_name_each_group_and_are_kept() -> None:
    prefills = Pool.of([ep("b"), ep("a"), ep("z"), ep("b")])
    decodes = Pool.of([ep("a"), ep("b"), ep("a")])
    slots = prefills.slots_in(decodes)
    assert slots.tolist() == [1, 0, 2, 1]  # z has no decode: len(decodes.groups)
    assert prefills.slots_in(decodes) is slots
    other = Pool.of([ep("z")])
    assert prefills.slots_in(other).tolist() == [1, 1, 0, 1]
    assert prefills.slots_in(decodes) is slots


def test_pool_shares_and_share_ratios_in_another_pool() -> None:
    prefills = Pool.of([ep("a", cap=100.0), ep("b", cap=300.0), ep("z", cap=100.0), ep("a", cap=100.0)])
    decodes = Pool.of([ep("a", cap=100.0), ep("b", cap=300.0)])
    assert prefills.shares == {"a": 200 / 600, "b": 300 / 600, "z": 100 / 600}
    assert decodes.shares == {"a": 0.25, "b": 0.75}
    ratios = prefills.share_ratios_in(decodes)
    assert ratios.tolist() == [(1 / 3) / 0.25, 0.5 / 0.75, 1.0, (1 / 3) / 0.25]  # z has no decode: 1.0
    assert prefills.share_ratios_in(decodes) is ratios
    assert not ratios.flags.writeable


def test_pool_arrays_must_have_one_entry_per_endpoint() -> None:
    with pytest.raises(ValueError, match="one tokens, requests and capacity entry per endpoint"):
        Pool([ep()], np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64), np.ones(1))


def test_the_decision_reads_the_pool_arrays_as_they_are_now() -> None:
    decodes = [ep("g1", 0, name="a"), ep("g1", 0, name="b")]
    pool, prefills = Pool.of(decodes), Pool.of([ep("g1")])
    pool.tokens[0] = 500
    assert choose(FREE, prefills, pool, policy(Mode.OFF), 0).decode is decodes[1]
    pool.tokens[:] = [0, 900]
    assert choose(FREE, prefills, pool, policy(Mode.OFF), 0).decode is decodes[0]
    pool.tokens[:] = [0, 0]
    pool.requests[:] = [3, 2]
    assert choose(FREE, prefills, pool, policy(Mode.OFF), 0).decode is decodes[1]


@ALL_MODES
@pytest.mark.parametrize("size", [3, 64, 127, 128, 129, 300, 2048])
def test_a_whole_pool_tied_rotates_in_input_order_at_every_size(mode: Mode, size: int) -> None:
    # Idle endpoints of one capacity: every key is equal, in both groups, at any size (list or
    # array pre-selection, small or large tie classes).
    prefills = [ep("g1", name="p1"), ep("g2", name="p2")]
    decodes = [ep(f"g{1 + i % 2}", name=f"d{i}") for i in range(size)]
    for tiebreak in (0, 1, size - 1, size + 5):
        result = decide(prefills, decodes, mode, fallbacks=3, tiebreak=tiebreak)
        assert result.prefill is prefills[tiebreak % 2]
        group = [d for d in decodes if d.group == result.prefill.group]
        if mode is Mode.OFF:
            expected = [decodes[(tiebreak + i) % size] for i in range(min(4, size))]
        else:  # strict: only the group; prefer and auto: the group's class ranks first, then the rest
            expected = [group[(tiebreak + i) % len(group)] for i in range(min(4, len(group)))]
            if mode in (Mode.PREFER, Mode.AUTO) and len(expected) < 4:
                rest = [d for d in decodes if d not in group]
                more = min(4 - len(expected), len(rest))
                expected += [rest[(tiebreak + i) % len(rest)] for i in range(more)]
        assert [result.decode, *result.fallbacks] == expected


def test_prefer_keys_beyond_float64_integers_stay_exact() -> None:
    # u = 1e7 and 1e7 + 2**-29 have ticks 10**16 + 2 and 10**16, beyond 2**53. With bonus_ticks = 1
    # the same-group key is 10**16 + 1, which loses to the other group's 10**16; float64 cannot
    # hold 10**16 + 1 and would call it a tie, won by the same group.
    cap = 2.0**30
    same = ep("g1", 10_737_418_240_000_002, cap=cap, name="same")
    other = ep("g2", 10_737_418_240_000_000, cap=cap, name="other")
    assert (ticks(same.utilisation(0)), ticks(other.utilisation(0)), ticks(1e-9)) == (10**16 + 2, 10**16, 1)
    result = decide([ep("g1")], [same, other], Mode.PREFER, bonus=1e-9, fallbacks=1)
    assert (result.decode, result.fallbacks) == (other, (same,))
    level = ep("g1", 10_737_418_240_000_000, cap=cap, name="level")  # 10**16 - 1 < 10**16: same wins
    result = decide([ep("g1")], [other, level], Mode.PREFER, bonus=1e-9, fallbacks=1)
    assert (result.decode, result.fallbacks) == (level, (other,))
