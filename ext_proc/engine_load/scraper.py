"""Scrape every pickable engine's ``/metrics`` on an interval and blend it into the registry's load.

One aiohttp session, one scrape in flight per engine at most (a slow engine delays only itself),
each bounded by a timeout and by ``max_bytes`` of body. Every ``interval_seconds`` a tick starts a
scrape of each engine whose last one has ended and zeroes the offset of every endpoint whose last
sample is older than ``stale_after_intervals`` intervals (and forgets their LoRA adapters). A sample
is blended the moment it lands (:mod:`ext_proc.engine_load.blend`), so the request path only ever
reads the registry's arrays: nothing here runs per request. Parsing a page costs about 0.3 ms of the
event loop for a 75 KB vLLM page (see :mod:`ext_proc.engine_load.parse`). With
``models_interval_seconds``, each engine's ``GET /v1/models`` is asked as often which models it
serves (:meth:`Registry.set_engine_models`); a failed poll keeps the last list (models come and go
far more rarely than polls fail).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from ext_proc.engine_load.blend import EngineSample, blended_offset, engine_tokens
from ext_proc.engine_load.parse import ScrapeError, parse_page
from ext_proc.metrics import Metrics
from ext_proc.models import ModelNameError, parse_model_list
from ext_proc.registry import EndpointState, Registry, Role

if TYPE_CHECKING:
    from ext_proc.engine_load.config import EngineMetricsConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Scrape:
    """The last good sample of one engine and when it landed (``at``, the scraper's clock, seconds)."""

    sample: EngineSample
    at: float


class EngineScraper:
    """Owns the scrapes of one server. Not thread-safe: runs on the server's event loop.

    ``sampled(address, queries, hits)``, when given, gets each good sample's prefix-cache counters (the
    router's prefix index corrects itself by them). ``clock`` (seconds, monotonic) is injectable for
    tests of staleness.
    """

    def __init__(
        self,
        registry: Registry,
        config: EngineMetricsConfig,
        metrics: Metrics,
        sampled: Callable[[str, float | None, float | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._sampled = sampled
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._scrapes: dict[str, Scrape] = {}
        self._errors: dict[str, str] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._polled: dict[str, float] = {}
        self._polling: dict[str, asyncio.Task[None]] = {}
        self._poll_errors: dict[str, str] = {}
        self._states: dict[str, list[EndpointState]] = {}
        self._request_tokens = dict.fromkeys(Role, float(config.queued_request_tokens))
        self._session: aiohttp.ClientSession | None = None
        self.version = 0
        """Grows with every good sample landed and every tick (samples may have gone stale): flow control
        reads :meth:`fresh_samples` again when it changed."""
        metrics.watch_engine_scrapes(self.ages, self.stale_count)
        metrics.watch_engine_ttft(self.first_tokens)

    async def run(self) -> None:
        """Scrape every ``interval_seconds`` until cancelled; the session and scrapes end with it."""
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_seconds)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        try:
            while True:
                self.tick()
                await asyncio.sleep(self._config.interval_seconds)
        finally:
            tasks = [*self._running.values(), *self._polling.values()]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self._session.close()

    def tick(self) -> None:
        """Run one round: start due scrapes, forget departed engines, drop stale offsets.

        Start a scrape of each pickable engine without one in flight; forget engines that left; drop
        the offsets of endpoints whose sample went stale; take each role's mean request cost."""
        self._states = {}
        for state in (*self._registry.prefills, *self._registry.decodes):
            self._states.setdefault(state.address, []).append(state)
        for address in [a for a in self._scrapes if a not in self._states]:
            del self._scrapes[address]
        self._errors = {a: e for a, e in self._errors.items() if a in self._states}
        for address, states in self._states.items():
            if address not in self._running:
                task = asyncio.get_running_loop().create_task(self._scrape(address, self._url(states[0])))
                self._running[address] = task
                task.add_done_callback(lambda _, a=address: self._running.pop(a, None))
        for role, pool in ((Role.PREFILL, self._registry.prefills), (Role.DECODE, self._registry.decodes)):
            self._request_tokens[role] = self._mean_request_tokens(pool)
        self.version += 1
        now = self._clock()
        if self._config.models_interval_seconds > 0:
            self._poll_models(now)
        for state in self._registry.endpoints():
            scrape = self._scrapes.get(state.address)
            if scrape is None or now - scrape.at > self._config.stale_after_seconds:
                state.lora_adapters = None
                if state.engine_offset:
                    state.set_engine_offset(0)

    def _poll_models(self, now: float) -> None:
        """Start a ``GET /v1/models`` of each pickable engine whose last one is due and has ended."""
        self._polled = {a: t for a, t in self._polled.items() if a in self._states}
        self._poll_errors = {a: e for a, e in self._poll_errors.items() if a in self._states}
        for address in self._states:
            due = now - self._polled.get(address, -math.inf) >= self._config.models_interval_seconds
            if due and address not in self._polling:
                self._polled[address] = now
                task = asyncio.get_running_loop().create_task(self._models(address))
                self._polling[address] = task
                task.add_done_callback(lambda _, a=address: self._polling.pop(a, None))

    async def _models(self, address: str) -> None:
        """Ask the engine at ``address`` which models it serves; tell the registry."""
        url = f"http://{address}/v1/models"
        try:
            page = await self._fetch(url)
            try:
                models = parse_model_list(page)
            except ModelNameError as exc:
                raise ScrapeError("parse", f"{url}: {exc}") from None
        except ScrapeError as exc:
            self._metrics.engine_models_polled(exc.reason)
            if address not in self._poll_errors:
                log.warning(
                    "models of %s: %s (the last list stays; logged once until a poll succeeds)", address, exc
                )
            self._poll_errors[address] = f"{exc.reason}: {exc}"
            return
        self._metrics.engine_models_polled("ok")
        self._poll_errors.pop(address, None)
        self._registry.set_engine_models(address, models)

    def ages(self) -> dict[str, float]:
        """Seconds since each scraped engine's last good sample, by address."""
        now = self._clock()
        return {address: now - scrape.at for address, scrape in self._scrapes.items()}

    def stale_count(self) -> int:
        """Pickable engines (as of the last tick) without a fresh sample: their load is local alone."""
        ages = self.ages()
        limit = self._config.stale_after_seconds
        return sum(1 for address in self._states if ages.get(address, limit + 1) > limit)

    def waiting(self) -> dict[str, float]:
        """The requests each engine with a fresh sample reported waiting, by address."""
        now, limit = self._clock(), self._config.stale_after_seconds
        return {a: s.sample.waiting for a, s in self._scrapes.items() if now - s.at <= limit}

    def first_tokens(self) -> list[tuple[str, str, float, float]]:
        """Each pickable engine's time-to-first-token histogram, as last sampled, per role it serves.

        (role, address, seconds, first tokens) from its last good sample (any age); engines whose pages
        lack it left out."""
        found = []
        for address, scrape in self._scrapes.items():
            seconds, count = scrape.sample.ttft_sum, scrape.sample.ttft_count
            if seconds is not None and count is not None:
                found += [(s.role.value, address, seconds, count) for s in self._states.get(address, ())]
        return found

    def fresh_samples(self) -> dict[str, list[tuple[float, float]]]:
        """``(waiting, kv_usage)`` of every pickable engine with a fresh sample, per role.

        Flow control's saturation rule reads them (:mod:`ext_proc.flow.saturation`)."""
        now, limit = self._clock(), self._config.stale_after_seconds
        fresh: dict[str, list[tuple[float, float]]] = {}
        for role, pool in ((Role.PREFILL, self._registry.prefills), (Role.DECODE, self._registry.decodes)):
            scrapes = (self._scrapes.get(state.address) for state in pool)
            fresh[role.value] = [
                (s.sample.waiting, s.sample.kv_usage)
                for s in scrapes
                if s is not None and now - s.at <= limit
            ]
        return fresh

    def describe(self, state: EndpointState) -> dict[str, object]:
        """The engine's view of ``state`` for ``/debug/endpoints``.

        The last sample, its age and whether it is fresh (blended), the engine-reported tokens, the
        LoRA adapters it holds and its ``max_lora`` (``None``: not reported), the last scrape error
        (``None`` if ok) and, polling models, the last poll's (``models_error``)."""
        scrape = self._scrapes.get(state.address)
        row: dict[str, object] = {"error": self._errors.get(state.address)}
        if self._config.models_interval_seconds > 0:
            row["models_error"] = self._poll_errors.get(state.address)
        if scrape is None:
            return row | {"fresh": False, "age_seconds": None}
        age = self._clock() - scrape.at
        sample = scrape.sample
        return row | {
            "fresh": age <= self._config.stale_after_seconds,
            "age_seconds": round(age, 3),
            "running": sample.running,
            "waiting": sample.waiting,
            "kv_usage": sample.kv_usage,
            "engine_tokens": round(self._engine_tokens(state, sample)),
            "lora_adapters": None if sample.lora_adapters is None else sorted(sample.lora_adapters),
            "max_lora": sample.max_lora,
        }

    def _url(self, state: EndpointState) -> str:
        host, _, serving = state.address.rpartition(":")
        port = self._config.port or state.metrics_port or serving
        return f"http://{host}:{port}{self._config.path}"

    async def _scrape(self, address: str, url: str) -> None:
        started = time.perf_counter()
        try:
            page = await self._fetch(url)
            sample = parse_page(page, self._config.engine)
        except ScrapeError as exc:
            self._failed(address, exc.reason, str(exc), time.perf_counter() - started)
            return
        self._metrics.engine_scrape("ok", time.perf_counter() - started)
        if self._errors.pop(address, None) is not None:
            log.info("engine metrics of %s: scraping again", address)
        self._scrapes[address] = Scrape(sample, self._clock())
        self.version += 1
        self._blend(address, sample)
        if self._sampled is not None:
            self._sampled(address, sample.prefix_queries, sample.prefix_hits)

    async def _fetch(self, url: str) -> bytes:
        """The page at ``url``, at most ``max_bytes``; raises :class:`ScrapeError`."""
        assert self._session is not None
        cap = self._config.max_bytes
        try:
            async with self._session.get(url, headers={"Accept-Encoding": "identity"}) as response:
                if response.status != 200:
                    raise ScrapeError("status", f"HTTP {response.status} from {url}")
                if (response.content_length or 0) > cap:
                    raise ScrapeError("too_large", f"{url} announces {response.content_length} bytes")
                chunks, size = [], 0
                async for chunk in response.content.iter_chunked(64 * 1024):
                    size += len(chunk)
                    if size > cap:
                        raise ScrapeError("too_large", f"{url} sends more than {cap} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
        except TimeoutError:
            raise ScrapeError(
                "timeout", f"{url}: no answer within {self._config.timeout_seconds} s"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ScrapeError("connect", f"{url}: {exc}") from None

    def _failed(self, address: str, reason: str, message: str, seconds: float) -> None:
        self._metrics.engine_scrape(reason, seconds)
        if address not in self._errors:
            log.warning(
                "engine metrics of %s: %s (its load is local accounting alone once the last sample "
                "is stale; logged once until a scrape succeeds)",
                address,
                message,
            )
        self._errors[address] = f"{reason}: {message}"

    def _blend(self, address: str, sample: EngineSample) -> None:
        """Set the offset of the engine's endpoints (one per role it serves) from ``sample`` and
        their local tokens now (docs/routing.md "Engine load signal"), and the LoRA adapters it holds."""
        for state in self._states.get(address, ()):
            state.set_engine_offset(blended_offset(state.active_tokens, self._engine_tokens(state, sample)))
            state.lora_adapters = sample.lora_adapters

    def _engine_tokens(self, state: EndpointState, sample: EngineSample) -> float:
        request_tokens = self._request_tokens[state.role]
        return engine_tokens(sample, state.token_capacity, request_tokens, self._config.queue_weight)

    def _mean_request_tokens(self, states: Iterable[EndpointState]) -> float:
        """What one queued request is expected to need: the mean local in-flight tokens per request
        over ``states``, else ``queued_request_tokens``."""
        tokens = requests = 0
        for state in states:
            tokens += state.active_tokens
            requests += state.active_requests
        return tokens / requests if requests > 0 else float(self._config.queued_request_tokens)
