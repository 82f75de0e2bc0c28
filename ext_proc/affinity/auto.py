"""The ``auto`` mode's time model: what a (prefill, decode) pair costs one request, in seconds.

``auto`` ranks the pairs by an estimate of the request's time to its first decoded token,

    time(p, d) = prefill(p) + transfer(p → d) + wait(u(d))

* ``prefill``: the prefill's queue and compute, ``prefill_ms_per_token / 1e3 * (backlog(p) +
  prompt_tokens - hit(p))`` s, where ``backlog(p)`` is the prompt tokens already in flight there
  (the pool's ``tokens``: the uncached tokens this gateway charged, plus any engine load signal) and
  ``hit(p)`` the prompt tokens its prefix cache is estimated to hold (0 without a prefix index). The
  ranking prices the uncached tokens twice (:mod:`ext_proc.affinity.decide`): computing them delays
  the prefill's later requests too, so a greedy choice of this request's time alone would give up a
  cache holder for a few milliseconds and pay the full prompt again at the next request of that prefix.
* ``transfer``: moving the KV cache of the prompt blocks ``d`` lacks (``prompt_tokens - hit(d)``)
  from the prefill to ``d``: ``base_latency_ms / 1e3 + tokens * kv_bytes_per_token / (gbps * 1e9)``
  s, with ``gbps`` the same-group or the cross-group bandwidth (GB/s, 10^9 bytes/s) — the
  simulator's model (:class:`sim.config.KvConfig`); a decode pulls only the blocks it does not hold
  (vLLM's NIXL connector). The base latency is paid by every transfer, so it tells no pair apart.
* ``wait``: the expected wait at a decode whose utilisation, with the request placed, is ``u``
  (dimensionless, 1.0 = its token capacity full; the number the pool gives, so an engine-metrics load
  signal blended into it is used as is). A continuously batching engine (vLLM, SGLang, the simulator)
  admits a request at once while it has a free batch slot and free KV blocks, and runs every admitted
  sequence in each step: below full, load only lengthens the step (the simulator's
  ``decode_step_per_seq_ms``); requests queue only once the batch or the KV cache is exhausted. The
  model, in units of ``wait_scale_ms`` (about one decode step at half batch), is batch-aware:
  ``u`` up to :data:`ROOM` (the step lengthening: one scale from empty to full), plus above ``ROOM``
  a queueing term ``(u - ROOM) / (1 - u)`` that is 0 at ``ROOM`` and grows without bound near 1
  (the M/M/1 wait on the headroom left past ``ROOM``). Above ``KNEE`` it continues as the straight
  line tangent at ``KNEE``, so over-full decodes (``u >= 1``, possible: load is charged before it is
  admitted) still rank by load, never divide by ~0. Strictly increasing, and nowhere steeper than the
  plain M/M/1 ``u / (1 - u)`` (continued the same way).

For a fixed prefill, the decode ranking is ``prefer``'s on the wait scale with a per-request,
per-decode bonus: a long prompt's cross-group transfer costs more than a short one's, so long prompts
stay in the prefill's group and short ones spill once the home decode's extra wait exceeds what their
transfer would cost; a decode that already holds most of the prompt needs little transfer at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

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
    model's service time (ms); ``prefill_ms_per_token`` >= 0: prefill compute per prompt token (ms).
    Defaults: Llama-3-8B in bf16 (128 KiB/token), 100 GB/s in a group, 10 GB/s across, 1 ms per
    transfer, 0.05 ms per prefilled token (the simulator's defaults) and a 15 ms decode step.
    """

    kv_bytes_per_token: int = 131_072
    same_group_gbps: float = 100.0
    cross_group_gbps: float = 10.0
    base_latency_ms: float = 1.0
    wait_scale_ms: float = 15.0
    prefill_ms_per_token: float = 0.05

    def prefill_s(self, tokens: U) -> U:
        """Seconds to prefill ``tokens`` prompt tokens (a count or an array of counts, element-wise)."""
        return tokens * (self.prefill_ms_per_token / 1e3)  # type: ignore[return-value]

    def seconds_per_token(self, same_group: bool) -> float:
        """Seconds one prompt token's KV cache takes to move within (``same_group``) or across groups."""
        gbps = self.same_group_gbps if same_group else self.cross_group_gbps
        return self.kv_bytes_per_token / (gbps * 1e9)

    def transfer_s(self, tokens: int, same_group: bool) -> float:
        """Seconds to move ``tokens`` tokens of KV cache within (``same_group``) or across groups,
        the base latency included."""
        return self.base_latency_ms / 1e3 + tokens * self.seconds_per_token(same_group)

    def wait_s(self, u: U) -> U:
        """Expected wait in seconds at utilisation ``u`` (>= 0; a float or an array, element-wise):
        ``scale * (u + max(u - ROOM, 0) / (1 - u))`` up to :data:`KNEE`, its tangent beyond. Strictly
        increasing when the scale is > 0; an array gives bit for bit the floats a scalar gives."""
        scale = self.wait_scale_ms / 1e3
        if isinstance(u, np.ndarray) and u.max() <= ROOM:  # the usual case: the same floats, fewer ops
            return scale * u  # type: ignore[no-any-return]  # q == 0, u - m == 0, and x + 0.0 == x
        m = np.minimum(u, KNEE)
        q = np.maximum(m - ROOM, 0.0)
        return scale * (u + q / (1.0 - m) + (u - m) * (_BEYOND - 1.0))  # type: ignore[no-any-return]
