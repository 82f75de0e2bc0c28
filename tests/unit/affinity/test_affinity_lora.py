"""A request for a LoRA adapter prefers the endpoints holding it (docs/routing.md "LoRA adapters").

``off``, ``prefer`` and ``strict`` rank an endpoint that lacks the adapter one tick (1e-9) behind: it
loses to a holder at equal key and to none a tick or more heavier; ``auto`` prices it ``lora_load_ms``
more, at a prefill in its time, at a decode in its wait. Exact numbers, every mode."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ext_proc.affinity import AutoModel, Candidate, Cost, Decision, Lacks, Mode, Policy, Pool, choose

BIG = 1e9  # a capacity of 1e9 tokens: one token is one tick of utilisation
RANKED = [Mode.OFF, Mode.PREFER, Mode.STRICT]


def lacks(prefill: list[bool], decode: list[bool]) -> Lacks:
    return Lacks(np.array(prefill, dtype=np.bool_), np.array(decode, dtype=np.bool_))


def pool(prefix: str, tokens: list[int], capacity: float = BIG) -> Pool[Candidate]:
    return Pool.of([Candidate(f"{prefix}{i + 1}", "g", capacity, t, 0) for i, t in enumerate(tokens)])


def decide(
    policy: Policy, prefills: list[int], decodes: list[int], lacking: Lacks | None, ticket: int = 0
) -> Decision[Candidate]:
    result = choose(Cost(0, 0), pool("p", prefills), pool("d", decodes), policy, ticket, None, lacking)
    assert isinstance(result, Decision)
    return result


@pytest.mark.parametrize("mode", RANKED)
@pytest.mark.parametrize("ticket", range(4))
def test_at_equal_load_the_holders_win_whatever_the_round_robin(mode: Mode, ticket: int) -> None:
    result = decide(Policy(mode), [5, 5], [7, 7], lacks([True, False], [True, False]), ticket)
    assert result.prefill is not None
    assert (result.prefill.address, result.decode.address) == ("p2", "d2")
    assert [d.address for d in result.fallbacks] == [
        "d1"
    ]  # the lacking decode ranks behind, still a fallback


@pytest.mark.parametrize("mode", RANKED)
@pytest.mark.parametrize("ticket", range(4))
def test_without_reports_the_round_robin_alone_breaks_the_tie(mode: Mode, ticket: int) -> None:
    unknown = lacks([False, False], [False, False])  # no fresh sample: no preference either way
    with_unknown = decide(Policy(mode), [5, 5], [7, 7], unknown, ticket)
    assert with_unknown == decide(Policy(mode), [5, 5], [7, 7], None, ticket)


@pytest.mark.parametrize("mode", RANKED)
def test_one_tick_lighter_ties_and_two_ticks_lighter_wins(mode: Mode) -> None:
    lacking = lacks([True, False], [True, False])
    # one token (one tick) lighter: key + 1 ties with the holder, the round robin picks either
    results = [decide(Policy(mode), [4, 5], [6, 7], lacking, ticket) for ticket in range(4)]
    picked = {(r.prefill.address if r.prefill else None, r.decode.address) for r in results}
    assert picked == {("p1", "d1"), ("p2", "d2")}
    # two ticks lighter: the lacking endpoints win whatever the ticket
    for ticket in range(4):
        result = decide(Policy(mode), [3, 5], [5, 7], lacking, ticket)
        assert result.prefill is not None
        assert (result.prefill.address, result.decode.address) == ("p1", "d1")


@pytest.mark.parametrize("mode", RANKED)
def test_decode_only_routing_prefers_the_holder(mode: Mode) -> None:
    decodes = pool("d", [7, 7])
    for ticket in range(4):
        result = choose(
            Cost(0, 0), pool("p", []), decodes, Policy(mode), ticket, None, lacks([], [False, True])
        )
        assert isinstance(result, Decision) and result.decode.address == "d1"


def test_huge_loads_rank_on_python_ints_alike() -> None:
    # utilisations beyond float64's exact tick range: the keys are Python ints, the tick still counts
    prefills = pool("p", [10**15, 10**15], capacity=1.0)
    decodes = pool("d", [10**15, 10**15], capacity=1.0)
    for mode in RANKED:
        for ticket in range(4):
            result = choose(
                Cost(0, 0), prefills, decodes, Policy(mode), ticket, None, lacks([False, True], [False, True])
            )
            assert isinstance(result, Decision) and result.prefill is not None
            assert (result.prefill.address, result.decode.address) == ("p1", "d1")


MODEL = AutoModel(
    kv_bytes_per_token=0,
    base_latency_ms=0.0,
    wait_scale_ms=10.0,
    prefill_ms_per_token=0.05,
    lora_load_ms=100.0,
)


def auto(
    prefills: list[int], decodes: list[int], lacking: Lacks | None, model: AutoModel = MODEL
) -> Decision[Candidate]:
    policy = Policy(Mode.AUTO, auto=model)
    result = choose(
        Cost(0, 0), pool("p", prefills, 10_000.0), pool("d", decodes, 10_000.0), policy, 0, None, lacking
    )
    assert isinstance(result, Decision)
    return result


@pytest.mark.parametrize(("backlog", "prefill"), [(1_000, "p2"), (3_000, "p1")])
def test_auto_prices_a_prefills_load_against_the_holders_backlog(backlog: int, prefill: str) -> None:
    """p1 lacks the adapter, idle: 100 ms; p2 holds it with ``backlog`` tokens at 0.05 ms: 50 or 150 ms."""
    result = auto([0, backlog], [0], lacks([True, False], [False]))
    assert result.prefill is not None and result.prefill.address == prefill
    assert result.estimate is not None
    assert result.estimate.prefill_s == pytest.approx(0.1 if prefill == "p1" else backlog * 0.05e-3)


@pytest.mark.parametrize(("load_ms", "decode"), [(100.0, "d2"), (1.0, "d1")])
def test_auto_prices_a_decodes_load_in_its_wait(load_ms: float, decode: str) -> None:
    """d1 lacks the adapter, idle: ``load_ms``; d2 holds it at u 0.5: 10 ms x 0.5 = 5 ms."""
    result = auto([0], [0, 5_000], lacks([False], [True, False]), replace(MODEL, lora_load_ms=load_ms))
    assert result.decode.address == decode
    assert result.estimate is not None
    assert result.estimate.wait_s == pytest.approx(load_ms / 1e3 if decode == "d1" else 0.005)


def test_auto_one_pair_still_estimates_the_loads() -> None:
    result = auto([0], [0], lacks([True], [True]))
    assert result.estimate is not None
    assert (result.estimate.prefill_s, result.estimate.wait_s) == (pytest.approx(0.1), pytest.approx(0.1))


def test_auto_without_reports_is_unchanged() -> None:
    unknown = lacks([False, False], [False, False])
    assert auto([0, 10], [0, 10], unknown) == auto([0, 10], [0, 10], None)
