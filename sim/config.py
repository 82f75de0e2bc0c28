"""Configuration of one simulated engine. Every duration is in *model* time (see :mod:`sim.clock`).

The field ``metadata["help"]`` strings double as the ``sim`` CLI help (:mod:`sim.cli` derives one
``--option`` per field of :class:`TimingConfig` and :class:`KvConfig`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both")
DEFAULT_MODEL = "sim-llama-3-8b"
KV_CONNECTORS = ("nixl", "mooncake")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


SCHEDULING_POLICIES = ("fcfs", "priority", "priority-preempt")
"""The engines' scheduling policies the simulator models: vLLM's ``--scheduling-policy`` values, and
``priority-preempt`` (SGLang's priority scheduling: preempts to admit; :mod:`sim.engine`)."""


def _opt(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class TimingConfig:
    """Timing and capacity model of one engine (continuous batching with chunked prefill).

    A scheduler step prefills up to ``max_num_batched_tokens`` prompt tokens and decodes one
    token for every running sequence whose prefill is done. Its duration in ms is
    ``decode_step_ms + decode_step_per_seq_ms * n_decode + decode_step_per_seq_ctx_ms * context`` (if
    any sequence decodes; ``context`` the decoding sequences' tokens so far, summed: reading their KV)
    plus ``prefill_base_ms + prefill_per_token_ms * tokens * (1 + prefill_batch_penalty * (n_prefill -
    1)) + prefill_per_token2_ms * pairs`` (if any sequence prefills; ``pairs`` counts attention: a
    chunk of ``k`` tokens after ``p`` tokens already in its sequence's KV adds ``k * (2p + k)``, so a
    whole prompt of ``n`` tokens costs ``prefill_per_token2_ms * n**2`` however it is chunked).
    Defaults are the ``legacy`` profile (:mod:`sim.profiles`): roughly Llama-3-8B on one fast GPU,
    chosen, not measured, scaled so that a demo of a few hundred requests over 6-8 engines finishes
    in seconds; the measured profiles come from a GPU's calibration.
    """

    prefill_base_ms: float = _opt(3.0, "fixed cost of a step that prefills (ms)")
    prefill_per_token_ms: float = _opt(0.05, "prefill cost per prompt token (ms/token)")
    prefill_per_token2_ms: float = _opt(
        0.0, "prefill attention cost (ms per token squared: a whole n-token prompt adds it times n**2)"
    )
    prefill_batch_penalty: float = _opt(
        0.05, "relative prefill slowdown per extra sequence prefilled in the same step"
    )
    decode_step_ms: float = _opt(12.0, "fixed cost of a decode step (ms)")
    decode_step_per_seq_ms: float = _opt(0.1, "decode step cost per running sequence (ms/seq)")
    decode_step_per_seq_ctx_ms: float = _opt(
        0.0, "decode step cost per context token of every decoding sequence: its KV read (ms/token)"
    )
    max_batch: int = _opt(64, "max sequences running at once; more wait (vLLM max_num_seqs)")
    max_num_batched_tokens: int = _opt(8192, "token budget of one step, decode tokens included")
    kv_capacity_tokens: int = _opt(262144, "KV cache capacity (tokens); requests wait when full")
    cpu_kv_capacity_tokens: int = _opt(
        0,
        "CPU KV tier (tokens, 0 = none): blocks evicted from the KV cache are kept there, least "
        "recently used dropped first, and a prompt hitting them loads them (vLLM native offloading)",
    )
    block_size: int = _opt(16, "KV cache block size (tokens)")
    enable_prefix_caching: bool = _opt(
        False,
        "vLLM automatic prefix caching: a prompt's cached leading blocks are neither computed nor "
        "pulled again (vLLM's default is on; off here so repeated synthetic prompts measure as before)",
    )
    max_model_len: int = _opt(32768, "max prompt + output tokens of one request")
    default_max_tokens: int = _opt(256, "output budget when the request sets neither max_tokens")
    stream_interval: int = _opt(1, "tokens per streamed chunk (vLLM --stream-interval)")
    time_scale: float = _opt(1.0, "wall seconds per model second; < 1 runs faster than real time")
    scheduling_policy: str = _opt(
        "fcfs",
        "vLLM --scheduling-policy: fcfs (KV reserved for prompt + output at admission, no preemption) or "
        "priority (waiting ordered by the body's priority, lower first; KV taken as sequences grow, the "
        "lowest-priority running sequence preempted and recomputed when a block is missing) or "
        "priority-preempt (SGLang's: as priority, and a waiting sequence finding no room preempts running "
        "ones whose priority is more than 10 worse)",
    )

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_num_batched_tokens", "kv_capacity_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.cpu_kv_capacity_tokens < 0:
            raise ValueError("cpu_kv_capacity_tokens must be >= 0")
        for name in ("max_model_len", "default_max_tokens", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError("time_scale must be a finite number > 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        for name in (
            "prefill_base_ms",
            "prefill_per_token_ms",
            "prefill_per_token2_ms",
            "prefill_batch_penalty",
            "decode_step_ms",
            "decode_step_per_seq_ms",
            "decode_step_per_seq_ctx_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    def prefill_ms(self, tokens: int, seqs: int, pairs: int = 0) -> float:
        """Model ms to prefill ``tokens`` prompt tokens in one step.

        Model ms to prefill ``tokens`` prompt tokens spread over ``seqs`` sequences in one step,
        ``pairs`` attended token pairs among them (see the class docstring)."""
        if seqs <= 0:
            return 0.0
        return (
            self.prefill_base_ms
            + self.prefill_per_token_ms * tokens * (1.0 + self.prefill_batch_penalty * (seqs - 1))
            + self.prefill_per_token2_ms * pairs
        )

    def decode_ms(self, seqs: int, context: int = 0) -> float:
        """Model ms of one decode step.

        Model ms of one decode step over ``seqs`` running sequences holding ``context`` tokens in
        all (0 when none decode)."""
        if seqs <= 0:
            return 0.0
        return (
            self.decode_step_ms
            + self.decode_step_per_seq_ms * seqs
            + self.decode_step_per_seq_ctx_ms * context
        )

    @property
    def kv_capacity_blocks(self) -> int:
        """KV capacity in blocks (``kv_capacity_tokens`` rounded down, at least one block)."""
        return max(1, self.kv_capacity_tokens // self.block_size)

    @property
    def cpu_kv_capacity_blocks(self) -> int:
        """CPU KV tier capacity in blocks (``cpu_kv_capacity_tokens`` rounded down; 0: no tier)."""
        return self.cpu_kv_capacity_tokens // self.block_size


@dataclass(frozen=True)
class KvConfig:
    """KV-cache transfer model.

    ``kv_base_latency_ms + prompt_tokens * kv_bytes_per_token / bandwidth``, and the timeouts of the PD
    handoff protocols.

    Bandwidths are in GB/s (10^9 bytes/s). Same-group transfers use a dedicated fabric; all
    cross-group transfers of one process share one link (processor sharing, :class:`sim.kv.SharedLink`).
    ``kv_connector`` is the vLLM connector the engine runs (``nixl``: NixlConnector, prefill first;
    ``mooncake``: vLLM's upstream MooncakeConnector, legs concurrent); ``kv_load_failure_policy`` what a
    decode does when a pull fails (vLLM 0.32 ``KVTransferConfig.kv_load_failure_policy``: ``fail``, the
    default, fails the request; ``recompute`` prefills it locally). The timeouts are model seconds,
    defaulting to the real engines' (vLLM 0.32 NIXL ``kv_lease_duration`` 30 s, renewed by the decode's
    heartbeats; ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` 480 s; SGLang
    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` 300 s).
    """

    kv_bytes_per_token: int = _opt(131072, "KV cache bytes per token (128 KiB = Llama-3-8B, bf16)")
    same_group_gbps: float = _opt(100.0, "intra-group transfer bandwidth (GB/s)")
    cross_group_gbps: float = _opt(10.0, "cross-group link bandwidth, shared by all transfers (GB/s)")
    kv_base_latency_ms: float = _opt(1.0, "fixed latency of one KV transfer (ms)")
    cpu_kv_gbps: float = _opt(55.0, "CPU KV tier to GPU load bandwidth (GB/s; PCIe Gen5 x16 measured 55)")
    kv_connector: str = _opt("nixl", "vLLM KV connector: nixl (prefill first) or mooncake (legs concurrent)")
    kv_load_failure_policy: str = _opt(
        "fail", "a decode whose KV pull fails: fail (HTTP 500 / an error event, vLLM 0.32) or recompute"
    )
    kv_lease_s: float = _opt(
        30.0,
        "NIXL: model s a prefill holds a do_remote_decode request's KV; each decode heartbeat "
        "(every lease/6) extends it to 2/3 lease from then (vLLM kv_lease_duration)",
    )
    mooncake_abort_timeout_s: float = _opt(
        480.0,
        "Mooncake: model s a prefill holds a transfer's KV, and a decode waits for it "
        "(vLLM VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)",
    )
    bootstrap_timeout_s: float = _opt(
        300.0,
        "model s an SGLang-style prefill waits for its decode to register, and a decode for its "
        "prefill's KV (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT / _WAITING_TIMEOUT)",
    )

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 0 or self.kv_base_latency_ms < 0:
            raise ValueError("kv_bytes_per_token and kv_base_latency_ms must be >= 0")
        if not (self.same_group_gbps > 0 and self.cross_group_gbps > 0 and self.cpu_kv_gbps > 0):
            raise ValueError("bandwidths must be > 0")
        for name in ("kv_lease_s", "mooncake_abort_timeout_s", "bootstrap_timeout_s"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a finite number > 0")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS)}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}")

    def transfer_bytes(self, prompt_tokens: int) -> int:
        """Bytes of KV cache for ``prompt_tokens`` tokens."""
        return prompt_tokens * self.kv_bytes_per_token

    def cpu_load_ms(self, tokens: int) -> float:
        """Model ms to load ``tokens`` tokens of KV cache from the CPU tier (0 for none)."""
        return self.transfer_bytes(tokens) / (self.cpu_kv_gbps * 1e9) * 1e3

    def unloaded_transfer_ms(self, prompt_tokens: int, same_group: bool) -> float:
        """Model ms of one transfer with the link to itself (no concurrent cross-group transfers)."""
        gbps = self.same_group_gbps if same_group else self.cross_group_gbps
        return self.kv_base_latency_ms + self.transfer_bytes(prompt_tokens) / (gbps * 1e9) * 1e3


KvEventEncoding = Literal["array", "map", "mixed"]
KV_EVENT_ENCODINGS: tuple[KvEventEncoding, ...] = ("array", "map", "mixed")
KvEventHashForm = Literal["int", "bytes"]
KV_EVENT_HASH_FORMS: tuple[KvEventHashForm, ...] = ("int", "bytes")


@dataclass(frozen=True)
class KvEventsConfig:
    """The engine's KV-cache event publisher, as vLLM's ``--kv-events-config`` sets it (:mod:`sim.kv_events`).

    ``port``: the PUB socket's (0: an ephemeral one); ``replay_port``: the replay ROUTER socket's (0:
    an ephemeral one, ``None``: no replay socket); ``encoding``: ``array`` (vLLM 0.32's tagged arrays),
    ``map`` (newer vLLM's maps) or ``mixed`` (map events in an array batch); ``hashes``: block hashes
    as ``int`` (64-bit unsigned) or ``bytes`` (32 of them)."""

    port: int = 0
    replay_port: int | None = 0
    encoding: KvEventEncoding = "array"
    hashes: KvEventHashForm = "int"

    def __post_init__(self) -> None:
        for name in ("port", "replay_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"kv events {name} out of range: {value}")
        if self.encoding not in KV_EVENT_ENCODINGS:
            raise ValueError(f"kv events encoding must be one of {', '.join(KV_EVENT_ENCODINGS)}")
        if self.hashes not in KV_EVENT_HASH_FORMS:
            raise ValueError(f"kv events hashes must be one of {', '.join(KV_EVENT_HASH_FORMS)}")


@dataclass(frozen=True)
class EngineConfig:
    """One simulated engine: identity, listen address, EDS files and the two models.

    ``port`` 0 binds an ephemeral port. ``advertise_host`` (default: ``host``) is the host this
    engine reports in ``x-sim-engine`` and ``kv_transfer_params.remote_host``; it must match the
    address in the EDS files for group lookups to work. ``kv_events``: publish the KV cache's events
    (``None``: not; it needs ``timing.enable_prefix_caching`` to have any). ``strict_model``: refuse a
    request naming another model than ``model`` with vLLM's 404 (off: any name is served, as the
    tests that name no particular model expect).
    """

    role: Role = "both"
    group: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    model: str = DEFAULT_MODEL
    eds_files: tuple[str, ...] = ()
    eds_namespace: str = "pd"
    timing: TimingConfig = field(default_factory=TimingConfig)
    kv: KvConfig = field(default_factory=KvConfig)
    prefill_timeout_s: float = 300.0
    shutdown_timeout_s: float = 5.0
    access_log: bool = False
    kv_events: KvEventsConfig | None = None
    strict_model: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
