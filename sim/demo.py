"""``pd-extproc demo``: the main job on an embedded default cluster, on real traffic.

Starts the simulated PD cluster (two pdGroups of different shapes, engines of a measured profile,
:mod:`sim.profiles`, each with a CPU KV tier), pd-extproc and the real Envoy on free loopback ports,
replays a window of a production trace (by default the head of the Mooncake conversation trace
shipped in ``sim/trace_samples/``, sped up, outputs capped; ``--trace FILE``: a file of your own, as
recorded) through the gateway with the OpenAI SDK once per affinity mode, and prints the numbers users
judge a PD router by. The engines are driven with one handoff protocol (default ``kv-transfer-params``,
as InferNex's vllm-ascend + Mooncake deployments use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from sim.cluster import clusters
from sim.experiment import measure
from sim.profiles import MEASURED_PROFILE, engines_of, profile_names
from sim.report import better, format_table
from sim.stack import Stack, StackError, start_stack
from sim.traces import SAMPLE, TraceError, TraceRequest, read_window
from sim.workload import RequestPlan, trace_plans

MODES = ("off", "prefer", "strict")
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
VLLM_REQUESTS = 40
VLLM_RATE = 1.0
"""Requests per mode and arrivals per second on real engines (their own synthetic workload): a CPU
engine decodes tens of tokens a second, and at 10 requests/s the requests mostly queue."""
HANDOFFS = ("kv-transfer-params", "sidecar", "sglang-bootstrap", "vllm-mooncake")
CONNECTORS = {"vllm-mooncake": "mooncake"}
"""The simulated engines' ``kv_connector`` per handoff (``nixl`` for the others)."""
SIM_ONLY = ("trace", "format", "start", "count", "speed", "max_output", "profile")
VLLM_ONLY = ("requests", "rate")
"""Options (their argparse ``dest``) of one kind of engines: the simulated demo replays a trace, the
real engines' demo runs its own workload."""
CV_NOTE = (
    "decode load CV (0 = evenly loaded) moves by a tenth or more between runs of this size: one run does "
    "not rank the modes by it"
)
"""Printed under the table: one short run's decode load CV is noisy (docs/getting-started.md, the demo)."""


def start_demo_stack(handoff: str = HANDOFFS[0], profile: str = MEASURED_PROFILE) -> Stack:
    """The demo's stack: the :data:`CLUSTER` cluster, its engines of ``profile``'s costs with a
    :data:`CPU_TIER_TOKENS` CPU tier, their KV connector the one ``handoff`` drives."""
    large, small, kv = engines_of(profile, CPU_TIER_TOKENS)
    kv = replace(kv, kv_connector=CONNECTORS.get(handoff, "nixl"))
    return start_stack(clusters(large, small)[CLUSTER], large, kv)


def sample_plans(count: int = SAMPLE_COUNT) -> list[RequestPlan]:
    """The demo's default workload: the first ``count`` requests of the shipped sample (by default
    :data:`SAMPLE_COUNT`) at :data:`SAMPLE_SPEED`, outputs capped at :data:`SAMPLE_MAX_OUTPUT` tokens."""
    return trace_plans(read_window(SAMPLE, None, 0, count), SAMPLE_SPEED, SAMPLE_MAX_OUTPUT)


async def run_demo(
    plans: list[RequestPlan],
    modes: list[str],
    bonus: float,
    handoff: str = HANDOFFS[0],
    profile: str = MEASURED_PROFILE,
) -> dict[str, dict]:
    """Send ``plans`` once per mode through one stack (:func:`start_demo_stack`); return the summaries
    by mode."""
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


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes must be a comma-separated subset of {','.join(MODES)}")
    return modes


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _bonus(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


async def run_vllm(requests: int, modes: list[str], rate: float, bonus: float) -> tuple[str, dict[str, dict]]:
    """:func:`rig.demo.run_vllm_demo` (the engines' dtype and attention kernels, the results) with a
    progress bar (imported here: ``serve`` and the simulated demo never load the real-engine rig)."""
    from rig.demo import run_vllm_demo

    with tqdm(total=requests * len(modes), unit="req", desc="demo on vLLM", leave=False) as bar:
        return await run_vllm_demo(requests, modes, rate, bonus, progress=lambda: bar.update(1))


def _given(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d) is not None]


def _window_line(args: argparse.Namespace, window: list[TraceRequest], speed: float, cap: int | None) -> str:
    start = args.start or 0
    prompts = statistics.fmean(r.prompt_tokens for r in window)
    outputs = f", outputs capped at {cap} tokens" if cap is not None else ""
    return (
        f"{len(window)} requests per mode of {Path(args.trace or SAMPLE).name} (requests {start}-"
        f"{start + len(window) - 1}: {round(window[-1].arrival_s, 1):g} s of traffic at {speed:g}x, prompts "
        f"{prompts:,.0f} tokens mean{outputs})"
    )


def _replay(args: argparse.Namespace) -> tuple[str, str, dict[str, dict]]:
    """The simulated demo: what it replays, on which cluster (one line each), and the results."""
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


def _run(args: argparse.Namespace) -> int:
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request would drown the progress bar
        logging.getLogger(noisy).setLevel(logging.WARNING)
    vllm = args.engines == "vllm"
    wrong = _given(args, SIM_ONLY if vllm else VLLM_ONLY)
    if wrong:
        runs = "its own workload" if vllm else "a trace (--count, --speed)"
        print(
            f"pd-extproc demo: {', '.join(wrong)}: the demo on --engines {args.engines} runs {runs}",
            file=sys.stderr,
        )
        return 2
    if vllm and args.handoff != HANDOFFS[0]:
        print("pd-extproc demo: --engines vllm runs the kv-transfer-params handoff only", file=sys.stderr)
        return 2
    try:
        if vllm:
            requests, rate = args.requests or VLLM_REQUESTS, args.rate or VLLM_RATE
            workload = f"{requests} streaming requests per mode at {rate:g} req/s"
            kernels, results = asyncio.run(run_vllm(requests, args.modes, rate, args.bonus))
            cluster = (
                f"real vLLM engines (CPU, tiny Llama, NixlConnector; {kernels}): rack-a 1P+1D, rack-b 1P+1D"
            )
        else:
            workload, cluster, results = _replay(args)
    except TraceError as exc:
        print(f"pd-extproc demo: {exc}", file=sys.stderr)
        return 2
    except StackError as exc:
        print(f"pd-extproc demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pd-extproc demo: interrupted; everything was stopped", file=sys.stderr)
        return 130
    print(
        f"\n{workload} through Envoy + pd-extproc (bonus {args.bonus:g}, handoff {args.handoff}); {cluster}\n"
    )
    if vllm:
        from rig.demo import COLUMNS_VLLM

        print(format_table(results, COLUMNS_VLLM))
        print(f"\n{better(COLUMNS_VLLM)}\n{CV_NOTE}")
    else:
        print(format_table(results))
        print(f"\n{better()}\n{CV_NOTE}")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
        except OSError as exc:
            print(f"pd-extproc demo: cannot write {args.json}: {exc}", file=sys.stderr)
            return 1
        print(f"\nresults written to {args.json}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo", help="compare affinity modes on a simulated PD cluster", description=__doc__
    )
    parser.add_argument(
        "--trace",
        help="replay this trace file, as recorded unless --speed/--max-output say otherwise (default: "
        f"the shipped Mooncake conversation sample, its first {SAMPLE_COUNT} requests at "
        f"{SAMPLE_SPEED:g}x, outputs capped at {SAMPLE_MAX_OUTPUT} tokens)",
    )
    parser.add_argument("--format", help="mooncake or azure (default: by suffix, .csv is azure)")
    parser.add_argument("--start", type=_count, default=None, help="first request of the window, 0-based")
    parser.add_argument(
        "--count", type=_positive_int, default=None, help="requests in the window (default: to the end)"
    )
    parser.add_argument("--speed", type=_positive_float, default=None, help="arrivals this many times faster")
    parser.add_argument(
        "--max-output", type=_positive_int, default=None, help="cap every request's output tokens"
    )
    parser.add_argument(
        "--profile",
        choices=profile_names(),
        default=None,
        help=f"the simulated engines' costs (default {MEASURED_PROFILE}, measured on an H200)",
    )
    parser.add_argument(
        "--requests",
        type=_positive_int,
        default=None,
        help=f"with --engines vllm: requests per mode (default {VLLM_REQUESTS})",
    )
    parser.add_argument(
        "--modes", type=_modes, default=list(MODES), help="comma-separated, default off,prefer,strict"
    )
    parser.add_argument(
        "--rate",
        type=_positive_float,
        default=None,
        help=f"with --engines vllm: mean arrival rate, requests/s (default {VLLM_RATE:g})",
    )
    parser.add_argument("--bonus", type=_bonus, default=0.3, help="prefer-mode bonus (default %(default)s)")
    parser.add_argument(
        "--handoff",
        choices=HANDOFFS,
        default=HANDOFFS[0],
        help="how the engines receive the prefill (default %(default)s)",
    )
    parser.add_argument(
        "--engines",
        choices=("sim", "vllm"),
        default="sim",
        help="simulated engines (default), or real vLLM engines for CPU: needs `make vllm-env` and "
        "about 10.5 GiB of free memory",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.set_defaults(func=_run)
