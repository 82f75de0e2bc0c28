"""Replay a production trace through pd-extproc's routing and the peers' rules on simulated engines.

Reads a window of a trace (:mod:`sim.traces`: Mooncake JSON lines or the Azure CSV), synthesises each
prompt from its block hash ids (identical ids, identical text; exactly its prompt tokens by the
gateway's estimate), and replays it in virtual time (:mod:`sim.virtual`), once per setting: every
request arrives at its trace time (divided by ``--speed``; ``--spread``: the requests sharing a stamp
spread evenly up to the next one, :func:`sim.traces.spread`), is placed by the setting's router (the
shipped ``Router`` for pd-extproc's settings; :mod:`bench.prefix_peers` for the peers' rules, NVIDIA
Dynamo's KV router cost and the oracle), prefilled, its KV pulled by its decode and decoded, on engines
of a named profile (:mod:`sim.profiles`, measured on a GPU by default), each with an optional CPU KV
tier. Settings are :mod:`bench.prefix_routing`'s (its replica settings ``x2``, ``x4``, its suffix
``scraped``: every replica with the engine load signal, ``engine_metrics`` at its defaults, the
simulated engines' ``/metrics`` pages read in process at virtual time, ``norecent``: the
``kv-events`` source without each replica's overlay of its own recent placements, and ``shared``: the
replicas sharing their bookings and placements over the real ``shared_state`` seam with a sync delay of
``--sync-delay-ms``, and with ``--decision-slot-ms`` their decision slots, :mod:`bench.shared_replicas`),
``pair:auto+prefix tier`` (the same, its endpoints declaring their KV capacity plus their CPU tier's:
the prefix index then remembers what the tier holds, and the load is weighed by that capacity too) and
``dynamo``; clusters its ``demo`` and ``three-group``, built from the profile (small decodes: half the
KV cache and batch, a third longer fixed decode step).

Per setting: TTFT p50/p90/p99, decode TTFT p99, TPOT p99 (ms), prefix hit rate by tier (engine truth:
prompt tokens the prefill found in its KV cache, in its CPU tier), prompt tokens computed (millions),
cross-group share and GB, decode load CV, router µs per request (p50 and mean; the ``kv-events``
settings' tokenizer stand-in apart, its p50 ``tok µs``: :class:`bench.prefix_routing.Record`),
throughput (requests and output tokens per model second) and errors (a ``shared`` setting: also the KB
its replicas published per request, the messages dropped, and the p50 and mean of the requests' wait
for their replica's decision slot); plus the window's reuse bound
(the share of prompt tokens an infinite cache would hold), and the issue's targets for pd-extproc's
best setting (:func:`verdicts`). With several ``--start`` windows, each window's table, then the
medians over them.
``--json`` writes ``{"trace", "window", "settings": {NAME: {METRIC: value}}, "bound", "verdicts"}``
(several windows: ``window`` a list, ``settings`` and ``bound`` the medians, ``windows`` each one's),
``--png`` the TTFT CDFs per setting (one file a window).

Run: ``python -m bench.trace_replay TRACE [--format mooncake|azure] [--start N[,N...]] [--count N] [--speed X]
[--max-output N] [--spread] [--cluster NAME] [--profile NAME] [--cpu-tier TOKENS] [--kv-tokens N]
[--settings a,b,...] [--sync-delay-ms MS[,MS...]] [--decision-slot-ms MS[,MS...]] [--json OUT]
[--png OUT]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import write_json
from bench.prefix_peers import DynamoKvRouter, Endpoint
from bench.prefix_routing import CLUSTERS, SHARED_SETTINGS, Record, Router, Serve, run_cluster, summarize
from bench.prefix_routing import METRICS as ROUTING_METRICS
from bench.prefix_routing import SETTINGS as ROUTING_SETTINGS
from bench.shared_replicas import DEFAULT_SYNC_DELAY_SECONDS, SharedReplicas
from ext_proc.affinity import AutoModel
from sim.cluster import clusters
from sim.config import DEFAULT_MODEL
from sim.engine import Engine, EngineError
from sim.profiles import MEASURED_PROFILE, engines_of, profile_names
from sim.report import format_table
from sim.traces import (
    FORMATS,
    TraceError,
    TraceRequest,
    output_budget,
    prompt_text,
    read_window,
    reuse_bound,
    spread,
)
from sim.virtual import VirtualClock, new_loop

DEFAULT_COUNT = 1200
NEW = "pair:auto+prefix"


def _with_tier(endpoints: list[Endpoint], engines: dict[str, Engine]) -> list[Endpoint]:
    """``endpoints`` declaring their KV capacity plus their CPU tier's."""
    tiers = {a: e.config.timing.cpu_kv_capacity_tokens for a, e in engines.items()}
    return [e._replace(capacity=e.capacity + tiers[e.address]) for e in endpoints]


SETTINGS: dict[str, Router] = {
    **ROUTING_SETTINGS,
    f"{NEW} tier": lambda endpoints, engines, model: ROUTING_SETTINGS[NEW](
        _with_tier(endpoints, engines), engines, model
    ),
    "dynamo": lambda endpoints, engines, _: DynamoKvRouter(endpoints, engines),
}


@dataclass(frozen=True)
class Replay:
    """What one replay runs: the window's requests, the cluster and the engines' settings.

    Also their output cap, the arrival speed-up, the engines' profile, CPU tier (tokens, 0: none), KV cache
    (tokens of the large engines; ``None``: the profile's) and the ` shared` settings' sync delay (seconds)
    and decision slot (``shared_state.decision_slot_ms``; 0: off).
    Every engine caches prefixes."""

    requests: list[TraceRequest]
    max_output: int | None
    speed: float
    cluster: str
    profile: str
    cpu_tier_tokens: int
    kv_tokens: int | None = None
    sync_delay_s: float = DEFAULT_SYNC_DELAY_SECONDS
    decision_slot_ms: float = 0.0


def run_setting(replay: Replay, setting: str) -> tuple[list[Record], dict]:
    """One setting over the window in virtual time on a fresh event loop: the records and the summary.

    A ` shared` setting's replicas share their state with ``replay.sync_delay_s``; its summary adds what
    they published (KB per request, each message reaching every peer) and dropped (messages), and the
    requests' wait for their replica's decision slot (p50 and mean, ms)."""
    large, small, kv = engines_of(replay.profile, replay.cpu_tier_tokens, replay.kv_tokens)
    specs = clusters(large, small)[replay.cluster]
    errors = 0
    made: list[object] = []

    def router_of(endpoints: list[Endpoint], engines: dict[str, Engine], model: AutoModel) -> object:
        of = SETTINGS[setting]
        if setting in SHARED_SETTINGS:
            of = SHARED_SETTINGS[setting](replay.sync_delay_s, replay.decision_slot_ms)
        made.append(of(endpoints, engines, model))
        return made[-1]

    async def send(serve: Serve, clock: VirtualClock, index: int, request: TraceRequest) -> None:
        nonlocal errors
        await clock.sleep(request.arrival_s / replay.speed - clock.now())
        body = {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": prompt_text(request, index)}],
            "max_tokens": output_budget(request, replay.max_output),
        }
        try:
            await serve(body)
        except (EngineError, ValueError):
            errors += 1

    async def drive(serve: Serve, clock: VirtualClock) -> None:
        await asyncio.gather(*(send(serve, clock, i, r) for i, r in enumerate(replay.requests)))

    loop = new_loop()
    try:
        records, capacities = loop.run_until_complete(run_cluster(specs, router_of, large, kv, drive))
    finally:
        loop.close()
    row = summarize(records, capacities, kv.kv_bytes_per_token) if records else {"requests": 0}
    duration = row.get("duration_s") or float("nan")
    row.update(
        hbm_hit_rate=row.get("hit_rate", 0.0) - row.get("cpu_hit_rate", 0.0),
        router_us_mean=statistics.fmean(r.router_us for r in records) if records else float("nan"),
        throughput_rps=len(records) / duration,
        output_tps=sum(r.generated for r in records) / duration,
        errors=errors,
    )
    if isinstance(made[0], SharedReplicas):
        sharing = made[0].totals()
        row.update(
            sync_kb_per_request=sharing.sent_bytes / 1e3 / max(1, len(records)),
            sync_dropped=sum(sharing.dropped.values()),
            slot_wait_p50_ms=statistics.median(made[0].waits) * 1e3,
            slot_wait_mean_ms=statistics.fmean(made[0].waits) * 1e3,
        )
    return records, row


METRICS = (
    ROUTING_METRICS[0],
    ("hbm_hit_rate", "HBM", "{:.1%}"),
    ("cpu_hit_rate", "CPU", "{:.1%}"),
    *ROUTING_METRICS[1:],
    ("router_us_mean", "µs mean", "{:.0f}"),
    ("tokenize_us_p50", "tok µs", "{:.0f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("output_tps", "out tok/s", "{:.0f}"),
    ("errors", "errors", "{}"),
    ("sync_kb_per_request", "sync KB/req", "{:.1f}"),
    ("sync_dropped", "sync drops", "{}"),
    ("slot_wait_p50_ms", "slot wait p50", "{:.1f}"),
    ("slot_wait_mean_ms", "mean", "{:.1f}"),
)


def _plot(ttfts: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab20").colors
    for index, (setting, values) in enumerate(ttfts.items()):
        ordered = sorted(values)
        style = "--" if setting in PEERS else ":" if _is_oracle(setting) else "-"
        if ordered:
            shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.plot(ordered, shares, style, color=colours[index % len(colours)], label=setting)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, model time)")
    ax.set_ylabel("share of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", help="the trace file")
    parser.add_argument("--format", help=f"{' or '.join(FORMATS)} (default: by suffix, .csv is azure)")
    parser.add_argument(
        "--start",
        type=_starts,
        default=[0],
        help="first request of the window, 0-based (default 0); several, comma-separated: one window "
        "each, and the medians over them",
    )
    parser.add_argument(
        "--count", type=int, default=DEFAULT_COUNT, help="requests in the window (default %(default)s)"
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="arrivals this many times faster (default 1)"
    )
    parser.add_argument("--max-output", type=int, help="cap every request's output tokens")
    parser.add_argument(
        "--spread",
        action="store_true",
        help="spread the requests that share a timestamp evenly up to the next one (sim.traces.spread)",
    )
    parser.add_argument("--cluster", default="demo", help="demo or three-group (default %(default)s)")
    parser.add_argument("--profile", default=MEASURED_PROFILE, help="engine profile (default %(default)s)")
    parser.add_argument(
        "--cpu-tier", type=int, default=0, help="CPU KV tier of every engine, tokens (default 0: none)"
    )
    parser.add_argument(
        "--kv-tokens", type=int, help="KV cache of the large engines, tokens (default: the profile's)"
    )
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset")
    parser.add_argument(
        "--sync-delay-ms",
        type=_milliseconds("--sync-delay-ms", 60_000),
        default=[DEFAULT_SYNC_DELAY_SECONDS * 1e3],
        help="the ` shared` settings' sync delay, ms (default 2); several, comma-separated: each shared "
        "setting once per delay, its rows named 'SETTING Dms'",
    )
    parser.add_argument(
        "--decision-slot-ms",
        type=_milliseconds("--decision-slot-ms", 50),
        default=[0.0],
        help="the ` shared` settings' decision slot, ms (shared_state.decision_slot_ms; default 0: off); "
        "several, comma-separated: each shared setting once per slot (and delay), rows 'SETTING slot Sms'",
    )
    parser.add_argument(
        "--stack",
        action="store_true",
        help="replay through the real Envoy + pd-extproc serve + simulated engines over HTTP, wall clock "
        f"(pd-extproc's settings only: {', '.join(STACK_SETTINGS)})",
    )
    parser.add_argument("--json", help="write the window, the settings' numbers and the bound as JSON")
    parser.add_argument("--png", help="write the TTFT CDFs per setting (needs matplotlib)")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The settings asked for; exit with one line naming the option that is wrong."""
    settings = [n for n in args.settings.split(",") if n]
    unknown = [n for n in settings if n not in SETTINGS]
    if unknown or not settings:
        parser.error(
            f"--settings: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SETTINGS)}"
        )
    if args.cluster not in CLUSTERS:
        parser.error(f"--cluster: unknown cluster {args.cluster!r}; choose from {', '.join(CLUSTERS)}")
    if args.profile not in profile_names():
        parser.error(f"--profile: unknown profile {args.profile!r}; choose from {', '.join(profile_names())}")
    if args.stack:
        virtual_only = [n for n in settings if n not in STACK_SETTINGS]
        if virtual_only and args.settings != ",".join(SETTINGS):
            parser.error(f"--stack: {', '.join(virtual_only)} run in virtual time only")
        settings = [n for n in settings if n in STACK_SETTINGS]
    if not args.speed > 0:
        parser.error("--speed must be > 0")
    if args.max_output is not None and args.max_output < 1:
        parser.error("--max-output must be >= 1")
    if args.cpu_tier < 0:
        parser.error("--cpu-tier must be >= 0")
    if args.kv_tokens is not None and args.kv_tokens < 1:
        parser.error("--kv-tokens must be >= 1")
    return settings


PEERS = ("sglang", "llm-d", "dynamo")
"""The peers' rules; every setting but these and the oracle's (:func:`_is_oracle`) is pd-extproc's."""


def _is_oracle(setting: str) -> bool:
    """Whether ``setting`` is the oracle (``oracle``, its replicas ``oracle x4``, ``scraped`` or not)."""
    return setting.split(" ", 1)[0] == "oracle"


def medians(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Per setting, each numeric metric's median over the windows' ``runs`` (``None`` values left out)."""
    out: dict[str, dict] = {}
    for setting in runs[0]:
        keys = [k for k, v in runs[0][setting].items() if v is None or isinstance(v, int | float)]
        values = {k: [r[setting][k] for r in runs if r[setting].get(k) is not None] for k in keys}
        out[setting] = {k: statistics.median(v) if v else None for k, v in values.items()}
    return out


def verdicts(rows: dict[str, dict], bound: float) -> list[dict]:
    """The issue's targets judged on ``rows``: pd-extproc's best setting against the peers.

    ``rows``: one window's numbers, or medians over windows. pd-extproc's best setting (its least TTFT p90)
    against the best peer rule (least TTFT p90; least dTTFT p99 for that target), ``off`` and the oracle; its
    hit rate against ``bound``. Only what ``rows`` holds is judged."""
    ours = [
        s for s in rows if s not in PEERS and not _is_oracle(s) and rows[s].get("ttft_p90_ms") is not None
    ]
    peers = [s for s in PEERS if s in rows]
    if not ours:
        return []
    best = min(ours, key=lambda s: rows[s]["ttft_p90_ms"])
    row = rows[best]
    out = []

    def add(target: str, value: float, met: bool) -> None:
        out.append({"target": f"{best}: {target}", "value": value, "met": met})

    if peers:
        peer = min(peers, key=lambda s: rows[s]["ttft_p90_ms"])
        value = row["ttft_p90_ms"] / rows[peer]["ttft_p90_ms"]
        add(f"TTFT p90 / best peer's ({peer}) <= 0.8", value, value <= 0.8)
        peer = min(peers, key=lambda s: rows[s]["dttft_p99_ms"])
        value = row["dttft_p99_ms"] / rows[peer]["dttft_p99_ms"]
        add(f"decode TTFT p99 / best peer's ({peer}) <= 0.25", value, value <= 0.25)
    add("cross-group share <= 2%", row["cross_group_share"], row["cross_group_share"] <= 0.02)
    if "off" in rows and rows["off"].get("decode_load_cv"):
        value = row["decode_load_cv"] / rows["off"]["decode_load_cv"]
        add("decode load CV / off's <= 1.2", value, value <= 1.2)
    if "oracle" in rows:
        gap = row["hit_rate"] - rows["oracle"]["hit_rate"]
        add("hit rate - oracle's >= -2 points", gap, gap >= -0.02)
    if bound > 0:
        value = row["hit_rate"] / bound
        add("hit rate / the window's reuse bound >= 0.7", value, value >= 0.7)
    return out


def _replay_window(
    args: argparse.Namespace, settings: list[str], start: int, requests: list[TraceRequest]
) -> dict:
    """One window, ``requests`` from ``start``: its table printed, its numbers (``window``, ``settings``,
    ``bound``) returned."""
    replay = Replay(
        requests, args.max_output, args.speed, args.cluster, args.profile, args.cpu_tier, args.kv_tokens
    )
    window = {
        "start": start,
        "count": len(requests),
        "speed": args.speed,
        "max_output": args.max_output,
        "trace_span_s": requests[-1].arrival_s,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in requests),
    }
    bound = {"hit_rate": reuse_bound(requests)}
    rows: dict[str, dict] = {}
    ttfts: dict[str, list[float]] = {}
    for name, setting, delay, slot in runs_of(settings, args.sync_delay_ms, args.decision_slot_ms):
        started = time.perf_counter()
        records, rows[name] = run_setting(replace(replay, sync_delay_s=delay, decision_slot_ms=slot), setting)
        ttfts[name] = [(r.first_token - r.arrival) * 1e3 for r in records]
        print(f"  {start} {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    title = (
        f"{args.trace} requests {start}-{start + len(requests) - 1}, cluster {args.cluster}, "
        f"profile {args.profile}, CPU tier {args.cpu_tier} tokens{', arrivals spread' if args.spread else ''}"
    )
    print(f"\n{title}\nreuse bound (infinite cache): {bound['hit_rate']:.1%} of prompt tokens")
    print(format_table(rows, METRICS))
    if args.png:
        png = Path(args.png)
        _plot(ttfts, str(png if start == args.start[0] else png.with_stem(f"{png.stem}-{start}")), title)
    return {"window": window, "settings": rows, "bound": bound}


STACK_SETTINGS: dict[str, tuple[str, bool]] = {
    name: (name.removeprefix("pair:").removesuffix("+prefix"), name.endswith("+prefix"))
    for name in SETTINGS
    if name.startswith("pair:") and " " not in name
}
"""The settings ``--stack`` runs: the shipped router's mode and whether its prefix index is on."""
STACK_HANDOFF = "kv-transfer-params"
STACK_METRICS = (
    ("ttft_p50_ms", "TTFT p50", "{:.0f}"),
    ("ttft_p90_ms", "p90", "{:.0f}"),
    ("ttft_p99_ms", "p99", "{:.0f}"),
    ("decode_ttft_p99_ms", "dTTFT p99", "{:.0f}"),
    ("tpot_p99_ms", "TPOT p99", "{:.1f}"),
    ("cross_group_share", "cross", "{:.1%}"),
    ("decode_load_cv", "load CV", "{:.3f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("errors", "errors", "{}"),
)


def _stack_window(
    args: argparse.Namespace, settings: list[str], start: int, requests: list[TraceRequest]
) -> dict:
    """One window, ``requests`` from ``start``, through Envoy, ``pd-extproc serve`` and simulated engines
    over HTTP (wall clock, one model second a second), each setting in turn on the same cluster; its
    table printed, its numbers (``window``, ``settings`` as :func:`sim.report.summarize` gives them,
    ``bound``) returned."""
    from sim.experiment import measure
    from sim.stack import start_stack
    from sim.workload import trace_plans

    plans = trace_plans(requests, args.speed, args.max_output)
    large, small, kv = engines_of(args.profile, args.cpu_tier, args.kv_tokens)
    stack = start_stack(clusters(large, small)[args.cluster], large, kv)
    rows: dict[str, dict] = {}
    try:
        for setting in settings:
            mode, prefix = STACK_SETTINGS[setting]
            started = time.perf_counter()
            rows[setting] = asyncio.run(
                measure(
                    stack,
                    mode,
                    plans,
                    handoff=STACK_HANDOFF,
                    config={"affinity": {"prefix": {"enabled": prefix}}},
                )
            )
            print(
                f"  {start} {setting} (stack): {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stack.stop()
    where = f"requests {start}-{start + len(requests) - 1} through the stack"
    print(f"\n{args.trace} {where}, cluster {args.cluster}, profile {args.profile}")
    print(format_table(rows, STACK_METRICS))
    window = {"start": start, "count": len(requests), "speed": args.speed, "max_output": args.max_output}
    return {"window": window, "settings": rows, "bound": {"hit_rate": reuse_bound(requests)}}


def _milliseconds(flag: str, high: float) -> Callable[[str], list[float]]:
    """The parser of ``flag``: milliseconds separated by commas, each in ``[0, high]``."""

    def parse(text: str) -> list[float]:
        try:
            values = [float(n) for n in text.split(",") if n.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be milliseconds separated by commas") from None
        if not values or any(not 0 <= v <= high for v in values):
            raise argparse.ArgumentTypeError(f"{flag} must name values in [0, {high:g}] ms")
        return values

    return parse


def runs_of(
    settings: list[str], delays_ms: list[float], slots_ms: Sequence[float] = (0.0,)
) -> list[tuple[str, str, float, float]]:
    """``(row name, setting, sync delay in seconds, decision slot in ms)`` per run.

    A ` shared` setting once per delay and slot (named ``SETTING Dms`` when there are several delays,
    ``… slot Sms`` when there are several slots or the one is not 0), every other setting once."""
    out = []
    for setting in settings:
        if setting not in SHARED_SETTINGS:
            out.append((setting, setting, DEFAULT_SYNC_DELAY_SECONDS, 0.0))
            continue
        for d in delays_ms:
            named = setting if len(delays_ms) == 1 else f"{setting} {d:g}ms"
            for slot in slots_ms:
                shown = f"{named} slot {slot:g}ms" if len(slots_ms) > 1 or slot else named
                out.append((shown, setting, d / 1e3, slot))
    return out


def _starts(text: str) -> list[int]:
    try:
        starts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("--start must be request numbers separated by commas") from None
    if not starts:
        raise argparse.ArgumentTypeError("--start must name at least one request")
    return starts


def main(argv: list[str] | None = None) -> int:
    """Run the replay from the command line ``argv``; print the tables (and write JSON when asked)."""
    parser = _parser()
    args = parser.parse_args(argv)
    settings = _check(parser, args)
    replay_window = _stack_window if args.stack else _replay_window
    try:  # every window read before any runs: one past the end stops the replay at once
        windows = [read_window(Path(args.trace), args.format, start, args.count) for start in args.start]
        if args.spread:
            windows = [spread(requests) for requests in windows]
    except TraceError as exc:
        print(f"trace_replay: {exc}", file=sys.stderr)
        return 2
    runs = [replay_window(args, settings, start, w) for start, w in zip(args.start, windows, strict=True)]
    if len(runs) == 1:
        window, rows, bound = runs[0]["window"], runs[0]["settings"], runs[0]["bound"]
    else:
        window = [run["window"] for run in runs]
        rows = medians([run["settings"] for run in runs])
        bound = {"hit_rate": statistics.median(run["bound"]["hit_rate"] for run in runs)}
        print(f"\nmedians over the windows starting at {', '.join(map(str, args.start))}")
        print(f"reuse bound (infinite cache), median: {bound['hit_rate']:.1%} of prompt tokens")
        print(format_table(rows, STACK_METRICS if args.stack else METRICS))
    judged = [] if args.stack else verdicts(rows, bound["hit_rate"])
    if judged:
        print("\ntargets" + (" (medians over the windows)" if len(runs) > 1 else "") + ":")
        for v in judged:
            print(f"  {'met    ' if v['met'] else 'NOT met'}  {v['target']}: {v['value']:.3f}")
    write_json(
        args.json,
        {
            "trace": args.trace,
            "window": window,
            "cluster": args.cluster,
            "profile": args.profile,
            "cpu_tier_tokens": args.cpu_tier,
            "kv_tokens": args.kv_tokens,
            "sync_delay_ms": args.sync_delay_ms,
            "decision_slot_ms": args.decision_slot_ms,
            "spread": args.spread,
            "settings": rows,
            "bound": bound,
            "verdicts": judged,
            **({"windows": runs} if len(runs) > 1 else {}),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
