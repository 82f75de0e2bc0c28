"""The blending formula, exhaustively: it is pure, so properties over every input."""

from __future__ import annotations

import math

from builders import endpoint
from hypothesis import given
from hypothesis import strategies as st

from ext_proc.endpoints import ClusterEndpoints
from ext_proc.engine_load.blend import EngineSample, blended_offset, engine_tokens
from ext_proc.load import Lease
from ext_proc.registry import Registry

tokens = st.integers(min_value=0, max_value=10**9)
engine_load = st.none() | st.floats(min_value=0, max_value=1e9, allow_nan=False)
samples = st.builds(
    EngineSample,
    running=st.none() | st.floats(0, 1e4),
    waiting=st.floats(0, 1e4),
    kv_usage=st.floats(0, 1),
)


def test_the_formula_on_numbers() -> None:
    sample = EngineSample(running=9.0, waiting=2.0, kv_usage=0.25)
    assert engine_tokens(sample, capacity=100_000, request_tokens=1_500, queue_weight=1.0) == 28_000
    assert engine_tokens(sample, capacity=100_000, request_tokens=1_500, queue_weight=0.0) == 25_000
    assert blended_offset(10_000, 28_000.0) == 18_000  # the engine knows more: read 28,000
    assert blended_offset(30_000, 28_000.0) == 0  # local knows more (requests routed since): read 30,000
    assert blended_offset(30_000, None) == 0  # stale or never scraped: local alone


@given(tokens, engine_load)
def test_never_below_local_and_equal_to_the_larger_view(local: int, engine: float | None) -> None:
    offset = blended_offset(local, engine)
    assert offset >= 0
    expected = local if engine is None else max(local, math.ceil(engine))
    assert local + offset == expected


@given(tokens)
def test_unknown_engine_load_is_local_accounting(local: int) -> None:
    assert blended_offset(local, None) == 0


@given(tokens, st.floats(0, 1e9), st.floats(0, 1e9))
def test_monotonic_in_engine_load(local: int, a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert local + blended_offset(local, low) <= local + blended_offset(local, high)


@given(samples, st.floats(1, 1e7), st.floats(0, 1e5), st.floats(0, 10), st.floats(0, 1), st.floats(0, 100))
def test_engine_tokens_grow_with_usage_and_queue(
    sample: EngineSample,
    capacity: float,
    request_tokens: float,
    weight: float,
    more_usage: float,
    more_queue: float,
) -> None:
    base = engine_tokens(sample, capacity, request_tokens, weight)
    assert base >= sample.kv_usage * capacity
    busier = EngineSample(sample.running, sample.waiting + more_queue, min(1.0, sample.kv_usage + more_usage))
    assert engine_tokens(busier, capacity, request_tokens, weight) >= base


def _decode() -> Registry:
    registry = Registry("prefill", "decode", 1000.0)
    registry.update([ClusterEndpoints("decode", (endpoint("10.0.0.1:80", "g", 1000.0),), "")])
    return registry


@given(
    st.lists(st.integers(1, 10**6), max_size=5),
    st.floats(0, 1e7),
    st.lists(st.integers(1, 10**6), max_size=5),
)
def test_charges_after_a_scrape_add_to_the_blended_load_and_releases_undo_them(
    before: list[int], engine: float, after: list[int]
) -> None:
    """Requests routed since the scrape are in the local term, so they count once, on top of the
    engine's view; releasing everything brings back exactly the offset."""
    registry = _decode()
    state = registry.decodes[0]
    held = [Lease(None, 0, state, t) for t in before]
    state.set_engine_offset(blended_offset(state.active_tokens, engine))
    at_scrape = state.blended_tokens
    assert at_scrape == max(sum(before), math.ceil(engine))
    assert int(registry.decode_pool.tokens[0]) == at_scrape  # what the decision reads
    routed = [Lease(None, 0, state, t) for t in after]
    assert state.blended_tokens == at_scrape + sum(after)
    assert state.active_tokens == sum(before) + sum(after)
    for lease in held + routed:
        lease.release()
    assert state.active_tokens == 0 and state.active_requests == 0
    assert state.blended_tokens == state.engine_offset
    state.set_engine_offset(0)  # stale
    assert state.blended_tokens == 0


def test_the_offset_survives_an_eds_update_with_the_endpoint() -> None:
    registry = _decode()
    state = registry.decodes[0]
    lease = Lease(None, 0, state, 100)
    state.set_engine_offset(400)
    spec = endpoint("10.0.0.1:80", "g", 1000.0)
    registry.update([ClusterEndpoints("decode", (endpoint("10.0.0.2:80", "g"), spec), "")])
    assert registry.decodes[1] is state
    assert int(registry.decode_pool.tokens[1]) == 500 and state.active_tokens == 100
    lease.release()
    assert state.blended_tokens == 400
