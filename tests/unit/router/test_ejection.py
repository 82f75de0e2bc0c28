"""Ejection after a failure (``ext_proc/ejection.py``): a prefill's failed leg, a dead decode; for how long,
and never everyone."""

from __future__ import annotations

from prometheus_client import generate_latest

from ext_proc.affinity import Pool
from ext_proc.ejection import Ejections
from ext_proc.metrics import Metrics
from ext_proc.registry import EndpointState, Role


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pool(*addresses: str) -> Pool[EndpointState]:
    states = [EndpointState(Role.PREFILL, a) for a in addresses]
    for state in states:
        state.group = "a"
    return Pool.of(states)


def _addresses(pool: Pool[EndpointState]) -> list[str]:
    return [e.address for e in pool.endpoints]


def test_a_failed_prefill_is_left_out_for_its_time_then_back():
    clock, metrics = Clock(), Metrics(lambda: ())
    ejections = Ejections(5.0, metrics, clock)
    pool = _pool("p1", "p2", "p3")
    assert ejections.keep(pool) is pool  # nothing ejected: the live pool itself, no copy
    ejections.eject("p2", "connect_error")
    assert _addresses(ejections.keep(pool)) == ["p1", "p3"]
    clock.now += 4.9
    assert ejections.ejected() == {"p2"}
    ejections.eject("p2", "server_error")  # a later failure restarts its time
    clock.now += 4.9
    assert _addresses(ejections.keep(pool)) == ["p1", "p3"]
    clock.now += 0.2
    assert ejections.keep(pool) is pool and ejections.ejected() == frozenset()
    text = generate_latest(metrics.registry).decode()
    assert 'pd_extproc_prefill_ejections_total{outcome="connect_error"} 1.0' in text
    assert 'pd_extproc_prefill_ejections_total{outcome="server_error"} 1.0' in text


def test_a_dead_decode_is_ejected_and_counted_as_a_decode(caplog):
    clock, metrics = Clock(), Metrics(lambda: ())
    ejections = Ejections(5.0, metrics, clock, role="decode")
    ejections.eject("d1", "decode_engine_dead")
    assert ejections.ejected() == {"d1"}
    text = generate_latest(metrics.registry).decode()
    assert 'pd_extproc_decode_ejections_total{outcome="decode_engine_dead"} 1.0' in text
    assert "pd_extproc_prefill_ejections_total{" not in text
    assert "decode d1 ejected for 5 s after a failure (decode_engine_dead)" in caplog.text
    clock.now += 5.1
    assert ejections.ejected() == frozenset()


def test_ejection_never_leaves_no_prefill():
    ejections = Ejections(5.0, Metrics(lambda: ()), Clock())
    pool = _pool("p1", "p2")
    ejections.eject("p1", "timeout")
    ejections.eject("p2", "timeout")
    assert ejections.keep(pool) is pool


def test_zero_seconds_ejects_nothing():
    ejections = Ejections(0.0, Metrics(lambda: ()), Clock())
    ejections.eject("p1", "timeout")
    assert ejections.ejected() == frozenset()


def test_held_addresses_are_left_out_but_never_all():
    ejections = Ejections(0.0, Metrics(lambda: ()))
    pool = _pool("a:1", "b:1", "c:1")
    ejections.hold(frozenset({"b:1"}))
    assert [e.address for e in ejections.keep(pool).endpoints] == ["a:1", "c:1"]
    ejections.hold(frozenset({"a:1", "b:1", "c:1"}))
    assert ejections.keep(pool) is pool
    ejections.hold(frozenset())
    assert ejections.keep(pool) is pool
