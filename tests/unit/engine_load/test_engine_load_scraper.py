"""The scraper against real HTTP servers on loopback serving real metric pages, and its failures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import builders
import pytest
from aiohttp import web
from builders import endpoint
from polling import until

from ext_proc.endpoints import ClusterEndpoints
from ext_proc.engine_load.config import EngineMetricsConfig
from ext_proc.engine_load.scraper import EngineScraper
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.registry import Registry
from sim.gateway import free_port

FIXTURES = Path(__file__).parent / "fixtures"
CAPACITY = 100_000.0
CONFIG = EngineMetricsConfig(
    enabled=True, interval_seconds=0.01, timeout_seconds=0.5, stale_after_intervals=3
)


class Engine:
    """A loopback HTTP server whose /metrics serves ``page`` (or misbehaves as told), and whose
    /v1/models serves ``models`` (404 while ``None``)."""

    def __init__(self, page: bytes) -> None:
        self.page = page
        self.status = 200
        self.hang = asyncio.Event()
        self.hanging = False
        self.chunked = False
        self.models: bytes | None = None
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.hanging:
            await self.hang.wait()
        if not self.chunked:
            return web.Response(body=self.page, status=self.status, content_type="text/plain")
        response = web.StreamResponse(status=self.status)
        await response.prepare(request)
        for start in range(0, len(self.page), 4096):
            await response.write(self.page[start : start + 4096])
        await response.write_eof()
        return response

    async def _models(self, _: web.Request) -> web.Response:
        if self.models is None:
            return web.Response(status=404)
        return web.Response(body=self.models, content_type="application/json")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self.hang.set()
        assert self._runner is not None
        await self._runner.cleanup()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def usage_page(kv_usage: float, waiting: int = 0) -> bytes:
    lines = (
        "vllm:num_requests_running 3",
        f"vllm:num_requests_waiting {waiting}",
        f"vllm:kv_cache_usage_perc {kv_usage}",
    )
    return "\n".join(lines).encode() + b"\n"


def registry_of(decodes: list[str], prefills: tuple[str, ...] = ()) -> Registry:
    """A registry of these addresses, each declaring ``CAPACITY`` tokens."""
    return builders.registry_of(
        [endpoint(a, "g", CAPACITY) for a in prefills],
        [endpoint(a, "g", CAPACITY) for a in decodes],
        CAPACITY,
    )


def frozen() -> float:
    """A clock that stands still: a sample is as fresh when read as when it landed."""
    return 0.0


@contextlib.asynccontextmanager
async def scraping(
    registry: Registry, config: EngineMetricsConfig = CONFIG, clock: Callable[[], float] = frozen
) -> AsyncIterator[tuple[EngineScraper, Metrics]]:
    """The scraper of ``registry`` running; its ``clock`` (seconds) dates samples and ages them.

    By default it stands still, so no sample goes stale on its own: with the wall clock, a sample read
    more than ``CONFIG``'s 30 ms after it landed was stale on a loaded machine, and a test asserting it
    fresh (or blended) failed; staleness is tested by moving an injected clock."""
    metrics = Metrics(registry.endpoints)
    scraper = EngineScraper(registry, config, metrics, clock=clock)
    task = asyncio.create_task(scraper.run())
    try:
        yield scraper, metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    server = Engine(usage_page(0.25))
    await server.start()
    yield server
    await server.stop()


def scrapes(metrics: Metrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("pd_extproc_engine_scrapes_total", {"outcome": outcome}) or 0.0


async def test_engine_load_is_blended_and_local_charges_move_it(engine: Engine) -> None:
    registry = registry_of([engine.address])
    state = registry.decodes[0]
    lease = Lease(None, 0, state, 5_000)
    async with scraping(registry) as (scraper, metrics):
        await until(lambda: state.blended_tokens == 25_000)  # max(local 5,000, 0.25 x 100,000)
        assert state.active_tokens == 5_000
        view = scraper.describe(state)
        assert view["fresh"] is True and view["error"] is None
        assert (view["kv_usage"], view["waiting"], view["running"], view["engine_tokens"]) == (
            0.25,
            0.0,
            3.0,
            25_000,
        )
        engine.page = usage_page(0.01)  # the engine emptied: local accounting is the larger view
        await until(lambda: state.blended_tokens == 5_000)
        assert scrapes(metrics, "ok") >= 2
    lease.release()


async def test_queued_requests_count_at_the_mean_local_request_cost(engine: Engine) -> None:
    engine.page = usage_page(0.0, waiting=4)
    registry = registry_of([engine.address])
    state = registry.decodes[0]
    leases = [Lease(None, 0, state, t) for t in (1_000, 3_000)]  # mean 2,000 tokens per request
    async with scraping(registry, dataclasses.replace(CONFIG, queue_weight=1.0)):
        await until(lambda: state.blended_tokens == 8_000)  # 4 waiting x 2,000 > local 4,000
    for lease in leases:
        lease.release()


async def test_nothing_in_flight_uses_queued_request_tokens(engine: Engine) -> None:
    engine.page = usage_page(0.0, waiting=2)
    registry = registry_of([engine.address])
    config = dataclasses.replace(CONFIG, queued_request_tokens=300, queue_weight=0.5)
    async with scraping(registry, config):
        await until(lambda: registry.decodes[0].blended_tokens == 300)  # 0.5 x 2 x 300


async def test_a_stale_sample_falls_back_to_local_accounting(engine: Engine) -> None:
    now = [0.0]
    registry = registry_of([engine.address])
    state = registry.decodes[0]
    lease = Lease(None, 0, state, 1_000)
    async with scraping(registry, clock=lambda: now[0]) as (scraper, metrics):
        await until(lambda: state.blended_tokens == 25_000)
        engine.status = 503
        await until(lambda: scrapes(metrics, "status") >= 1)
        assert state.blended_tokens == 25_000  # the last sample is still fresh
        assert str(scraper.describe(state)["error"]).startswith("status: HTTP 503")
        now[0] += CONFIG.stale_after_seconds + 0.001
        await until(lambda: state.blended_tokens == 1_000)
        assert scraper.describe(state)["fresh"] is False
        assert metrics.registry.get_sample_value("pd_extproc_engine_stale_endpoints") == 1
        age = metrics.registry.get_sample_value(
            "pd_extproc_engine_sample_age_seconds", {"endpoint": engine.address}
        )
        assert age == pytest.approx(CONFIG.stale_after_seconds + 0.001)
        engine.status = 200  # it recovers: fresh again, blended again
        await until(lambda: state.blended_tokens == 25_000)
        assert scraper.describe(state)["error"] is None
    lease.release()


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_page_over_max_bytes_is_refused(engine: Engine, chunked: bool) -> None:
    engine.page = usage_page(0.5) + b"# padding\n" * 1000
    engine.chunked = chunked  # no content-length: the cap applies while reading
    registry = registry_of([engine.address])
    async with scraping(registry, dataclasses.replace(CONFIG, max_bytes=4096)) as (_, metrics):
        await until(lambda: scrapes(metrics, "too_large") >= 2)
        assert registry.decodes[0].blended_tokens == 0 and scrapes(metrics, "ok") == 0


async def test_a_chunked_page_within_max_bytes_is_read_whole(engine: Engine) -> None:
    engine.page = b"# padding\n" * 2000 + (FIXTURES / "vllm_metrics.txt").read_bytes()
    engine.chunked = True
    registry = registry_of([engine.address])
    async with scraping(registry):
        await until(
            lambda: registry.decodes[0].blended_tokens == 53_220
        )  # mean usage 0.5322 (queue weight 0)


async def test_a_hanging_engine_times_out_without_delaying_the_others(engine: Engine) -> None:
    slow = Engine(usage_page(0.5))
    await slow.start()
    slow.hanging = True
    registry = registry_of([slow.address, engine.address])
    config = dataclasses.replace(CONFIG, timeout_seconds=0.3)
    try:
        async with scraping(registry, config) as (scraper, metrics):
            await until(lambda: scrapes(metrics, "ok") >= 5)  # the healthy one, while the slow one hangs
            assert registry.decodes[1].blended_tokens == 25_000
            await until(lambda: scrapes(metrics, "timeout") >= 1)
            assert registry.decodes[0].blended_tokens == 0
            assert str(scraper.describe(registry.decodes[0])["error"]).startswith("timeout")
    finally:
        await slow.stop()


async def test_unreachable_and_foreign_pages_are_errors(engine: Engine) -> None:
    engine.page = b"<html>hello</html>"
    closed = f"127.0.0.1:{free_port()}"
    registry = registry_of([engine.address, closed])
    async with scraping(registry) as (scraper, metrics):
        await until(lambda: scrapes(metrics, "missing") >= 1 and scrapes(metrics, "connect") >= 1)
        assert str(scraper.describe(registry.decodes[1])["error"]).startswith("connect")
        assert scraper.describe(registry.decodes[1])["age_seconds"] is None
        assert metrics.registry.get_sample_value("pd_extproc_engine_scrape_seconds_count") >= 2


async def test_prefills_are_scraped_and_a_departed_engine_loses_its_offset(engine: Engine) -> None:
    registry = registry_of([], prefills=(engine.address,))
    state = registry.prefills[0]
    state.charge(10)  # one request in flight on it
    async with scraping(registry) as (scraper, _):
        await until(lambda: state.blended_tokens == 25_000)
        registry.update([])  # it leaves discovery while a request is still charged to it
        await until(lambda: state.engine_offset == 0)
        assert state.blended_tokens == state.active_tokens == 10
        assert scraper.ages() == {}
    state.release(10)


async def test_the_metrics_port_and_path_come_from_metadata_and_config(engine: Engine) -> None:
    registry = Registry("prefill", "decode", CAPACITY)
    serving = f"127.0.0.1:{free_port()}"  # nothing listens on the serving port
    spec = endpoint(serving, "g", CAPACITY, metrics_port=engine.port)
    registry.update([ClusterEndpoints("decode", (spec,), "d")])
    async with scraping(registry):
        await until(lambda: registry.decodes[0].blended_tokens == 25_000)
    registry = registry_of([serving])
    async with scraping(registry, dataclasses.replace(CONFIG, port=engine.port, path="/nope")) as (
        _,
        metrics,
    ):
        await until(lambda: scrapes(metrics, "status") >= 1)  # the configured port, the configured path: 404


def model_list(*models: tuple[str, str | None]) -> bytes:
    """A vLLM ``GET /v1/models`` answer listing ``(id, parent)`` pairs."""
    data = [{"id": m, "object": "model", "root": m, "parent": p, "max_model_len": 4096} for m, p in models]
    return json.dumps({"object": "list", "data": data}).encode()


def polls(metrics: Metrics, outcome: str) -> float:
    return (
        metrics.registry.get_sample_value("pd_extproc_engine_model_polls_total", {"outcome": outcome}) or 0.0
    )


async def test_the_engines_model_lists_are_polled_where_nothing_is_declared(engine: Engine) -> None:
    engine.models = model_list(("base", None), ("sql", "base"))
    declared = Engine(usage_page(0.1))
    await declared.start()
    registry = builders.registry_of(
        [], [endpoint(engine.address), endpoint(declared.address, models=("b",))], 1.0
    )
    declared.models = model_list(("base", None))
    now = [0.0]
    config = dataclasses.replace(CONFIG, models_interval_seconds=5.0)
    try:
        async with scraping(registry, config, clock=lambda: now[0]) as (scraper, metrics):
            polled, kept = registry.decodes
            await until(lambda: polls(metrics, "ok") == 2)
            assert polled.served == {"base", "sql"} and kept.served == {"b"}  # a declaration wins
            assert [(m.name, m.parent) for m in polled.models() or ()] == [("base", None), ("sql", "base")]
            assert scraper.describe(polled)["models_error"] is None
            engine.models = b"{not json"
            now[0] = 5.0  # due again
            await until(lambda: polls(metrics, "parse") == 1)
            assert polled.served == {"base", "sql"}  # a failed poll keeps the last list
            assert str(scraper.describe(polled)["models_error"]).startswith("parse")
            engine.models = model_list(("base", None))  # the adapter unloaded
            now[0] = 10.0
            await until(lambda: polled.served == {"base"})
            assert registry.pools_for("sql") is None
    finally:
        await declared.stop()


async def test_engine_ttft_and_waiting_are_exposed_as_last_sampled(engine: Engine) -> None:
    """The engine's time-to-first-token sum and count are mirrored by the role it serves; its waiting
    requests are told while fresh, then no more."""
    now = [0.0]
    ttft = b"vllm:time_to_first_token_seconds_sum 12.5\nvllm:time_to_first_token_seconds_count 50\n"
    engine.page = usage_page(0.1, waiting=3) + ttft
    registry = registry_of([engine.address])
    async with scraping(registry, clock=lambda: now[0]) as (scraper, metrics):
        await until(lambda: scraper.waiting() == {engine.address: 3.0})
        labels = {"role": "decode", "endpoint": engine.address}
        sample = metrics.registry.get_sample_value
        assert sample("pd_extproc_engine_ttft_seconds_sum", labels) == 12.5
        assert sample("pd_extproc_engine_ttft_seconds_count", labels) == 50
        engine.status = 503
        await until(lambda: scrapes(metrics, "status") >= 1)
        now[0] += CONFIG.stale_after_seconds + 0.001
        assert scraper.waiting() == {}
        assert sample("pd_extproc_engine_ttft_seconds_count", labels) == 50  # a counter: kept
        engine.page = usage_page(0.1)  # an engine without the histogram: not mirrored
        engine.status = 200
        await until(lambda: scraper.waiting() == {engine.address: 0.0})
        assert sample("pd_extproc_engine_ttft_seconds_count", labels) is None


async def test_the_lora_adapters_an_engine_holds_are_kept_while_its_sample_is_fresh(engine: Engine) -> None:
    now = [0.0]
    lora = (
        b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="chat"} 9\n'
    )
    engine.page = usage_page(0.25) + lora
    registry = registry_of([engine.address])
    state = registry.decodes[0]
    assert state.lora_adapters is None  # unknown before any sample
    async with scraping(registry, clock=lambda: now[0]) as (scraper, _):
        await until(lambda: state.lora_adapters == frozenset({"sql", "chat"}))
        view = scraper.describe(state)
        assert (view["lora_adapters"], view["max_lora"]) == (["chat", "sql"], 2)
        engine.status = 503
        now[0] += CONFIG.stale_after_seconds + 0.001
        await until(lambda: state.lora_adapters is None)  # stale: unknown again, no preference
        engine.status = 200
        await until(lambda: state.lora_adapters == frozenset({"sql", "chat"}))
