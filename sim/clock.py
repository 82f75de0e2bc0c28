"""Model time: what a real engine would take, stretched or shrunk by ``time_scale``.

Everything the simulator reports (headers, metrics) is in model seconds/ms, so numbers do not
depend on ``time_scale``; only wall-clock waiting does: ``wall = model * time_scale``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class SimClock:
    """Monotonic model clock: ``now()`` is ``time.monotonic() / time_scale`` (model seconds)."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale

    def now(self) -> float:
        """Current model time in seconds (arbitrary origin, monotonic)."""
        return time.monotonic() / self.time_scale

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of model time (``seconds * time_scale`` wall seconds)."""
        await asyncio.sleep(max(0.0, seconds) * self.time_scale)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        """Run ``callback`` on the running loop after ``seconds`` of model time."""
        return asyncio.get_running_loop().call_later(max(0.0, seconds) * self.time_scale, callback)

    async def wait_for(self, aw: Awaitable[T], seconds: float) -> T:
        """Await ``aw`` for up to ``seconds`` of model time; then cancel it and raise ``TimeoutError``."""
        return await asyncio.wait_for(aw, max(0.0, seconds) * self.time_scale)
