"""Which Prometheus metrics of each engine type say what (the per-engine-type map of names).

Three facts make the load: requests running (shown, never blended: the local accounting already
holds the requests this gateway placed), requests waiting, and the KV-cache usage fraction. Two more,
optional, feed the prefix index's self-correction: the prompt tokens an engine looked up in its prefix
cache and the ones it found (vLLM's counters; SGLang has a hit-rate gauge only). Two more, shown only
(``pd_extproc_engine_ttft_seconds``), never blended: the sum and count of the engine's time-to-first-token
histogram, whose rate is the engine's mean TTFT (a decode's includes its wait for the KV). A fact is
a tuple of *terms* whose values add up (SGLang's waiting requests: its scheduler queue plus the PD
disaggregation queues, which ``num_queue_reqs`` does not count); a term is a tuple of alternative names
of which the first one a page carries is read (vLLM renamed ``gpu_cache_usage_perc`` to
``kv_cache_usage_perc``; SGLang ``num_prefill_prealloc_queue_reqs`` to ``..._bootstrap_queue_reqs``).
A term a page lacks adds nothing; a fact none of whose terms is there is missing. Apart from the facts,
:data:`LORA_INFO` names the info gauge of an engine type's LoRA adapters (vLLM's; SGLang has none).
"""

from __future__ import annotations

import enum
from typing import Literal, get_args

Fact = Literal["running", "waiting", "kv_usage", "prefix_queries", "prefix_hits", "ttft_sum", "ttft_count"]
Terms = tuple[tuple[str, ...], ...]


class EngineKind(enum.StrEnum):
    """``engine_metrics.engine``: the engines' type; ``auto`` accepts every known name."""

    AUTO = "auto"
    VLLM = "vllm"
    SGLANG = "sglang"


NAMES: dict[EngineKind, dict[Fact, Terms]] = {
    EngineKind.VLLM: {  # also the simulator's names (sim/metrics.py)
        "running": (("vllm:num_requests_running",),),
        "waiting": (("vllm:num_requests_waiting",),),
        "kv_usage": (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),),
        "prefix_queries": (("vllm:prefix_cache_queries_total",),),
        "prefix_hits": (("vllm:prefix_cache_hits_total",),),
        "ttft_sum": (("vllm:time_to_first_token_seconds_sum",),),
        "ttft_count": (("vllm:time_to_first_token_seconds_count",),),
    },
    EngineKind.SGLANG: {  # sglang/srt/metrics/collector.py SchedulerStats
        "running": (("sglang:num_running_reqs",),),
        "waiting": (
            ("sglang:num_queue_reqs",),
            # a prefill's requests waiting for their decode to connect, then sending their KV
            ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_prealloc_queue_reqs"),
            ("sglang:num_prefill_inflight_queue_reqs",),
            # a decode's requests waiting for KV memory, then receiving their KV
            ("sglang:num_decode_prealloc_queue_reqs",),
            ("sglang:num_decode_transfer_queue_reqs",),
        ),
        "kv_usage": (("sglang:token_usage",),),
        "prefix_queries": (),  # SGLang reports a hit-rate gauge only, no counters
        "prefix_hits": (),
        "ttft_sum": (("sglang:time_to_first_token_seconds_sum",),),
        "ttft_count": (("sglang:time_to_first_token_seconds_count",),),
    },
}


LORA_INFO: dict[EngineKind, str] = {
    # vllm/v1/metrics/loggers.py: labels running_lora_adapters and waiting_lora_adapters (comma-separated
    # adapter names) and max_lora; the value is when the label set was last set (Unix seconds), so the
    # page keeps every past label set and the largest value is the current one
    EngineKind.VLLM: "vllm:lora_requests_info",
}
"""The LoRA info gauge of each engine type that has one."""


def lora_info_names(kind: EngineKind) -> tuple[str, ...]:
    """The LoRA info gauges to read for engine type ``kind`` (``auto``: every type's)."""
    if kind is EngineKind.AUTO:
        return tuple(LORA_INFO.values())
    return tuple(name for k, name in LORA_INFO.items() if k is kind)


def names_for(kind: EngineKind) -> dict[Fact, Terms]:
    """The terms to read for engine type ``kind``.

    ``auto``: every type's, concatenated in :data:`NAMES` order (a page carries one type's names, so
    the other type's terms add nothing)."""
    if kind is not EngineKind.AUTO:
        return NAMES[kind]
    merged: dict[Fact, Terms] = {fact: () for fact in get_args(Fact)}
    for names in NAMES.values():
        for fact, terms in names.items():
            merged[fact] += terms
    return merged
