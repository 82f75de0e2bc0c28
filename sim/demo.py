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


def _run(args: argparse.Namespace) -> int:
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request would drown the progress bar
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        results = asyncio.run(run_demo(args.requests, args.modes, args.rate, args.bonus, args.handoff))
    except StackError as exc:
        print(f"pd-extproc demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pd-extproc demo: interrupted; everything was stopped", file=sys.stderr)
        return 130
    print(
        f"\n{args.requests} streaming requests per mode at {args.rate:g} req/s through Envoy + pd-extproc "
        f"(bonus {args.bonus:g}, handoff {args.handoff}); cluster rack-a 2P+3D large, rack-b 1P+2D small\n"
    )
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
        "--requests", type=_positive_int, default=150, help="requests per mode (default %(default)s)"
    )
    parser.add_argument(
        "--modes", type=_modes, default=list(MODES), help="comma-separated, default off,prefer,strict"
    )
    parser.add_argument(
        "--rate",
        type=_positive_float,
        default=10.0,
        help="mean arrival rate, requests/s (default %(default)s)",
    )
    parser.add_argument("--bonus", type=_bonus, default=0.3, help="prefer-mode bonus (default %(default)s)")
    parser.add_argument(
        "--handoff",
        choices=HANDOFFS,
        default=HANDOFFS[0],
        help="how the engines receive the prefill (default %(default)s)",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.set_defaults(func=_run)
