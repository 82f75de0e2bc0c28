"""Open-loop workloads sent through a gateway with the OpenAI SDK, recording what each request saw.

Requests are planned up front (:func:`plan_workload`: arrival time, prompt size, output budget;
seeded, so every mode sees the same workload; or :func:`trace_plans`, a production trace's window)
and sent at their arrival times, streaming, by :func:`run_workload`. Each :class:`Record` holds the
client-side timings and the simulator's ground truth from the response headers (which engine decoded,
where the KV cache came from and how long its transfer took).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import openai

from sim.config import DEFAULT_MODEL
from sim.traces import TraceRequest, output_budget, prompt_text

WORDS = ("the", "cache", "prefill", "decode", "token", "group", "router", "envoy", "batch", "latency")


@dataclass(frozen=True)
class RequestPlan:
    """One request: send ``at`` seconds after the start, ``prompt_tokens`` long, up to ``max_tokens``.

    Its text ``prompt`` (``None``: words, :func:`_prompt`)."""

    at: float
    prompt_tokens: int
    max_tokens: int
    prompt: str | None = None


def plan_workload(
    requests: int,
    rate_rps: float,
    prompt_tokens: tuple[int, int] = (256, 2048),
    output_tokens: tuple[int, int] = (16, 96),
    seed: int = 7,
    burst: int = 1,
) -> list[RequestPlan]:
    """A Poisson workload with uniform prompt and output lengths.

    Poisson arrivals at ``rate_rps`` (bursts of ``burst`` requests at once when > 1), prompt and
    output lengths uniform in the given inclusive ranges (tokens)."""
    rng = random.Random(seed)
    plans, now = [], 0.0
    while len(plans) < requests:
        now += rng.expovariate(rate_rps / burst)
        for _ in range(min(burst, requests - len(plans))):
            plans.append(RequestPlan(now, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))
    return plans


def trace_plans(requests: Sequence[TraceRequest], speed: float, max_output: int | None) -> list[RequestPlan]:
    """A trace window (:func:`sim.traces.read_window`) as a workload.

    Each request sent at its arrival divided by ``speed``, its prompt :func:`sim.traces.prompt_text` (the
    ``i``-th of the window), its budget :func:`sim.traces.output_budget` under ``max_output``."""
    return [
        RequestPlan(r.arrival_s / speed, r.prompt_tokens, output_budget(r, max_output), prompt_text(r, i))
        for i, r in enumerate(requests)
    ]


@dataclass
class Record:
    """What one request saw. Times are wall-clock milliseconds; ``None`` where not applicable."""

    plan: RequestPlan
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    end_ms: float | None = None
    completion_tokens: int = 0
    decode_engine: str | None = None
    prefill_engine: str | None = None
    kv_transfer: str | None = None
    kv_transfer_ms: float | None = None
    remote_prefill_ms: float | None = None
    response_id: str | None = None
    """The ``id`` of the answer's chunks (vLLM derives it from the request's ``X-Request-Id``)."""

    @property
    def decode_ttft_ms(self) -> float | None:
        """Time to first token of the decode phase.

        Client TTFT minus the remote prefill as the decode engine reports it (``x-sim-remote-prefill-ms``)."""
        if self.ttft_ms is None:
            return None
        return self.ttft_ms - (self.remote_prefill_ms or 0.0)


def _prompt(tokens: int) -> str:
    """Text of about ``tokens`` tokens by the gateway's estimate (4 characters per token)."""
    words = []
    chars = 0
    i = 0
    while chars < tokens * 4:
        word = WORDS[i % len(WORDS)]
        words.append(word)
        chars += len(word) + 1
        i += 1
    return " ".join(words)[: tokens * 4]


def _float_header(headers: Mapping[str, str], name: str) -> float | None:
    value = headers.get(name)
    return float(value) if value not in (None, "") else None


async def _one(client: openai.AsyncOpenAI, model: str, record: Record, t0: float) -> None:
    plan = record.plan
    await asyncio.sleep(max(0.0, t0 + plan.at - time.perf_counter()))
    record.start = time.perf_counter()
    stamps: list[float] = []
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": plan.prompt or _prompt(plan.prompt_tokens)}],
            max_tokens=plan.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        headers = stream.response.headers
        record.decode_engine = headers.get("x-sim-engine")
        record.prefill_engine = headers.get("x-sim-prefill-engine")
        record.kv_transfer = headers.get("x-sim-kv-transfer")
        record.kv_transfer_ms = _float_header(headers, "x-sim-kv-transfer-ms")
        record.remote_prefill_ms = _float_header(headers, "x-sim-remote-prefill-ms")
        async for chunk in stream:
            record.response_id = record.response_id or chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                record.completion_tokens = chunk.usage.completion_tokens
        record.ok = bool(stamps)
        if not stamps:
            record.error = "no tokens received"
    except openai.APIStatusError as exc:
        record.error = f"{exc.status_code}: {exc.message}"
    except openai.APIError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    record.end_ms = (end - record.start) * 1e3
    if stamps:
        record.ttft_ms = (stamps[0] - record.start) * 1e3
        tokens_after_first = max(record.completion_tokens - 1, len(stamps) - 1)
        if tokens_after_first > 0:
            record.tpot_ms = (stamps[-1] - stamps[0]) * 1e3 / tokens_after_first


async def run_workload(
    base_url: str | Sequence[str],
    plans: list[RequestPlan],
    model: str = DEFAULT_MODEL,
    progress: Callable[[], None] | None = None,
    timeout_s: float = 120.0,
) -> tuple[list[Record], float]:
    """Send every planned request through the gateway; the records and the duration.

    Send every planned request through ``base_url`` (the gateway; several gateway replicas: request
    ``i`` through the ``i % n``-th, round robin); return the records and the wall-clock duration in
    seconds from the first send to the last completion."""
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    clients = [
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
        for url in urls
    ]
    records = [Record(plan) for plan in plans]
    t0 = time.perf_counter()

    async def tracked(index: int, record: Record) -> None:
        await _one(clients[index % len(clients)], model, record, t0)
        if progress is not None:
            progress()

    try:
        await asyncio.gather(*(tracked(i, r) for i, r in enumerate(records)))
    finally:
        for client in clients:
            await client.close()
    return records, time.perf_counter() - t0
