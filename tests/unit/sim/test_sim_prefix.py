"""The simulator's vLLM-style prefix caching: the block cache, the scheduler's use of it, the engine's
counters and headers, and virtual time."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from sim.config import EngineConfig, TimingConfig
from sim.engine import Engine, Scheduler, Sequence
from sim.kv import TransferResult
from sim.prefix import BlockCache, PromptBlocks, chain
from sim.protocol import token_text
from sim.virtual import Deadlock, VirtualClock, new_loop

BLOCK = 16
TEXT = "".join(chr(ord("a") + i % 26) * 64 for i in range(20))  # 20 distinct blocks of 16 tokens


def blocks(text: str) -> PromptBlocks:
    return PromptBlocks(text, BLOCK)


# ---------------------------------------------------------------- the block cache


def test_chain_blocks_text_in_fours_and_ids_as_they_are() -> None:
    assert len(chain("x" * 64 * 3 + "y" * 10, BLOCK)) == 3
    assert chain("x" * 128, BLOCK)[0] == chain("x" * 64 + "z" * 64, BLOCK)[0]
    assert len(chain(list(range(40)), BLOCK)) == 2


def test_a_lookup_stops_one_token_short_of_the_whole_prompt() -> None:
    cache = BlockCache(100, BLOCK)
    hashes = chain(TEXT[: 64 * 4], BLOCK)  # 64 tokens, 4 blocks
    holding = cache.take([], 4, 64)
    cache.cache(holding, hashes)
    assert cache.lookup(hashes, 64) == 3  # at most (64 - 1) // 16 blocks
    assert cache.lookup(hashes, 65) == 4
    cache.release(holding)
    assert cache.lookup(hashes, 65) == 4  # freed blocks stay cached
    assert cache.used == 0 and cache.cached_blocks == 4


def test_hits_are_shared_not_reserved_again_and_counted() -> None:
    cache = BlockCache(10, BLOCK)
    hashes = chain(TEXT[: 64 * 4], BLOCK)
    first = cache.take([], 5, 65)
    cache.cache(first, hashes)
    assert (cache.used, first.private) == (5, 1)
    hit = hashes[: cache.lookup(hashes, 65)]
    assert cache.fits(hit, 5)
    assert not cache.fits(hit, 6)
    second = cache.take(hit, 1, 65)
    assert cache.used == 6  # the 4 cached blocks are shared
    assert (cache.queries, cache.hits) == (130, 64)
    cache.release(first)
    assert cache.used == 5  # still referenced by the second
    cache.release(second)
    assert cache.used == 0


def test_free_cached_blocks_are_evicted_least_recently_freed_first_prompt_tail_first() -> None:
    cache = BlockCache(6, BLOCK)
    a, b = chain(TEXT[: 64 * 3], BLOCK), chain(TEXT[64 * 10 : 64 * 13], BLOCK)
    for hashes in (a, b):
        holding = cache.take([], 3, 64 * 3 + 1)
        cache.cache(holding, hashes)
        cache.release(holding)
    cache.release(cache.take([], 2, 1))  # two fresh blocks: the two oldest free ones go: a's tail
    assert cache.lookup(a, 10**6) == 1 and cache.lookup(b, 10**6) == 3
    assert not cache.fits([], 7)


def test_blocks_in_use_are_never_evicted() -> None:
    cache = BlockCache(4, BLOCK)
    hashes = chain(TEXT[: 64 * 2], BLOCK)
    holding = cache.take([], 2, 33)
    cache.cache(holding, hashes)
    assert cache.fits([], 2) and not cache.fits([], 3)
    cache.release(cache.take([], 2, 1))
    assert cache.lookup(hashes, 33) == 2


def test_two_sequences_computing_one_block_keep_one_cached() -> None:
    cache = BlockCache(10, BLOCK)
    hashes = chain(TEXT[: 64 * 2], BLOCK)
    first, second = cache.take([], 2, 33), cache.take([], 2, 33)
    cache.cache(first, hashes)
    cache.cache(second, hashes)
    assert (first.private, second.private, cache.cached_blocks) == (0, 2, 2)
    cache.release(first)
    cache.release(second)
    assert cache.used == 0 and cache.lookup(hashes, 33) == 2


def test_the_output_extends_the_chain() -> None:
    prompt = blocks(TEXT[:100])
    assert prompt.with_output(0) == prompt.hashes
    extended = prompt.with_output(40)
    assert extended == chain(TEXT[:100] + token_text(0, 40), BLOCK)
    assert PromptBlocks([1, 2, 3] * 20, BLOCK).with_output(40) == chain([1, 2, 3] * 20, BLOCK)


# ---------------------------------------------------------------- the scheduler


CACHING = TimingConfig(enable_prefix_caching=True, kv_capacity_tokens=64 * BLOCK)


def seq(prompt_text: str, out: int = 2, pull: bool = False) -> Sequence:
    async def load(tokens: int) -> TransferResult:  # never awaited by the pure scheduler
        raise AssertionError

    tokens = -(-len(prompt_text) // 4)
    return Sequence("r", tokens, out, out, 0.0, pull=load if pull else None, prefix=blocks(prompt_text))


def run_to_end(s: Scheduler) -> None:
    now = 0.0
    while (plan := s.plan()) is not None:
        now += plan.duration_s
        s.apply(plan, now)


def test_a_repeated_prompt_computes_only_its_uncached_tokens() -> None:
    s = Scheduler(CACHING)
    first = seq(TEXT[: 64 * 5 + 8])  # 82 tokens: 5 full blocks
    s.add(first)
    s.admit(0.0)
    assert first.cached_tokens == 0
    run_to_end(s)
    again = seq(TEXT[: 64 * 5 + 8])
    s.add(again)
    s.admit(1.0)
    assert again.cached_tokens == 80 and again.prefilled == 80
    plan = s.plan()
    assert plan is not None and plan.prefill == [(again, 2)]
    assert (s.cache.queries, s.cache.hits) == (164, 80)


def test_a_pulled_sequence_pulls_only_what_it_lacks_and_caches_the_rest() -> None:
    s = Scheduler(CACHING)
    warm = seq(TEXT[: 64 * 3])
    s.add(warm)
    s.admit(0.0)
    run_to_end(s)
    pulled = seq(TEXT[: 64 * 6], pull=True)
    s.add(pulled)
    s.admit(1.0)
    assert pulled.cached_tokens == 48  # 3 blocks held; the decode asks for 96 - 48 tokens
    s.kv_loaded(pulled)
    assert s.cache.lookup(chain(TEXT[: 64 * 6], BLOCK), 10**6) == 6


def test_the_reply_is_cached_for_the_next_turn() -> None:
    s = Scheduler(CACHING)
    turn = seq(TEXT[: 64 * 2], out=40)
    s.add(turn)
    s.admit(0.0)
    run_to_end(s)
    reply = token_text(0, 40)
    following = seq(TEXT[: 64 * 2] + reply + "q" * 64)
    s.add(following)
    s.admit(1.0)
    assert following.cached_tokens == (128 + 160) // 64 * BLOCK  # the prompt and the reply's full blocks


def test_without_prefix_caching_nothing_is_cached() -> None:
    engine = Engine(EngineConfig(timing=replace(CACHING, enable_prefix_caching=False)))
    first = engine.submit(100, 2, 2, prefix=blocks(TEXT[:400]))
    assert first.prefix is None


# ---------------------------------------------------------------- engines in virtual time


def test_virtual_time_runs_an_engine_and_its_counters_on_the_page() -> None:
    loop = new_loop()

    async def main() -> tuple[float, float, float, bytes]:
        engine = Engine(
            EngineConfig(timing=replace(CACHING, kv_capacity_tokens=262144)), clock=VirtualClock()
        )
        await engine.start()
        cold = engine.submit(1000, 4, 4, prefix=blocks(TEXT * 4))
        await engine.wait_done(cold)
        warm = engine.submit(1000, 4, 4, prefix=blocks(TEXT * 4))
        await engine.wait_done(warm)
        page = engine.metrics.render()
        await engine.stop()
        assert cold.first_token_at is not None and warm.first_token_at is not None
        return (
            cold.first_token_at - cold.arrival,
            warm.first_token_at - warm.arrival,
            engine.clock.now(),
            page,
        )

    try:
        cold_s, warm_s, now, page = loop.run_until_complete(main())
    finally:
        loop.close()
    timing = CACHING
    assert cold_s == pytest.approx(timing.prefill_ms(1000, 1) / 1e3)
    assert warm_s == pytest.approx(timing.prefill_ms(1000 - 992, 1) / 1e3)  # 62 blocks cached
    assert now > cold_s + warm_s  # model seconds passed; the test took milliseconds
    assert b"vllm:prefix_cache_queries_total" in page and b"vllm:prefix_cache_hits_total" in page
    assert b'vllm:prefix_cache_hits_total{engine="0",model_name="sim-llama-3-8b"} 992.0' in page


def test_virtual_time_reports_a_deadlock_instead_of_hanging() -> None:
    loop = new_loop()
    try:
        with pytest.raises(Deadlock):
            loop.run_until_complete(asyncio.Event().wait())
    finally:
        loop.close()
