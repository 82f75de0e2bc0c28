"""The ``kv-events`` prefix source on a real vLLM engine of two data-parallel ranks.

One engine of role ``both`` run with ``--data-parallel-size 2`` behind its one API server
(:func:`rig.cluster.kv_events_spec`; EDS metadata ``data_parallel_size: 2``): vLLM 0.32 publishes rank
``r``'s KV-cache events on the configured ports plus ``r`` (``data_parallel_rank`` ``r`` in each batch,
each rank's sequence from 0), and sends a request carrying ``X-data-parallel-rank: r`` to rank ``r``
(out of range: 400). The gateway subscribes to both ranks and indexes them apart
(``pd_extproc_kv_index_blocks{endpoint="ip:port@dp<r>"}``); a request whose prompt rank 1 holds is
pinned to rank 1 on its way through Envoy (handoff ``kv-transfer-params``, decode-only), whatever rank
the client asked for: the block it adds is published by rank 1, after the blocks rank 1 holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest
from e2e_harness import wait_idle
from polling import until
from test_vllm_kv_events import GATEWAY_CONFIG, PD_THRESHOLD_TOKENS, cluster_of, fresh_ids, gateway_sample

from rig.cluster import kv_events_spec, start_kv_events_stack
from rig.engine import BLOCK_TOKENS, MODEL_NAME, Engine
from sim.stack import Stack

pytestmark = pytest.mark.timeout(600)  # the engine's two ranks start in 1-3 min
RANKS = 2


@pytest.fixture(scope="module")
def dp_stack() -> Iterator[Stack]:
    """``rack-dp``: one engine of :data:`RANKS` data-parallel ranks, no gateway yet."""
    started = time.monotonic()
    stack = asyncio.run(start_kv_events_stack([kv_events_spec("rack-dp", data_parallel_size=RANKS)]))
    print(
        f"\nvLLM engine of {RANKS} data-parallel ranks: ready in {time.monotonic() - started:.0f} s; "
        f"{cluster_of(stack).attention.describe()}",
        flush=True,
    )
    try:
        yield stack
    finally:
        stack.stop()


async def rank_blocks(session: aiohttp.ClientSession, stack: Stack, engine: Engine, rank: int) -> float:
    """The blocks the gateway's index holds for rank ``rank`` of ``engine``."""
    endpoint = f"{engine.address}@dp{rank}"
    return await gateway_sample(session, stack, "pd_extproc_kv_index_blocks", endpoint=endpoint, tier="GPU")


async def complete(session: aiohttp.ClientSession, url: str, ids: list[int], rank: int) -> None:
    """One completion of ``ids`` at ``url`` (the engine or the gateway) asking for rank ``rank``."""
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1}
    headers = {"X-data-parallel-rank": str(rank)}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()


async def stored_at(
    session: aiohttp.ClientSession, stack: Stack, engine: Engine, rank: int, ids: list[int], deadline: float
) -> None:
    """Send ``ids`` straight to rank ``rank`` and wait until the gateway indexed a block more there."""
    before = await rank_blocks(session, stack, engine, rank)
    await complete(session, engine.url, ids, rank)

    async def indexed() -> bool:
        return await rank_blocks(session, stack, engine, rank) > before

    await until(indexed, deadline)


async def test_each_rank_is_indexed_apart_and_a_request_is_pinned_to_the_rank_holding_its_prompt(dp_stack):
    (engine,) = cluster_of(dp_stack).running.values()
    await dp_stack.route_with(
        "prefer", handoff="kv-transfer-params", pd_threshold_tokens=PD_THRESHOLD_TOKENS, config=GATEWAY_CONFIG
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for rank in range(RANKS):  # a ZeroMQ subscriber misses what precedes its connection
            for _ in range(10):
                try:
                    await stored_at(session, dp_stack, engine, rank, fresh_ids(BLOCK_TOKENS), deadline=2.0)
                    break
                except AssertionError:
                    continue
            else:
                pytest.fail(f"the gateway heard nothing from rank {rank}")
        shared = fresh_ids(3 * BLOCK_TOKENS)
        held = await rank_blocks(session, dp_stack, engine, 1)
        await stored_at(session, dp_stack, engine, 1, shared, deadline=20.0)
        assert await rank_blocks(session, dp_stack, engine, 1) == held + 3
        zero, one = [await rank_blocks(session, dp_stack, engine, r) for r in range(RANKS)]

        await complete(
            session, dp_stack.url, [*shared, *fresh_ids(BLOCK_TOKENS)], rank=0
        )  # the client's: removed

        async def extended_on_rank_1() -> bool:
            return await rank_blocks(session, dp_stack, engine, 1) == one + 1

        await until(extended_on_rank_1, 20.0)  # a fourth block whose parent rank 1 holds: served there
        assert await rank_blocks(session, dp_stack, engine, 0) == zero
        hit = "pd_extproc_prefix_predicted_hit_tokens_sum"
        assert await gateway_sample(session, dp_stack, hit, role="decode") == 3 * BLOCK_TOKENS
        assert await wait_idle(session, dp_stack.admin_url) == []
