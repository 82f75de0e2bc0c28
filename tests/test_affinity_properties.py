"""Property tests for :func:`ext_proc.affinity.choose` against a naive reference of its contract."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.affinity import (
    Candidate,
    Cost,
    Decision,
    Locality,
    Mode,
    Policy,
    Pool,
    Rejection,
    RejectReason,
)
from ext_proc.affinity import choose as choose_over_pools
from ext_proc.affinity.decide import ticks

GROUPS = ["", "a", "b", "c"]
FLOAT_SLACK = 2e-9  # two roundings to the 1e-9 grid
no_deadline = settings(deadline=None)  # a shared 2-core machine; these tests never assert on time

capacities = st.one_of(
    st.sampled_from([1000.0, 2048.0, 4096.0, 3000.0, 10.000000000001]),
    st.integers(min_value=1, max_value=100_000).map(float),
)


@st.composite
def candidates(draw: st.DrawFn, prefix: str, max_size: int, min_size: int = 0) -> list[Candidate]:
    """Endpoints with few distinct loads, so that ties on ``u`` and ``active_requests`` are common."""
    size = draw(st.integers(min_value=min_size, max_value=max_size))
    tokens = st.one_of(st.sampled_from([0, 100, 300, 500]), st.integers(min_value=0, max_value=50_000))
    return [
        Candidate(
            address=f"{prefix}{i}",
            group=draw(st.sampled_from(GROUPS)),
            token_capacity=draw(capacities),
            active_tokens=draw(tokens),
            active_requests=draw(st.integers(min_value=0, max_value=2)),
        )
        for i in range(size)
    ]


costs = st.builds(
    lambda p, extra: Cost(prefill_tokens=p, decode_tokens=p + extra),
    st.sampled_from([0, 0, 100, 1000]) | st.integers(0, 5000),
    st.integers(0, 5000),
)
policies = st.builds(
    Policy,
    mode=st.sampled_from(list(Mode)),
    bonus=st.sampled_from([0.0, 0.3, 1.0, 0.1]) | st.floats(min_value=0.0, max_value=1.0),
    fallback_count=st.integers(min_value=0, max_value=5),
)
tiebreaks = st.integers(min_value=0, max_value=10_000)


def scenarios(max_size: int = 10, min_size: int = 0) -> st.SearchStrategy[tuple]:
    return st.tuples(
        costs, candidates("p", max_size, min_size), candidates("d", max_size, min_size), policies, tiebreaks
    )


def choose(
    cost: Cost, prefills: Sequence[Candidate], decodes: Sequence[Candidate], policy: Policy, tiebreak: int
) -> Decision | Rejection:
    """:func:`ext_proc.affinity.choose` over pools built from candidate lists (the array form)."""
    return choose_over_pools(cost, Pool.of(prefills), Pool.of(decodes), policy, tiebreak)


# ---------------------------------------------------------------- naive reference


def naive_rank(
    pool: Sequence[Candidate], key: Callable[[Candidate], tuple], tiebreak: int
) -> list[Candidate]:
    """Full sort by ``key``; each class of equal keys, in input order, rotated left by tiebreak."""
    out: list[Candidate] = []
    for k in sorted({key(c) for c in pool}):
        cls = [c for c in pool if key(c) == k]
        r = tiebreak % len(cls)
        out += cls[r:] + cls[:r]
    return out


def by_u(cost: int) -> Callable[[Candidate], tuple]:
    return lambda c: (ticks(c.utilisation(cost)), c.active_requests)


def prefer_key(cost: int, group: str, bonus: float) -> Callable[[Candidate], tuple]:
    def key(c: Candidate) -> tuple:
        u = ticks(c.utilisation(cost))
        same = c.group == group
        return (u - ticks(bonus) if same else u, not same, c.active_requests)

    return key


def auto_key(cost: Cost, group: str, decodes: Sequence[Candidate], policy: Policy) -> Callable:
    """``auto``'s documented key: ``prefer``'s on the wait estimate, with the transfer penalty as the
    bonus; ``off``'s when the penalty is 0 on the grid or the decodes are all in one group."""
    model, dc = policy.auto, cost.decode_tokens
    penalty = model.penalty_s(cost.prefill_tokens)
    groups = {d.group for d in decodes}
    if ticks(penalty) == 0 or len(groups) == 1 or group not in groups:
        return by_u(dc)

    def key(c: Candidate) -> tuple:
        w = ticks(model.wait_s(c.utilisation(dc)))
        same = c.group == group
        return (w - ticks(penalty) if same else w, not same, c.active_requests)

    return key


def expected_prefill(cost: Cost, prefills: list[Candidate], decodes: list[Candidate], policy: Policy, t: int):
    pool = prefills
    if policy.mode is Mode.STRICT:
        pool = [p for p in prefills if any(d.group == p.group for d in decodes)]
    return naive_rank(pool, by_u(cost.prefill_tokens), t)[0] if pool else None


def eligible_decodes(decision: Decision, decodes: list[Candidate], policy: Policy) -> list[Candidate]:
    if decision.prefill is not None and policy.mode is Mode.STRICT:
        return [d for d in decodes if d.group == decision.prefill.group]
    return decodes


def all_u(pool: Sequence[Candidate], cost: int) -> list[float]:
    return [c.utilisation(cost) for c in pool]


# ---------------------------------------------------------------- properties


@no_deadline
@given(scenarios())
def test_rejects_exactly_when_the_contract_says(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak)
    decode_groups = {d.group for d in decodes}
    if not decodes:
        assert result == Rejection(RejectReason.NO_DECODE_ENDPOINT, result.message)
    elif policy.mode is Mode.STRICT and prefills and not any(p.group in decode_groups for p in prefills):
        assert isinstance(result, Rejection)
        assert result.reason is RejectReason.NO_SAME_GROUP_DECODE
    else:
        assert isinstance(result, Decision)


@no_deadline
@given(scenarios())
def test_strict_never_crosses_groups(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    result = choose(cost, prefills, decodes, replace(policy, mode=Mode.STRICT), tiebreak)
    if isinstance(result, Decision) and result.prefill is not None:
        assert result.locality is Locality.SAME_GROUP
        assert all(c.group == result.prefill.group for c in (result.decode, *result.fallbacks))


@no_deadline
@given(scenarios())
def test_prefer_stays_within_the_bonus_of_the_best_decode(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    policy = replace(policy, mode=Mode.PREFER)
    result = choose(cost, prefills, decodes, policy, tiebreak)
    if isinstance(result, Decision):
        best = min(all_u(decodes, cost.decode_tokens))
        slack = 0.0 if result.prefill is None else policy.bonus
        assert result.decode.utilisation(cost.decode_tokens) <= best + slack + FLOAT_SLACK


@no_deadline
@given(scenarios())
def test_off_and_decode_only_pick_a_minimum_utilisation_decode(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    result = choose(cost, prefills, decodes, replace(policy, mode=Mode.OFF), tiebreak)
    for res in (result, choose(cost, [], decodes, policy, tiebreak)):
        if isinstance(res, Decision):
            best = min(ticks(u) for u in all_u(decodes, cost.decode_tokens))
            assert ticks(res.decode.utilisation(cost.decode_tokens)) == best


@no_deadline
@given(scenarios())
def test_the_decision_is_deterministic(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    first = choose(cost, prefills, decodes, policy, tiebreak)
    copies = [replace(c) for c in prefills], [replace(c) for c in decodes]
    assert choose(replace(cost), *copies, replace(policy), tiebreak) == first


@no_deadline
@given(scenarios())
def test_fallbacks_are_distinct_exclude_the_decode_and_have_the_right_length(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak)
    if isinstance(result, Decision):
        eligible = eligible_decodes(result, decodes, policy)
        addresses = [c.address for c in (result.decode, *result.fallbacks)]
        assert len(set(addresses)) == len(addresses)
        assert len(result.fallbacks) == min(policy.fallback_count, len(eligible) - 1)
        assert set(addresses) <= {c.address for c in eligible}


@no_deadline
@given(scenarios())
def test_prefer_ranking_top_is_the_naive_prefer_rule(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    policy = replace(policy, mode=Mode.PREFER)
    result = choose(cost, prefills, decodes, policy, tiebreak)
    if not isinstance(result, Decision) or result.prefill is None:
        return
    dc, group = cost.decode_tokens, result.prefill.group
    same = [d for d in decodes if d.group == group]
    d_a = naive_rank(decodes, by_u(dc), tiebreak)[0]
    expected = d_a
    if same:
        d_s = naive_rank(same, by_u(dc), tiebreak)[0]
        if ticks(d_s.utilisation(dc)) <= ticks(d_a.utilisation(dc)) + ticks(policy.bonus):
            expected = d_s
    assert result.decode == expected
    assert result.locality is (Locality.SAME_GROUP if expected.group == group else Locality.CROSS_GROUP)


def assert_follows_documented_ranking(scenario: tuple) -> None:
    """The decode and fallbacks are the head of the naive ranking; the prefill is the expected one."""
    cost, prefills, decodes, policy, tiebreak = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak)
    if not isinstance(result, Decision):
        return
    dc = cost.decode_tokens
    if result.prefill is not None and policy.mode is Mode.PREFER:
        key = prefer_key(dc, result.prefill.group, policy.bonus)
    elif result.prefill is not None and policy.mode is Mode.AUTO:
        key = auto_key(cost, result.prefill.group, decodes, policy)
    else:
        key = by_u(dc)
    ranked = naive_rank(eligible_decodes(result, decodes, policy), key, tiebreak)
    assert [result.decode, *result.fallbacks] == ranked[: policy.fallback_count + 1]
    assert result.prefill == expected_prefill(cost, prefills, decodes, policy, tiebreak)


@no_deadline
@given(scenarios())
def test_decode_and_fallbacks_follow_the_documented_ranking(scenario: tuple) -> None:
    assert_follows_documented_ranking(scenario)


@no_deadline
@given(scenarios())
def test_chosen_prefill_has_minimum_utilisation_among_eligible(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak)
    if not isinstance(result, Decision) or result.prefill is None:
        return
    pc = cost.prefill_tokens
    pool = prefills
    if policy.mode is Mode.STRICT:
        pool = [p for p in prefills if p.group in {d.group for d in decodes}]
    assert ticks(result.prefill.utilisation(pc)) == min(ticks(u) for u in all_u(pool, pc))
    assert result.prefill == expected_prefill(cost, prefills, decodes, policy, tiebreak)


@settings(max_examples=40, deadline=None)
@given(st.one_of(scenarios(max_size=200), scenarios(max_size=140, min_size=116)))
def test_large_pools_follow_the_documented_ranking(scenario: tuple) -> None:
    """Also around 128 endpoints, where pre-selection switches from Python lists to numpy."""
    assert_follows_documented_ranking(scenario)


@no_deadline
@given(candidates("d", 8).filter(bool), st.integers(0, 1000))
def test_rotation_over_consecutive_tiebreaks_reaches_every_tied_decode(decodes: list, start: int) -> None:
    key = by_u(0)
    best = min(key(d) for d in decodes)
    tied = {d.address for d in decodes if key(d) == best}
    policy = Policy(mode=Mode.OFF, fallback_count=0)
    picks = {choose(Cost(0, 0), [], decodes, policy, start + t).decode.address for t in range(len(tied))}
    assert picks == tied
