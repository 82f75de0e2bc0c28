"""The simulator's CPU KV tier (sim.prefix, sim.engine): evicted blocks kept there least recently used
first, prompts hitting them loading at the CPU-to-GPU bandwidth, hits counted per tier."""

from __future__ import annotations

import pytest

from sim.config import EngineConfig, KvConfig, TimingConfig
from sim.engine import Engine, Scheduler, Sequence
from sim.prefix import BlockCache, PromptBlocks
from sim.virtual import VirtualClock, new_loop

BLOCK = 16
A = [1, 2, 3, 4]


def _cached(cache: BlockCache, hashes: list[int]) -> None:
    """A sequence computes ``hashes`` and finishes: its blocks become free cached ones."""
    holding = cache.take([], len(hashes), 0)
    cache.cache(holding, hashes)
    cache.release(holding)


def test_evicted_blocks_go_to_the_cpu_tier_which_drops_its_least_recently_used() -> None:
    cache = BlockCache(4, BLOCK, cpu_capacity=2)
    _cached(cache, A)
    cache.release(cache.take([], 4, 0))  # evicts 4, 3, 2, 1 (tail first); the tier keeps the last two
    prompt = 4 * BLOCK + 1
    assert cache.lookup(A, prompt) == 0
    assert cache.lookup_cpu(A, prompt, 0) == 2
    holding = cache.take([], 4, prompt, loaded=A[:2])
    assert (holding.refs, holding.private) == ([1, 2], 2)
    assert (cache.queries, cache.hits, cache.cpu_hits) == (prompt, 0, 2 * BLOCK)
    assert cache.lookup(A, prompt) == 2  # loaded blocks are cached in the KV cache again
    assert cache.lookup_cpu(A, prompt, 2) == 0


def test_without_a_tier_evicted_blocks_are_gone() -> None:
    cache = BlockCache(4, BLOCK)
    _cached(cache, A)
    cache.release(cache.take([], 4, 0))
    assert cache.lookup(A, 100) == 0 and cache.lookup_cpu(A, 100, 0) == 0


def test_the_cpu_run_continues_the_kv_cache_hit_within_the_prompt_limit() -> None:
    cache = BlockCache(4, BLOCK, cpu_capacity=8)
    _cached(cache, A)
    cache.release(cache.take([], 2, 0))  # evicts 4 and 3 only
    assert cache.lookup(A, 100) == 2
    assert cache.lookup_cpu(A, 100, 2) == 2
    assert cache.lookup_cpu(A, 3 * BLOCK, 2) == 0  # at least one prompt token is computed: 2 blocks max


TEXT = "".join(f"{i:064d}" for i in range(40))  # 40 distinct blocks of 16 tokens
TIER = TimingConfig(
    enable_prefix_caching=True, kv_capacity_tokens=8 * BLOCK, cpu_kv_capacity_tokens=64 * BLOCK
)


def _seq(text: str) -> Sequence:
    return Sequence("r", len(text) // 4, 2, 2, 0.0, prefix=PromptBlocks(text, BLOCK))


def _finish(s: Scheduler, seq: Sequence) -> list[float]:
    """Admit and run ``seq`` alone to its end; the durations of its steps (model s)."""
    s.add(seq)
    s.admit(0.0)
    steps = []
    while (plan := s.plan()) is not None:
        steps.append(plan.duration_s)
        s.apply(plan, sum(steps))
    return steps


def test_a_prompt_hitting_the_tier_loads_its_blocks_at_pcie_speed_once() -> None:
    kv = KvConfig()
    s = Scheduler(TIER, kv)
    prompt_a = TEXT[: 64 * 5 + 8]  # 82 tokens: 5 full blocks; 6 blocks with its 2 output tokens
    _finish(s, _seq(prompt_a))
    _finish(s, _seq(TEXT[64 * 20 : 64 * 25 + 8]))  # 6 fresh blocks: A's 3 tail blocks go to the tier
    again = _seq(prompt_a)
    steps = _finish(s, again)
    assert (again.cached_tokens, again.cpu_tokens) == (80, 48)  # 2 blocks in HBM, 3 loaded
    assert (s.cache.hits, s.cache.cpu_hits) == (32, 48)
    prefill = TIER.prefill_ms(2, 1, 2 * (2 * 80 + 2))
    assert steps[0] * 1e3 == pytest.approx(prefill + kv.cpu_load_ms(48))
    assert kv.cpu_load_ms(48) == pytest.approx(48 * 131072 / 55e9 * 1e3)
    assert steps[1] * 1e3 == pytest.approx(TIER.decode_ms(1, 83))  # the load is paid once


def test_the_engine_reports_cpu_tier_hits_apart() -> None:
    loop = new_loop()

    async def main() -> bytes:
        engine = Engine(EngineConfig(timing=TIER), clock=VirtualClock())
        await engine.start()
        for text in (TEXT[: 64 * 5 + 8], TEXT[64 * 20 : 64 * 25 + 8], TEXT[: 64 * 5 + 8]):
            await engine.wait_done(engine.submit(82, 2, 2, prefix=PromptBlocks(text, BLOCK)))
        page = engine.metrics.render()
        await engine.stop()
        return page

    try:
        page = loop.run_until_complete(main())
    finally:
        loop.close()
    assert b'vllm:prefix_cache_hits_total{engine="0",model_name="sim-llama-3-8b"} 32.0' in page
    assert b'sim:prefix_cache_cpu_hits_total{engine="0",model_name="sim-llama-3-8b"} 48.0' in page


def test_tier_options_are_checked() -> None:
    with pytest.raises(ValueError, match="cpu_kv_capacity_tokens"):
        TimingConfig(cpu_kv_capacity_tokens=-1)
    with pytest.raises(ValueError):
        KvConfig(cpu_kv_gbps=0.0)
    assert TimingConfig(cpu_kv_capacity_tokens=100, block_size=16).cpu_kv_capacity_blocks == 6
