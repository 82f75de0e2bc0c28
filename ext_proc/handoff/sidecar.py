"""The decode-sidecar handoff (llm-d P/D convention, Gateway API Inference Extension protocol).

Envoy forwards the request to the decode endpoint named in ``x-gateway-destination-endpoint``
(header and ``envoy.lb`` metadata: ``"ip:port[,fallback...]"``). A sidecar in front of the
decode engine reads ``x-prefiller-host-port``, runs the prefill there, and hands the KV cache
to its engine. Without a prefill the header is removed, so the decode engine prefills locally.
"""

from __future__ import annotations

from ext_proc.affinity import Decision
from ext_proc.handoff.base import (
    HandoffJob,
    Placement,
    Rerouter,
    Routed,
    RoutingInstructions,
    destination_list,
)
from ext_proc.registry import EndpointState


class SidecarHandoff:
    """Routing headers for a decode sidecar; header names are configurable (lower case)."""

    def __init__(self, destination_header: str, prefill_header: str) -> None:
        self._destination = destination_header
        self._prefill = prefill_header
        self.routing_headers = (destination_header, prefill_header)

    def instructions(self, decision: Decision[EndpointState]) -> RoutingInstructions:
        """Destination list = decode then fallbacks; the prefill header only when a prefill was chosen."""
        destination = destination_list(decision)
        if decision.prefill is None:
            return RoutingInstructions(
                ((self._destination, destination),), (self._prefill,), ((self._destination, destination),)
            )
        return RoutingInstructions(
            ((self._destination, destination), (self._prefill, decision.prefill.address)),
            (),
            ((self._destination, destination),),
        )

    def hand_off(self, job: HandoffJob, placement: Placement, router: Rerouter) -> Routed:
        """Headers only: the sidecar does the rest."""
        return Routed(self.instructions(placement.decision), placement.lease)

    async def close(self) -> None:
        """Nothing runs in the background."""
