"""Handoff protocols: turn a routing decision into what Envoy and the engines need.

- :class:`SidecarHandoff`: headers (and the body only to drop a client's handoff fields), for an
  llm-d style decode sidecar that runs the prefill;
- :class:`KvTransferParamsHandoff`: vLLM / vllm-ascend ``kv_transfer_params``, prefill leg first;
- :class:`SglangBootstrapHandoff`: SGLang bootstrap fields, prefill leg alongside the decode;
- :class:`VllmMooncakeHandoff`: vLLM's upstream MooncakeConnector, prefill leg alongside the decode.

:mod:`ext_proc.handoff.kinds` is the seam (the :class:`~ext_proc.handoff.kinds.Handoff` protocol and the
table of kinds), :mod:`ext_proc.handoff.base` what a handoff may ask of the router and the decode routing
the handoffs share (what they produce: :mod:`ext_proc.outcome`); :mod:`~ext_proc.handoff.body` the body
rewriting; :mod:`~ext_proc.handoff.leg` the prefill leg's HTTP client; :mod:`~ext_proc.handoff.kv_failure`
the watcher of a decode's failed KV pull.
"""

from ext_proc.handoff.base import DecodeRoute, FailurePolicy, HandoffMode, Rerouter
from ext_proc.handoff.kv_transfer import KvTransferParamsHandoff
from ext_proc.handoff.leg import LegOutcome, PrefillClient
from ext_proc.handoff.mooncake import VllmMooncakeHandoff
from ext_proc.handoff.sglang import SglangBootstrapHandoff
from ext_proc.handoff.sidecar import SidecarHandoff

__all__ = [
    "DecodeRoute",
    "FailurePolicy",
    "HandoffMode",
    "KvTransferParamsHandoff",
    "LegOutcome",
    "PrefillClient",
    "Rerouter",
    "SglangBootstrapHandoff",
    "SidecarHandoff",
    "VllmMooncakeHandoff",
]
