"""One measured run: a workload through one gateway setting of a running :class:`~sim.stack.Stack`.

Shared by the demo and the routing benchmark, so both measure exactly the same way: a few
unrecorded warm-up requests (cold connections would penalise whichever run goes first), then the
planned workload, optionally with a disruption (a decode node dying) part-way through. A gateway
process (pd-extproc or Envoy) that exits meanwhile stops the run with :class:`~sim.stack.StackError`
saying which and why, instead of a table of failed requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from sim.config import DEFAULT_MODEL
from sim.report import summarize
from sim.stack import Stack, StackError
from sim.workload import Record, RequestPlan, plan_workload, run_workload

T = TypeVar("T")

WARMUP = plan_workload(4, 20.0, prompt_tokens=(64, 64), output_tokens=(4, 4), seed=1)
BASELINE = "round-robin"
"""Run name of the plain-Envoy baseline (no ext_proc, round robin over the decodes)."""
WATCH_SECONDS = 0.25
"""How often a run checks that its gateway processes still run."""


async def watched(
    work: Awaitable[T], failure: Callable[[], str | None], interval: float = WATCH_SECONDS
) -> T:
    """``work``'s result, checking ``failure()`` every ``interval`` seconds while it runs and once after.

    When ``failure()`` gives a reason, ``work`` is cancelled (if it still runs) and
    :class:`~sim.stack.StackError` raised with that reason, so a dead gateway ends a run at once."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            why = failure()
            if why is not None:
                raise StackError(why)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@dataclass(frozen=True)
class Disruption:
    """At ``at`` seconds into the workload, ``action(stack)`` runs (e.g. kill a decode engine)."""

    at: float
    action: Callable[[Stack], Awaitable[None]]


async def measure(
    stack: Stack,
    mode: str,
    plans: list[RequestPlan],
    bonus: float = 0.3,
    progress: Callable[[], None] | None = None,
    disruption: Disruption | None = None,
    handoff: str = "sidecar",
    model: str = DEFAULT_MODEL,
    ground_truth: Callable[[list[Record]], None] | None = None,
    **routing: object,
) -> dict:
    """Route one workload through the stack with ``mode``; its summary.

    Route with ``mode`` (``off``/``prefer``/``strict``, or :data:`BASELINE`), ``handoff``
    (pd-extproc's ``handoff.mode``) and more ``routing`` options of :meth:`Stack.route_with` (with
    several ``replicas``, the requests go round robin over their gateways), run ``plans`` asking for
    ``model``; return the summary (see :func:`sim.report.summarize`). ``ground_truth``, when given,
    fills in the records' engines and KV transfer before the summary (real engines send none of the
    simulator's response headers). Raises :class:`~sim.stack.StackError` as soon as a gateway process
    exits (:meth:`Stack.failure`), the requests in flight abandoned."""
    if mode == BASELINE:
        await stack.round_robin()
    else:
        await stack.route_with(mode, bonus, handoff, **routing)  # type: ignore[arg-type]
    urls = stack.urls
    capacities = stack.decode_capacities()

    async def run() -> tuple[list[Record], float]:
        await run_workload(urls, WARMUP, model)
        task = None
        if disruption is not None:

            async def disrupt() -> None:
                await asyncio.sleep(disruption.at)
                await disruption.action(stack)

            task = asyncio.create_task(disrupt())
        try:
            return await run_workload(urls, plans, model, progress=progress)
        except BaseException:  # cancelled (a gateway exited): the disruption is moot
            if task is not None:
                task.cancel()
            raise
        finally:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    records, duration = await watched(run(), stack.failure)
    if ground_truth is not None:
        ground_truth(records)
    return summarize(records, duration, capacities)
