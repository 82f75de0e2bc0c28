"""The blending formula: engine-reported load and local in-flight accounting → the load the decision reads.

Pure functions, no clock or I/O. Units are tokens. At the moment a fresh scrape of an endpoint lands:

    engine_tokens = kv_usage * token_capacity + queue_weight * waiting * request_tokens
    offset        = max(0, engine_tokens - local_tokens)         (local_tokens: at that moment)

and from then on, until the next scrape, the decision reads ``local_tokens(t) + offset``: equal to
``max(local, engine)`` when the scrape lands, then moving with every charge and release this
gateway makes (the requests it routes after the scrape are in the local term and nowhere else, so
none is counted twice or missed). A stale or failed scrape makes the offset 0: unknown engine load
falls back to local accounting, never to zero. Running-request counts are not blended (the local
accounting already holds the requests this gateway placed; the KV usage covers everyone's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSample:
    """What one scrape of an engine said.

    ``running`` and ``waiting`` requests (summed over the page's series, e.g. data-parallel ranks;
    ``running`` is ``None`` when the page lacks it) and ``kv_usage``, the fraction of its KV cache in
    use (mean over series, clamped to [0, 1]). ``prefix_queries`` and ``prefix_hits``: the engine's
    prefix-cache counters (prompt tokens looked up and found since it started, summed over series;
    ``None`` when the page lacks them), for the prefix index, not the load. ``ttft_sum`` (seconds) and
    ``ttft_count`` (first tokens): the engine's time-to-first-token histogram's sum and count since it
    started (summed over series; ``None`` when the page lacks them), shown, never blended.
    ``lora_adapters``: the LoRA adapters the engine holds now, running or waiting requests (the names
    its LoRA info gauge lists), and ``max_lora`` the adapters it can hold in GPU memory at once; both
    ``None`` when the page has no LoRA info (an engine without LoRA, or one that does not report it)."""

    running: float | None
    waiting: float
    kv_usage: float
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    lora_adapters: frozenset[str] | None = None
    max_lora: int | None = None


def engine_tokens(sample: EngineSample, capacity: float, request_tokens: float, queue_weight: float) -> float:
    """The engine's load in tokens.

    Its KV usage times ``capacity`` (the endpoint's declared ``token_capacity``) plus
    ``queue_weight`` * waiting requests * ``request_tokens`` (what one queued request is expected to
    need)."""
    return sample.kv_usage * capacity + queue_weight * sample.waiting * request_tokens


def blended_offset(local_tokens: int, engine: float | None) -> int:
    """Tokens to add to the local in-flight tokens: ``max(0, ceil(engine) - local_tokens)``.

    So local + offset = max(local, engine), rounded up to whole tokens; 0 when ``engine`` is ``None``
    (no fresh scrape: local accounting alone)."""
    if engine is None:
        return 0
    return max(0, math.ceil(engine) - local_tokens)
