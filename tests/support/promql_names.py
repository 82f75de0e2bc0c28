"""The metric names a PromQL expression reads, and the sample names pd-extproc's metrics expose.

A small tokenizer, not a PromQL parser: it drops string literals, label matchers (``{...}``), range and
subquery brackets (``[...]``), the label lists of ``by``/``without``/``on``/``ignoring``/``group_left``/
``group_right`` and the durations after ``offset``, then reads the identifiers left. An identifier
followed by ``(`` is a function or an aggregation; the operators and modifiers are keywords; numbers
are not identifiers; every other identifier is a metric name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from ext_proc.flow.metrics import FlowMetrics
from ext_proc.metrics import Metrics
from ext_proc.pool_signals import PoolSignal
from ext_proc.registry import Registry, Role

KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right", "offset"}
)
"""PromQL's binary set operators and modifiers (never metric names)."""
GROUPINGS = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
NUMBER = (
    r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|Inf|NaN)(?![\w:])"
)
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', " ", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(GROUPINGS, " ", text)
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana's variables outside the matchers
    text = re.sub(NUMBER, " ", text)
    names = set()
    for match in IDENTIFIER.finditer(text):
        following = text[match.end() :].lstrip()
        if match.group() not in KEYWORDS and not following.startswith("("):
            names.add(match.group())
    return names


SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "unknown": ("",),
}
"""The sample names of a metric family of each type, as suffixes of the family's name (``_created``,
which ``PROMETHEUS_DISABLE_CREATED_SERIES`` turns off, and a summary's quantiles, which pd-extproc's
summaries do not have, left out: a query must not rely on them)."""


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` exposes, from its families' names and types (a labelled family
    with no child yet counts too)."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def pd_extproc_names() -> set[str]:
    """Every sample name pd-extproc's ``/metrics`` can carry.

    A :class:`Metrics` with each collector registered, as ``serve`` registers them with engine metrics, KV
    events, shared state and flow control on."""
    metrics = Metrics(Registry("prefill", "decode", 1.0).endpoints)
    metrics.count_inflight(lambda: 0)
    metrics.watch_engine_scrapes(dict, lambda: 0)
    metrics.watch_kv_events(dict, lambda: 0)
    metrics.watch_peers(lambda: 0)
    metrics.watch_pools(lambda: [PoolSignal(Role.DECODE, "g", 1, 1.0, 0, 0, 1.0, 0.0)])
    metrics.watch_engine_ttft(list)
    flow = FlowMetrics(metrics.registry, [0])
    flow.watch(dict, dict)
    return exposed_names(metrics.registry)


def unknown_names(exprs: Iterable[str], known: set[str]) -> dict[str, set[str]]:
    """The metric names of each of ``exprs`` not in ``known``, for the expressions that have some."""
    return {expr: missing for expr in exprs if (missing := metric_names(expr) - known)}
