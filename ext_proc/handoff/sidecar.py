"""The decode-sidecar handoff (llm-d P/D convention, Gateway API Inference Extension protocol).

Envoy forwards the request to the decode endpoint named in ``x-gateway-destination-endpoint``
(header and ``envoy.lb`` metadata: ``"ip:port[,fallback...]"``). A sidecar in front of the
decode engine reads ``x-prefiller-host-port``, runs the prefill there, and hands the KV cache
to its engine. Without a prefill the header is removed, so the decode engine prefills locally.

The sidecar and its engine read the handoff body fields (``kv_transfer_params``, SGLang's
``bootstrap_*``) as instructions, so a client's are removed: the body is rewritten only when it
has one, otherwise it passes through untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ext_proc.affinity import Decision
from ext_proc.handoff.base import Rerouter, destination_list, owned_headers
from ext_proc.handoff.body import HANDOFF_FIELDS, without_fields
from ext_proc.outcome import HandoffJob, Placement, Routed, RoutingInstructions
from ext_proc.registry import EndpointState

if TYPE_CHECKING:
    from ext_proc.handoff.config import HandoffConfig
    from ext_proc.handoff.routing import RoutingConfig
    from ext_proc.metrics import Metrics


def build(routing: RoutingConfig, settings: HandoffConfig, metrics: Metrics) -> SidecarHandoff:
    """The sidecar handoff of ``routing``'s header names.

    It reads nothing of ``settings`` and counts nothing."""
    return SidecarHandoff(routing.destination_header, routing.prefill_header)


class SidecarHandoff:
    """Routing headers for a decode sidecar; header names are configurable (lower case)."""

    def __init__(self, destination_header: str, prefill_header: str) -> None:
        self._destination = destination_header
        self._prefill = prefill_header
        self.routing_headers = owned_headers(destination_header, prefill_header)
        self.hands_kv = False
        self.pins_ranks = False  # the sidecar sends the prefill request: its rank cannot be set here

    def instructions(self, decision: Decision[EndpointState], body: bytes | None) -> RoutingInstructions:
        """Routing instructions for a sidecar: destination list = decode then fallbacks.

        The prefill header only when a prefill was chosen; ``body``, when not ``None``, replaces the
        client's."""
        destination = destination_list(decision)
        metadata = ((self._destination, destination),)
        if decision.prefill is None:
            return RoutingInstructions(((self._destination, destination),), (self._prefill,), metadata, body)
        headers = ((self._destination, destination), (self._prefill, decision.prefill.address))
        return RoutingInstructions(headers, (), metadata, body)

    def hand_off(self, job: HandoffJob, placement: Placement, router: Rerouter) -> Routed:
        """Routing headers, and the client's body without its handoff fields if it had any."""
        plain = without_fields(job.raw, job.body, HANDOFF_FIELDS, job.rewritten)
        return Routed(self.instructions(placement.decision, plain), placement.lease)

    async def close(self) -> None:
        """Nothing runs in the background."""
