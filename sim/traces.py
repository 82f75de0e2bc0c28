"""Production request traces: readers, one a format, and the prompt text a replay sends.

A trace is read as :class:`TraceRequest` values: arrival (seconds from the trace's first request),
prompt tokens, output tokens and the prompt's blocks. Formats:

* ``mooncake``: JSON lines with ``timestamp`` (ms), ``input_length``, ``output_length`` and
  ``hash_ids``, the prompt's 512-token blocks as prefix-block hashes (Mooncake's FAST'25 traces; the
  format AIPerf, vLLM and SGLang replay).
* ``azure``: the Azure LLM inference traces' CSV, a header then ``TIMESTAMP,ContextTokens,
  GeneratedTokens`` (an ISO date and time, or seconds); no prefix information, so every prompt is
  its own.

:func:`prompt_text` synthesises a prompt: one fixed text of :data:`TRACE_BLOCK_TOKENS` tokens per
hash id (identical ids give identical text, different ids share no 16-token block), cut to exactly
the request's prompt tokens by the gateway's and the simulator's estimate (4 characters a token,
:mod:`ext_proc.request`); blocks the ids do not cover are the request's own. A malformed line, an
unknown format or a window past the end raises :class:`TraceError`, whose message names the line or
the option.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from itertools import groupby, islice, pairwise
from pathlib import Path

from ext_proc.prefix.blocks import CHARS_PER_TOKEN

SAMPLE = Path(__file__).with_name("trace_samples") / "mooncake_conversation_head.jsonl"
"""The first 200 requests of the Mooncake conversation trace, shipped with the package (its source and
licence: ``sim/trace_samples/README.md``)."""
TRACE_BLOCK_TOKENS = 512
"""Tokens a ``hash_ids`` block stands for (Mooncake's traces)."""


class TraceError(ValueError):
    """A trace cannot be read as asked; the message says where (file and line) or which option."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    ``arrival_s`` seconds after the trace's first one; ``blocks`` the prompt's block hash ids,
    :data:`TRACE_BLOCK_TOKENS` tokens each (empty: no prefix information)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()


def _count(value: object, what: str, least: int) -> int:
    if type(value) is not int or value < least:
        raise ValueError(f"{what} must be an integer >= {least}, got {value!r}")
    return value


def _mooncake_line(line: str) -> TraceRequest:
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    stamp = row["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
        raise ValueError(f"timestamp must be a number of ms >= 0, got {stamp!r}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ValueError("hash_ids must be a list of integers")
    return TraceRequest(
        stamp / 1e3,
        _count(row["input_length"], "input_length", 1),
        _count(row["output_length"], "output_length", 0),
        tuple(ids),
    )


def read_mooncake(path: Path) -> Iterator[TraceRequest]:
    """The requests of a Mooncake JSON-lines trace, in file order (blank lines skipped)."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield _mooncake_line(line)
            except ValueError as exc:  # json.JSONDecodeError included
                raise TraceError(f"{path}:{number}: not a Mooncake trace line: {exc}") from None


def _seconds(stamp: str) -> float:
    try:
        return float(stamp)
    except ValueError:
        return datetime.fromisoformat(stamp).timestamp()


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_azure(path: Path) -> Iterator[TraceRequest]:
    """The requests of an Azure LLM inference CSV trace, arrivals from its first row's time."""
    with path.open(encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle)
        header = next(rows, None)
        if header is None or tuple(h.strip() for h in header[:3]) != AZURE_COLUMNS:
            raise TraceError(f"{path}:1: not an Azure trace: the header must be {','.join(AZURE_COLUMNS)}")
        first: float | None = None
        for number, row in enumerate(rows, 2):
            if not row:
                continue
            try:
                if len(row) < 3:
                    raise ValueError(f"{len(row)} columns, 3 expected")
                at = _seconds(row[0].strip())
                first = at if first is None else first
                if at < first:
                    raise ValueError("arrives before the first request")
                prompt = _count(int(row[1]), "ContextTokens", 1)
                yield TraceRequest(at - first, prompt, _count(int(row[2]), "GeneratedTokens", 0))
            except ValueError as exc:
                raise TraceError(f"{path}:{number}: not an Azure trace line: {exc}") from None


FORMATS: dict[str, Callable[[Path], Iterator[TraceRequest]]] = {
    "mooncake": read_mooncake,
    "azure": read_azure,
}


def trace_format(path: Path, name: str | None) -> str:
    """The format ``name``, or the one ``path``'s suffix says (``.csv``: azure, else mooncake)."""
    if name is None:
        return "azure" if path.suffix.lower() == ".csv" else "mooncake"
    if name not in FORMATS:
        raise TraceError(f"--format: unknown trace format {name!r}; choose from {', '.join(FORMATS)}")
    return name


def read_window(path: Path, fmt: str | None, start: int, count: int | None) -> list[TraceRequest]:
    """A window of the trace at ``path``, arrivals shifted so its first one is at 0.

    Requests ``start`` .. ``start + count - 1`` (0-based; ``count`` ``None``: to the end).

    The file is read as far as the window reaches; a window past its end raises :class:`TraceError`
    naming the file's length (it was read to the end)."""
    if start < 0 or (count is not None and count < 1):
        raise TraceError("--start must be >= 0 and --count >= 1")
    window: list[TraceRequest] = []
    length = 0
    try:
        reader = FORMATS[trace_format(path, fmt)](path)
        for length, request in enumerate(islice(reader, None if count is None else start + count), 1):
            if length > start:
                window.append(request)
    except OSError as exc:
        raise TraceError(f"cannot read the trace: {exc}") from None
    if not window or (count is not None and len(window) < count):
        asked = f"--start {start}" + ("" if count is None else f" --count {count}")
        raise TraceError(
            f"{asked}: the window runs past the end of {path}, which holds {length} requests"
            + (f" (0-{length - 1})" if length else "")
        )
    first = window[0].arrival_s
    return [TraceRequest(r.arrival_s - first, r.prompt_tokens, r.output_tokens, r.blocks) for r in window]


def spread(requests: list[TraceRequest]) -> list[TraceRequest]:
    """``requests`` with the ones that share an arrival spread over the time to the next.

    ``requests`` (in arrival order) with the ones that share an arrival spread evenly over the time to
    the next distinct arrival: the ``j``-th of ``k`` sharing ``t`` arrives at ``t + j * gap / k``. The last
    group takes the median gap between distinct arrivals (none: it stays at once). The Mooncake
    conversation trace stamps its requests every ~3 s, ~10 a stamp: replayed as stamped they arrive at
    the same instant, which one router places one after another knowing each, and several replicas
    place in parallel, each blind to the others' (herding at its worst)."""
    stamps = sorted({r.arrival_s for r in requests})
    gaps = [b - a for a, b in pairwise(stamps)]
    after = dict(zip(stamps, gaps, strict=False))
    last = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    out: list[TraceRequest] = []
    for stamp, same in groupby(requests, key=lambda r: r.arrival_s):
        group = list(same)
        gap = after.get(stamp, last)
        out += [replace(r, arrival_s=stamp + j * gap / len(group)) for j, r in enumerate(group)]
    return out


def block_text(key: object) -> str:
    """The fixed text of one trace block (:data:`TRACE_BLOCK_TOKENS` tokens) for ``key``."""
    return random.Random(repr(key)).randbytes(TRACE_BLOCK_TOKENS * CHARS_PER_TOKEN // 2).hex()


def prompt_text(request: TraceRequest, index: int) -> str:
    """The prompt of ``request``, the ``index``-th of its trace (see the module docstring).

    Exactly ``request.prompt_tokens`` tokens at 4 characters a token."""
    blocks = -(-request.prompt_tokens // TRACE_BLOCK_TOKENS)
    keys: list[object] = list(request.blocks[:blocks])
    keys += [("request", index, i) for i in range(len(keys), blocks)]
    return "".join(map(block_text, keys))[: request.prompt_tokens * CHARS_PER_TOKEN]


def output_budget(request: TraceRequest, cap: int | None) -> int:
    """The completion budget a replay asks for.

    ``request``'s output tokens, at most ``cap`` (``None``: no cap), at least 1 (a trace's 0-token answers
    still take one decode step)."""
    return max(1, request.output_tokens if cap is None else min(request.output_tokens, cap))


def reuse_bound(requests: list[TraceRequest], block_size: int = 16) -> float:
    """The share of ``requests``' prompt tokens an infinite cache would hold when each arrives.

    Its leading blocks that an earlier request of the list had (chained, so equal as far as the ids agree),
    at most its prompt less one token, in whole ``block_size``-token blocks (an engine computes at least
    one token)."""
    seen: set[int] = set()
    hit = total = 0
    for request in requests:
        chain, matched, key = [], 0, 0
        for block in request.blocks:
            key = hash((key, block))
            chain.append(key)
        while matched < len(chain) and chain[matched] in seen:
            matched += 1
        limit = (request.prompt_tokens - 1) // block_size * block_size
        hit += min(matched * TRACE_BLOCK_TOKENS, limit)
        total += request.prompt_tokens
        seen.update(chain)
    return hit / total if total else 0.0
