"""Handoff protocols: turn a routing decision into what Envoy and the engines need.

A handoff is anything with ``instructions(decision) -> RoutingInstructions`` and a
``routing_headers`` tuple naming every header it owns (clients may not supply those). Today:
:class:`SidecarHandoff` (llm-d style decode sidecar). Later: vLLM ``kv_transfer_params`` and
SGLang bootstrap handoffs, which will also rewrite the body.
"""

from ext_proc.handoff.base import Handoff, RoutingInstructions
from ext_proc.handoff.sidecar import SidecarHandoff

__all__ = ["Handoff", "RoutingInstructions", "SidecarHandoff"]
