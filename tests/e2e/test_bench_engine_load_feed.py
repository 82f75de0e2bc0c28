"""bench/engine_load_feed.py: the engine load signal in virtual time reads the simulated engines' own pages
and blends them into each replica's load, as the server's scraper does over HTTP."""

from __future__ import annotations

import asyncio
import importlib
import math
from types import ModuleType

import pytest

from ext_proc.metrics import Metrics
from sim.config import KvConfig, TimingConfig
from sim.virtual import build_cluster, new_loop


@pytest.fixture(scope="module")
def routing() -> ModuleType:
    return importlib.import_module("bench.prefix_routing")


@pytest.fixture(scope="module")
def feed(routing: ModuleType) -> ModuleType:
    return importlib.import_module("bench.engine_load_feed")


@pytest.fixture(scope="module")
def peers(routing: ModuleType) -> ModuleType:
    return importlib.import_module("bench.prefix_peers")


def test_a_sample_of_an_engine_lands_in_its_endpoint_of_every_replica(
    routing: ModuleType, feed: ModuleType, peers: ModuleType
) -> None:
    """A decode holding a long request's KV: each replica's scraper reads its page at virtual time and
    blends its KV usage into that replica's view of it (and of no other engine)."""

    async def scenario() -> tuple[list[dict[str, int]], str, float]:
        engines = build_cluster(routing.CLUSTERS["demo"], TimingConfig(), KvConfig())
        by_address = {e.address: e for e in engines}
        endpoints = [
            peers.Endpoint(
                e.address, e.config.role, e.config.group, float(e.config.timing.kv_capacity_tokens)
            )
            for e in engines
        ]
        replicas = [peers.registry_of(endpoints) for _ in range(2)]
        scrapers = [feed.PageScraper(r, by_address, Metrics(r.endpoints)) for r in replicas]
        for engine in engines:
            await engine.start()
        decode = next(e for e in engines if e.config.role == "decode")
        decode.submit(20_000, 4_000, 4_000)
        await asyncio.sleep(1.0)  # virtual: admitted, decoding
        usage = decode.scheduler.kv_usage
        running = asyncio.gather(*(s.run() for s in scrapers))
        await asyncio.sleep(0.1)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        offsets = [{s.address: s.engine_offset for s in r.endpoints()} for r in replicas]
        for engine in engines:
            await engine.stop()
        return offsets, decode.address, usage * decode.config.timing.kv_capacity_tokens

    loop = new_loop()
    try:
        offsets, decode, engine_tokens = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert engine_tokens > 20_000
    for view in offsets:
        assert view[decode] == math.ceil(engine_tokens)
        assert all(offset == 0 for address, offset in view.items() if address != decode)


def test_a_scraped_setting_runs_its_scrapers_only_while_it_routes_and_is_deterministic(
    routing: ModuleType,
) -> None:
    first, second = (routing.run_one("demo", "A", "pair:auto+events x4 scraped", 41, True) for _ in range(2))
    for row in (first, second):
        assert row.pop("router_us_p50") > 0 and row.pop("tokenize_us_p50") > 0  # wall clock: varies
    assert first == second and first["requests"] == 12


def test_only_replicas_with_a_registry_take_the_engine_load_signal(
    feed: ModuleType, peers: ModuleType
) -> None:
    with pytest.raises(TypeError, match="SGLangCacheAware"):
        feed.scraper_of(peers.SGLangCacheAware([]), {})
