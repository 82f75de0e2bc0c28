"""One measured run: a workload through one gateway setting of a running :class:`~sim.stack.Stack`.

Shared by the demo and the routing benchmark, so both measure exactly the same way: a few
unrecorded warm-up requests (cold connections would penalise whichever run goes first), then the
planned workload, optionally with a disruption (a decode node dying) part-way through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sim.config import DEFAULT_MODEL
from sim.report import summarize
from sim.stack import Stack
from sim.workload import Record, RequestPlan, plan_workload, run_workload

WARMUP = plan_workload(4, 20.0, prompt_tokens=(64, 64), output_tokens=(4, 4), seed=1)
BASELINE = "round-robin"
"""Run name of the plain-Envoy baseline (no ext_proc, round robin over the decodes)."""


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
    """Route with ``mode`` (``off``/``prefer``/``strict``, or :data:`BASELINE`), ``handoff``
    (pd-extproc's ``handoff.mode``) and more ``routing`` options of :meth:`Stack.route_with` (with
    several ``replicas``, the requests go round robin over their gateways), run ``plans`` asking for
    ``model``; return the summary (see :func:`sim.report.summarize`). ``ground_truth``, when given,
    fills in the records' engines and KV transfer before the summary (real engines send none of the
    simulator's response headers)."""
    if mode == BASELINE:
        await stack.round_robin()
    else:
        await stack.route_with(mode, bonus, handoff, **routing)  # type: ignore[arg-type]
    urls = stack.urls
    await run_workload(urls, WARMUP, model)
    capacities = stack.decode_capacities()
    task = None
    if disruption is not None:

        async def disrupt() -> None:
            await asyncio.sleep(disruption.at)
            await disruption.action(stack)

        task = asyncio.create_task(disrupt())
    try:
        records, duration = await run_workload(urls, plans, model, progress=progress)
    finally:
        if task is not None:
            await task
    if ground_truth is not None:
        ground_truth(records)
    return summarize(records, duration, capacities)
