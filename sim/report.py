"""Turn workload records into the numbers users judge a PD router by, and print them.

* cross-group KV transfer share: of the requests whose KV cache was transferred, the share that
  crossed pdGroupID groups (ground truth from the simulator's ``x-sim-kv-transfer`` header);
* decode TTFT: client time to first token minus the sidecar's prefill call (transfer + decode
  queueing + first step), p50/p99 in ms; client TTFT (first content chunk received, the fair
  comparison across handoff protocols) p50/p99/mean in ms; TPOT p50/p99 in ms;
* decode load balance: coefficient of variation (std/mean) over decode engines of their
  time-averaged number of requests in flight, each divided by its relative capacity (the
  per-engine values are in the summary too, as ``decode_loads``);
* throughput: completed requests/s and generated tokens/s over the run.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

from sim.workload import Record


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; ``None`` without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def decode_loads(
    records: Iterable[Record], duration_s: float, capacities: Mapping[str, float]
) -> dict[str, float]:
    """Per decode engine of ``capacities``.

    Its time-averaged number of requests in flight (each request counts from its end minus the sidecar's
    prefill call) divided by its relative capacity (its capacity over the mean capacity). Empty without
    capacities or a positive duration."""
    if not capacities or duration_s <= 0:
        return {}
    busy = dict.fromkeys(capacities, 0.0)
    for r in records:
        if r.decode_engine in busy and r.end_ms is not None:
            busy[r.decode_engine] += max(0.0, r.end_ms - (r.remote_prefill_ms or 0.0)) / 1e3
    mean_capacity = statistics.fmean(capacities.values())
    return {a: busy[a] / duration_s / (capacities[a] / mean_capacity) for a in capacities}


def load_cv(loads: Iterable[float]) -> float | None:
    """Coefficient of variation (population std / mean) of ``loads``, 0 = perfect balance.

    ``None`` without loads or when they are all zero."""
    values = list(loads)
    if not values:
        return None
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else None


def summarize(records: Sequence[Record], duration_s: float, capacities: Mapping[str, float]) -> dict:
    """The headline numbers of one run (see the module docstring); times in ms."""
    ok = [r for r in records if r.ok]
    moved = [r for r in ok if r.kv_transfer in ("same_group", "cross_group")]
    cross = sum(r.kv_transfer == "cross_group" for r in moved)
    decode_ttft = [r.decode_ttft_ms for r in ok if r.decode_ttft_ms is not None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    loads = decode_loads(ok, duration_s, capacities)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_kinds": errors,
        "kv_transfers": len(moved),
        "cross_group_share": cross / len(moved) if moved else None,
        "decode_ttft_p50_ms": percentile(decode_ttft, 0.5),
        "decode_ttft_p99_ms": percentile(decode_ttft, 0.99),
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p90_ms": percentile(ttft, 0.9),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "tpot_p50_ms": percentile(tpot, 0.5),
        "tpot_p99_ms": percentile(tpot, 0.99),
        "kv_transfer_p50_ms": percentile(
            [r.kv_transfer_ms for r in moved if r.kv_transfer_ms is not None], 0.5
        ),
        "decode_loads": loads,
        "decode_load_cv": load_cv(loads.values()),
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
        "throughput_tokens_per_s": sum(r.completion_tokens for r in ok) / duration_s
        if duration_s > 0
        else None,
        "duration_s": duration_s,
    }


COLUMNS = (
    ("requests", "requests", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("cross_group_share", "cross-group KV", "{:.1%}"),
    ("decode_ttft_p50_ms", "dTTFT p50 ms", "{:.1f}"),
    ("decode_ttft_p99_ms", "dTTFT p99 ms", "{:.1f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("decode_load_cv", "decode load CV", "{:.3f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("throughput_tokens_per_s", "tok/s", "{:.0f}"),
)


LOWER_IS_BETTER = frozenset(
    {
        "errors",
        "cross_group_share",
        "decode_ttft_p50_ms",
        "decode_ttft_p99_ms",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "decode_load_cv",
    }
)
HIGHER_IS_BETTER = frozenset({"throughput_rps", "throughput_tokens_per_s"})
"""Which way each summary key is better (``requests``: neither, the workload's own count)."""


def better(columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    """One line saying which way each of ``columns`` is better, by title.

    ``lower is better: …; higher is better: …`` (columns of neither set left out; a side without columns
    left out)."""
    sides = (("lower", LOWER_IS_BETTER), ("higher", HIGHER_IS_BETTER))
    parts = [
        f"{word} is better: {', '.join(title for key, title, _ in columns if key in keys)}"
        for word, keys in sides
        if any(key in keys for key, _, _ in columns)
    ]
    return "; ".join(parts)


def format_table(
    results: Mapping[str, Mapping[str, object]], columns: Sequence[tuple[str, str, str]] = COLUMNS
) -> str:
    """A fixed-width table, one row per run name; ``columns`` are (summary key, title, format)."""
    width = max([len("run"), *map(len, results)]) + 2
    head = "run".ljust(width) + "".join(title.rjust(max(len(title) + 2, 10)) for _, title, _ in columns)
    lines = [head, "-" * len(head)]
    for name, summary in results.items():
        cells = []
        for key, title, fmt in columns:
            value = summary.get(key)
            text = "n/a" if value is None else fmt.format(value)
            cells.append(text.rjust(max(len(title) + 2, 10)))
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)
