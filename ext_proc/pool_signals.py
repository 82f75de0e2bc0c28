"""Autoscaling signals: each role's pools (one per group) folded from the registry, for ``/metrics``.

What an autoscaler (KEDA, an HPA on external metrics) needs to size the prefill and the decode pools,
read from the gateway without reading engine internals: the endpoints the router may pick, their
declared token capacity, the tokens and requests this replica has booked on them, the headroom left
and, with ``engine_metrics`` on, the requests the engines report waiting. Pure: a fold over the
registry and the engines' last samples, computed at scrape time, never on the request path
(docs/operations.md "Autoscaling signals").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ext_proc.registry import Registry, Role


@dataclass(frozen=True, slots=True)
class PoolSignal:
    """One role's endpoints of one group, as an autoscaler reads them.

    ``healthy``: endpoints the router may pick. ``capacity_tokens``: their declared ``token_capacity``
    summed (tokens). ``booked_tokens`` / ``booked_requests``: what this replica charged to the group's
    endpoints, healthy or not, and has not released (a prefill's booking is the prompt until its prefill
    ends, a decode's the prompt plus the output budget until the stream ends); summed over the replicas,
    the pool's. ``headroom_tokens``: ``capacity_tokens`` minus the load the decision reads on the healthy
    endpoints (every replica's bookings this one knows of, blended with the engine's own load when
    sampled); negative when overbooked. ``queued_requests``: the engines' own waiting requests from their
    fresh samples, ``None`` without ``engine_metrics``."""

    role: Role
    group: str
    healthy: int
    capacity_tokens: float
    booked_tokens: int
    booked_requests: int
    headroom_tokens: float
    queued_requests: float | None


def pool_signals(registry: Registry, waiting: Mapping[str, float] | None) -> list[PoolSignal]:
    """The pools of ``registry`` by role and group, in order of first appearance.

    ``waiting``: the requests each engine reported waiting, by address, for the engines with a fresh
    sample (``None``: no engine metrics). An engine that serves both roles counts in both pools."""
    pickable = {id(s) for s in (*registry.prefills, *registry.decodes)}
    pools: dict[tuple[Role, str], list[float]] = {}
    for state in registry.endpoints():
        # healthy, capacity, booked tokens, booked requests, load read on healthy ones, queued
        pool = pools.setdefault((state.role, state.group), [0, 0.0, 0, 0, 0, 0.0])
        if id(state) in pickable:
            pool[0] += 1
            pool[1] += state.token_capacity
            pool[4] += state.blended_tokens
        pool[2] += state.own_tokens
        pool[3] += state.own_requests
        if waiting is not None:
            pool[5] += waiting.get(state.address, 0.0)
    return [
        PoolSignal(
            role=role,
            group=group,
            healthy=int(healthy),
            capacity_tokens=capacity,
            booked_tokens=int(tokens),
            booked_requests=int(requests),
            headroom_tokens=capacity - load,
            queued_requests=queued if waiting is not None else None,
        )
        for (role, group), (healthy, capacity, tokens, requests, load, queued) in pools.items()
    ]
