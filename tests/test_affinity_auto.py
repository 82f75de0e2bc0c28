"""``auto`` affinity: the delay model's numbers, and the decision's guarantees as properties.

The exact ranking of ``auto`` against a naive reference is checked with the other modes in
``test_affinity_properties.py`` (default model); here the model's parameters vary too.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from test_affinity_properties import (
    assert_follows_documented_ranking,
    candidates,
    choose,
    costs,
    no_deadline,
    tiebreaks,
)

from ext_proc.affinity import AutoModel, Candidate, Cost, Decision, Locality, Mode, Policy
from ext_proc.affinity.auto import KNEE, ROOM

GRID = 1e-9  # seconds: auto compares delays on this grid


def estimate(model: AutoModel, cost: Cost, group: str, d: Candidate) -> float:
    """The documented delay estimate of decode ``d`` for a prefill of ``group``, in seconds."""
    same = d.group == group
    return model.transfer_s(cost.prefill_tokens, same) + model.wait_s(d.utilisation(cost.decode_tokens))


def tolerance(value: float) -> float:
    """Two roundings to the grid, plus float error relative to the estimate's size."""
    return 3 * GRID + 1e-12 * abs(value)


gbps = st.sampled_from([1.0, 10.0, 100.0, 400.0]) | st.floats(min_value=0.1, max_value=1000.0)
models = st.builds(
    lambda same, ratio, per_token, base, scale: AutoModel(per_token, same, same * ratio, base, scale),
    gbps,
    st.sampled_from([1.0, 0.1, 0.5]) | st.floats(min_value=0.01, max_value=1.0),
    st.sampled_from([0, 131_072, 1]) | st.integers(0, 2_000_000),
    st.sampled_from([0.0, 1.0]) | st.floats(min_value=0.0, max_value=50.0),
    st.sampled_from([0.0, 15.0]) | st.floats(min_value=0.0, max_value=1000.0),
)
auto_policies = st.builds(
    lambda model, fallbacks: Policy(Mode.AUTO, fallback_count=fallbacks, auto=model),
    models,
    st.integers(0, 5),
)


def auto_scenarios(max_size: int = 10) -> st.SearchStrategy[tuple]:
    return st.tuples(
        costs, candidates("p", max_size, 1), candidates("d", max_size, 1), auto_policies, tiebreaks
    )


# ---------------------------------------------------------------- the model's numbers


def test_transfer_is_the_simulators_model() -> None:
    model = AutoModel()  # 128 KiB/token, 100 GB/s in a group, 10 GB/s across, 1 ms
    assert model.transfer_s(30_000, same_group=False) == pytest.approx(0.001 + 30_000 * 131_072 / 10e9)
    assert model.transfer_s(30_000, same_group=True) == pytest.approx(0.001 + 30_000 * 131_072 / 100e9)
    assert model.penalty_s(30_000) == pytest.approx(30_000 * 131_072 * (1 / 10e9 - 1 / 100e9))
    assert model.penalty_s(0) == 0.0
    assert AutoModel(same_group_gbps=25.0, cross_group_gbps=25.0).penalty_s(123_456) == 0.0


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
    assert result.estimate == (AutoModel().transfer_s(100, False), AutoModel().wait_s(0.2), None)


# ---------------------------------------------------------------- properties


@no_deadline
@given(auto_scenarios())
def test_never_picks_a_decode_whose_estimate_is_worse_than_anothers(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    result = choose(cost, prefills, decodes, policy, tiebreak)
    assert isinstance(result, Decision) and result.prefill is not None
    group, model = result.prefill.group, policy.auto
    chosen = estimate(model, cost, group, result.decode)
    best = min(estimate(model, cost, group, d) for d in decodes)
    assert chosen <= best + tolerance(chosen)
    assert result.estimate is not None
    home = result.decode.group == group
    assert result.estimate.transfer_s == model.transfer_s(cost.prefill_tokens, home)
    assert result.estimate.wait_s == model.wait_s(result.decode.utilisation(cost.decode_tokens))
    others = [estimate(model, cost, group, d) for d in decodes if (d.group == group) != home]
    if others and len({d.group for d in decodes}) > 1:
        assert result.estimate.margin_s == pytest.approx(min(others) - chosen, abs=tolerance(chosen))
        assert result.estimate.margin_s >= -tolerance(chosen)
    else:
        assert result.estimate.margin_s is None


@no_deadline
@given(auto_scenarios())
def test_ranks_as_documented_for_any_model(scenario: tuple) -> None:
    assert_follows_documented_ranking(scenario)


@no_deadline
@given(auto_scenarios(), gbps, st.floats(min_value=0.0, max_value=50.0))
def test_free_transfers_degrade_to_off(scenario: tuple, bandwidth: float, base_ms: float) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    model = replace(
        policy.auto, same_group_gbps=bandwidth, cross_group_gbps=bandwidth, base_latency_ms=base_ms
    )
    auto = choose(cost, prefills, decodes, replace(policy, auto=model), tiebreak)
    off = choose(cost, prefills, decodes, replace(policy, mode=Mode.OFF), tiebreak)
    assert isinstance(auto, Decision) and isinstance(off, Decision)
    assert auto[:4] == off[:4]  # prefill, decode, fallbacks, locality: all of off's decision


@no_deadline
@given(auto_scenarios(), st.integers(0, 5000), st.floats(min_value=1.0, max_value=1e5))
def test_expensive_transfers_and_even_load_are_strict(scenario: tuple, tokens: int, cap: float) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    assume(cost.prefill_tokens > 0)
    even = [replace(d, active_tokens=tokens, token_capacity=cap) for d in decodes]
    model = AutoModel(kv_bytes_per_token=10**9, same_group_gbps=100.0, cross_group_gbps=1.0)
    auto = choose(cost, prefills, even, replace(policy, auto=model), tiebreak)
    strict = choose(cost, prefills, even, replace(policy, mode=Mode.STRICT), tiebreak)
    assert isinstance(auto, Decision) and auto.prefill is not None
    if isinstance(strict, Decision) and strict.prefill == auto.prefill:
        assert (auto.decode, auto.locality) == (strict.decode, Locality.SAME_GROUP)
        assert auto.fallbacks[: len(strict.fallbacks)] == strict.fallbacks
    elif auto.prefill.group in {d.group for d in even}:  # strict chose among fewer prefills
        assert auto.locality is Locality.SAME_GROUP


@no_deadline
@given(auto_scenarios())
def test_a_penalty_above_every_wait_difference_keeps_the_group(scenario: tuple) -> None:
    cost, prefills, decodes, policy, tiebreak = scenario
    assume(cost.prefill_tokens > 0)
    result = choose(cost, prefills, decodes, policy, tiebreak)
    assert isinstance(result, Decision) and result.prefill is not None
    group, model = result.prefill.group, policy.auto
    waits = [model.wait_s(d.utilisation(cost.decode_tokens)) for d in decodes]
    same = [d for d in decodes if d.group == group]
    if same and model.penalty_s(cost.prefill_tokens) > max(waits) - min(waits) + 3 * GRID:
        assert result.locality is Locality.SAME_GROUP
