"""``pd-extproc demo``: the main job on an embedded default cluster.

Starts the simulated PD cluster (two pdGroups of different shapes), pd-extproc and the real
Envoy on free loopback ports, sends the same seeded streaming workload through the gateway with
the OpenAI SDK once per affinity mode, and prints the numbers users judge a PD router by. The
engines are driven with one handoff protocol (default ``kv-transfer-params``, as InferNex's
vllm-ascend + Mooncake deployments use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from sim.cluster import EngineSpec
from sim.config import KvConfig, TimingConfig
from sim.experiment import measure
from sim.report import format_table
from sim.stack import StackError, start_stack
from sim.workload import plan_workload

MODES = ("off", "prefer", "strict")
SIM_REQUESTS = 150
SIM_RATE = 10.0
VLLM_REQUESTS = 40
VLLM_RATE = 1.0
"""Requests per mode and arrivals per second on real engines: a CPU engine decodes tens of tokens a
second, and at the simulator's rate the requests mostly queue."""
HANDOFFS = ("kv-transfer-params", "sidecar", "sglang-bootstrap", "vllm-mooncake")
CONNECTORS = {"vllm-mooncake": "mooncake"}
"""The simulated engines' ``kv_connector`` per handoff (``nixl`` for the others)."""
PROMPT_TOKENS = (512, 4096)
"""Prompt lengths of the demo workload (tokens, uniform): chat with history / RAG sized."""
BIG = TimingConfig()
"""Timing of a large decode engine (the simulator's defaults); the routing benchmark uses it too."""
SMALL = replace(BIG, kv_capacity_tokens=BIG.kv_capacity_tokens // 2, decode_step_ms=16.0, max_batch=32)
"""A smaller, slower decode engine: half the KV cache and batch, 16 ms decode steps."""

DEFAULT_CLUSTER = [
    *(EngineSpec("prefill", "rack-a") for _ in range(2)),
    *(EngineSpec("decode", "rack-a", timing=BIG) for _ in range(3)),
    EngineSpec("prefill", "rack-b"),
    *(EngineSpec("decode", "rack-b", timing=SMALL) for _ in range(2)),
]
"""rack-a: 2 prefill + 3 large decode engines; rack-b: 1 prefill + 2 smaller, slower decodes."""


async def run_demo(
    requests: int, modes: list[str], rate: float, bonus: float, handoff: str = HANDOFFS[0]
) -> dict[str, dict]:
    """Run the workload once per mode on one cluster with ``handoff``; return the summaries by mode."""
    plans = plan_workload(requests, rate, prompt_tokens=PROMPT_TOKENS)
    stack = start_stack(DEFAULT_CLUSTER, kv=KvConfig(kv_connector=CONNECTORS.get(handoff, "nixl")))
    results: dict[str, dict] = {}
    try:
        with tqdm(total=requests * len(modes), unit="req", desc="demo", leave=False) as bar:
            for mode in modes:
                bar.set_description(f"affinity {mode}")
                results[mode] = await measure(
                    stack, mode, plans, bonus, progress=lambda: bar.update(1), handoff=handoff
                )
    finally:
        stack.stop()
    return results


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


async def run_vllm(requests: int, modes: list[str], rate: float, bonus: float) -> dict[str, dict]:
    """:func:`rig.demo.run_vllm_demo` with a progress bar (imported here: ``serve`` and the simulated
    demo never load the real-engine rig)."""
    from rig.demo import run_vllm_demo

    with tqdm(total=requests * len(modes), unit="req", desc="demo on vLLM", leave=False) as bar:
        return await run_vllm_demo(requests, modes, rate, bonus, progress=lambda: bar.update(1))


def _run(args: argparse.Namespace) -> int:
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request would drown the progress bar
        logging.getLogger(noisy).setLevel(logging.WARNING)
    vllm = args.engines == "vllm"
    requests = args.requests or (VLLM_REQUESTS if vllm else SIM_REQUESTS)
    rate = args.rate or (VLLM_RATE if vllm else SIM_RATE)
    if vllm and args.handoff != HANDOFFS[0]:
        print("pd-extproc demo: --engines vllm runs the kv-transfer-params handoff only", file=sys.stderr)
        return 2
    try:
        if vllm:
            results = asyncio.run(run_vllm(requests, args.modes, rate, args.bonus))
        else:
            results = asyncio.run(run_demo(requests, args.modes, rate, args.bonus, args.handoff))
    except StackError as exc:
        print(f"pd-extproc demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pd-extproc demo: interrupted; everything was stopped", file=sys.stderr)
        return 130
    cluster = (
        "real vLLM engines (CPU, tiny Llama, NixlConnector): rack-a 1P+1D, rack-b 1P+1D"
        if vllm
        else "cluster rack-a 2P+3D large, rack-b 1P+2D small"
    )
    print(
        f"\n{requests} streaming requests per mode at {rate:g} req/s through Envoy + pd-extproc "
        f"(bonus {args.bonus:g}, handoff {args.handoff}); {cluster}\n"
    )
    if vllm:
        from rig.demo import COLUMNS_VLLM

        print(format_table(results, COLUMNS_VLLM))
    else:
        print(format_table(results))
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
        "--requests",
        type=_positive_int,
        default=None,
        help=f"requests per mode (default {SIM_REQUESTS}, {VLLM_REQUESTS} with --engines vllm)",
    )
    parser.add_argument(
        "--modes", type=_modes, default=list(MODES), help="comma-separated, default off,prefer,strict"
    )
    parser.add_argument(
        "--rate",
        type=_positive_float,
        default=None,
        help=f"mean arrival rate, requests/s (default {SIM_RATE:g}, {VLLM_RATE:g} with --engines vllm)",
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
