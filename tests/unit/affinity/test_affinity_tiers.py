"""A hit held only in a CPU tier: worth ``cpu_tier_weight`` of a GPU one in ``off``/``prefer``/``strict``,
priced as its load at ``cpu_tier_gbps`` in ``auto`` (docs/routing.md "Tiers"), exact numbers.

The decision against its naive reference with CPU-tier hits is a property of
``test_affinity_properties.py``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ext_proc.affinity import AutoModel, Candidate, Cost, Decision, Hits, Mode, Policy, Pool, choose

PROMPT = Cost(1000, 1000)
MODEL = AutoModel(
    kv_bytes_per_token=1_000_000,
    same_group_gbps=100.0,
    cross_group_gbps=10.0,
    base_latency_ms=1.0,
    wait_scale_ms=0.0,
    prefill_ms_per_token=0.05,
    cpu_tier_gbps=50.0,
)


def idle(address: str) -> Candidate:
    return Candidate(address, "g", 1000.0, 0, 0)


def hits(prefill: list[int], decode: list[int], prefill_cpu: list[int], decode_cpu: list[int]) -> Hits:
    return Hits(*(np.array(side, dtype=np.int64) for side in (prefill, decode, prefill_cpu, decode_cpu)))


def decide(policy: Policy, held: Hits) -> Decision[Candidate]:
    prefills = Pool.of([idle("p1"), idle("p2")])
    decodes = Pool.of([idle("d1"), idle("d2")])
    result = choose(PROMPT, prefills, decodes, policy, 0, held)
    assert isinstance(result, Decision)
    return result


@pytest.mark.parametrize(
    ("cpu_tier_weight", "prefill"),
    [(0.5, "p1"), (1.0, "p2")],
)
def test_a_cpu_tier_hit_is_credited_its_weight(cpu_tier_weight: float, prefill: str) -> None:
    """p1 holds 800 tokens in GPU memory: u 0.2, credit 0.8, key -0.6; p2 holds all 1000 in a CPU tier:
    u 0, credit 1000 - (1 - w) x 1000 = 0.5 at w = 0.5 (key -0.5: p1 wins), 1.0 at w = 1 (key -1: p2)."""
    policy = Policy(Mode.PREFER, prefix_weight=1.0, cpu_tier_weight=cpu_tier_weight)
    result = decide(policy, hits([800, 1000], [0, 0], [0, 1000], [0, 0]))
    assert result.prefill is not None and result.prefill.address == prefill


def test_a_decode_cpu_tier_hit_is_credited_its_weight_too() -> None:
    """d1 holds 600 in GPU memory (credit 0.6); d2 holds 1000, all in a CPU tier (credit 0.5 at w = 0.5)."""
    policy = Policy(Mode.OFF, prefix_weight=1.0, cpu_tier_weight=0.5)
    assert decide(policy, hits([0, 0], [600, 1000], [0, 0], [0, 1000])).decode.address == "d1"
    policy = Policy(Mode.OFF, prefix_weight=1.0, cpu_tier_weight=0.7)  # credit 0.7: d2
    assert decide(policy, hits([0, 0], [600, 1000], [0, 0], [0, 1000])).decode.address == "d2"


def test_auto_prices_a_prefills_cpu_tier_hit_as_its_load() -> None:
    """p1 holds the whole prompt in a CPU tier: loading it costs 1000 x 1 MB / 50 GB/s = 20 ms, against
    100 ms for p2 to compute it (2 x 1000 tokens x 0.05 ms, a miss priced twice): p1. At 5 GB/s the load
    is 200 ms: p2."""
    held = hits([1000, 0], [0, 0], [1000, 0], [0, 0])
    result = decide(Policy(Mode.AUTO, auto=MODEL), held)
    assert result.prefill is not None and result.prefill.address == "p1"
    assert result.estimate is not None and result.estimate.prefill_s == pytest.approx(0.020, abs=1e-12)
    result = decide(Policy(Mode.AUTO, auto=replace(MODEL, cpu_tier_gbps=5.0)), held)
    assert result.prefill is not None and result.prefill.address == "p2"


def test_auto_prices_a_decodes_cpu_tier_hit_as_its_load_against_the_transfer() -> None:
    """d1 holds the whole prompt in a CPU tier: 20 ms to load; d2 holds nothing: 1000 x 1 MB across the
    group's 100 GB/s, 10 ms. d2, its estimate the transfer alone (1 ms + 10 ms); at 200 GB/s the load
    is 5 ms: d1, its estimate the base latency and the load (1 ms + 5 ms)."""
    held = hits([0, 0], [1000, 0], [0, 0], [1000, 0])
    result = decide(Policy(Mode.AUTO, auto=MODEL), held)
    assert result.decode.address == "d2"
    assert result.estimate is not None and result.estimate.transfer_s == pytest.approx(0.011, abs=1e-12)
    result = decide(Policy(Mode.AUTO, auto=replace(MODEL, cpu_tier_gbps=200.0)), held)
    assert result.decode.address == "d1"
    assert result.estimate is not None and result.estimate.transfer_s == pytest.approx(0.006, abs=1e-12)


def test_the_load_is_bytes_over_the_tier_bandwidth() -> None:
    assert MODEL.cpu_load_s(1000) == pytest.approx(0.02, abs=1e-15)
    assert AutoModel().cpu_load_s(1) == pytest.approx(131_072 / 55e9, rel=1e-12)
