"""The ``affinity.auto`` section: the ``auto`` mode's time model, and its check (docs/configuration.md).

The ``affinity`` section around it is :class:`ext_proc.affinity_config.AffinityConfig`; its ``prefix``
subsection is :class:`ext_proc.prefix.config.PrefixConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.affinity.auto import AutoModel
from ext_proc.checks import ConfigError, in_range

MAX_KV_BYTES_PER_TOKEN = 1 << 30
"""Upper bound of ``affinity.auto.kv_bytes_per_token`` and of the shape's product (1 GiB a token)."""


@dataclass(frozen=True)
class AutoConfig:
    """The ``auto`` mode's delay model (docs/routing.md "Affinity modes"; :mod:`ext_proc.affinity.auto`).

    KV cache per prompt token: ``kv_bytes_per_token`` bytes, or when it is 0 (the default) the model
    shape's ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes`` (K and V per layer; defaults:
    Llama-3-8B in bf16, 131072 bytes). ``same_group_gbps`` / ``cross_group_gbps``: KV transfer
    bandwidth within a ``pdGroupID`` group / across groups, GB/s (10^9 bytes/s), cross <= same.
    ``base_latency_ms``: fixed cost of one transfer. ``wait_scale_ms``: the wait model's service time,
    ms (about one decode step at half batch): a decode at utilisation u waits ``wait_scale_ms * u`` while
    it has room (u <= 0.8), plus ``wait_scale_ms * (u - 0.8) / (1 - u)`` above (see ``affinity.auto``).
    ``prefill_ms_per_token``: prefill compute per prompt token, ms (the prefill's queue and its compute
    on the uncached tokens are priced with it). ``cpu_tier_gbps``: the bandwidth at which an engine
    loads a block held in its CPU tier back into GPU memory, GB/s (PCIe; a hit there is priced as that
    load instead of the prefill it saves). ``lora_load_ms``: what an engine that lacks a request's LoRA
    adapter takes to load it, ms (docs/routing.md "LoRA adapters").
    """

    kv_bytes_per_token: int = 0
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    same_group_gbps: float = 100.0
    cross_group_gbps: float = 10.0
    base_latency_ms: float = 1.0
    wait_scale_ms: float = 15.0
    prefill_ms_per_token: float = 0.05
    cpu_tier_gbps: float = 55.0
    lora_load_ms: float = 100.0

    def bytes_per_token(self) -> int:
        """KV bytes per prompt token: ``kv_bytes_per_token``, or the model shape's when that is 0."""
        shape = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes
        return self.kv_bytes_per_token or shape

    def model(self) -> AutoModel:
        """The pure decision's view of these keys."""
        return AutoModel(
            self.bytes_per_token(),
            self.same_group_gbps,
            self.cross_group_gbps,
            self.base_latency_ms,
            self.wait_scale_ms,
            self.prefill_ms_per_token,
            self.cpu_tier_gbps,
            self.lora_load_ms,
        )

    def check(self) -> None:
        """Raise :class:`ConfigError` when a key is out of range or the bandwidths are inverted.

        The error names the first key out of range, or a cross-group bandwidth above the same-group one."""
        key = "affinity.auto"
        in_range(
            f"{key}.kv_bytes_per_token",
            self.kv_bytes_per_token,
            0,
            MAX_KV_BYTES_PER_TOKEN,
            kind="an integer",
            note="0 = from num_layers, num_kv_heads, head_dim and dtype_bytes",
        )
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            in_range(f"{key}.{name}", getattr(self, name), 1, 65536, kind="an integer")
        if self.bytes_per_token() > MAX_KV_BYTES_PER_TOKEN:
            raise ConfigError(
                f"{key}: the model shape gives more than {MAX_KV_BYTES_PER_TOKEN} KV bytes a token"
            )
        for name in ("same_group_gbps", "cross_group_gbps", "cpu_tier_gbps"):
            in_range(f"{key}.{name}", getattr(self, name), 1e-3, 1e6, note="GB/s")
        if self.cross_group_gbps > self.same_group_gbps:
            raise ConfigError(
                f"{key}.cross_group_gbps ({self.cross_group_gbps:g}) must not exceed same_group_gbps "
                f"({self.same_group_gbps:g}): a group's own fabric is the fast one"
            )
        for name in ("base_latency_ms", "wait_scale_ms", "prefill_ms_per_token", "lora_load_ms"):
            in_range(f"{key}.{name}", getattr(self, name), 0, 1e6, note="ms")
