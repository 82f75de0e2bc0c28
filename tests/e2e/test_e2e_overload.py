"""Overload through the real Envoy: a burst of concurrent streaming requests far beyond
``limits.max_inflight_requests`` gets quick 429 ``overloaded`` answers with ``Retry-After`` while the
admitted ones stream to the end, and the in-flight count returns to 0.

Run with ``-s`` to see the measurement (docs/operations.md "Overload" quotes it).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
from builders import endpoint
from e2e_harness import gateway_over
from polling import until

from standins.backends import start_backend

LIMIT = 20
BURST = 200
CHUNK_DELAY_MS = 1000
"""Each admitted request streams 3 chunks this far apart, so it holds its slot about 3 s: far longer
than the whole burst takes to arrive."""
RETRY_AFTER = 2


@dataclass
class Outcome:
    status: int
    seconds: float
    retry_after: str | None
    body: bytes


async def _one(session: aiohttp.ClientSession, url: str) -> Outcome:
    payload = {"model": "m", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    started = time.perf_counter()
    headers = {"x-test-delay-ms": str(CHUNK_DELAY_MS)}
    async with session.post(f"{url}/v1/chat/completions", json=payload, headers=headers) as response:
        raw = await response.read()
        return Outcome(
            response.status, time.perf_counter() - started, response.headers.get("retry-after"), raw
        )


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def test_a_burst_beyond_the_limit_gets_quick_429s_and_the_admitted_complete(tmp_path) -> None:
    backends = [await start_backend() for _ in range(3)]
    prefill = [endpoint(backends[0].address, "a")]
    decodes = [endpoint(b.address, "a") for b in backends[1:]]
    settings = {"limits.max_inflight_requests": LIMIT, "limits.retry_after_seconds": RETRY_AFTER}
    try:
        async with gateway_over(tmp_path, prefill, decodes, settings) as g:
            admission = g.server.router.admission
            peak = 0

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, admission.inflight)
                    await asyncio.sleep(0.002)

            watcher = asyncio.create_task(watch())
            connector = aiohttp.TCPConnector(limit=0)  # every request on its own connection, at once
            async with aiohttp.ClientSession(connector=connector) as session:
                started = time.perf_counter()
                outcomes = await asyncio.gather(*(_one(session, g.gateway.url) for _ in range(BURST)))
                total = time.perf_counter() - started
            watcher.cancel()
            await until(lambda: admission.inflight == 0)
    finally:
        for backend in backends:
            await backend.stop()

    admitted = [o for o in outcomes if o.status == 200]
    rejected = [o for o in outcomes if o.status == 429]
    assert len(admitted) + len(rejected) == BURST, sorted({o.status for o in outcomes})
    assert peak == LIMIT  # reached, never passed
    assert len(admitted) >= LIMIT
    for outcome in admitted:
        assert outcome.body.rstrip().endswith(b"data: [DONE]"), outcome.body[-200:]
    for outcome in rejected:
        assert outcome.retry_after == str(RETRY_AFTER)
        error = json.loads(outcome.body)["error"]
        assert (error["code"], error["type"]) == ("overloaded", "rate_limit_error")
    rejected_seconds = [o.seconds for o in rejected]
    admitted_seconds = [o.seconds for o in admitted]
    # Quick: every refusal comes back before the fastest admitted request could even finish.
    assert max(rejected_seconds) < 3 * CHUNK_DELAY_MS / 1000
    print(
        f"\noverload: {BURST} concurrent streaming requests, limit {LIMIT}, each admitted one streams "
        f"~{3 * CHUNK_DELAY_MS} ms: {len(admitted)} admitted (all completed), {len(rejected)} x 429 "
        f"in {_ms(rejected_seconds, 0.5):.1f} ms p50 / {_ms(rejected_seconds, 0.99):.1f} ms p99 "
        f"(max {1000 * max(rejected_seconds):.1f} ms); admitted {_ms(admitted_seconds, 0.5):.0f} ms p50; "
        f"peak in flight {peak}; whole burst {1000 * total:.0f} ms; in flight afterwards 0"
    )
