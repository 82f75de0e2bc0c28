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
from dataclasses import dataclass, replace

from ext_proc.registry import EndpointState, Registry, Role


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
    healthy: int = 0
    capacity_tokens: float = 0.0
    booked_tokens: int = 0
    booked_requests: int = 0
    headroom_tokens: float = 0.0
    queued_requests: float | None = None


def pool_signals(registry: Registry, waiting: Mapping[str, float] | None) -> list[PoolSignal]:
    """The pools of ``registry`` by role and group, in order of first appearance.

    ``waiting``: the requests each engine reported waiting, by address, for the engines with a fresh
    sample (``None``: no engine metrics). An engine that serves both roles counts in both pools."""
    pickable = {id(s) for s in (*registry.prefills, *registry.decodes)}
    pools: dict[tuple[Role, str], PoolSignal] = {}
    for state in registry.endpoints():
        key = (state.role, state.group)
        pool = pools.get(key) or PoolSignal(*key, queued_requests=None if waiting is None else 0.0)
        pools[key] = _counted(pool, state, id(state) in pickable, waiting)
    return list(pools.values())


def _counted(
    pool: PoolSignal, state: EndpointState, pickable: bool, waiting: Mapping[str, float] | None
) -> PoolSignal:
    """``pool`` with ``state`` counted in: bookings and queue always, capacity and load if pickable."""
    capacity, load = (state.token_capacity, state.blended_tokens) if pickable else (0.0, 0)
    queued = pool.queued_requests
    return replace(
        pool,
        healthy=pool.healthy + pickable,
        capacity_tokens=pool.capacity_tokens + capacity,
        booked_tokens=pool.booked_tokens + state.own_tokens,
        booked_requests=pool.booked_requests + state.own_requests,
        headroom_tokens=pool.headroom_tokens + capacity - load,
        queued_requests=None
        if queued is None or waiting is None
        else queued + waiting.get(state.address, 0.0),
    )
