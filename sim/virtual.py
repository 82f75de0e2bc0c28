"""Virtual time: run simulated engines as a discrete-event simulation, as fast as the CPU allows.

The engines (:mod:`sim.engine`) only ever wait on the event loop's timers and on each other, through
their :class:`~sim.clock.SimClock`. On :func:`new_loop`'s event loop time is a number that jumps to
the next timer whenever nothing is ready to run, so an hour of model time passes in however long its
Python work takes, and every run of the same inputs makes the same events in the same order (there is
no wall clock and no I/O: the loop has no sockets to poll). :class:`VirtualClock` is the engines' clock
on such a loop. Any real I/O on it never completes: the loop raises :class:`Deadlock` instead of
waiting forever when nothing is scheduled.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sim.clock import SimClock
from sim.cluster import EngineSpec
from sim.config import EngineConfig, KvConfig, TimingConfig
from sim.engine import Engine
from sim.kv import GroupMap, SharedLink, host_port

FIRST_PORT = 20000
"""Engines of :func:`build_cluster` are named ``127.0.0.1:FIRST_PORT + i`` (nothing listens there)."""


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is due, yet the awaited work has not finished."""


class _Selector(selectors.BaseSelector):
    """A selector with nothing ever ready: waiting ``timeout`` seconds moves the loop's clock instead."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = self._keys[fileobj] = selectors.SelectorKey(fileobj, fd, events, data)
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("virtual time: nothing is ready and no timer is scheduled")
        self._loop.advance(timeout)
        return []

    def get_map(self) -> Any:
        return self._keys


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` advances only by the waits it would otherwise sleep."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_Selector(self))

    def time(self) -> float:
        """The virtual clock, in seconds."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` ahead (the loop calls this instead of sleeping)."""
        self._now += max(0.0, seconds)


class VirtualClock(SimClock):
    """Model time read from the running :class:`VirtualLoop` (time scale 1: model seconds are its seconds)."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def now(self) -> float:
        """The running loop's time, in seconds (virtual under a :class:`VirtualLoop`)."""
        return asyncio.get_running_loop().time()


def new_loop() -> VirtualLoop:
    """A fresh virtual-time event loop (run coroutines with ``loop.run_until_complete``; close it after)."""
    return VirtualLoop()


def build_cluster(specs: Sequence[EngineSpec], timing: TimingConfig, kv: KvConfig) -> list[Engine]:
    """Engines on one virtual clock, one per spec; not started.

    One engine per spec (``spec.timing`` or ``timing``), sharing one :class:`VirtualClock`, one
    cross-group link and the groups of the specs; not started (``await engine.start()`` on a
    :class:`VirtualLoop`). Engine ``i`` is ``127.0.0.1:FIRST_PORT + i``; they talk to each other
    in process, never over HTTP."""
    clock = VirtualClock()
    link = SharedLink(kv.cross_group_gbps * 1e9, clock)
    ports = range(FIRST_PORT, FIRST_PORT + len(specs))
    groups = GroupMap.fixed({host_port("127.0.0.1", p): s.group for p, s in zip(ports, specs, strict=True)})
    base = EngineConfig(kv=kv, timing=timing)
    engines = []
    for port, spec in zip(ports, specs, strict=True):
        config = replace(base, role=spec.role, group=spec.group, port=port, timing=spec.timing or timing)
        engines.append(Engine(config, clock=clock, link=link, groups=groups))
    return engines
