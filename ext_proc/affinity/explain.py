"""Why a decision: every candidate pair's cost in the rule of its mode, best first (pure, like ``choose``).

:func:`explain` takes the inputs of :func:`~ext_proc.affinity.choose` and returns its decision with the
terms behind it (docs/routing.md "The exact rule"): each prefill's key, each decode's key within the
prefill's group and outside it, and the ``limit`` pairs of least cost. A pair's cost is what the rule
minimises over pairs, on the same 1e-9 grid (:func:`~ext_proc.affinity.decide.ticks`):

* ``off``: prefill key + decode key (the two are chosen apart; their sum ranks the pairs alike);
* ``prefer``: prefill key + decode key, + ``ticks(bonus)`` when the decode is in another group;
* ``strict``: prefill key + decode key, for a decode of the prefill's group only;
* ``auto`` (seconds): the prefill's cost (its queue and the prompt's uncached tokens twice) + ``S(d)``
  in its group or ``C(d)`` outside;
* no prefill (decode-only): the decode key alone.

The chosen pair's cost is the least (``choose`` breaks ties among equal costs by active requests and
round robin). It is a separate function so that ``choose``'s own cost is untouched: this one spends
O(P·limit + D log D) Python work, for an operator's question, not per request. The pools are only read.
"""

from __future__ import annotations

from typing import Generic, NamedTuple

import numpy as np

from ext_proc.affinity.decide import (
    _ticks,
    auto_seconds,
    auto_wait,
    choose,
    endpoint_keys,
    prefill_utilisation,
    ticks,
)
from ext_proc.affinity.model import Cost, Decision, E, Hits, Lacks, Mode, NoPair, Policy
from ext_proc.affinity.pool import Pool


class PairCost(NamedTuple):
    """One candidate pair and its cost.

    ``prefill`` and ``decode`` are pool positions (``prefill`` ``None``: decode-only); ``same_group``:
    they share a group; ``cost`` in ticks (the rule's units times 1e9)."""

    prefill: int | None
    decode: int
    same_group: bool
    cost: int


class Explanation(NamedTuple, Generic[E]):
    """What :func:`explain` found.

    ``decision``: :func:`~ext_proc.affinity.choose`'s answer. ``seconds``: the costs are seconds
    (``auto``), else utilisation. ``prefill_keys[i]`` / ``decode_keys[j]`` (ticks): each endpoint's own
    term — a decode's from a prefill of its group (``auto``: ``S(d)``); ``decode_away_keys[j]``: the
    same decode's from a prefill of another group (``off``: the key; ``prefer``: key + bonus;
    ``auto``: ``C(d)``; ``strict``: ``None``, not a candidate). ``pairs``: the ``limit`` least-cost
    pairs, best first (ties: same group first, then by pool position); ``chosen``: the decision's pair
    and its cost (``None`` for a :class:`~ext_proc.affinity.NoPair`)."""

    decision: Decision[E] | NoPair
    seconds: bool
    prefill_keys: list[int]
    decode_keys: list[int]
    decode_away_keys: list[int | None]
    pairs: list[PairCost]
    chosen: PairCost | None


def _as_ints(keys: object, size: int) -> list[int]:
    """Per-endpoint ticks as Python ints (``keys`` an array of them, or one number for all)."""
    if isinstance(keys, np.ndarray):
        return [int(k) for k in keys.tolist()]
    return [int(keys)] * size  # type: ignore[call-overload]


def _keys(
    cost: Cost, prefills: Pool[E], decodes: Pool[E], policy: Policy, hits: Hits | None, lacks: Lacks | None
) -> tuple[list[int], list[int], list[int | None]]:
    """``(prefill keys, decode keys in group, decode keys outside)`` in ticks, by ``choose``'s own
    functions (so the ticks are equal to the ones it compares)."""
    prompt = cost.prefill_tokens
    phits, dhits, pcpu, dcpu = (None, None, None, None) if hits is None else hits
    u = (decodes.tokens + cost.decode_tokens) / decodes.capacity
    uncached = prompt if phits is None else prompt - phits
    if policy.mode is Mode.AUTO and prefills.size:
        model = policy.auto
        wait, lack = auto_wait(prompt, u, dhits, lacks, model)
        priced = prefills.tokens + uncached + uncached
        prefill_s, same_s, cross_s = auto_seconds(wait, lack, priced, pcpu, dcpu, lacks, model)
        return (
            _as_ints(_ticks(prefill_s, False), prefills.size),
            _as_ints(_ticks(same_s, False), decodes.size),
            list(_as_ints(_ticks(cross_s, False), decodes.size)),
        )
    pu = prefill_utilisation(prefills, decodes, uncached, policy.mode)
    plack, dlack = (None, None) if lacks is None else (lacks.prefill, lacks.decode)
    dkeys = _as_ints(endpoint_keys(u, dhits, dcpu, dlack, prompt, policy, False), decodes.size)
    pkeys = _as_ints(endpoint_keys(pu, phits, pcpu, plack, prompt, policy, False), prefills.size)
    if policy.mode is Mode.STRICT:
        return pkeys, dkeys, [None] * decodes.size
    bonus = ticks(policy.bonus) if policy.mode is Mode.PREFER else 0
    return pkeys, dkeys, [k + bonus for k in dkeys]


def explain(
    cost: Cost,
    prefills: Pool[E],
    decodes: Pool[E],
    policy: Policy,
    tiebreak: int,
    hits: Hits | None = None,
    limit: int = 10,
    lacks: Lacks | None = None,
) -> Explanation[E]:
    """The decision ``choose`` takes on these inputs, with the terms and pairs behind it.

    Each endpoint's term and the ``limit`` (>= 1) least-cost pairs (module docstring); without decodes,
    no key and no pair."""
    decision = choose(cost, prefills, decodes, policy, tiebreak, hits, lacks)
    if not decodes.size:  # no pair at all, and no key the rule defines
        return Explanation(decision, False, [], [], [], [], None)
    pkeys, dkeys, away = _keys(cost, prefills, decodes, policy, hits, lacks)
    seconds = policy.mode is Mode.AUTO and prefills.size > 0
    if not prefills.size:
        pairs = [PairCost(None, j, False, dkeys[j]) for j in range(decodes.size)]
    else:
        pairs = _candidates(prefills, decodes, pkeys, dkeys, away, limit)
    pairs.sort(key=lambda p: (p.cost, not p.same_group, p.prefill or 0, p.decode))
    chosen = None
    if not isinstance(decision, NoPair):
        j = decodes.endpoints.index(decision.decode)
        if decision.prefill is None:
            chosen = PairCost(None, j, False, dkeys[j])
        else:
            i = prefills.endpoints.index(decision.prefill)
            same = decision.prefill.group == decision.decode.group
            chosen = PairCost(i, j, same, pkeys[i] + (dkeys[j] if same else away[j] or 0))
    return Explanation(decision, seconds, pkeys, dkeys, away, pairs[:limit], chosen)


def _candidates(
    prefills: Pool[E],
    decodes: Pool[E],
    pkeys: list[int],
    dkeys: list[int],
    away: list[int | None],
    limit: int,
) -> list[PairCost]:
    """Every pair that can be among the ``limit`` best: for each prefill, the ``limit`` best decodes of
    its group (by ``dkeys``) and the ``limit`` best of the others (by ``away``; none in ``strict``)."""
    home = {g: sorted(members.tolist(), key=dkeys.__getitem__) for g, members in decodes.members.items()}
    outside = [] if away[0] is None else sorted(range(decodes.size), key=lambda j: away[j] or 0)
    groups = [e.group for e in decodes.endpoints]
    pairs: list[PairCost] = []
    for i, prefill in enumerate(prefills.endpoints):
        group = prefill.group
        pairs += [PairCost(i, j, True, pkeys[i] + dkeys[j]) for j in home.get(group, [])[:limit]]
        others = (j for j in outside if groups[j] != group)
        for _, j in zip(range(limit), others, strict=False):
            pairs.append(PairCost(i, j, False, pkeys[i] + (away[j] or 0)))
    return pairs
