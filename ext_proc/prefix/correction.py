"""Self-correction of the prefix index from the engines' own counters (pure).

vLLM counts, per engine, the prompt tokens it looked up in its prefix cache
(``vllm:prefix_cache_queries``) and the ones it found (``vllm:prefix_cache_hits``). Between two
scrapes of an engine the gateway also knows what it predicted there: the prompt tokens of the requests
it placed on that engine and the hit tokens its index predicted for them. When the index predicts a
higher hit rate than the engine reports, the engine keeps less than the index thinks (its running
requests take blocks, other traffic evicts, its cache is smaller than ``token_capacity`` says): the
index shrinks that endpoint's LRU. When it predicts less, it grows it back, never beyond the nominal
capacity (other gateway replicas' placements, which the engine also counts, cannot be learnt here).

The rule, per engine and interval with at least :data:`MIN_QUERY_TOKENS` tokens queried at the engine
and at least one prompt token placed by this gateway, rates ``engine = hits / queries`` and
``predicted = predicted hit tokens / placed prompt tokens``:

* ``predicted > engine + MARGIN``: ``scale *= max(1/2, engine / predicted)``;
* ``predicted < engine - MARGIN``: ``scale *= min(2, engine / predicted)`` (doubling from 0 predicted);
* otherwise unchanged; always clamped to [:data:`MIN_SCALE`, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.05
"""Hit-rate difference (absolute) the index tolerates before it corrects."""
MIN_QUERY_TOKENS = 4096
"""Tokens an engine must have looked up in an interval for its rate to count."""
MIN_SCALE = 1 / 64
"""The smallest share of the nominal capacity the index keeps for an endpoint."""


@dataclass(frozen=True, slots=True)
class Interval:
    """What one interval between two samples of an engine saw, in tokens.

    ``placed`` prompt tokens and ``predicted`` hit tokens of this gateway's placements there;
    ``queries`` and ``hits`` the engine's counter increments."""

    placed: float
    predicted: float
    queries: float
    hits: float


def corrected_scale(scale: float, seen: Interval) -> float:
    """The endpoint's new capacity factor after ``seen`` (see the module docstring)."""
    if seen.queries < MIN_QUERY_TOKENS or seen.placed < 1:
        return scale
    engine = min(1.0, seen.hits / seen.queries)
    predicted = min(1.0, seen.predicted / seen.placed)
    if predicted > engine + MARGIN:
        scale *= max(0.5, engine / predicted)
    elif predicted < engine - MARGIN:
        scale *= min(2.0, engine / predicted) if predicted > 0 else 2.0
    return min(1.0, max(MIN_SCALE, scale))
