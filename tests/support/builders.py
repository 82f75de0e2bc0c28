"""Endpoints, registries and routers built for tests: the one builder of each, shared by every test file.

:func:`endpoint` is an endpoint as an EDS file declares it; :func:`registry_of` a registry holding a prefill
and a decode cluster; :func:`make_router` a sidecar-handoff router over such a registry (the scenario of
``tests/unit/router/test_router.py``, whose addresses ``P1`` and ``D_SAME_IDLE`` other tests reuse);
:func:`kv_events_config` a server's configuration of the ``kv-events`` prefix source over EDS files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.affinity import Mode, Policy
from ext_proc.config import Config, load_config
from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import ClusterEndpoints, EndpointSpec
from ext_proc.handoff.kinds import Handoff
from ext_proc.handoff.sidecar import SidecarHandoff
from ext_proc.live import LiveParts
from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused, RequestMeta, Routed
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.registry import Registry
from ext_proc.router import Router, RouterSettings

DEST = "x-gateway-destination-endpoint"
PREFILL = "x-prefiller-host-port"
CHAT_META = RequestMeta("/v1/chat/completions")
DEFAULT_MAX_TOKENS = 100
ROUTER_CAPACITY = 10_000.0
"""The default token capacity of :func:`make_router`'s registry (an endpoint that declares none)."""

P1 = "10.0.0.1:8000"
D_SAME_IDLE = "10.0.1.1:8000"


def endpoint(
    address: str,
    group: str = "g1",
    capacity: float | None = None,
    health: str = "HEALTHY",
    bootstrap_port: int | None = None,
    metrics_port: int | None = None,
    kv_events_port: int | None = None,
    kv_events_replay_port: int | None = None,
    data_parallel_size: int = 1,
    models: tuple[str, ...] | None = None,
) -> EndpointSpec:
    """One endpoint as an EDS file declares it; healthy for ``HEALTHY`` and ``UNKNOWN``, as the EDS reader
    reads a health status; ``capacity`` ``None``: none declared (the registry's default applies);
    ``models`` ``None``: every model."""
    healthy = health in ("HEALTHY", "UNKNOWN")
    return EndpointSpec(
        address,
        group,
        capacity,
        healthy,
        health,
        bootstrap_port,
        metrics_port,
        kv_events_port,
        kv_events_replay_port,
        data_parallel_size,
        models,
    )


def kv_events_config(
    folder: Path, specs: Sequence[EndpointSpec], overrides: dict[str, object] | None = None
) -> Config:
    """A server's configuration: ``specs`` each a prefill and a decode (EDS files written in ``folder``),
    the ``kv-events`` prefix source, ephemeral listening ports, then ``overrides`` (dotted keys)."""
    write_eds_file(folder / "p.json", "prefill", list(specs))
    write_eds_file(folder / "d.json", "decode", list(specs))
    base = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "discovery.eds_files": [str(folder / "p.json"), str(folder / "d.json")],
        "affinity.prefix.enabled": True,
        "affinity.prefix.source": "kv-events",
    }
    return load_config(None, {**base, **(overrides or {})}, environ={})


def registry_of(
    prefills: Iterable[EndpointSpec], decodes: Iterable[EndpointSpec], default_capacity: float
) -> Registry:
    """A registry of the clusters ``prefill`` (``prefills``) and ``decode`` (``decodes``)."""
    registry = Registry("prefill", "decode", default_capacity)
    registry.update(
        [
            ClusterEndpoints("prefill", tuple(prefills), "p.yaml"),
            ClusterEndpoints("decode", tuple(decodes), "d.yaml"),
        ]
    )
    return registry


def make_router(
    prefills: list[EndpointSpec],
    decodes: list[EndpointSpec],
    mode: Mode = Mode.PREFER,
    bonus: float = 0.3,
    fallback_count: int = 2,
    max_inflight_requests: int = 0,
    retry_after_seconds: int = 1,
    prefix: PrefixSettings | None = None,
    prefix_weight: float = 0.0,
    handoff: Callable[[Metrics], Handoff] | None = None,
    eject_seconds: float = 0.0,
) -> Router:
    """A router over :func:`registry_of` the endpoints; ``handoff`` builds its handoff from the router's
    metrics (default: the sidecar handoff, headers ``DEST`` and ``PREFILL``)."""
    registry = registry_of(prefills, decodes, ROUTER_CAPACITY)
    metrics = Metrics(registry.endpoints)
    settings = RouterSettings(
        DEFAULT_MAX_TOKENS,
        max_inflight_requests=max_inflight_requests,
        retry_after_seconds=retry_after_seconds,
        eject_seconds=eject_seconds,
    )
    return Router(
        settings,
        registry=registry,
        policy=Policy(mode, bonus, fallback_count, prefix_weight=prefix_weight),
        handoff=SidecarHandoff(DEST, PREFILL) if handoff is None else handoff(metrics),
        metrics=metrics,
        live=LiveParts(prefix, metrics),
    )


def refused(result: Routed | Refused) -> Refused:
    """``result``, asserted to be a refusal."""
    assert isinstance(result, Refused), result
    return result


def samples(router: Router) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a ``/metrics`` scrape, keyed by name and label set."""
    text = generate_latest(router.metrics.registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(router: Router, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` with exactly ``labels`` (``None``: no such sample)."""
    return samples(router).get((name, frozenset(labels.items())))
