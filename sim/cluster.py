"""Many simulated engines in one asyncio process: the setup demos and benchmarks use.

They share one model clock, one cross-group link and one EDS group map.

Typical use with ephemeral ports: start the cluster, then write the EDS files the gateway will
read from :func:`endpoint_specs` (the engines re-read them on their next lookup)::

    engines = await start_cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")], [eds])
    write_eds_file(eds, "pd", endpoint_specs(engines))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ext_proc.endpoints import EndpointSpec
from sim.clock import SimClock
from sim.config import DEFAULT_MODEL, EngineConfig, KvConfig, KvEventsConfig, Role, TimingConfig
from sim.kv import GroupMap, SharedLink
from sim.server import RunningEngine, start_engine


@dataclass(frozen=True)
class EngineSpec:
    """One engine of a cluster; ``timing`` overrides the cluster's (same ``time_scale`` required)."""

    role: Role
    group: str
    port: int = 0
    timing: TimingConfig | None = None
    model: str | None = None
    """The model it serves, refusing others as vLLM does (``None``: the cluster's, serving any name)."""


def clusters(large: TimingConfig, small: TimingConfig) -> dict[str, list[EngineSpec]]:
    """The named clusters of the demo and the benchmarks.

    ``demo`` (pdGroup rack-a 2 prefills + 3 large decodes, rack-b 1 prefill + 2 small decodes) and
    ``three-group`` (g1 and g2 each 2 prefills + 3 large decodes; ``trap`` 2 prefills and 1 small decode);
    every prefill and the large decodes ``large``, the small decodes ``small``."""

    def engines(group: str, prefills: int, decodes: int, timing: TimingConfig) -> list[EngineSpec]:
        return [EngineSpec("prefill", group, timing=large) for _ in range(prefills)] + [
            EngineSpec("decode", group, timing=timing) for _ in range(decodes)
        ]

    return {
        "demo": engines("rack-a", 2, 3, large) + engines("rack-b", 1, 2, small),
        "three-group": engines("g1", 2, 3, large) + engines("g2", 2, 3, large) + engines("trap", 2, 1, small),
    }


async def start_cluster(
    specs: Sequence[EngineSpec],
    eds_files: Sequence[str | Path] = (),
    *,
    host: str = "127.0.0.1",
    timing: TimingConfig | None = None,
    kv: KvConfig | None = None,
    model: str = DEFAULT_MODEL,
    namespace: str = "pd",
    kv_events: KvEventsConfig | None = None,
) -> list[RunningEngine]:
    """Start one engine per spec (in order); stop them all and re-raise if any fails to start.

    ``kv_events``: every engine publishes its KV-cache events so (ports 0: each its own ephemeral ones)."""
    timing = timing or TimingConfig()
    kv = kv or KvConfig()
    clock = SimClock(timing.time_scale)
    link = SharedLink(kv.cross_group_gbps * 1e9, clock)
    groups = GroupMap(eds_files, namespace)
    base = EngineConfig(
        host=host,
        model=model,
        eds_files=tuple(map(str, eds_files)),
        eds_namespace=namespace,
        timing=timing,
        kv=kv,
        kv_events=kv_events,
    )
    started: list[RunningEngine] = []
    try:
        for spec in specs:
            if spec.timing is not None and spec.timing.time_scale != timing.time_scale:
                raise ValueError("every engine of a cluster must use the cluster's time_scale")
            config = replace(
                base, role=spec.role, group=spec.group, port=spec.port, timing=spec.timing or timing
            )
            if spec.model is not None:
                config = replace(config, model=spec.model, strict_model=True)
            started.append(await start_engine(config, clock=clock, link=link, groups=groups))
    except BaseException:
        await stop_cluster(started)
        raise
    return started


async def stop_cluster(engines: Iterable[RunningEngine]) -> None:
    """Stop every engine (each drains its in-flight requests first)."""
    for engine in engines:
        await engine.stop()


def bootstrap_port(engine: RunningEngine) -> int | None:
    """The EDS ``bootstrap_port`` of ``engine``: a prefill engine's bootstrap server is its HTTP port."""
    return engine.port if engine.engine.config.role == "prefill" else None


def endpoint_specs(
    engines: Iterable[RunningEngine], roles: Iterable[str] | None = None
) -> list[EndpointSpec]:
    """The EDS endpoints of the engines whose role is in ``roles`` (default all).

    Each with its address, ``pdGroupID``, :func:`bootstrap_port`, ``kv_events_port`` and
    ``kv_events_replay_port`` when the engine publishes KV-cache events, and ``models`` when it serves
    one model only (:attr:`EngineSpec.model`)."""
    wanted = set(roles) if roles is not None else None
    return [
        EndpointSpec(
            e.address,
            e.engine.config.group,
            None,
            True,
            "HEALTHY",
            bootstrap_port(e),
            kv_events_port=e.kv_events_port,
            kv_events_replay_port=e.kv_events_replay_port,
            models=(e.engine.config.model,) if e.engine.config.strict_model else None,
        )
        for e in engines
        if wanted is None or e.engine.config.role in wanted
    ]
