"""The autoscaling signals: each role's pools folded from the registry, and their exposition."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from builders import endpoint, registry_of
from grpc_harness import start_with

from ext_proc.endpoints import ClusterEndpoints
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.pool_signals import PoolSignal, pool_signals
from ext_proc.registry import Registry, Role

P_A, P_B = "10.0.0.1:8000", "10.0.0.2:8000"
D_A1, D_A2, D_B = "10.0.1.1:8000", "10.0.1.2:8000", "10.0.1.3:8000"


def two_groups() -> Registry:
    """Group a: a prefill, a healthy decode of 1,000 tokens and an unhealthy one; group b: one of each."""
    return registry_of(
        [endpoint(P_A, "a", 4_000), endpoint(P_B, "b", 4_000)],
        [endpoint(D_A1, "a", 1_000), endpoint(D_A2, "a", 1_000, health="UNHEALTHY"), endpoint(D_B, "b", 500)],
        100.0,
    )


def by_pool(signals: list[PoolSignal]) -> dict[tuple[Role, str], PoolSignal]:
    return {(s.role, s.group): s for s in signals}


def test_pools_fold_health_capacity_bookings_and_headroom() -> None:
    registry = two_groups()
    decode_a = registry.decodes[0]
    lease = Lease(registry.prefills[0], 300, decode_a, 400)
    decode_a.set_peer_load(100, 2)  # a peer's bookings: in the headroom, not in this replica's booking
    registry.decodes[1].set_engine_offset(50)  # group b's engine says it holds 50 tokens
    pools = by_pool(pool_signals(registry, None))
    assert pools[(Role.PREFILL, "a")] == PoolSignal(Role.PREFILL, "a", 1, 4_000.0, 300, 1, 3_700.0, None)
    assert pools[(Role.PREFILL, "b")] == PoolSignal(Role.PREFILL, "b", 1, 4_000.0, 0, 0, 4_000.0, None)
    # the unhealthy decode's capacity is not counted; group a's decode holds 400 own + 100 peer tokens
    assert pools[(Role.DECODE, "a")] == PoolSignal(Role.DECODE, "a", 1, 1_000.0, 400, 1, 500.0, None)
    assert pools[(Role.DECODE, "b")] == PoolSignal(Role.DECODE, "b", 1, 500.0, 0, 0, 450.0, None)
    lease.release()
    assert by_pool(pool_signals(registry, None))[(Role.DECODE, "a")].booked_tokens == 0


def test_an_overbooked_pool_has_negative_headroom_and_a_departed_endpoint_keeps_its_booking() -> None:
    registry = two_groups()
    lease = Lease(None, 0, registry.decodes[1], 800)  # group b's 500-token decode
    assert by_pool(pool_signals(registry, None))[(Role.DECODE, "b")].headroom_tokens == -300.0
    remaining = [ClusterEndpoints("decode", (endpoint(D_A1, "a", 1_000),), "d.yaml")]
    registry.update(remaining)
    gone = by_pool(pool_signals(registry, None))[(Role.DECODE, "b")]
    assert (gone.healthy, gone.capacity_tokens, gone.booked_tokens, gone.booked_requests) == (0, 0.0, 800, 1)
    lease.release()
    registry.update(remaining)  # the registry forgets a departed endpoint once its requests ended
    assert (Role.DECODE, "b") not in by_pool(pool_signals(registry, None))


def test_engine_waiting_requests_are_summed_per_pool() -> None:
    registry = two_groups()
    pools = by_pool(pool_signals(registry, {D_A1: 3.0, D_A2: 1.0, P_B: 7.0}))
    assert pools[(Role.DECODE, "a")].queued_requests == 4.0  # unhealthy engines still hold their queue
    assert pools[(Role.PREFILL, "b")].queued_requests == 7.0
    assert pools[(Role.DECODE, "b")].queued_requests == 0.0  # no fresh sample: nothing known waiting


def test_exposition_names_both_roles_even_without_endpoints() -> None:
    registry = Registry("prefill", "decode", 1.0)
    metrics = Metrics(registry.endpoints)
    metrics.watch_pools(lambda: pool_signals(registry, None))
    sample = metrics.registry.get_sample_value
    assert sample("pd_extproc_healthy_endpoints", {"role": "prefill"}) == 0
    assert sample("pd_extproc_healthy_endpoints", {"role": "decode"}) == 0


def test_exposition_of_the_pools() -> None:
    registry = two_groups()
    metrics = Metrics(registry.endpoints)
    waiting: dict[str, float] | None = None
    metrics.watch_pools(lambda: pool_signals(registry, waiting))
    sample = metrics.registry.get_sample_value
    assert sample("pd_extproc_healthy_endpoints", {"role": "decode"}) == 2
    decode_a = {"role": "decode", "group": "a"}
    assert sample("pd_extproc_pool_capacity_tokens", decode_a) == 1_000
    assert sample("pd_extproc_pool_headroom_tokens", decode_a) == 1_000
    assert sample("pd_extproc_pool_queued_requests", decode_a) is None  # no engine metrics: not exposed
    waiting = {D_A1: 2.0}
    assert sample("pd_extproc_pool_queued_requests", decode_a) == 2


@pytest.mark.parametrize("engine_metrics", [False, True])
async def test_a_running_server_exposes_its_pools(tmp_path: Path, engine_metrics: bool) -> None:
    """``serve`` wires the pools to /metrics; the engines' queue only with engine metrics (nothing answers
    at these addresses: no fresh sample, nothing known waiting)."""
    settings = {"engine_metrics.enabled": engine_metrics, "engine_metrics.timeout_seconds": 0.1}
    server = await start_with(tmp_path, ["10.0.0.2:8000", "10.0.0.3:8000"], settings=settings)
    try:
        url = f"http://127.0.0.1:{server.admin_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            text = await response.text()
    finally:
        await server.stop(grace=0)
    assert 'pd_extproc_healthy_endpoints{role="decode"} 2.0' in text
    assert 'pd_extproc_pool_capacity_tokens{group="a",role="decode"} 2000.0' in text
    assert 'pd_extproc_pool_booked_tokens{group="a",role="prefill"} 0.0' in text
    queued = 'pd_extproc_pool_queued_requests{group="a",role="decode"} 0.0'
    assert (queued in text) is engine_metrics
    assert ("# TYPE pd_extproc_engine_ttft_seconds summary" in text) is engine_metrics
