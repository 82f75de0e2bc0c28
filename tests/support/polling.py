"""Wait for a condition by polling, with a deadline generous enough for a busy 2-core CI machine."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

DEADLINE = 10.0
"""Seconds before a wait fails: far above what any condition needs on an idle machine."""


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    deadline: float = DEADLINE,
    every: float = 0.01,
    describe: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition`` (sync or async) every ``every`` seconds until it is true; fail after
    ``deadline`` s (a condition that asks other processes over HTTP costs them CPU at each poll), with
    ``describe()`` (what was seen instead) in the failure's message when given."""
    end = time.monotonic() + deadline
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert time.monotonic() < end, f"condition not met within {deadline} s" + (
            f": {describe()}" if describe is not None else ""
        )
        await asyncio.sleep(every)
