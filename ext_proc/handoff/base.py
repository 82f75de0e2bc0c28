"""The handoff seam: the data a handoff produces and the interface it implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ext_proc.affinity import Decision, Endpoint


@dataclass(frozen=True, slots=True)
class RoutingInstructions:
    """What to tell Envoy for one request.

    ``set_headers`` overwrite (or add) request headers; ``remove_headers`` are dropped;
    ``lb_metadata`` goes into dynamic metadata namespace ``envoy.lb``, which Envoy's
    ``override_host`` load balancing policy reads.
    """

    set_headers: tuple[tuple[str, str], ...]
    remove_headers: tuple[str, ...]
    lb_metadata: tuple[tuple[str, str], ...]


class Handoff(Protocol):
    """Turns a :class:`~ext_proc.affinity.Decision` into :class:`RoutingInstructions`."""

    routing_headers: tuple[str, ...]

    def instructions(self, decision: Decision[Endpoint]) -> RoutingInstructions:
        """The headers and metadata that make Envoy and the engines carry out ``decision``."""
        ...
