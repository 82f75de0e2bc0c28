"""The current set of endpoints, with their live load, as the router sees it.

Each endpoint is one mutable :class:`EndpointState` that the load accounting charges and
releases in place, so a request's routing reads loads without copying anything. Updates from
a discovery source keep the same object for an endpoint that stays (same role and address):
in-flight accounting survives any number of EDS changes. An endpoint that leaves while it still
has requests in flight is kept aside and revived if it comes back before they finish.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

from ext_proc.discovery.eds import ClusterEndpoints

log = logging.getLogger(__name__)


class Role(enum.StrEnum):
    """The part an endpoint plays in disaggregated serving."""

    PREFILL = "prefill"
    DECODE = "decode"


class EndpointState:
    """One endpoint of one role: identity, declared capacity and health, and live load.

    Satisfies the :class:`ext_proc.affinity.Candidate` shape (``address``, ``group``,
    ``token_capacity`` in tokens, ``active_tokens``, ``active_requests``).
    """

    __slots__ = (
        "active_requests",
        "active_tokens",
        "address",
        "group",
        "health_status",
        "healthy",
        "role",
        "token_capacity",
    )

    def __init__(self, role: Role, address: str) -> None:
        self.role = role
        self.address = address
        self.group = ""
        self.token_capacity = 1.0
        self.healthy = False
        self.health_status = "UNKNOWN"
        self.active_tokens = 0
        self.active_requests = 0

    def utilisation(self, cost: int) -> float:
        """``(active_tokens + cost) / token_capacity``."""
        return (self.active_tokens + cost) / self.token_capacity


class Registry:
    """Endpoints by role. ``prefills``/``decodes`` hold only the healthy ones (candidates).

    Not thread-safe: owned by the server's event loop.
    """

    def __init__(self, prefill_cluster: str, decode_cluster: str, default_token_capacity: float) -> None:
        self._roles = {prefill_cluster: Role.PREFILL, decode_cluster: Role.DECODE}
        self._default_capacity = default_token_capacity
        self._current: dict[tuple[Role, str], EndpointState] = {}
        self._departed: dict[tuple[Role, str], EndpointState] = {}
        self.prefills: tuple[EndpointState, ...] = ()
        self.decodes: tuple[EndpointState, ...] = ()
        self.version = 0

    def update(self, clusters: Iterable[ClusterEndpoints]) -> None:
        """Replace the endpoint set with ``clusters``; clusters with other names are ignored (logged).

        Several clusters with the same name are merged; an address listed twice for one role
        keeps its first entry.
        """
        fresh: dict[tuple[Role, str], EndpointState] = {}
        for cluster in clusters:
            role = self._roles.get(cluster.cluster_name)
            if role is None:
                log.warning(
                    "ignoring EDS cluster %r from %s: neither the prefill nor the decode cluster",
                    cluster.cluster_name,
                    cluster.source,
                )
                continue
            for spec in cluster.endpoints:
                key = (role, spec.address)
                if key in fresh:
                    continue
                state = (
                    self._current.get(key)
                    or self._departed.pop(key, None)
                    or EndpointState(role, spec.address)
                )
                state.group = spec.group
                state.token_capacity = spec.token_capacity or self._default_capacity
                state.healthy = spec.healthy
                state.health_status = spec.health_status
                fresh[key] = state
        for key, state in self._current.items():
            if key not in fresh and state.active_requests:
                self._departed[key] = state
        self._departed = {k: s for k, s in self._departed.items() if s.active_requests}
        self._current = fresh
        self.prefills = tuple(s for s in fresh.values() if s.role is Role.PREFILL and s.healthy)
        self.decodes = tuple(s for s in fresh.values() if s.role is Role.DECODE and s.healthy)
        self.version += 1

    def endpoints(self) -> tuple[EndpointState, ...]:
        """Every known endpoint, healthy or not, plus departed ones that still have requests in flight."""
        return (*self._current.values(), *self._departed.values())
