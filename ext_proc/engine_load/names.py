"""Which Prometheus metric of each engine type says what (the per-engine-type map of names).

Only three facts are read: requests running (shown, never blended: the local accounting already
holds the requests this gateway placed), requests waiting, and the KV-cache usage fraction. Where an
engine type has several names for one fact (vLLM renamed ``gpu_cache_usage_perc`` to
``kv_cache_usage_perc``), the first name listed that a page carries wins.
"""

from __future__ import annotations

import enum
from typing import Literal

Fact = Literal["running", "waiting", "kv_usage"]


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
    },
    EngineKind.SGLANG: {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
    },
}


def names_for(kind: EngineKind) -> dict[Fact, tuple[str, ...]]:
    """The names to read for ``kind``; ``auto``: every type's, concatenated in :data:`NAMES` order."""
    if kind is not EngineKind.AUTO:
        return NAMES[kind]
    merged: dict[Fact, tuple[str, ...]] = {"running": (), "waiting": (), "kv_usage": ()}
    for names in NAMES.values():
        for fact, listed in names.items():
            merged[fact] += listed
    return merged
