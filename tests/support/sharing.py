"""Routers sharing their state over an in-process :class:`MemoryHub` (the decision-slot tests)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from builders import endpoint, make_router

from ext_proc.router import Router
from ext_proc.shared.config import SharedStateConfig
from ext_proc.shared.kinds import BusState
from ext_proc.shared.replica import ReplicaState
from ext_proc.shared.runner import MemoryHub

P1, P2 = "10.0.0.1:8000", "10.0.0.2:8000"
D1, D2 = "10.0.1.1:8000", "10.0.1.2:8000"


def two_pair_router() -> Router:
    """A router over two prefills and two decodes, all in group ``g1``, without a prefix index."""
    return make_router([endpoint(P1, "g1"), endpoint(P2, "g1")], [endpoint(D1, "g1"), endpoint(D2, "g1")])


def share(
    router: Router,
    hub: MemoryHub,
    name: str,
    config: SharedStateConfig,
    wall: Callable[[], float] = time.time,
) -> BusState:
    """``router``'s shared state as replica ``name`` on ``hub`` (not started), its wall clock ``wall``."""
    replica = ReplicaState(
        router.registry, lambda: None, router.metrics, config.peer_timeout_seconds, name, wall=wall
    )
    shared = BusState("memory", replica, hub.bus(), config, router.metrics)
    router.live.shared = shared
    return shared


def chat(words: int) -> bytes:
    """A chat completion body whose one user message is ``words`` words."""
    text = " ".join(f"w{i}" for i in range(words))
    message = {"role": "user", "content": text}
    return json.dumps({"model": "m", "messages": [message], "max_tokens": 10}).encode()
