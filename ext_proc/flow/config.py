"""The ``flow_control`` section: priorities per objective, the queue's bounds and the saturation rule.

See docs/configuration.md and docs/operations.md "Flow control"."""

from __future__ import annotations

from dataclasses import dataclass, field

from ext_proc.checks import ConfigError, in_range

MAX_QUEUE_SECONDS = 3600.0
"""Upper bound of ``flow_control.max_queue_seconds``: Envoy grants an ext_proc answer at most an hour."""
MAX_PRIORITY = 1_000_000
"""Bound of an objective's priority, either sign."""


def _objectives() -> dict[str, int]:
    return {"interactive": 10, "standard": 0, "batch": -1}


@dataclass(frozen=True)
class FlowControlConfig:
    """The ``flow_control`` section (docs/operations.md "Flow control").

    ``enabled``: queue requests while the pool is saturated (off: ``limits.max_inflight_requests``
    answers 429 at once, as before the section existed). ``objectives``: the priority of each
    ``x-gateway-inference-objective`` value (higher first; negative: sheddable, answered 429 at once
    instead of queuing while saturated). ``default_objective``: the objective of a request naming none,
    or one not in ``objectives`` (counted). ``max_queued_requests``: the most requests queued, all bands
    together. ``max_queue_seconds``: the longest one waits before a 503. ``max_flows``: the most
    fairness ids (``x-gateway-inference-fairness-id``) with their own flow in one band; requests of
    further ids share one flow. ``reserved_requests``: the room (in-flight slots, or requests the engines
    can take) sheddable requests leave to the others: one is shed while no more than this is left, so
    that a request of a higher band finds room at once instead of waiting for a slot to free.
    ``engine_priority``: write each request's scheduling priority into the body the engines get (vLLM's
    ``priority``, lower first: the objective's priority negated), replacing any the client sent; off, a
    client's ``priority`` reaches the engines as it came.
    ``queue_depth_threshold`` and ``kv_cache_threshold``: the Gateway API
    Inference Extension's saturation rule on the engines' own signals (``engine_metrics``): an engine
    with fewer requests waiting and less of its KV cache in use than these has room.
    """

    enabled: bool = False
    objectives: dict[str, int] = field(default_factory=_objectives)
    default_objective: str = "standard"
    max_queued_requests: int = 1000
    max_queue_seconds: float = 30.0
    max_flows: int = 64
    reserved_requests: int = 0
    engine_priority: bool = False
    queue_depth_threshold: int = 5
    kv_cache_threshold: float = 0.8

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first bad key (out of range, unknown, needing another)."""
        key = "flow_control"
        for name, priority in self.objectives.items():
            if not name or len(name) > 128:
                raise ConfigError(
                    f"{key}.objectives: {name!r} is not allowed; use a name of 1 to 128 characters"
                )
            in_range(f"{key}.objectives.{name}", priority, -MAX_PRIORITY, MAX_PRIORITY, kind="an integer")
        if self.default_objective not in self.objectives:
            known = ", ".join(sorted(self.objectives)) or "none"
            raise ConfigError(
                f"{key}.default_objective: {self.default_objective!r} is not one of flow_control.objectives "
                f"({known})"
            )
        in_range(f"{key}.max_queued_requests", self.max_queued_requests, 1, 1_000_000, kind="an integer")
        in_range(f"{key}.max_queue_seconds", self.max_queue_seconds, 0, MAX_QUEUE_SECONDS, low_open=True)
        in_range(f"{key}.max_flows", self.max_flows, 1, 100_000, kind="an integer")
        in_range(f"{key}.reserved_requests", self.reserved_requests, 0, 1_000_000, kind="an integer")
        in_range(f"{key}.queue_depth_threshold", self.queue_depth_threshold, 1, 1_000_000, kind="an integer")
        in_range(f"{key}.kv_cache_threshold", self.kv_cache_threshold, 0, 1, low_open=True)
        if self.engine_priority and not self.enabled:
            raise ConfigError(
                f"{key}.engine_priority: needs {key}.enabled (the priority comes from flow control's "
                "objectives); turn both on, or this off"
            )
