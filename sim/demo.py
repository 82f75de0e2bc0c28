"""The demo on simulated engines, ``pd-extproc demo``'s default (:mod:`demo.cli`, the command).

The simulated PD cluster (two pdGroups of different shapes, engines of a measured profile,
:mod:`sim.profiles`, each with a CPU KV tier), pd-extproc and the real Envoy on free loopback ports; a
window of a production trace replayed through them once per affinity mode.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from sim.cluster import clusters
from sim.experiment import measure
from sim.profiles import MEASURED_PROFILE, engines_of
from sim.stack import Stack, StackError, start_stack
from sim.traces import SAMPLE, TraceRequest, read_window
from sim.workload import RequestPlan, trace_plans

SAMPLE_COUNT = 60
SAMPLE_SPEED = 1.5
SAMPLE_MAX_OUTPUT = 32
"""The default window of :data:`sim.traces.SAMPLE`: its first 60 requests (15 s of the trace, 12k-token
prompts on average, up to 87k), arrivals 1.5 times as fast (the three prefills about 80% busy on
``h200-llama-3-8b``; twice as fast would overrun them), at most 32 output tokens a request (the trace's
own, 360 on average, would be 360 streamed chunks a request through Envoy and Python engines): three
modes in about a minute on 2 cores."""
CPU_TIER_TOKENS = 2_000_000
"""Every engine's CPU KV tier (tokens): what vLLM's native offloading adds to a production engine."""
CLUSTER = "demo"
HANDOFFS = ("kv-transfer-params", "sidecar", "sglang-bootstrap", "vllm-mooncake")
CONNECTORS = {"vllm-mooncake": "mooncake"}
"""The simulated engines' ``kv_connector`` per handoff (``nixl`` for the others)."""


def start_demo_stack(handoff: str = HANDOFFS[0], profile: str = MEASURED_PROFILE) -> Stack:
    """Start the demo's stack: the :data:`CLUSTER` cluster of ``profile``'s engines.

    The engines have a :data:`CPU_TIER_TOKENS` CPU tier and the KV connector ``handoff`` drives."""
    large, small, kv = engines_of(profile, CPU_TIER_TOKENS)
    kv = replace(kv, kv_connector=CONNECTORS.get(handoff, "nixl"))
    return start_stack(clusters(large, small)[CLUSTER], large, kv)


def sample_plans(count: int = SAMPLE_COUNT) -> list[RequestPlan]:
    """The demo's default workload: the first ``count`` requests of the shipped sample.

    ``count`` defaults to :data:`SAMPLE_COUNT`; replayed at :data:`SAMPLE_SPEED`, outputs capped at
    :data:`SAMPLE_MAX_OUTPUT` tokens."""
    return trace_plans(read_window(SAMPLE, None, 0, count), SAMPLE_SPEED, SAMPLE_MAX_OUTPUT)


async def run_demo(
    plans: list[RequestPlan],
    modes: list[str],
    bonus: float,
    handoff: str = HANDOFFS[0],
    profile: str = MEASURED_PROFILE,
) -> dict[str, dict]:
    """Send ``plans`` once per mode through one stack; return the summaries by mode.

    The stack is :func:`start_demo_stack`'s for ``handoff`` and ``profile``."""
    stack = start_demo_stack(handoff, profile)
    results: dict[str, dict] = {}
    try:
        with tqdm(total=len(plans) * len(modes), unit="req", desc="demo", leave=False) as bar:
            for mode in modes:
                bar.set_description(f"affinity {mode}")
                try:
                    results[mode] = await measure(
                        stack, mode, plans, bonus, progress=lambda: bar.update(1), handoff=handoff
                    )
                except StackError as exc:  # a gateway process exited: no table of failed requests
                    raise StackError(f"the {mode} run stopped: {exc}") from None
    finally:
        stack.stop()
    return results


def _trace_window(args: argparse.Namespace) -> list[TraceRequest]:
    """The requests the demo replays: ``--start``/``--count`` of ``--trace`` (default: the whole file),
    or of the shipped sample (default: its first :data:`SAMPLE_COUNT`); raise
    :class:`~sim.traces.TraceError` naming the line or option that is wrong."""
    count = args.count if args.count is not None or args.trace else SAMPLE_COUNT
    return read_window(Path(args.trace or SAMPLE), args.format, args.start or 0, count)


def _window_line(args: argparse.Namespace, window: list[TraceRequest], speed: float, cap: int | None) -> str:
    start = args.start or 0
    prompts = statistics.fmean(r.prompt_tokens for r in window)
    outputs = f", outputs capped at {cap} tokens" if cap is not None else ""
    return (
        f"{len(window)} requests per mode of {Path(args.trace or SAMPLE).name} (requests {start}-"
        f"{start + len(window) - 1}: {round(window[-1].arrival_s, 1):g} s of traffic at {speed:g}x, prompts "
        f"{prompts:,.0f} tokens mean{outputs})"
    )


def replay(args: argparse.Namespace) -> tuple[str, str, dict[str, dict]]:
    """Run the simulated demo for the parsed options of ``pd-extproc demo``.

    ``args`` come from :mod:`demo.cli`; returns what it replays, on which cluster (one line each), and the
    results by mode."""
    window = _trace_window(args)
    speed = args.speed or (1.0 if args.trace else SAMPLE_SPEED)
    cap = args.max_output or (None if args.trace else SAMPLE_MAX_OUTPUT)
    profile = args.profile or MEASURED_PROFILE
    cluster = (
        f"cluster rack-a 2P+3D large, rack-b 1P+2D small, engines {profile}, "
        f"CPU KV tier {CPU_TIER_TOKENS:,} tokens each"
    )
    results = asyncio.run(
        run_demo(trace_plans(window, speed, cap), args.modes, args.bonus, args.handoff, profile)
    )
    return _window_line(args, window, speed, cap), cluster, results
