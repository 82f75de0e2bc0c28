"""KV-cache transfer model: same-group vs cross-group pulls, a shared cross-group link, EDS groups.

A decode engine pulling the KV cache of ``prompt_tokens`` tokens from a prefill engine waits
``kv_base_latency_ms`` plus the bytes over the bandwidth of the path: a dedicated intra-group
fabric when the prefill engine is in the decode's ``pdGroupID``, else the process-wide
:class:`SharedLink`, which divides its bandwidth equally among the transfers in flight.
Groups come from the same EDS files the gateway reads (:class:`GroupMap`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ext_proc.discovery.eds import EdsError, load_eds_file
from sim.clock import SimClock
from sim.config import KvConfig

log = logging.getLogger(__name__)

SAME_GROUP = "same_group"
CROSS_GROUP = "cross_group"
NO_TRANSFER = "none"
_EPS_BYTES = 1e-6


def host_port(host: str, port: int) -> str:
    """``"host:port"``, the address form of EDS files and ``x-sim-*`` headers (IPv6 as ``"[ip]:port"``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(eq=False)
class Flow:
    """One transfer on a :class:`SharedLink`; times are model seconds, sizes bytes."""

    nbytes: float
    start: float
    remaining: float
    finish: float | None = None
    done: asyncio.Future[float] | None = field(default=None, repr=False)


class SharedLink:
    """A link whose bandwidth is shared equally by the flows in flight (processor sharing).

    The core (:meth:`start`, :meth:`advance`, :meth:`next_finish`) is pure bookkeeping over explicit
    model times, so finish times are exact whatever the event loop's wake-up jitter;
    :meth:`transfer` drives it from a :class:`SimClock`.
    """

    def __init__(self, bandwidth_bytes_per_s: float, clock: SimClock | None = None) -> None:
        if not bandwidth_bytes_per_s > 0:
            raise ValueError("bandwidth must be > 0")
        self.bandwidth = bandwidth_bytes_per_s
        self.clock = clock or SimClock()
        self._flows: list[Flow] = []
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._finished: list[Flow] = []  # completed by advance(), futures not yet resolved

    @property
    def active(self) -> int:
        """Number of flows in flight."""
        return len(self._flows)

    def advance(self, now: float) -> list[Flow]:
        """Serve bytes up to model time ``now``; return the flows completed, with exact ``finish``."""
        finished: list[Flow] = []
        now = max(now, self._last)
        while self._flows:
            rate = self.bandwidth / len(self._flows)
            smallest = min(f.remaining for f in self._flows)
            at = self._last + smallest / rate
            if at > now:
                served = rate * (now - self._last)
                for f in self._flows:
                    f.remaining -= served
                break
            for f in self._flows:
                f.remaining -= smallest
            for f in [f for f in self._flows if f.remaining <= _EPS_BYTES]:
                f.remaining, f.finish = 0.0, at
                self._flows.remove(f)
                finished.append(f)
                if f.done is not None:
                    self._finished.append(f)
            self._last = at
        self._last = now
        return finished

    def start(self, nbytes: float, now: float) -> Flow:
        """Add a flow of ``nbytes`` at model time ``now`` (advancing the others first)."""
        self.advance(now)
        now = self._last
        flow = Flow(nbytes=nbytes, start=now, remaining=float(nbytes))
        if nbytes <= _EPS_BYTES:
            flow.remaining, flow.finish = 0.0, now
        else:
            self._flows.append(flow)
        return flow

    def next_finish(self) -> float | None:
        """Model time the next flow completes if no flow starts meanwhile (``None`` when idle)."""
        if not self._flows:
            return None
        return self._last + min(f.remaining for f in self._flows) * len(self._flows) / self.bandwidth

    async def transfer(self, nbytes: float) -> float:
        """Send ``nbytes`` over the link; return the model seconds it took (start to exact finish)."""
        flow = self.start(nbytes, self.clock.now())
        if flow.finish is not None:
            return 0.0
        flow.done = asyncio.get_running_loop().create_future()
        self._settle()
        try:
            return await flow.done
        finally:
            if flow in self._flows:  # cancelled: free the bandwidth it was using
                self.advance(self.clock.now())
                if flow in self._flows:
                    self._flows.remove(flow)
                self._settle()

    def _settle(self) -> None:
        finished, self._finished = self._finished, []
        for f in finished:
            if f.done is not None and not f.done.done():
                f.done.set_result(f.finish - f.start)  # type: ignore[operator]
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        at = self.next_finish()
        if at is not None:
            self._timer_at = at
            self._timer = self.clock.call_later(at - self.clock.now(), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.advance(max(self.clock.now(), self._timer_at))
        self._settle()


class GroupMap:
    """``"ip:port"`` → ``pdGroupID`` from EDS files, re-read when a file's stat changes.

    Each :meth:`lookup` stats the files (cheap) and reloads the changed ones; an unreadable or
    invalid file keeps its last good content. Later files win on conflicting addresses.
    """

    def __init__(self, paths: Sequence[str | Path] = (), namespace: str = "pd") -> None:
        self.paths = [str(p) for p in paths]
        self.namespace = namespace
        self._stamps: dict[str, tuple[int, int, int] | None] = {}
        self._per_file: dict[str, dict[str, str]] = {}
        self._merged: dict[str, str] = {}

    @classmethod
    def fixed(cls, groups: Mapping[str, str]) -> GroupMap:
        """A map of ``groups`` (``"ip:port"`` → ``pdGroupID``) read from no file (in-process clusters)."""
        mapped = cls()
        mapped._merged = dict(groups)
        return mapped

    def _refresh(self) -> None:
        changed = False
        for path in self.paths:
            try:
                st = os.stat(path)
                stamp: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                stamp = None
            if path in self._stamps and self._stamps[path] == stamp:
                continue
            self._stamps[path] = stamp
            if stamp is None:
                log.warning("EDS file %s is missing; keeping its last good content", path)
                continue
            try:
                cluster = load_eds_file(path, namespace=self.namespace)
            except EdsError as exc:
                log.warning("ignoring invalid EDS file: %s", exc)
                continue
            self._per_file[path] = {ep.address: ep.group for ep in cluster.endpoints}
            changed = True
        if changed:
            self._merged = {}
            for path in self.paths:
                self._merged.update(self._per_file.get(path, {}))

    def lookup(self, address: str) -> str | None:
        """The ``pdGroupID`` of ``address`` (``"ip:port"``), or ``None`` if no file lists it."""
        self._refresh()
        return self._merged.get(address)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What one KV pull did.

    ``model_ms`` is model time; ``prefill_group`` ``None`` = not in EDS; ``reported_group`` is the group
    the prefill engine reported itself (``None``: not asked); ``remote_prefill_ms`` the model ms the remote
    prefill took as this decode can tell (``None``: unknown); ``remote_cached_tokens`` the prompt tokens
    the prefill found in its prefix cache (``None``: unknown)."""

    kind: str
    model_ms: float
    prefill_address: str | None = None
    prefill_group: str | None = None
    reported_group: str | None = None
    remote_prefill_ms: float | None = None
    remote_cached_tokens: int | None = None


NO_TRANSFER_RESULT = TransferResult(NO_TRANSFER, 0.0)


class KvTransferModel:
    """Pulls KV caches into an engine of group ``own_group``; see the module docstring."""

    def __init__(
        self, config: KvConfig, own_group: str, groups: GroupMap, link: SharedLink, clock: SimClock
    ) -> None:
        self.config = config
        self.own_group = own_group
        self.groups = groups
        self.link = link
        self.clock = clock

    def classify(self, prefill_address: str) -> tuple[str, str | None]:
        """``(SAME_GROUP | CROSS_GROUP, prefill group or None)``; unknown addresses are cross-group."""
        group = self.groups.lookup(prefill_address)
        kind = SAME_GROUP if group is not None and group == self.own_group else CROSS_GROUP
        return kind, group

    async def pull(self, prefill_address: str, prompt_tokens: int) -> TransferResult:
        """Wait for the KV of ``prompt_tokens`` tokens to arrive from ``prefill_address``."""
        kind, group = self.classify(prefill_address)
        if kind == SAME_GROUP:
            ms = self.config.unloaded_transfer_ms(prompt_tokens, same_group=True)
            await self.clock.sleep(ms / 1e3)
        else:
            base_s = self.config.kv_base_latency_ms / 1e3
            await self.clock.sleep(base_s)
            ms = (base_s + await self.link.transfer(self.config.transfer_bytes(prompt_tokens))) * 1e3
        return TransferResult(kind, ms, prefill_address, group)
