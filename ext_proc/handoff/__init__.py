"""Handoff protocols: turn a routing decision into what Envoy and the engines need.

One module per kind:

- :mod:`~ext_proc.handoff.sidecar`: headers (and the body only to drop a client's handoff fields), for
  an llm-d style decode sidecar that runs the prefill;
- :mod:`~ext_proc.handoff.kv_transfer`: vLLM / vllm-ascend ``kv_transfer_params``, prefill leg first;
- :mod:`~ext_proc.handoff.sglang`: SGLang bootstrap fields, prefill leg alongside the decode;
- :mod:`~ext_proc.handoff.mooncake`: vLLM's upstream MooncakeConnector, prefill leg alongside the decode.

:mod:`ext_proc.handoff.kinds` is the seam (the :class:`~ext_proc.handoff.kinds.Handoff` protocol and the
table of kinds), :mod:`ext_proc.handoff.base` what a handoff may ask of the router and the decode routing
the handoffs share (what they produce: :mod:`ext_proc.outcome`); :mod:`~ext_proc.handoff.body` the body
rewriting; :mod:`~ext_proc.handoff.leg` the prefill leg's HTTP client; :mod:`~ext_proc.handoff.kv_failure`
the watcher of a decode's failed KV pull. This module imports nothing: the configuration
(:mod:`~ext_proc.handoff.config`) loads without the HTTP client.
"""
