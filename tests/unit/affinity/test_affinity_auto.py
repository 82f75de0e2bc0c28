"""``auto`` affinity: the time model's numbers, and the decision's guarantees as properties.

The exact ranking of ``auto`` against a naive reference is checked with the other modes in
``test_affinity_properties.py``; here the model's parameters vary more, and the float estimate in
seconds is checked against the chosen pair.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from test_affinity_properties import (
    assert_matches_reference,
    candidates,
    choose,
    costs,
    hit_lists,
    no_deadline,
    tiebreaks,
)

from ext_proc.affinity import AutoModel, Candidate, Cost, Decision, Locality, Mode, Policy
from ext_proc.affinity.auto import KNEE, ROOM

GRID = 1e-9  # seconds: auto compares times on this grid


def hit(hits: tuple | None, pool: list, endpoint: Candidate, role: int) -> int:
    return 0 if hits is None else hits[role][pool.index(endpoint)]


def estimate(
    model: AutoModel,
    cost: Cost,
    p: Candidate,
    d: Candidate,
    prefills: list,
    decodes: list,
    hits: tuple | None,
) -> float:
    """The documented price of the pair (p, d), in seconds: its time to the first decoded token, the
    prefill's uncached tokens counted twice."""
    prompt = cost.prefill_tokens
    backlog = p.active_tokens + 2 * (prompt - hit(hits, prefills, p, 0))
    lack = prompt - hit(hits, decodes, d, 1)
    wait = model.wait_s(d.utilisation(cost.decode_tokens))
    return model.prefill_s(backlog) + model.transfer_s(lack, p.group == d.group) + wait


def tolerance(value: float) -> float:
    """Two roundings to the grid, plus float error relative to the estimate's size."""
    return 3 * GRID + 1e-12 * abs(value)


gbps = st.sampled_from([1.0, 10.0, 100.0, 400.0]) | st.floats(min_value=0.1, max_value=1000.0)
models = st.builds(
    lambda same, ratio, per_token, base, scale, prefill: AutoModel(
        per_token, same, same * ratio, base, scale, prefill
    ),
    gbps,
    st.sampled_from([1.0, 0.1, 0.5]) | st.floats(min_value=0.01, max_value=1.0),
    st.sampled_from([0, 131_072, 1]) | st.integers(0, 2_000_000),
    st.sampled_from([0.0, 1.0]) | st.floats(min_value=0.0, max_value=50.0),
    st.sampled_from([0.0, 15.0]) | st.floats(min_value=0.0, max_value=1000.0),
    st.sampled_from([0.0, 0.05]) | st.floats(min_value=0.0, max_value=10.0),
)
auto_policies = st.builds(
    lambda model, fallbacks: Policy(Mode.AUTO, fallback_count=fallbacks, auto=model),
    models,
    st.integers(0, 5),
)


@st.composite
def auto_scenarios(draw: st.DrawFn, max_size: int = 10) -> tuple:
    cost = draw(costs)
    prefills, decodes = draw(candidates("p", max_size, 1)), draw(candidates("d", max_size, 1))
    return (
        cost,
        prefills,
        decodes,
        draw(auto_policies),
        draw(tiebreaks),
        draw(hit_lists(cost, prefills, decodes)),
    )


# ---------------------------------------------------------------- the model's numbers


def test_transfer_and_prefill_are_the_simulators_model() -> None:
    model = AutoModel()  # 128 KiB/token, 100 GB/s in a group, 10 GB/s across, 1 ms, 0.05 ms/token
    assert model.transfer_s(30_000, same_group=False) == pytest.approx(0.001 + 30_000 * 131_072 / 10e9)
    assert model.transfer_s(30_000, same_group=True) == pytest.approx(0.001 + 30_000 * 131_072 / 100e9)
    assert model.transfer_s(0, same_group=False) == 0.001
    assert model.seconds_per_token(True) == 131_072 / 100e9
    assert model.prefill_s(4_000) == pytest.approx(0.2)
    assert model.prefill_s(np.array([0, 2_000])).tolist() == pytest.approx([0.0, 0.1])


def test_wait_is_the_step_below_room_then_queueing_then_its_tangent() -> None:
    model = AutoModel(wait_scale_ms=20.0)
    assert model.wait_s(0.0) == 0.0
    assert model.wait_s(0.5) == pytest.approx(0.020 * 0.5)  # room: only a longer step
    assert model.wait_s(ROOM) == pytest.approx(0.020 * ROOM)
    assert model.wait_s(0.9) == pytest.approx(0.020 * (0.9 + (0.9 - ROOM) / 0.1))
    at_knee = model.wait_s(KNEE)
    slope = 0.020 * (1 + (1 - ROOM) / (1 - KNEE) ** 2)
    assert model.wait_s(KNEE + 0.5) == pytest.approx(at_knee + 0.5 * slope)
    assert model.wait_s(3.0) > model.wait_s(2.0) > model.wait_s(1.0) > at_knee


def _mm1(u: float) -> float:
    """The plain M/M/1 ``u / (1 - u)`` continued as its tangent above KNEE (the wait ``auto`` used first)."""
    m = min(u, KNEE)
    return m / (1 - m) + (u - m) / (1 - KNEE) ** 2


@given(st.floats(0.0, 3.0), st.floats(0.0, 3.0))
def test_wait_differences_are_never_larger_than_mm1s(a: float, b: float) -> None:
    # So for a given pool, auto crosses groups only where the M/M/1 wait would have.
    lo, hi = min(a, b), max(a, b)
    model = AutoModel(wait_scale_ms=1e3)
    assert model.wait_s(hi) - model.wait_s(lo) <= _mm1(hi) - _mm1(lo) + 1e-9
    assert model.wait_s(hi) >= model.wait_s(lo)


def test_wait_over_an_array_is_the_scalars_bit_for_bit() -> None:
    model = AutoModel(wait_scale_ms=13.7)
    for u in (
        np.array([0.0, 1e-9, 0.3, ROOM, 0.81, 0.949999, KNEE, 0.96, 1.0, 7.25]),
        np.array([0.0, 0.1, 0.7, ROOM]),
        np.array([0.0, 0.1, 0.7, KNEE]),
    ):
        assert model.wait_s(u).tolist() == [float(model.wait_s(float(x))) for x in u]


def test_long_prompts_stay_home_short_ones_spill_to_the_idle_group() -> None:
    # The home decode is at u ~ 0.9 (wait ~ 27 ms at 15 ms scale: its batch is about full), the other
    # group's at ~ 0.2 (~ 3 ms): crossing saves ~ 24 ms of wait. A 1k-token prompt's transfer penalty is
    # 12 ms, a 16k one's 189 ms.
    prefill = Candidate("p", "a", 1000.0, 0, 0)
    home = Candidate("home", "a", 1e6, 900_000, 3)
    away = Candidate("away", "b", 1e6, 200_000, 1)
    policy = Policy(Mode.AUTO, fallback_count=1)
    model = policy.auto
    short = choose(Cost(1024, 1024), [prefill], [home, away], policy, 0)
    long = choose(Cost(16_384, 16_384), [prefill], [home, away], policy, 0)
    assert isinstance(short, Decision) and isinstance(long, Decision)
    assert (short.decode, short.fallbacks, short.locality) == (away, (home,), Locality.CROSS_GROUP)
    assert (long.decode, long.fallbacks, long.locality) == (home, (away,), Locality.SAME_GROUP)
    wait_home, wait_away = home.utilisation(1024), away.utilisation(1024)
    wait_home, wait_away = model.wait_s(wait_home), model.wait_s(wait_away)
    assert short.estimate == (
        model.prefill_s(1024),
        model.transfer_s(1024, False),
        wait_away,
        pytest.approx(wait_home + model.transfer_s(1024, True) - wait_away - model.transfer_s(1024, False)),
    )
    assert long.estimate is not None and long.estimate.margin_s is not None
    assert long.estimate.transfer_s == model.transfer_s(16_384, True)
    assert long.estimate.margin_s > 0.1  # staying home saves over 0.1 s


def test_decode_only_and_other_modes_carry_no_estimate() -> None:
    decodes = [Candidate("d0", "a", 1000.0, 0, 0), Candidate("d1", "b", 1000.0, 0, 0)]
    prefills = [Candidate("p", "a", 1000.0, 0, 0)]
    assert choose(Cost(100, 200), [], decodes, Policy(Mode.AUTO), 0).estimate is None
    for mode in (Mode.OFF, Mode.PREFER, Mode.STRICT):
        assert choose(Cost(100, 200), prefills, decodes, Policy(mode), 0).estimate is None


def test_one_decode_group_reports_the_estimate_without_a_margin() -> None:
    decodes = [Candidate("d0", "b", 1000.0, 500, 0), Candidate("d1", "b", 1000.0, 0, 0)]
    result = choose(Cost(100, 200), [Candidate("p", "a", 1000.0, 0, 0)], decodes, Policy(Mode.AUTO), 0)
    assert isinstance(result, Decision) and result.decode is decodes[1]
    model = AutoModel()
    assert result.estimate == (model.prefill_s(100), model.transfer_s(100, False), model.wait_s(0.2), None)


def test_a_trapped_groups_prefills_lose_to_a_pair_with_decode_headroom() -> None:
    # Group t has two idle prefills and one decode near full; group h's prefill has a short queue and
    # its decodes are idle. Prefill-first routing would take an idle prefill of t and then wait on t's
    # decode or pay a cross-group transfer; the pair choice takes h's prefill and an in-group decode.
    prefills = [
        Candidate("t0", "t", 1e6, 0, 0),
        Candidate("t1", "t", 1e6, 0, 0),
        Candidate("h0", "h", 1e6, 400, 1),
    ]
    decodes = [
        Candidate("td", "t", 1e5, 93_000, 9),
        Candidate("hd0", "h", 1e6, 0, 0),
        Candidate("hd1", "h", 1e6, 0, 0),
    ]
    for mode in (Mode.AUTO, Mode.PREFER, Mode.STRICT):
        result = choose(Cost(4_000, 4_100), prefills, decodes, Policy(mode), 0)
        assert isinstance(result, Decision)
        assert (result.prefill.address, result.locality) == ("h0", Locality.SAME_GROUP), mode


def test_a_decode_holding_the_prompt_needs_only_the_base_latency() -> None:
    prefill = Candidate("p", "a", 1e6, 0, 0)
    warm, cold = Candidate("warm", "b", 1e6, 1_000, 1), Candidate("cold", "a", 1e6, 0, 0)
    policy = Policy(Mode.AUTO, fallback_count=1)
    result = choose(Cost(20_000, 20_100), [prefill], [warm, cold], policy, 0, ([0], [20_000, 0]))
    assert isinstance(result, Decision) and result.decode is warm and result.locality is Locality.CROSS_GROUP
    assert result.estimate is not None and result.estimate.transfer_s == policy.auto.transfer_s(0, False)


def test_a_prefill_holding_the_prompt_wins_until_its_queue_costs_more_than_it_saves() -> None:
    policy = Policy(Mode.AUTO)
    decodes = [Candidate("d", "a", 1e6, 0, 0)]
    for backlog, expected in ((13_000, "warm"), (15_000, "cold")):  # the miss: 2 x 8k; the hit: 2 x 1k
        warm, cold = Candidate("warm", "a", 1e6, backlog, 2), Candidate("cold", "a", 1e6, 0, 0)
        result = choose(Cost(8_000, 8_100), [warm, cold], decodes, policy, 0, ([7_000, 0], [0]))
        assert isinstance(result, Decision) and result.prefill.address == expected, backlog


# ---------------------------------------------------------------- properties


@no_deadline
@given(auto_scenarios())
def test_never_picks_a_pair_priced_above_another(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak, hits = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak, hits)
    assert isinstance(result, Decision) and result.prefill is not None
    model, p, d = policy.auto, result.prefill, result.decode
    chosen = estimate(model, cost, p, d, prefills, decodes, hits)
    best = min(estimate(model, cost, q, e, prefills, decodes, hits) for q in prefills for e in decodes)
    assert chosen <= best + tolerance(chosen)
    assert result.estimate is not None
    home = d.group == p.group
    prompt = cost.prefill_tokens
    assert result.estimate.prefill_s == model.prefill_s(p.active_tokens + prompt - hit(hits, prefills, p, 0))
    assert result.estimate.transfer_s == model.transfer_s(prompt - hit(hits, decodes, d, 1), home)
    assert result.estimate.wait_s == model.wait_s(d.utilisation(cost.decode_tokens))
    others = [
        estimate(model, cost, p, e, prefills, decodes, hits) for e in decodes if (e.group == p.group) != home
    ]
    if others and len({e.group for e in decodes}) > 1 and p.group in {e.group for e in decodes}:
        assert result.estimate.margin_s == pytest.approx(min(others) - chosen, abs=tolerance(chosen))
        assert result.estimate.margin_s >= -tolerance(chosen)
    else:
        assert result.estimate.margin_s is None


@no_deadline
@given(auto_scenarios())
def test_ranks_as_documented_for_any_model(scenario: tuple) -> None:
    assert_matches_reference(scenario)


@no_deadline
@given(auto_scenarios(), gbps)
def test_equal_bandwidths_and_no_cache_pick_a_least_utilised_decode(
    scenario: tuple, bandwidth: float
) -> None:
    cost, prefills, decodes, policy, tiebreak, _ = scenario
    model = replace(policy.auto, same_group_gbps=bandwidth, cross_group_gbps=bandwidth)
    assume(model.wait_scale_ms > 0)
    result = choose(cost, prefills, decodes, replace(policy, auto=model), tiebreak)
    assert isinstance(result, Decision)
    waits = [ticks_s(model.wait_s(d.utilisation(cost.decode_tokens))) for d in decodes]
    assert ticks_s(model.wait_s(result.decode.utilisation(cost.decode_tokens))) <= min(waits) + 1


def ticks_s(seconds: float) -> int:
    return round(seconds * 1e9)


@no_deadline
@given(auto_scenarios(), st.integers(0, 5000), st.floats(min_value=1.0, max_value=1e5))
def test_expensive_transfers_and_even_load_keep_the_group(scenario: tuple, tokens: int, cap: float) -> None:
    cost, prefills, decodes, policy, tiebreak, _ = scenario
    assume(cost.prefill_tokens > 0)
    even = [replace(d, active_tokens=tokens, token_capacity=cap) for d in decodes]
    model = AutoModel(
        kv_bytes_per_token=10**9, same_group_gbps=100.0, cross_group_gbps=1.0, prefill_ms_per_token=0.0
    )
    auto = choose(cost, prefills, even, replace(policy, auto=model), tiebreak)
    assert isinstance(auto, Decision) and auto.prefill is not None
    if any(p.group in {d.group for d in even} for p in prefills):
        assert auto.locality is Locality.SAME_GROUP
