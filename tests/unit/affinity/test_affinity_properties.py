"""Property tests for :func:`ext_proc.affinity.choose` against a naive reference of its contract.

The reference (:func:`reference`) follows the module docstring of :mod:`ext_proc.affinity.decide`
with plain Python ints, group by group; :func:`pair_cost` prices every (prefill, decode) pair on its
own, so the brute-force minimum over all pairs checks the grouped O(P + D·G) computation from a second
direction. Both repeat the decision's float operations term for term (one rounding per term).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from unittest.mock import patch

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.affinity import (
    AutoModel,
    Candidate,
    Cost,
    Decision,
    Hits,
    Lacks,
    Locality,
    Mode,
    NoPair,
    NoPairReason,
    Policy,
    Pool,
    decide,
    extremes,
)
from ext_proc.affinity import choose as choose_over_pools
from ext_proc.affinity.decide import ticks

GROUPS = ["", "a", "b", "c"]
no_deadline = settings(deadline=None)  # a shared 2-core machine; these tests never assert on time

capacities = st.one_of(
    st.sampled_from([1000.0, 2048.0, 4096.0, 3000.0, 10.000000000001]),
    st.integers(min_value=1, max_value=100_000).map(float),
)


@st.composite
def candidates(draw: st.DrawFn, prefix: str, max_size: int, min_size: int = 0) -> list[Candidate]:
    """Endpoints with few distinct loads, so that ties on keys and ``active_requests`` are common."""
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
auto_models = st.builds(
    AutoModel,
    kv_bytes_per_token=st.sampled_from([131_072, 0, 1]) | st.integers(0, 2_000_000),
    same_group_gbps=st.sampled_from([100.0, 10.0]),
    cross_group_gbps=st.sampled_from([10.0, 1.0, 0.5]),
    base_latency_ms=st.sampled_from([1.0, 0.0]),
    wait_scale_ms=st.sampled_from([15.0, 0.0, 200.0]),
    prefill_ms_per_token=st.sampled_from([0.05, 0.0, 1.0]),
    cpu_tier_gbps=st.sampled_from([55.0, 1.0, 0.001]),
    lora_load_ms=st.sampled_from([100.0, 0.0, 5.0]) | st.floats(min_value=0.0, max_value=1000.0),
)
policies = st.builds(
    Policy,
    mode=st.sampled_from(list(Mode)),
    bonus=st.sampled_from([0.0, 0.3, 1.0, 0.1]) | st.floats(min_value=0.0, max_value=1.0),
    fallback_count=st.integers(min_value=0, max_value=5),
    auto=auto_models,
    prefix_weight=st.sampled_from([0.0, 0.1, 1.0]) | st.floats(min_value=0.0, max_value=2.0),
    cpu_tier_weight=st.sampled_from([0.5, 0.0, 1.0]) | st.floats(min_value=0.0, max_value=1.0),
)
tiebreaks = st.integers(min_value=0, max_value=10_000)


@st.composite
def hit_lists(draw: st.DrawFn, cost: Cost, prefills: list, decodes: list) -> tuple | None:
    """``None`` (no prefix index) or hit tokens in [0, prompt] per endpoint, often equal or extreme."""
    if draw(st.booleans()):
        return None
    prompt = cost.prefill_tokens
    hit = st.sampled_from([0, prompt, prompt // 2]) | st.integers(0, prompt)
    return [draw(hit) for _ in prefills], [draw(hit) for _ in decodes]


@st.composite
def scenarios(draw: st.DrawFn, max_size: int = 10, min_size: int = 0) -> tuple:
    cost = draw(costs)
    prefills, decodes = draw(candidates("p", max_size, min_size)), draw(candidates("d", max_size, min_size))
    return cost, prefills, decodes, draw(policies), draw(tiebreaks), draw(hit_lists(cost, prefills, decodes))


@st.composite
def tiered_scenarios(draw: st.DrawFn, max_size: int = 10) -> tuple:
    """Scenarios with hits, part of each held only in a CPU tier (``(hp, hd, cp, cd)``)."""
    cost = draw(costs)
    prefills, decodes = draw(candidates("p", max_size)), draw(candidates("d", max_size))
    hits = draw(hit_lists(cost, prefills, decodes).filter(lambda h: h is not None))
    cpu = [[draw(st.sampled_from([0, h]) | st.integers(0, h)) for h in side] for side in hits]
    return cost, prefills, decodes, draw(policies), draw(tiebreaks), (*hits, *cpu)


def as_hits(hits: tuple | None) -> Hits | None:
    """The decision's :class:`Hits` of ``(hp, hd)`` or, with CPU-tier parts, ``(hp, hd, cp, cd)``."""
    if hits is None:
        return None
    return Hits(*(np.array(side, dtype=np.int64) for side in hits))


def choose(
    cost: Cost,
    prefills: Sequence[Candidate],
    decodes: Sequence[Candidate],
    policy: Policy,
    tiebreak: int,
    hits: tuple | None = None,
    lacks: Lacks | None = None,
) -> Decision | NoPair:
    """:func:`ext_proc.affinity.choose` over pools built from candidate lists (the array form)."""
    pools = Pool.of(prefills), Pool.of(decodes)
    return choose_over_pools(cost, *pools, policy, tiebreak, as_hits(hits), lacks)


# ---------------------------------------------------------------- naive reference


def naive_rank(pool: Sequence, key: Callable, tiebreak: int) -> list:
    """Full sort by ``key``; each class of equal keys, in input order, rotated left by tiebreak."""
    classes: dict = {}
    for c in pool:
        classes.setdefault(key(c), []).append(c)
    out: list = []
    for k in sorted(classes):
        cls = classes[k]
        r = tiebreak % len(cls)
        out += cls[r:] + cls[:r]
    return out


def share(pool: list, group: str) -> float:
    """The group's share of the pool's capacity (``Pool.shares``), 0.0 when it has no endpoint there."""
    total = math.fsum(c.token_capacity for c in pool)
    return math.fsum(c.token_capacity for c in pool if c.group == group) / total


class Keys:
    """Every per-endpoint key of the module docstring, for one scenario, in plain Python ints."""

    def __init__(
        self,
        cost: Cost,
        prefills: list,
        decodes: list,
        policy: Policy,
        hits: tuple | None,
        lacks: tuple[list[bool], list[bool]] | None = None,
    ):
        self.cost, self.policy = cost, policy
        lp, ld = lacks if lacks is not None else ([False] * len(prefills), [False] * len(decodes))
        self.lp = {c.address: lack for c, lack in zip(prefills, lp, strict=True)}  # lacks the adapter
        self.ld = {c.address: lack for c, lack in zip(decodes, ld, strict=True)}
        p_hits, d_hits = hits[:2] if hits is not None else ([0] * len(prefills), [0] * len(decodes))
        p_cpu, d_cpu = (
            hits[2:] if hits is not None and len(hits) == 4 else ([0] * len(prefills), [0] * len(decodes))
        )
        self.hp = {c.address: h for c, h in zip(prefills, p_hits, strict=True)}
        self.hd = {c.address: h for c, h in zip(decodes, d_hits, strict=True)}
        self.cp = {c.address: h for c, h in zip(prefills, p_cpu, strict=True)}
        self.cd = {c.address: h for c, h in zip(decodes, d_cpu, strict=True)}
        self.indexed = hits is not None
        self.ratio = {p.group: 1.0 for p in prefills}
        if policy.mode in (Mode.PREFER, Mode.STRICT) and decodes:
            self.ratio.update(
                (g, share(prefills, g) / share(decodes, g)) for g in self.ratio if share(decodes, g)
            )

    def credit(self, hit: int, cpu: int) -> int:
        """A hit's credit; ``cpu`` of it held in a CPU tier, worth ``cpu_tier_weight`` of a GPU token."""
        prompt, weight = self.cost.prefill_tokens, self.policy.prefix_weight
        if not self.indexed or weight <= 0.0 or prompt <= 0:
            return 0
        return ticks((hit - (1.0 - self.policy.cpu_tier_weight) * cpu) * (weight / prompt))

    def decode(self, d: Candidate) -> int:
        credit = self.credit(self.hd[d.address], self.cd[d.address])
        return ticks(d.utilisation(self.cost.decode_tokens)) - credit + self.ld[d.address]  # one tick behind

    def prefill(self, p: Candidate) -> int:
        backlog = p.active_tokens * self.ratio[p.group] + (self.cost.prefill_tokens - self.hp[p.address])
        credit = self.credit(self.hp[p.address], self.cp[p.address])
        return ticks(backlog / p.token_capacity) - credit + self.lp[p.address]

    def auto_decode(self, d: Candidate, same: bool) -> int:
        """The wait (its adapter load included), the transfer of what ``d`` lacks, and the load of what it
        holds in a CPU tier."""
        model = self.policy.auto
        wait = model.wait_s(d.utilisation(self.cost.decode_tokens))
        wait += model.lora_load_ms / 1e3 if self.ld[d.address] else 0.0
        lack = self.cost.prefill_tokens - self.hd[d.address]
        return ticks(wait + lack * model.seconds_per_token(same) + model.cpu_load_s(self.cd[d.address]))

    def auto_prefill(self, p: Candidate) -> int:
        """The queue, the uncached tokens twice (a miss priced twice), the load of its CPU-tier hit and
        of the adapter it lacks."""
        model = self.policy.auto
        uncached = self.cost.prefill_tokens - self.hp[p.address]
        seconds = model.prefill_s(p.active_tokens + 2 * uncached) + model.cpu_load_s(self.cp[p.address])
        return ticks(seconds + (model.lora_load_ms / 1e3 if self.lp[p.address] else 0.0))


def pair_cost(keys: Keys, p: Candidate, d: Candidate) -> int | None:
    """One pair's documented cost in its mode (``None``: the mode forbids the pair)."""
    mode, same = keys.policy.mode, p.group == d.group
    if mode is Mode.AUTO:
        return keys.auto_prefill(p) + keys.auto_decode(d, same)
    if mode is Mode.STRICT and not same:
        return None
    bonus = ticks(keys.policy.bonus) if mode is Mode.PREFER and not same else 0
    return keys.prefill(p) + keys.decode(d) + bonus


def decode_key(keys: Keys, group: str) -> Callable:
    """The decode ranking key after a prefill of ``group`` was chosen."""
    mode = keys.policy.mode
    if mode is Mode.AUTO:
        return lambda d: (keys.auto_decode(d, d.group == group), d.group != group, d.active_requests)
    if mode is Mode.PREFER:
        b = ticks(keys.policy.bonus)
        return lambda d: (
            keys.decode(d) - (b if d.group == group else 0),
            d.group != group,
            d.active_requests,
        )
    return lambda d: (keys.decode(d), d.active_requests)


def reference(
    cost: Cost,
    prefills: list,
    decodes: list,
    policy: Policy,
    tiebreak: int,
    hits: tuple | None,
    lacks: tuple[list[bool], list[bool]] | None = None,
) -> NoPairReason | tuple:
    """The expected ``(prefill, [decode, *fallbacks])``, or the expected rejection reason.

    ``lacks``: per endpoint, whether it lacks the request's LoRA adapter (``None``: none does)."""
    keys = Keys(cost, prefills, decodes, policy, hits, lacks)
    want = policy.fallback_count + 1
    if not decodes:
        return NoPairReason.NO_DECODE_ENDPOINT
    if not prefills:
        by_off = lambda d: (keys.decode(d), d.active_requests)  # noqa: E731
        return None, naive_rank(decodes, by_off, tiebreak)[:want]
    mode = policy.mode
    groups = {d.group for d in decodes}

    def best(pool: list, key: Callable) -> int:
        return min(key(d) for d in pool)

    pairs: dict[str, int] = {}

    def pair(p: Candidate) -> int:
        if p.group not in pairs:
            pairs[p.group] = group_pair(p)
        return pairs[p.group]

    def group_pair(p: Candidate) -> int:
        home = [d for d in decodes if d.group == p.group]
        if mode is Mode.OFF:
            return 0
        if mode is Mode.STRICT:
            return best(home, keys.decode)
        if mode is Mode.PREFER:
            spill = best(decodes, keys.decode) + ticks(policy.bonus)
            return min(best(home, keys.decode), spill) if home else spill
        away = [d for d in decodes if d.group != p.group]
        options = []
        if home:
            options.append(best(home, lambda d: keys.auto_decode(d, True)))
        if away:
            options.append(best(away, lambda d: keys.auto_decode(d, False)))
        return min(options)

    eligible = [p for p in prefills if mode is not Mode.STRICT or p.group in groups]
    if not eligible:
        return NoPairReason.NO_SAME_GROUP_DECODE
    own = keys.auto_prefill if mode is Mode.AUTO else keys.prefill
    prefill = naive_rank(eligible, lambda p: (own(p) + pair(p), p.active_requests), tiebreak)[0]
    pool = [d for d in decodes if mode is not Mode.STRICT or d.group == prefill.group]
    return prefill, naive_rank(pool, decode_key(keys, prefill.group), tiebreak)[:want]


def assert_matches_reference(scenario: tuple, lacks: tuple[list[bool], list[bool]] | None = None) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    masks = None if lacks is None else Lacks(*(np.array(side, dtype=np.bool_) for side in lacks))
    result = choose(cost, prefills, decodes, policy, tiebreak, hits, masks)
    expected = reference(cost, prefills, decodes, policy, tiebreak, hits, lacks)
    if isinstance(expected, NoPairReason):
        assert isinstance(result, NoPair) and result.reason is expected
        return
    assert isinstance(result, Decision), result
    prefill, ranked = expected
    assert (result.prefill, [result.decode, *result.fallbacks]) == (prefill, ranked)
    if prefill is None:
        assert result.locality is Locality.DECODE_ONLY
    else:
        same = result.decode.group == prefill.group
        assert result.locality is (Locality.SAME_GROUP if same else Locality.CROSS_GROUP)


# ---------------------------------------------------------------- properties


@no_deadline
@given(scenarios())
def test_the_decision_is_the_documented_rule(scenario: tuple) -> None:
    assert_matches_reference(scenario)


@settings(max_examples=200, deadline=None)
@given(st.one_of(scenarios(), tiered_scenarios()), st.booleans(), st.data())
def test_a_request_for_an_adapter_follows_the_documented_rule(
    scenario: tuple, idle: bool, data: st.DataObject
) -> None:
    """Any endpoints lacking the adapter (docs/routing.md "LoRA adapters"), in every mode; ``idle``
    pools (no token in flight) make the tied keys that the adapter breaks."""
    cost, prefills, decodes, *rest = scenario
    if idle:
        prefills, decodes = ([replace(c, active_tokens=0) for c in side] for side in (prefills, decodes))
    sizes = (len(prefills), len(decodes))
    lacks = tuple(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in sizes)
    assert_matches_reference((cost, prefills, decodes, *rest), lacks)


@settings(max_examples=40, deadline=None)
@given(st.one_of(scenarios(max_size=200), scenarios(max_size=140, min_size=116)))
def test_large_pools_follow_the_documented_rule(scenario: tuple) -> None:
    """Also around 128 endpoints, and with many tied keys in one class."""
    assert_matches_reference(scenario)


@no_deadline
@given(scenarios())
def test_the_chosen_pair_is_the_cheapest_of_all_pairs(scenario: tuple) -> None:
    """Brute force over every (prefill, decode) pair: the grouped computation finds the minimum."""
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak, hits)
    if not isinstance(result, Decision) or result.prefill is None:
        return
    keys = Keys(cost, prefills, decodes, policy, hits)
    prices = [c for p in prefills for d in decodes if (c := pair_cost(keys, p, d)) is not None]
    assert pair_cost(keys, result.prefill, result.decode) == min(prices)


@no_deadline
@given(scenarios())
def test_rejects_exactly_when_the_contract_says(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak, hits)
    decode_groups = {d.group for d in decodes}
    if not decodes:
        assert result == NoPair(NoPairReason.NO_DECODE_ENDPOINT, result.message)
    elif policy.mode is Mode.STRICT and prefills and not any(p.group in decode_groups for p in prefills):
        assert isinstance(result, NoPair)
        assert result.reason is NoPairReason.NO_SAME_GROUP_DECODE
    else:
        assert isinstance(result, Decision)


@no_deadline
@given(scenarios())
def test_strict_never_crosses_groups(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    result = choose(cost, prefills, decodes, replace(policy, mode=Mode.STRICT), tiebreak, hits)
    if isinstance(result, Decision) and result.prefill is not None:
        assert result.locality is Locality.SAME_GROUP
        assert all(c.group == result.prefill.group for c in (result.decode, *result.fallbacks))


@no_deadline
@given(scenarios())
def test_prefer_stays_within_the_bonus_of_the_best_decode(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    policy = replace(policy, mode=Mode.PREFER)
    result = choose(cost, prefills, decodes, policy, tiebreak, hits)
    if isinstance(result, Decision):
        keys = Keys(cost, prefills, decodes, policy, hits)
        best = min(keys.decode(d) for d in decodes)
        slack = 0 if result.prefill is None else ticks(policy.bonus)
        assert keys.decode(result.decode) <= best + slack


@no_deadline
@given(scenarios())
def test_without_hits_off_picks_the_least_utilised_prefill_and_decode(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak, _ = scenario
    result = choose(cost, prefills, decodes, replace(policy, mode=Mode.OFF), tiebreak)
    if isinstance(result, Decision):
        best = min(ticks(d.utilisation(cost.decode_tokens)) for d in decodes)
        assert ticks(result.decode.utilisation(cost.decode_tokens)) == best
        if result.prefill is not None:
            best = min(ticks(p.utilisation(cost.prefill_tokens)) for p in prefills)
            assert ticks(result.prefill.utilisation(cost.prefill_tokens)) == best


@no_deadline
@given(scenarios(min_size=1), st.integers(1, 5000))
def test_more_cache_on_the_chosen_prefill_keeps_the_decision(scenario: tuple, more: int) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    if hits is None:
        return
    result = choose(cost, prefills, decodes, policy, tiebreak, hits)
    if not isinstance(result, Decision):
        return
    p_hits = list(hits[0])
    i = prefills.index(result.prefill)
    p_hits[i] = min(cost.prefill_tokens, p_hits[i] + more)
    assert choose(cost, prefills, decodes, policy, tiebreak, (p_hits, hits[1]))[:3] == result[:3]


@no_deadline
@given(scenarios(min_size=1), st.integers(1, 5000))
def test_more_cache_on_the_chosen_decode_keeps_it_for_its_prefill(scenario: tuple, more: int) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    if hits is None:
        return
    one = prefills[:1]
    result = choose(cost, one, decodes, policy, tiebreak, (hits[0][:1], hits[1]))
    if not isinstance(result, Decision):
        return
    d_hits = list(hits[1])
    j = decodes.index(result.decode)
    d_hits[j] = min(cost.prefill_tokens, d_hits[j] + more)
    again = choose(cost, one, decodes, policy, tiebreak, (hits[0][:1], d_hits))
    assert isinstance(again, Decision) and again.decode == result.decode


@no_deadline
@given(scenarios())
def test_the_decision_is_deterministic(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    first = choose(cost, prefills, decodes, policy, tiebreak, hits)
    copies = [replace(c) for c in prefills], [replace(c) for c in decodes]
    assert choose(replace(cost), *copies, replace(policy), tiebreak, hits) == first


@no_deadline
@given(scenarios())
def test_fallbacks_are_distinct_exclude_the_decode_and_have_the_right_length(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak, hits)
    if isinstance(result, Decision):
        eligible = decodes
        if result.prefill is not None and policy.mode is Mode.STRICT:
            eligible = [d for d in decodes if d.group == result.prefill.group]
        addresses = [c.address for c in (result.decode, *result.fallbacks)]
        assert len(set(addresses)) == len(addresses)
        assert len(result.fallbacks) == min(policy.fallback_count, len(eligible) - 1)
        assert set(addresses) <= {c.address for c in eligible}


@no_deadline
@given(candidates("d", 8).filter(bool), st.integers(0, 1000))
def test_rotation_over_consecutive_tiebreaks_reaches_every_tied_decode(decodes: list, start: int) -> None:
    key = lambda d: (ticks(d.utilisation(0)), d.active_requests)  # noqa: E731
    best = min(key(d) for d in decodes)
    tied = {d.address for d in decodes if key(d) == best}
    policy = Policy(mode=Mode.OFF, fallback_count=0)
    picks = {choose(Cost(0, 0), [], decodes, policy, start + t).decode.address for t in range(len(tied))}
    assert picks == tied


@no_deadline
@given(candidates("p", 8).filter(bool), st.sampled_from([Mode.PREFER, Mode.STRICT]), st.integers(0, 1000))
def test_rotation_spreads_tied_pairs_over_every_tied_prefill(prefills: list, mode: Mode, start: int) -> None:
    decodes = [Candidate(f"d{g}", g, 1000.0, 0, 0) for g in GROUPS]  # every group: the same headroom
    policy = Policy(mode=mode, fallback_count=0)
    keys = Keys(Cost(0, 0), prefills, decodes, policy, None)
    key = lambda p: (keys.prefill(p), p.active_requests)  # noqa: E731
    best = min(key(p) for p in prefills)
    tied = {p.address for p in prefills if key(p) == best}
    picks = {choose(Cost(0, 0), prefills, decodes, policy, start + t).prefill.address for t in range(8)}
    assert picks == tied


@no_deadline
@given(tiered_scenarios())
def test_hits_in_a_cpu_tier_follow_the_documented_rule(scenario: tuple) -> None:
    assert_matches_reference(scenario)


@no_deadline
@given(tiered_scenarios())
def test_a_cpu_tier_weighed_as_gpu_memory_is_the_decision_without_tiers(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    policy = replace(
        policy, mode=Mode.PREFER if policy.mode is Mode.AUTO else policy.mode, cpu_tier_weight=1.0
    )
    tiered = choose(cost, prefills, decodes, policy, tiebreak, hits)
    assert tiered == choose(cost, prefills, decodes, policy, tiebreak, hits[:2])


@no_deadline
@given(tiered_scenarios(), st.integers(1, 5000))
def test_moving_the_chosen_prefills_hit_to_gpu_memory_keeps_the_decision(scenario: tuple, moved: int) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak, hits)
    if not isinstance(result, Decision) or result.prefill is None:
        return
    p_cpu = list(hits[2])
    i = prefills.index(result.prefill)
    p_cpu[i] = max(0, p_cpu[i] - moved)
    again = choose(cost, prefills, decodes, policy, tiebreak, (hits[0], hits[1], p_cpu, hits[3]))
    assert isinstance(again, Decision) and again.prefill == result.prefill


# ---------------------------------------------------------------- small pools: the general form's decisions


@contextmanager
def general_form() -> Iterator[None]:
    """Every reduction and ranking of the decision in numpy, whatever the pools' size (``LIST_MAX`` 0)."""
    with patch.object(decide, "LIST_MAX", 0), patch.object(extremes, "LIST_MAX", 0):
        yield


@no_deadline
@given(
    st.one_of(scenarios(), tiered_scenarios(), scenarios(max_size=2, min_size=1)),
    st.sampled_from([1.0, 1.0, 1e-9]),
)
def test_small_pools_decide_as_the_general_form(scenario: tuple, scale: float) -> None:
    """Python lists below ``LIST_MAX`` give the decision numpy gives: pair, fallbacks, estimate, refusal.

    ``scale`` 1e-9 shrinks the capacities until the keys leave float64's exact range (Python ints)."""
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    prefills, decodes = (
        [replace(c, token_capacity=c.token_capacity * scale) for c in pool] for pool in (prefills, decodes)
    )
    small = choose(cost, prefills, decodes, policy, tiebreak, hits)
    with general_form():
        assert choose(cost, prefills, decodes, policy, tiebreak, hits) == small


@no_deadline
@given(st.one_of(scenarios(max_size=1, min_size=1), tiered_scenarios(max_size=1)))
def test_one_prefill_and_one_decode_are_the_pair_the_ranking_gives(scenario: tuple) -> None:
    """One pair computes no key: the ranking, run anyway, gives that pair and no margin."""
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    if not prefills or not decodes:
        return
    p, d, h = Pool.of(prefills), Pool.of(decodes), as_hits(hits)
    prompt, want = cost.prefill_tokens, policy.fallback_count + 1
    u = (d.tokens + cost.decode_tokens) / d.capacity
    uncached = prompt if h is None else prompt - h.prefill
    if policy.mode is not Mode.AUTO:
        assert decide._rank(prompt, p, d, u, uncached, h, None, None, want, tiebreak, policy) == (0, [0])
        return
    model = policy.auto
    lack = prompt if h is None else prompt - h.decode
    cpu = (None, None) if h is None else (h.prefill_cpu, h.decode_cpu)
    priced = p.tokens + uncached + uncached
    ranking = decide._rank_auto(p, d, model.wait_s(u), lack, priced, *cpu, None, want, tiebreak, model)
    assert ranking == (0, [0], None)


@no_deadline
@given(
    st.one_of(scenarios(max_size=1, min_size=1), tiered_scenarios(max_size=1)),
    st.sampled_from([1.0, 0.01, 1e-9]),
)
def test_one_pair_on_python_numbers_decides_as_the_general_form(scenario: tuple, scale: float) -> None:
    """One prefill (or none) and one decode: the rule's arithmetic on their Python numbers gives the
    decision and the estimate, bit for bit, that numpy's arrays give (``scale`` 0.01 puts most
    utilisations past ``ROOM`` and ``KNEE``: the wait's whole curve; CPU tiers from the tiered pools)."""
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    prefills, decodes = (
        [replace(c, token_capacity=c.token_capacity * scale) for c in pool] for pool in (prefills, decodes)
    )
    on_numbers = choose(cost, prefills, decodes, policy, tiebreak, hits)
    with general_form():
        on_arrays = choose(cost, prefills, decodes, policy, tiebreak, hits)
    assert on_numbers == on_arrays
    if isinstance(on_numbers, Decision) and on_numbers.estimate is not None:
        assert [math.copysign(1.0, x) for x in on_numbers.estimate[:3]] == [
            math.copysign(1.0, x) for x in on_arrays.estimate[:3]
        ]
