"""Flow control with two tenants on a saturated pool: simulated engines behind the real Envoy and pd-extproc.

Two engines (``--max-batch`` sequences each), every request decode-only, the same size (``--prompt-tokens``,
``--output-tokens``), sent open-loop (Poisson) and streamed; the pool's saturation is
``limits.max_inflight_requests`` = the engines' batch slots together. Phases, each a fresh pd-extproc:

1. ``capacity``: a sheddable (``batch``) tenant flooding alone: the completions per second it gets is the
   pool's capacity C (flow control on: beyond the slots, 429 ``shed`` at once).
2. ``alone``: the ``interactive`` tenant alone at 20% of C: its time to first token (TTFT).
3. ``with``: both, the batch tenant at 3 x C: the interactive TTFT against ``alone`` (target: p99 within
   1.3 x), and the batch tenant's completions against what the interactive one leaves (C minus its
   completions; target >= 90%).
4. ``without``: the same two tenants, flow control off and no in-flight limit (every request goes to the
   engines, which queue what they cannot run): the interactive TTFT then.
5. ``fair``: two tenants of one band (``standard``, fairness ids ``a`` and ``b``) flooding at 3 x C and
   1.5 x C: each one's share of the completions (target: within 10% of equal).

``--time-scale`` slows the engines (fewer requests per second for the same load: less of this
machine's CPU goes to the clients, Envoy and pd-extproc, whose own delays then weigh less).
``--reserved`` lists values of ``flow_control.reserved_requests`` (the slots the sheddable tenant leaves
to the interactive one): one ``with`` phase each, ``with r=N``, each judged against the targets.
``--priority`` lists ``O:M`` pairs, one ``prio O:M`` phase each: ``flow_control.engine_priority`` on (the
engines get each request's priority; they run ``--engine-policy`` in every phase: vLLM's ``priority``
by default, or ``priority-preempt``, SGLang's, which also preempts to admit; without priorities in the
bodies either orders by arrival as ``fcfs`` does),
``limits.max_inflight_requests`` = slots + ``O`` + ``M`` and ``reserved_requests`` = ``M``: the batch
tenant may overbook the engines' slots by ``O`` requests, which wait in the engines' queues, and ``M``
in-flight slots stay for the interactive one, which the engines then schedule before every waiting batch
request. TTFTs
are of requests sent after ``--warmup`` seconds; completions per second are of requests ending between
the warmup and the end of the phase.

Run: ``python -m bench.flow_control [--seconds 40] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from bench.common import summary_ms, write_json
from sim.cluster import EngineSpec
from sim.config import DEFAULT_MODEL, SCHEDULING_POLICIES, TimingConfig
from sim.stack import Stack, start_stack

OBJECTIVE = "x-gateway-inference-objective"
FAIRNESS = "x-gateway-inference-fairness-id"


@dataclass(frozen=True)
class Tenant:
    """An open-loop client: ``rate`` requests per second with ``objective`` and fairness id ``name``."""

    name: str
    objective: str
    rate: float


@dataclass
class Seen:
    """What one tenant's requests saw in one phase."""

    sent: int = 0
    ok: int = 0
    ended_in_window: int = 0
    ttft_s: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Shape:
    """The cluster and requests: engine batch slots, request size, phase length and warm-up (seconds)."""

    max_batch: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    warmup: float
    time_scale: float = 1.0

    @property
    def slots(self) -> int:
        """The two engines' batch slots together: the pool's saturation."""
        return 2 * self.max_batch


async def _one(
    session: aiohttp.ClientSession, url: str, tenant: Tenant, shape: Shape, seen: Seen, t0: float
) -> None:
    body = {
        "model": DEFAULT_MODEL,
        "prompt": "token " * shape.prompt_tokens,
        "max_tokens": shape.output_tokens,
        "stream": True,
    }
    headers = {OBJECTIVE: tenant.objective, FAIRNESS: tenant.name}
    started = time.perf_counter()
    first = None
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            status = str(response.status)
            async for line in response.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter()
    except aiohttp.ClientError as exc:
        status = type(exc).__name__
    ended = time.perf_counter()
    seen.statuses[status] = seen.statuses.get(status, 0) + 1
    if status != "200" or first is None:
        return
    seen.ok += 1
    if started - t0 >= shape.warmup:
        seen.ttft_s.append(first - started)
    if shape.warmup <= ended - t0 <= shape.seconds:
        seen.ended_in_window += 1


async def run_phase(url: str, tenants: list[Tenant], shape: Shape, seed: int = 7) -> dict[str, Seen]:
    """Send every tenant's Poisson arrivals for ``shape.seconds``, then wait for the answers."""
    seen = {t.name: Seen() for t in tenants}
    rng = random.Random(seed)
    arrivals = sorted((at, tenant) for tenant in tenants for at in _poisson(rng, tenant.rate, shape.seconds))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=shape.seconds + 120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = []
        for at, tenant in arrivals:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            seen[tenant.name].sent += 1
            tasks.append(asyncio.create_task(_one(session, url, tenant, shape, seen[tenant.name], t0)))
        await asyncio.gather(*tasks)
    return seen


def _poisson(rng: random.Random, rate: float, seconds: float) -> list[float]:
    times, now = [], 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= seconds:
            return times
        times.append(now)


def _row(seen: Seen, shape: Shape) -> dict[str, object]:
    window = shape.seconds - shape.warmup
    return {
        "sent": seen.sent,
        "ok": seen.ok,
        "statuses": dict(sorted(seen.statuses.items())),
        "completions_per_s": seen.ended_in_window / window,
        "ttft": summary_ms(seen.ttft_s),
        "ttft_samples": len(seen.ttft_s),
    }


async def _configure(
    stack: Stack, flow: bool, shape: Shape, reserved: int = 0, overbook: int | None = None
) -> str:
    """Route with flow control (or without); ``overbook`` set: engine priorities on, the in-flight limit
    ``overbook`` + ``reserved`` above the engines' slots."""
    config: dict[str, object] = {"load": {"default_max_tokens": shape.output_tokens}}
    if flow:
        extra = 0 if overbook is None else overbook + reserved
        config["limits"] = {"max_inflight_requests": shape.slots + extra, "retry_after_seconds": 1}
        config["flow_control"] = {
            "enabled": True,
            "max_queued_requests": 4 * shape.slots,
            "max_queue_seconds": 30,
            "reserved_requests": reserved,
            "engine_priority": overbook is not None,
        }
    return await stack.route_with("prefer", pd_threshold_tokens=1_000_000, config=config)


async def run(
    shape: Shape,
    reserved: list[int],
    priority: list[tuple[int, int]] | None = None,
    engine_policy: str = "priority",
) -> dict[str, object]:
    """Every phase on one simulated cluster; the numbers and the targets' verdicts.

    ``priority``: the ``(overbook, reserved)`` of each ``prio`` phase; ``engine_policy``: the engines'
    scheduling policy (:data:`sim.config.SCHEDULING_POLICIES`)."""
    timing = TimingConfig(
        max_batch=shape.max_batch, time_scale=shape.time_scale, scheduling_policy=engine_policy
    )
    stack = start_stack([EngineSpec("both", "a"), EngineSpec("both", "a")], timing)
    phases: dict[str, dict[str, object]] = {}
    try:
        url = await _configure(stack, True, shape)
        step = 0.012 * shape.time_scale  # a decode step's wall seconds, about: the flood is far beyond C
        capacity_rate = 3.0 * shape.slots / (shape.output_tokens * step)
        seen = await run_phase(url, [Tenant("batch", "batch", capacity_rate)], shape)
        phases["capacity"] = {"batch": _row(seen["batch"], shape)}
        capacity = seen["batch"].ended_in_window / (shape.seconds - shape.warmup)
        interactive = Tenant("interactive", "interactive", 0.2 * capacity)
        flood = Tenant("batch", "batch", 3.0 * capacity)
        seen = await run_phase(url, [interactive], shape, seed=8)
        phases["alone"] = {"interactive": _row(seen["interactive"], shape)}
        for value in reserved:
            url = await _configure(stack, True, shape, value)
            seen = await run_phase(url, [interactive, flood], shape, seed=9)
            phases[f"with r={value}"] = {name: _row(s, shape) for name, s in seen.items()}
        for overbook, value in priority or []:
            url = await _configure(stack, True, shape, value, overbook)
            seen = await run_phase(url, [interactive, flood], shape, seed=9)
            phases[f"prio {overbook}:{value}"] = {name: _row(s, shape) for name, s in seen.items()}
        url = await _configure(stack, False, shape)
        seen = await run_phase(url, [interactive, flood], shape, seed=9)
        phases["without"] = {name: _row(s, shape) for name, s in seen.items()}
        url = await _configure(stack, True, shape)
        tenants = [Tenant("a", "standard", 3.0 * capacity), Tenant("b", "standard", 1.5 * capacity)]
        seen = await run_phase(url, tenants, shape, seed=10)
        phases["fair"] = {name: _row(s, shape) for name, s in seen.items()}
    finally:
        stack.stop()
    verdicts = {f"r={value}": verdict(phases, capacity, f"with r={value}") for value in reserved}
    for overbook, value in priority or []:
        name = f"prio {overbook}:{value}"
        verdicts[name] = verdict(phases, capacity, name)
    return {
        "shape": shape.__dict__,
        "engine_policy": engine_policy,
        "capacity_rps": capacity,
        "phases": phases,
        "verdicts": verdicts,
    }


def _p99(phases: dict[str, dict[str, object]], phase: str, tenant: str) -> float:
    return phases[phase][tenant]["ttft"]["p99_ms"]  # type: ignore[index]


def _ttft(phases: dict[str, dict[str, object]], phase: str, which: str) -> float:
    return phases[phase]["interactive"]["ttft"][which]  # type: ignore[index]


def _rps(phases: dict[str, dict[str, object]], phase: str, tenant: str) -> float:
    return phases[phase][tenant]["completions_per_s"]  # type: ignore[index,return-value]


def verdict(phases: dict[str, dict[str, object]], capacity: float, phase: str) -> dict[str, object]:
    """The targets of the ``phase`` with flow control: the ratios, and ``targets_met`` per target.

    - interactive TTFT p99 within 1.3 x alone (p50 shown too);
    - batch >= 90% of what is left;
    - two tenants of one band within 10% of an equal share."""
    ttft_ratio = _p99(phases, phase, "interactive") / _p99(phases, "alone", "interactive")
    p50 = _ttft(phases, phase, "p50_ms") / _ttft(phases, "alone", "p50_ms")
    left = capacity - _rps(phases, phase, "interactive")
    batch_share = _rps(phases, phase, "batch") / left
    a, b = _rps(phases, "fair", "a"), _rps(phases, "fair", "b")
    share_a = a / (a + b)
    return {
        "interactive_ttft_p99_with_vs_alone": ttft_ratio,
        "interactive_ttft_p50_with_vs_alone": p50,
        "interactive_ttft_p99_without_vs_alone": _p99(phases, "without", "interactive")
        / _p99(phases, "alone", "interactive"),
        "batch_of_what_is_left": batch_share,
        "fair_share_a": share_a,
        "targets_met": {
            "ttft_within_1.3x": ttft_ratio <= 1.3,
            "batch_at_least_90pct": batch_share >= 0.9,
            "shares_within_10pct": abs(share_a - 0.5) <= 0.05,
        },
    }


def report(result: dict[str, object]) -> str:
    """The phases as a table, then the verdicts."""
    lines = [
        f"engines' scheduling policy: {result.get('engine_policy', 'fcfs')}",
        f"pool capacity C = {result['capacity_rps']:.1f} completions/s",
        "",
    ]
    lines.append(
        f"{'phase':<11}{'tenant':<13}{'sent':>6}{'ok':>6}{'done/s':>8}{'TTFT p50':>10}{'p99 ms':>9}  statuses"
    )
    for phase, tenants in result["phases"].items():  # type: ignore[union-attr]
        for name, row in tenants.items():
            ttft = row["ttft"]
            lines.append(
                f"{phase:<11}{name:<13}{row['sent']:>6}{row['ok']:>6}{row['completions_per_s']:>8.1f}"
                f"{ttft['p50_ms']:>10.1f}{ttft['p99_ms']:>9.1f}  {json.dumps(row['statuses'])}"
            )
    lines.append("")
    lines.append(json.dumps(result["verdicts"], indent=2))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the report (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds left out of each phase's numbers")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences each of the two engines runs")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="engines' wall seconds per model second"
    )
    parser.add_argument(
        "--reserved", default="0", help="flow_control.reserved_requests of the 'with' phases, comma-separated"
    )
    parser.add_argument(
        "--priority",
        default="",
        help="overbook:reserved pairs of the 'prio' phases (engine priorities on), comma-separated",
    )
    parser.add_argument(
        "--engine-policy",
        default="priority",
        choices=[policy for policy in SCHEDULING_POLICIES if policy != "fcfs"],
        help="the engines' scheduling policy (default %(default)s: vLLM's)",
    )
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    shape = Shape(
        args.max_batch, args.prompt_tokens, args.output_tokens, args.seconds, args.warmup, args.time_scale
    )
    pairs = [tuple(int(n) for n in pair.split(":")) for pair in args.priority.split(",") if pair]
    priority = [(pair[0], pair[1]) for pair in pairs]
    reserved = [int(value) for value in args.reserved.split(",")]
    result = asyncio.run(run(shape, reserved, priority, args.engine_policy))
    print(report(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
