"""``pd-extproc demo``: the main job on an embedded default cluster, on real traffic.

Starts the simulated PD cluster (two pdGroups of different shapes, engines of a measured profile,
:mod:`sim.profiles`, each with a CPU KV tier), pd-extproc and the real Envoy on free loopback ports,
replays a window of a production trace (by default the head of the Mooncake conversation trace
shipped in ``sim/trace_samples/``, sped up, outputs capped; ``--trace FILE``: a file of your own, as
recorded) through the gateway with the OpenAI SDK once per affinity mode, and prints the numbers users
judge a PD router by. The engines are driven with one handoff protocol (default ``kv-transfer-params``,
as InferNex's vllm-ascend + Mooncake deployments use). ``--engines vllm``: real vLLM engines for CPU
instead, with their own workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from sim.demo import HANDOFFS, SAMPLE_COUNT, SAMPLE_MAX_OUTPUT, SAMPLE_SPEED, replay
from sim.profiles import MEASURED_PROFILE, profile_names
from sim.report import better, format_table
from sim.stack import StackError
from sim.traces import TraceError

MODES = ("off", "prefer", "strict")
VLLM_REQUESTS = 40
VLLM_RATE = 1.0
"""Requests per mode and arrivals per second on real engines (their own synthetic workload): a CPU
engine decodes tens of tokens a second, and at 10 requests/s the requests mostly queue."""
SIM_ONLY = ("trace", "format", "start", "count", "speed", "max_output", "profile")
VLLM_ONLY = ("requests", "rate")
"""Options (their argparse ``dest``) of one kind of engines: the simulated demo replays a trace, the
real engines' demo runs its own workload."""
CV_NOTE = (
    "decode load CV (0 = evenly loaded) moves by a tenth or more between runs of this size: one run does "
    "not rank the modes by it"
)
"""Printed under the table: one short run's decode load CV is noisy (docs/getting-started.md, the demo)."""


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


def _given(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d) is not None]


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
            from rig.demo import run_vllm  # only with real engines: the image ships no rig

            kernels, results = asyncio.run(run_vllm(requests, args.modes, rate, args.bonus))
            cluster = (
                f"real vLLM engines (CPU, tiny Llama, NixlConnector; {kernels}): rack-a 1P+1D, rack-b 1P+1D"
            )
        else:
            workload, cluster, results = replay(args)
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
        from rig.demo import COLUMNS_VLLM  # only with real engines: the image ships no rig

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
