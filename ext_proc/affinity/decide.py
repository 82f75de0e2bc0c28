"""The routing decision: one (prefill, decode) pair and a few decode fallbacks for a request.

:func:`choose` is a pure function of its arguments (no I/O, clock or randomness; ``tiebreak`` is the
only source of variation), so equal inputs always give an equal result. It reads endpoint load from
the arrays of two :class:`~ext_proc.affinity.Pool` values, and prefix-cache hit estimates from a
:class:`~ext_proc.affinity.Hits`, and returns the pools' endpoint objects. Token counts are tokens,
utilisations dimensionless, and every ranked quantity is an integer count of :data:`EPS` ticks.

The rule of each mode (its keys, ties and fallbacks) and its cost are written out in docs/routing.md,
"The exact rule" (docs/routing.md#the-exact-rule-ext_procaffinitydecidepy-pure).
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import pairwise

import numpy as np
from numpy.typing import NDArray

from ext_proc.affinity.model import (
    Cost,
    Decision,
    E,
    Estimate,
    Hits,
    Locality,
    Mode,
    NoPair,
    NoPairReason,
    Policy,
)
from ext_proc.affinity.pool import Pool

EPS = 1e-9
"""Resolution of every comparison: one tick (utilisation units; 1 ns in ``auto``)."""
SCALE = 1_000_000_000
"""``1 / EPS``: ticks per unit."""
_SCALE_F = float(SCALE)  # the same product as ``x * SCALE`` for a float x; a float scalar is cheaper in numpy
_EXACT = 2.0**50  # keys below this in magnitude: their sums and ``2 * key + 1`` are exact in float64
_SAFE_U = _EXACT / 4 / _SCALE_F  # utilisations, weights and bonuses adding up below this give such keys
_LIST_MAX = 128  # up to this many endpoints, ranking Python lists beats numpy partition + lexsort
_WINDOW = 64  # sorted keys copied (beyond n) to Python lists to delimit tie classes
# Enum members bound once: attribute access on an Enum class costs ~0.25 µs per lookup on CPython 3.11.
_OFF, _STRICT, _PREFER, _AUTO = Mode.OFF, Mode.STRICT, Mode.PREFER, Mode.AUTO
_SAME, _CROSS, _DECODE_ONLY = Locality.SAME_GROUP, Locality.CROSS_GROUP, Locality.DECODE_ONLY

Floats = NDArray[np.float64]
Ints = NDArray[np.int64]
Keys = NDArray[np.float64] | NDArray[np.object_]  # integral float64, or Python ints when too large
Positions = NDArray[np.intp]


def ticks(x: float) -> int:
    """``x`` (a utilisation, bonus or time in seconds) on the grid of ``EPS``: ``round(x * SCALE)``."""
    return round(x * SCALE)


def _ticks(x: Floats, exact: bool = True) -> Keys:
    """:func:`ticks` of every element (``np.rint`` rounds half to even, as ``round``): integral float64
    when ``exact`` (the caller checked the magnitudes), else Python ints."""
    t = np.rint(x * _SCALE_F)
    return t if exact else _ints(t)


def _ints(a: Keys) -> NDArray[np.object_]:
    """``a`` as an array of Python ints (integral float64 values convert exactly)."""
    return a if a.dtype == object else np.array([int(x) for x in a.tolist()], dtype=object)


def _credit(hits: Ints | None, cpu: Ints | None, prompt: int, policy: Policy, exact: bool) -> Keys | int:
    """``credit(hits)`` of docs/routing.md "The exact rule", per endpoint (0 when nothing is credited).

    ``cpu``: the hit tokens held only in a CPU tier, worth ``policy.cpu_tier_weight`` of one in GPU."""
    weight = policy.prefix_weight
    if hits is None or weight <= 0.0 or prompt <= 0:
        return 0
    if cpu is None:
        return _ticks(hits * (weight / prompt), exact)
    return _ticks((hits - (1.0 - policy.cpu_tier_weight) * cpu) * (weight / prompt), exact)


def choose(
    cost: Cost,
    prefills: Pool[E],
    decodes: Pool[E],
    policy: Policy,
    tiebreak: int,
    hits: Hits | None = None,
) -> Decision[E] | NoPair:
    """Pick where one request runs, from healthy endpoints only (the pools hold no others).

    * No decodes: ``NoPair(NO_DECODE_ENDPOINT)``.
    * No prefills: decode-only routing in every mode (``prefill=None``, ``Locality.DECODE_ONLY``,
      decode and fallbacks ranked as in ``off``).
    * ``strict`` with no prefill whose group has a decode: ``NoPair(NO_SAME_GROUP_DECODE)``.
    * Otherwise the pair of the rule for ``policy.mode`` (docs/routing.md "The exact rule"), with
      ``policy.fallback_count`` more decodes of the chosen prefill's ranking (``strict``: within its
      group), all distinct, and in ``auto`` the pair's :class:`Estimate`.

    ``hits`` (optional): the prompt tokens each endpoint's prefix cache is estimated to hold. Token
    counts must fit in int64 (``OverflowError`` otherwise); the pools are only read.
    """
    if not decodes.size:
        return NoPair(
            NoPairReason.NO_DECODE_ENDPOINT,
            f"no healthy decode endpoint (healthy prefill endpoints: {prefills.size})",
        )
    want = policy.fallback_count + 1
    prompt = cost.prefill_tokens
    u = (decodes.tokens + cost.decode_tokens) / decodes.capacity
    out = decodes.endpoints
    mode = policy.mode
    phits, dhits = (None, None) if hits is None else (hits.prefill, hits.decode)
    uncached = prompt if phits is None else prompt - phits
    backlog = prefills.tokens + uncached
    if mode is _AUTO and prefills.size:
        slots = prefills.slots_in(decodes)
        priced = backlog + uncached  # a miss priced twice (docs/routing.md "The exact rule")
        return _choose_auto(
            prompt, prefills, decodes, u, hits, backlog, priced, slots, want, tiebreak, policy
        )
    weight = policy.prefix_weight
    inflight = prefills.tokens
    if mode is not _OFF and prefills.size:  # the backlog in flight weighed by r(g) (docs/routing.md)
        inflight = inflight * prefills.share_ratios_in(decodes)
    pu = (inflight + uncached) / prefills.capacity
    top = float(u.max()) + (float(pu.max()) if prefills.size else 0.0)
    exact = top + 2.0 * weight + policy.bonus < _SAFE_U
    pcpu, dcpu = (None, None) if hits is None else (hits.prefill_cpu, hits.decode_cpu)
    dkey = _ticks(u, exact) - _credit(dhits, dcpu, prompt, policy, exact)
    if not prefills.size:
        picked = [out[i] for i in _top(dkey, want, tiebreak, decodes.requests)]
        return Decision(None, picked[0], tuple(picked[1:]), _DECODE_ONLY)
    keys = _ticks(pu, exact) - _credit(phits, pcpu, prompt, policy, exact)
    groups = len(decodes.groups)
    eligible = None
    if mode is not _OFF:  # off: the decode does not depend on the prefill's group
        slots = prefills.slots_in(decodes)
        pair = np.empty(groups + 1, dtype=dkey.dtype)  # the last: a prefill group without decodes
        best = np.minimum.reduceat(dkey[decodes.group_order], decodes.group_starts)
        if mode is _STRICT:
            pair[:groups], pair[groups] = best, 0
            if slots.max() >= groups:  # some prefill group has no decode: only the others may serve
                eligible = np.flatnonzero(slots < groups)
                if not len(eligible):
                    names = ", ".join(sorted(repr(g) for g in prefills.groups))
                    return NoPair(
                        NoPairReason.NO_SAME_GROUP_DECODE,
                        f"strict pdGroupID affinity: no healthy decode endpoint in the group of any of "
                        f"the {prefills.size} healthy prefill endpoints (prefill groups: {names})",
                    )
        else:
            spill = best.min() + ticks(policy.bonus)
            pair[:groups], pair[groups] = np.minimum(best, spill), spill
        keys = keys + pair[slots]
    if eligible is None:
        first = _top(keys, 1, tiebreak, prefills.requests)[0]
    else:
        first = _top(keys[eligible], 1, tiebreak, prefills.requests, eligible)[0]
    prefill = prefills.endpoints[first]
    group = prefill.group
    requests = decodes.requests
    if mode is _PREFER and groups > 1 and group in decodes.in_group:
        # (key - bonus * same, not same) as one integer, order-preserving: 2 * key - (2 * bonus + 1) * same
        step = 2 * ticks(policy.bonus) + 1
        same = decodes.in_group[group] if exact else decodes.in_group[group].astype(np.int64).astype(object)
        ranked = _top(dkey + dkey - step * same, want, tiebreak, requests)
    elif mode is _STRICT and groups > 1:
        sub = decodes.members[group]
        ranked = _top(dkey[sub], want, tiebreak, requests, sub)
    else:  # off, or every decode in one group: the bonus is for none or all
        ranked = _top(dkey, want, tiebreak, requests)
    picked = [out[i] for i in ranked]
    decode = picked[0]
    return Decision(prefill, decode, tuple(picked[1:]), _SAME if decode.group == group else _CROSS)


def _choose_auto(
    prompt: int,
    prefills: Pool[E],
    decodes: Pool[E],
    u: Floats,
    hits: Hits | None,
    backlog: Ints,
    priced: Ints,
    slots: Positions,
    want: int,
    tiebreak: int,
    policy: Policy,
) -> Decision[E]:
    """``auto``'s pair and fallbacks (docs/routing.md "The exact rule"), with the estimate.

    ``u`` holds the decodes' utilisations with the request placed, ``backlog`` each prefill's prompt
    tokens in flight plus the ones this request makes it compute, ``priced`` the tokens its cost is
    priced at; ``slots`` maps each prefill to its group's index in ``decodes.groups``; ``want`` = 1 +
    fallbacks. A hit held only in a CPU tier adds its load (:meth:`AutoModel.cpu_load_s`) to the
    prefill's time at a prefill, to the transfer's at a decode.
    """
    model = policy.auto
    wait = model.wait_s(u)
    dhits = None if hits is None else hits.decode
    pcpu, dcpu = (None, None) if hits is None else (hits.prefill_cpu, hits.decode_cpu)
    lack = prompt if dhits is None else prompt - dhits
    same_s = wait + lack * model.seconds_per_token(True)
    cross_s = wait + lack * model.seconds_per_token(False)
    prefill_s = model.prefill_s(priced)
    if dcpu is not None:
        dload = model.cpu_load_s(dcpu)
        same_s, cross_s = same_s + dload, cross_s + dload
    if pcpu is not None:
        prefill_s = prefill_s + model.cpu_load_s(pcpu)
    exact = max(float(cross_s.max()), float(same_s.max()), float(prefill_s.max())) < _EXACT / 4 / _SCALE_F
    same_key, cross_key = _ticks(same_s, exact), _ticks(cross_s, exact)
    order, starts = decodes.group_order, decodes.group_starts
    groups = len(starts)
    pair = np.empty(groups + 1, dtype=same_key.dtype)  # per group of the prefill; the last: no decodes
    home = np.minimum.reduceat(same_key[order], starts)  # per decode group: its best from a prefill in it
    if groups == 1:
        pair[0], pair[1] = home[0], cross_key.min()
    else:  # from a prefill of group g, the best cross-group decode is the least ``away`` of the others
        away = np.minimum.reduceat(cross_key[order], starts)
        low = int(away.argmin())
        least = away[low]
        second = np.partition(away, 1)[1] if exact else sorted(away.tolist())[1]  # == least on a tie
        pair[:groups] = np.minimum(home, least)
        pair[low] = min(home[low], second)
        pair[groups] = least
    first = _top(_ticks(prefill_s, exact) + pair[slots], 1, tiebreak, prefills.requests)[0]
    prefill = prefills.endpoints[first]
    group = prefill.group
    same = decodes.in_group.get(group)
    if same is None:
        keys = ranked_keys = cross_key
    elif groups == 1:
        keys = ranked_keys = same_key
    else:  # (S or C, not same) as one integer, order-preserving: 2 * key + not same
        keys = np.where(same > 0.0, same_key, cross_key)
        ranked_keys = keys + keys + (1.0 - same if exact else (1 - same).astype(np.int64).astype(object))
    ranked = _top(ranked_keys, want, tiebreak, decodes.requests)
    out = decodes.endpoints
    picked = [out[i] for i in ranked]
    chosen = ranked[0]
    decode = picked[0]
    home_pick = decode.group == group
    margin = None
    if same is not None and groups > 1:
        outside = decodes.outside[group]
        others = keys[outside if home_pick else ~outside].min()
        margin = float(others - keys[chosen]) / _SCALE_F
    moved = lack if dhits is None else int(lack[chosen])
    prefill_first = float(model.prefill_s(backlog[first]))
    transfer = model.transfer_s(moved, home_pick)
    if pcpu is not None:
        prefill_first += float(model.cpu_load_s(pcpu[first]))
    if dcpu is not None:
        transfer += float(model.cpu_load_s(dcpu[chosen]))
    estimate = Estimate(prefill_first, transfer, float(wait[chosen]), margin)
    return Decision(prefill, decode, tuple(picked[1:]), _SAME if home_pick else _CROSS, estimate)


def _top(keys: Keys, n: int, tiebreak: int, requests: Ints, index: Positions | None = None) -> list[int]:
    """The pool positions of the first ``min(n, m)`` of m (>= 1) ranked endpoints, in ranking order.

    ``keys[j]`` is the exact integer key (integral float64 or Python int) of the endpoint at pool
    position ``index[j]`` (``j`` when ``index`` is ``None``; ``index`` ascends); ``requests`` (the
    secondary key) is indexed by pool position. Only the endpoints at or below the n-th key can be in
    the answer: when the n best keys are distinct and below the rest, they are it (no request count is
    read); otherwise :func:`_exact` ranks the endpoints at or below the n-th key.
    """
    m = len(keys)
    if m == 1:
        return [0 if index is None else int(index[0])]
    n = min(n, m)
    if m <= _LIST_MAX or keys.dtype == object:
        listed = keys.tolist()
        if n == 1:
            low = min(listed)
            if listed.count(low) == 1:
                j = listed.index(low)
                return [j if index is None else int(index[j])]
            high = low
        else:
            ordered = sorted(listed)
            high = ordered[n - 1]
            if (n == m or ordered[n] > high) and all(a < b for a, b in pairwise(ordered[:n])):
                best = [listed.index(k) for k in ordered[:n]]
                return best if index is None else [int(index[j]) for j in best]
        near = np.array([j for j, k in enumerate(listed) if k <= high], dtype=np.intp)
    elif n == 1:
        near = np.flatnonzero(keys == keys.min())
        if len(near) == 1:
            return [int(near[0]) if index is None else int(index[near[0]])]
    else:
        near = np.flatnonzero(keys <= np.partition(keys, n - 1)[n - 1])
    picked = keys[near]
    return _exact(near if index is None else index[near], picked, requests, n, tiebreak)


def _exact(near: Positions, keys: Keys, requests: Ints, n: int, tiebreak: int) -> list[int]:
    """The first ``n`` of the ``near`` pool positions (ascending) by ``(keys, requests)``, tie classes
    rotated.

    One ``np.lexsort`` orders the keys; each tie class needed (at most n) is then delimited by
    bisection, in a short Python window of the sorted keys or, for a class running past it, in the
    arrays themselves, so no step but the sort grows with the number of tied endpoints.
    """
    t = keys
    r = requests[near]
    order = np.lexsort((r, t))  # by t, then r; stable, so each tie class stays in pool order
    t, r, ranked = t[order], r[order], near[order]
    size = len(order)
    window = min(size, _WINDOW + n)  # > n: a class reaching past it holds all the picks still missing
    tw, rw = t[:window].tolist(), r[:window].tolist()
    picked: list[int] = []
    start = 0
    while True:
        end = bisect_right(tw, tw[start], start)  # the run of equal t, and within it of equal r
        end = bisect_right(rw, rw[start], start, end)
        if end == window < size:
            end = start + int(t[start:].searchsorted(t[start], "right"))
            end = start + int(r[start:end].searchsorted(r[start], "right"))
        tied = end - start
        turn = tiebreak % tied
        picked += [int(ranked[start + (turn + i) % tied]) for i in range(min(tied, n - len(picked)))]
        if len(picked) == n:
            return picked
        start = end
