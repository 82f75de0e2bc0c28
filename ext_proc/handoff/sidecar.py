"""The decode-sidecar handoff (llm-d P/D convention, Gateway API Inference Extension protocol).

Envoy forwards the request to the decode endpoint named in ``x-gateway-destination-endpoint``
(header and ``envoy.lb`` metadata: ``"ip:port[,fallback...]"``). A sidecar in front of the
decode engine reads ``x-prefiller-host-port``, runs the prefill there, and hands the KV cache
to its engine. Without a prefill the header is removed, so the decode engine prefills locally.
"""

from __future__ import annotations

from ext_proc.affinity import Decision, Endpoint
from ext_proc.handoff.base import RoutingInstructions


class SidecarHandoff:
    """Routing headers for a decode sidecar; header names are configurable (lower case)."""

    def __init__(self, destination_header: str, prefill_header: str) -> None:
        self._destination = destination_header
        self._prefill = prefill_header
        self.routing_headers = (destination_header, prefill_header)

    def instructions(self, decision: Decision[Endpoint]) -> RoutingInstructions:
        """Destination list = decode then fallbacks; the prefill header only when a prefill was chosen."""
        if decision.fallbacks:
            destination = ",".join([decision.decode.address, *(f.address for f in decision.fallbacks)])
        else:
            destination = decision.decode.address
        if decision.prefill is None:
            return RoutingInstructions(
                ((self._destination, destination),), (self._prefill,), ((self._destination, destination),)
            )
        return RoutingInstructions(
            ((self._destination, destination), (self._prefill, decision.prefill.address)),
            (),
            ((self._destination, destination),),
        )
