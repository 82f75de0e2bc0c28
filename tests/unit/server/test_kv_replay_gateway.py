"""Replay through the gateway on real ZeroMQ over loopback: simulated engines publishing their KV-cache
events, each with a replay socket on a port of its own that EDS names (``kv_events_replay_port``), and
``pd-extproc``'s server subscribed to them. Batches the gateway missed (a gap), and those it missed right
after an engine restarted (the sequence back at 0), are replayed: the index then holds their blocks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from itertools import count
from pathlib import Path

import aiohttp
from builders import kv_events_config
from polling import until

from ext_proc.app import start_server
from ext_proc.outcome import RequestMeta, Routed
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.event_index import ROOT
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.router import Router
from sim.cluster import EngineSpec, endpoint_specs, start_cluster, stop_cluster
from sim.config import KvEventsConfig, TimingConfig
from sim.server import RunningEngine

BLOCK = 16
PROMPT_TOKENS = 2 * BLOCK


def prompts() -> Iterator[list[int]]:
    """Fresh prompts of two whole blocks, sharing no block."""
    for first in count(1_000, PROMPT_TOKENS):
        yield list(range(first, first + PROMPT_TOKENS))


def held(router: Router, engine: RunningEngine, ids: list[int]) -> int:
    source = router.live.prefix
    assert isinstance(source, KvEventSource)
    chain = block_hashes(ids, BLOCK, 100, ROOT)
    return source.index.match(chain, source.clock()).get(engine.address, 0)


def sample(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_the_gateway_replays_a_gap_and_what_follows_a_restart_from_each_engines_replay_port(
    tmp_path: Path,
) -> None:
    timing = TimingConfig(time_scale=0.01, enable_prefix_caching=True)
    engines = await start_cluster(
        [EngineSpec("both", "g"), EngineSpec("both", "g")], timing=timing, kv_events=KvEventsConfig()
    )
    specs = endpoint_specs(engines)
    replay_ports = {s.kv_events_replay_port for s in specs}
    assert None not in replay_ports and len(replay_ports) == 2  # each engine's own: no global port
    overrides = {"affinity.prefix.kv_events.recent_seconds": 0}
    server = await start_server(kv_events_config(tmp_path, specs, overrides))
    router, engine, fresh = server.router, engines[1], prompts()
    publisher = engine.publisher
    assert publisher is not None
    cache = engine.engine.scheduler.cache

    def lose_next_batches(lost: bool) -> None:
        """The engine's batches from now on are numbered and buffered but never reach the gateway live."""
        cache.events = lambda batch: publisher.publish(*batch, send=not lost)

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

            async def send(ids: list[int]) -> None:
                body = {"prompt": ids, "max_tokens": 1}
                async with http.post(engine.url + "/v1/completions", json=body) as response:
                    assert response.status == 200

            async def subscribed() -> bool:
                ids = next(fresh)
                await send(ids)
                for _ in range(20):
                    if held(router, engine, ids):
                        return True
                    await asyncio.sleep(0.01)
                return False

            await until(subscribed)  # a SUB socket misses what precedes its connection
            first = next(fresh)
            await send(first)
            await until(lambda: held(router, engine, first) == 2)

            lose_next_batches(True)
            missed = next(fresh)
            await send(missed)
            lose_next_batches(False)
            live = next(fresh)
            await send(live)  # the gap shows: the gateway asks the engine's replay socket
            await until(lambda: held(router, engine, live) == 2)
            assert held(router, engine, missed) == 2 and held(router, engine, first) == 2
            ok = {"endpoint": engine.address, "outcome": "ok"}
            assert sample(router, "pd_extproc_kv_events_replays_total", **ok) >= 1
            assert publisher.replays[-1] > 0

            publisher.restart()  # the engine restarted: its sequence is back at 0
            lose_next_batches(True)
            missed_after = next(fresh)
            await send(missed_after)  # batch 0 of the new run: lost
            lose_next_batches(False)
            live_after = next(fresh)
            await send(live_after)
            await until(lambda: held(router, engine, live_after) == 2)
            assert held(router, engine, missed_after) == 2  # replayed from 0
            assert held(router, engine, first) == 0  # the old run's entries were dropped
            restart = {"endpoint": engine.address, "reason": "restart"}
            assert sample(router, "pd_extproc_kv_events_resets_total", **restart) == 1
            assert publisher.replays[-1] == 0

            body = f'{{"model": "m", "prompt": {missed_after}, "max_tokens": 1}}'.encode()
            routed = router.route_body(body, RequestMeta("/v1/completions"))
            assert isinstance(routed, Routed)
            destinations = dict(routed.instructions.set_headers)["x-gateway-destination-endpoint"]
            assert destinations.split(",")[0] == engine.address  # the engine that holds the prompt
    finally:
        await server.stop()
        await stop_cluster(engines)
