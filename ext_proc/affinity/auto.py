"""The ``auto`` mode's time model: what a (prefill, decode) pair costs one request, in seconds.

``auto`` ranks the pairs by an estimate of the request's time to its first decoded token,
``time(p, d) = prefill(p) + transfer(p → d) + wait(u(d))``: the prefill's queue and compute on the
prompt tokens it does not hold, the KV transfer of the blocks the decode lacks (at the same-group or the
cross-group bandwidth), and a batch-aware wait at the decode's utilisation ``u`` (dimensionless, 1.0 =
full). :class:`AutoModel` holds the parameters and prices each term. The model, why :data:`ROOM` and
:data:`KNEE`, and why the ranking prices a cache miss twice: docs/routing.md, "`auto`: the time model"
(docs/routing.md#auto-the-time-model-affinityauto).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from ext_proc.affinity.extremes import largest

ROOM = 0.8
"""Utilisation up to which :meth:`AutoModel.wait_s` assumes a decode has batch slots and KV blocks
free (no queueing, only a longer step). The router charges each request its whole output budget, so
its ``u`` overstates the KV a decode really holds; 0.8 leaves room for batch slots that fill first."""
KNEE = 0.95
"""Utilisation above which :meth:`AutoModel.wait_s` grows linearly (its slope at ``KNEE``)."""
_BEYOND = 1.0 + (1.0 - ROOM) / (1.0 - KNEE) ** 2

U = TypeVar("U", float, NDArray[np.float64])


@dataclass(frozen=True, slots=True)
class AutoModel:
    """The fabric and wait parameters of ``auto`` (validated by the configuration).

    ``kv_bytes_per_token``: bytes of KV cache per prompt token (>= 0); ``same_group_gbps`` >=
    ``cross_group_gbps`` > 0: KV transfer bandwidths in GB/s within a ``pdGroupID`` group and across
    groups; ``base_latency_ms`` >= 0: fixed cost of one transfer; ``wait_scale_ms`` >= 0: the wait
    model's service time (ms); ``prefill_ms_per_token`` >= 0: prefill compute per prompt token (ms);
    ``cpu_tier_gbps`` > 0: the bandwidth at which an engine loads blocks held in its CPU tier into GPU
    memory (GB/s); ``lora_load_ms`` >= 0: what an engine lacking a request's LoRA adapter takes to load
    it (ms; docs/routing.md "LoRA adapters"). Defaults: Llama-3-8B in bf16 (128 KiB/token), 100 GB/s
    in a group, 10 GB/s across, 1 ms per transfer, 0.05 ms per prefilled token (the simulator's
    defaults), a 15 ms decode step, PCIe's 55 GB/s as measured (docs/routing.md "Tiers") and 100 ms to
    load an adapter.
    """

    kv_bytes_per_token: int = 131_072
    same_group_gbps: float = 100.0
    cross_group_gbps: float = 10.0
    base_latency_ms: float = 1.0
    wait_scale_ms: float = 15.0
    prefill_ms_per_token: float = 0.05
    cpu_tier_gbps: float = 55.0
    lora_load_ms: float = 100.0

    def lora_load_s(self, lacks: NDArray[np.bool_]) -> NDArray[np.float64]:
        """Seconds each endpoint takes to load the request's adapter: ``lora_load_ms`` where it lacks it."""
        return lacks * (self.lora_load_ms / 1e3)  # type: ignore[no-any-return]

    def cpu_load_s(self, tokens: U) -> U:
        """Seconds to load ``tokens`` prompt tokens' KV cache from the CPU tier (element-wise on arrays)."""
        return tokens * (self.kv_bytes_per_token / (self.cpu_tier_gbps * 1e9))  # type: ignore[return-value]

    def prefill_s(self, tokens: U) -> U:
        """Seconds to prefill ``tokens`` prompt tokens (a count or an array of counts, element-wise)."""
        return tokens * (self.prefill_ms_per_token / 1e3)  # type: ignore[return-value]

    def seconds_per_token(self, same_group: bool) -> float:
        """Seconds one prompt token's KV cache takes to move within (``same_group``) or across groups."""
        gbps = self.same_group_gbps if same_group else self.cross_group_gbps
        return self.kv_bytes_per_token / (gbps * 1e9)

    def transfer_s(self, tokens: int, same_group: bool) -> float:
        """Seconds to move ``tokens`` tokens of KV cache, the base latency included.

        Within a group when ``same_group``, else across groups."""
        return self.base_latency_ms / 1e3 + tokens * self.seconds_per_token(same_group)

    def wait_s(self, u: U) -> U:
        """Expected wait in seconds at utilisation ``u``.

        ``u`` >= 0, a float or an array (element-wise): ``scale * (u + max(u - ROOM, 0) / (1 - u))`` up
        to :data:`KNEE`, its tangent beyond. Strictly increasing when the scale is > 0; an array gives
        bit for bit the floats a scalar gives."""
        scale = self.wait_scale_ms / 1e3
        array = isinstance(u, np.ndarray)
        if (largest(u) if array else u) <= ROOM:  # the usual case: the same floats, fewer ops
            return scale * u  # type: ignore[no-any-return]  # q == 0, u - m == 0, and x + 0.0 == x
        m = np.minimum(u, KNEE) if array else min(u, KNEE)  # a float: Python's, numpy's value
        q = np.maximum(m - ROOM, 0.0) if array else max(m - ROOM, 0.0)
        return scale * (u + q / (1.0 - m) + (u - m) * (_BEYOND - 1.0))  # type: ignore[no-any-return]
