"""Which Prometheus metric of each engine type says what (the per-engine-type map of names).

Three facts make the load: requests running (shown, never blended: the local accounting already
holds the requests this gateway placed), requests waiting, and the KV-cache usage fraction. Two more,
optional, feed the prefix index's self-correction: the prompt tokens an engine looked up in its prefix
cache and the ones it found (counters; SGLang reports only a hit-rate gauge, so none there). Where an
engine type has several names for one fact (vLLM renamed ``gpu_cache_usage_perc`` to
``kv_cache_usage_perc``), the first name listed that a page carries wins.
"""

from __future__ import annotations

import enum
from typing import Literal, get_args

Fact = Literal["running", "waiting", "kv_usage", "prefix_queries", "prefix_hits"]


class EngineKind(enum.StrEnum):
    """``engine_metrics.engine``: the engines' type; ``auto`` accepts every known name."""

    AUTO = "auto"
    VLLM = "vllm"
    SGLANG = "sglang"


NAMES: dict[EngineKind, dict[Fact, tuple[str, ...]]] = {
    EngineKind.VLLM: {  # also the simulator's names (sim/metrics.py)
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prefix_queries": ("vllm:prefix_cache_queries_total",),
        "prefix_hits": ("vllm:prefix_cache_hits_total",),
    },
    EngineKind.SGLANG: {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
        "prefix_queries": (),
        "prefix_hits": (),
    },
}


def names_for(kind: EngineKind) -> dict[Fact, tuple[str, ...]]:
    """The names to read for ``kind``; ``auto``: every type's, concatenated in :data:`NAMES` order."""
    if kind is not EngineKind.AUTO:
        return NAMES[kind]
    merged: dict[Fact, tuple[str, ...]] = {fact: () for fact in get_args(Fact)}
    for names in NAMES.values():
        for fact, listed in names.items():
            merged[fact] += listed
    return merged
