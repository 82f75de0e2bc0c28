"""The routing decision: one (prefill, decode) pair and a few decode fallbacks for a request.

:func:`choose` is a pure function of its arguments (no I/O, clock or randomness; ``tiebreak`` is the
only source of variation), so equal inputs always give an equal result. It reads endpoint load from
the arrays of two :class:`~ext_proc.affinity.Pool` values, and prefix-cache hit estimates from a
:class:`~ext_proc.affinity.Hits`, and returns the pools' endpoint objects.

Units and the grid. Token counts (``Cost``, ``Pool.tokens``, ``Pool.capacity``, ``Hits``) are tokens.
A utilisation ``u = (tokens + cost) / capacity`` is dimensionless (1.0 = full; the int64 sum is exact
and converted to float64 once, bit for bit :meth:`Candidate.utilisation`). Every ranked quantity is
put on an integer grid before it is compared or added: ``ticks(x) = round(x * 1e9)`` (utilisation
units, or seconds in ``auto``: 1 ns), rounded once per term, so float noise never flips a decision and
the sums below are exact integers (float64 while they stay below 2**52, Python ints beyond).

Keys (``P`` = prompt tokens, ``B`` = output budget, ``hp``/``hd`` = a prefill's/decode's cache hit,
0 without :class:`Hits`; ``w`` = ``Policy.prefix_weight``; ``credit(h) = ticks(w * h / P)``, 0 when P = 0):

* ``off``, ``prefer``, ``strict``: a decode's key is ``ticks(u_d) - credit(hd)`` with ``u_d`` at cost
  ``P + B``; a prefill's is ``ticks(u_p) - credit(hp)`` with ``u_p`` at cost ``P - hp`` (the tokens it
  must compute). ``best(g)`` is the least decode key in group ``g``, ``best`` the least of all.
  The prefill is the one of least ``key + pair(g)``, ``g`` its group:

  - ``off``: ``pair(g) = 0`` (the decode does not depend on the prefill's group);
  - ``strict``: ``pair(g) = best(g)``; only prefills whose group has a decode are eligible;
  - ``prefer``: ``pair(g) = min(best(g), best + ticks(bonus))`` (``best + ticks(bonus)`` when ``g``
    has no decode): the group's decode headroom, or what spilling out of the group costs.

  Its decode is then the first by ``(key - ticks(bonus) * same, not same, active_requests)`` in
  ``prefer`` (``same``: in the prefill's group), by ``(key, active_requests)`` in ``off`` and, within the
  prefill's group, in ``strict``.
* ``auto`` (:mod:`ext_proc.affinity.auto`, seconds): with ``W(d) = wait_s(u_d)`` and
  ``X(d, same) = (P - hd) * seconds_per_token(same)``, a decode costs ``S(d) = ticks(W + X(d, True))``
  from a prefill of its own group and ``C(d) = ticks(W + X(d, False))`` from any other. The prefill is
  the one of least ``ticks(prefill_s(backlog + P - hp)) + min(min over d in g of S(d), min over d not
  in g of C(d))``: the least estimated time to the first decoded token over every pair. Its decode is
  the first by ``(S or C, not same, active_requests)``.

Ties: after those keys, prefills rank by ``active_requests``; endpoints whose keys are all equal form
a tie class, taken in input order and rotated left by ``tiebreak % len(class)``, so a round-robin
``tiebreak`` spreads picks over every tied endpoint. The fallbacks are the next decodes of the chosen
prefill's decode ranking. No prefill (decode-only): the decodes ranked as in ``off``, in every mode.

Cost: O(P + D) vector work per decision plus O(G) for the groups (one ``np.minimum.reduceat`` gives
every group's best decode), and Python work proportional to the handful of endpoints in the answer:
the ``n`` best keys are pre-selected by ``np.partition`` and only the endpoints at or below the n-th
key are sorted exactly (all of them only when they tie, e.g. an idle pool).
"""

from __future__ import annotations

from bisect import bisect_right

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
    Policy,
    Rejection,
    RejectReason,
)
from ext_proc.affinity.pool import Pool

EPS = 1e-9
"""Resolution of every comparison: one tick (utilisation units; 1 ns in ``auto``)."""
SCALE = 1_000_000_000
"""``1 / EPS``: ticks per unit."""
_SCALE_F = float(SCALE)  # the same product as ``x * SCALE`` for a float x; a float scalar is cheaper in numpy
_EXACT = 2.0**51  # below this, sums of two ticks and 2 * key + 1 are exact in float64
_WINDOW = 64  # sorted keys copied (beyond n) to Python lists to delimit tie classes
# Enum members bound once: attribute access on an Enum class costs ~0.25 µs per lookup on CPython 3.11.
_OFF, _STRICT, _PREFER, _AUTO = Mode.OFF, Mode.STRICT, Mode.PREFER, Mode.AUTO
_SAME, _CROSS, _DECODE_ONLY = Locality.SAME_GROUP, Locality.CROSS_GROUP, Locality.DECODE_ONLY

Floats = NDArray[np.float64]
Ints = NDArray[np.int64]
Keys = NDArray[np.float64] | NDArray[np.object_]  # integral float64, or Python ints when too large
Positions = NDArray[np.intp]


def ticks(x: float) -> int:
    """``x`` (a utilisation, bonus or time in seconds) on the integer grid of ``EPS``: ``round(x * SCALE)``."""
    return round(x * SCALE)


def _ticks(x: Floats) -> Floats:
    """:func:`ticks` of every element, as integral float64 (``np.rint`` rounds half to even, as ``round``)."""
    return np.rint(x * _SCALE_F)


def _add(a: Keys, b: Keys) -> Keys:
    """``a + b`` exactly: in float64 while every term is below 2**51, else on Python ints."""
    if a.dtype != object and b.dtype != object and max(np.abs(a).max(), np.abs(b).max()) < _EXACT:
        return a + b
    return _ints(a) + _ints(b)


def _ints(a: Keys) -> NDArray[np.object_]:
    """``a`` as an array of Python ints (integral float64 values convert exactly)."""
    return a if a.dtype == object else np.array([int(x) for x in a.tolist()], dtype=object)


def _credited(key: Floats, hits: Ints | None, prompt: int, weight: float) -> Keys:
    """``key - credit(hits)`` (see the module docstring), exact."""
    if hits is None or weight <= 0.0 or prompt <= 0:
        return key
    return _add(key, -_ticks(hits * (weight / prompt)))


def choose(
    cost: Cost,
    prefills: Pool[E],
    decodes: Pool[E],
    policy: Policy,
    tiebreak: int,
    hits: Hits | None = None,
) -> Decision[E] | Rejection:
    """Pick where one request runs, from healthy endpoints only (the pools hold no others).

    * No decodes: ``Rejection(NO_DECODE_ENDPOINT)``.
    * No prefills: decode-only routing in every mode (``prefill=None``, ``Locality.DECODE_ONLY``,
      decode and fallbacks ranked as in ``off``).
    * ``strict`` with no prefill whose group has a decode: ``Rejection(NO_SAME_GROUP_DECODE)``.
    * Otherwise the pair of the module docstring's rule for ``policy.mode``, with
      ``policy.fallback_count`` more decodes of the chosen prefill's ranking (``strict``: within its
      group), all distinct, and in ``auto`` the pair's :class:`Estimate`.

    ``hits`` (optional): the prompt tokens each endpoint's prefix cache is estimated to hold. Token
    counts must fit in int64 (``OverflowError`` otherwise); the pools are only read.
    """
    if not decodes.size:
        return Rejection(
            RejectReason.NO_DECODE_ENDPOINT,
            f"no healthy decode endpoint (healthy prefill endpoints: {prefills.size})",
        )
    want = policy.fallback_count + 1
    prompt = cost.prefill_tokens
    u = (decodes.tokens + cost.decode_tokens) / decodes.capacity
    out = decodes.endpoints
    dhits = None if hits is None else hits.decode
    mode = policy.mode
    if not prefills.size or mode is not _AUTO:
        dkey = _credited(_ticks(u), dhits, prompt, policy.prefix_weight)
        if not prefills.size:
            picked = [out[i] for i in _top(dkey, want, tiebreak, decodes.requests)]
            return Decision(None, picked[0], tuple(picked[1:]), _DECODE_ONLY)
    phits = None if hits is None else hits.prefill
    backlog = prefills.tokens + (prompt if phits is None else prompt - phits)
    slots = prefills.slots_in(decodes)
    groups = len(decodes.groups)
    if mode is _AUTO:
        return _choose_auto(prompt, prefills, decodes, u, dhits, backlog, slots, want, tiebreak, policy)
    pkey = _credited(_ticks(backlog / prefills.capacity), phits, prompt, policy.prefix_weight)
    eligible = None
    if mode is _OFF:
        keys = pkey
    else:
        best = np.minimum.reduceat(dkey[decodes.group_order], decodes.group_starts)
        if mode is _STRICT:
            if slots.max() >= groups:  # some prefill group has no decode: only the others may serve
                eligible = np.flatnonzero(slots < groups)
                if not len(eligible):
                    names = ", ".join(sorted(repr(g) for g in prefills.groups))
                    return Rejection(
                        RejectReason.NO_SAME_GROUP_DECODE,
                        f"strict pdGroupID affinity: no healthy decode endpoint in the group of any of "
                        f"the {prefills.size} healthy prefill endpoints (prefill groups: {names})",
                    )
            pair = np.append(best, 0.0) if best.dtype != object else np.append(best, 0)
        else:
            spill = best.min() + ticks(policy.bonus)
            pair = np.append(np.minimum(best, spill), spill)
        keys = _add(pkey, pair[slots])
    if eligible is None:
        first = _top(keys, 1, tiebreak, prefills.requests)[0]
    else:
        first = _top(keys[eligible], 1, tiebreak, prefills.requests, None, eligible)[0]
    prefill = prefills.endpoints[first]
    group = prefill.group
    requests = decodes.requests
    if mode is _PREFER and groups > 1 and group in decodes.in_group:
        same = decodes.in_group[group]
        ranked = _top(_add(dkey, -ticks(policy.bonus) * same), want, tiebreak, requests, 1.0 - same)
    elif mode is _STRICT and groups > 1:
        sub = decodes.members[group]
        ranked = _top(dkey[sub], want, tiebreak, requests, None, sub)
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
    dhits: Ints | None,
    backlog: Ints,
    slots: Positions,
    want: int,
    tiebreak: int,
    policy: Policy,
) -> Decision[E]:
    """``auto``'s pair and fallbacks (see the module docstring), with the estimate.

    ``u`` holds the decodes' utilisations with the request placed, ``backlog`` each prefill's prompt
    tokens in flight plus the ones this request makes it compute; ``slots`` maps each prefill to its
    group's index in ``decodes.groups``; ``want`` = 1 + fallbacks.
    """
    model = policy.auto
    wait = model.wait_s(u)
    lack = prompt if dhits is None else prompt - dhits
    same_key = _ticks(wait + lack * model.seconds_per_token(True))
    cross_key = _ticks(wait + lack * model.seconds_per_token(False))
    order, starts = decodes.group_order, decodes.group_starts
    home = np.minimum.reduceat(same_key[order], starts)  # per decode group: its best from a prefill in it
    away = np.minimum.reduceat(cross_key[order], starts)  # ... and its best from any other group
    groups = len(away)
    if groups == 1:
        elsewhere = np.array([np.inf])
    else:  # the best cross-group decode for a prefill of each group: the least ``away`` of the others
        low = int(away.argmin())
        elsewhere = np.full(groups, away[low])
        elsewhere[low] = np.delete(away, low).min()
    pair = np.append(np.minimum(home, elsewhere), away.min())  # the last: a prefill group without decodes
    prefill_s = model.prefill_s(backlog)
    first = _top(_add(_ticks(prefill_s), pair[slots]), 1, tiebreak, prefills.requests)[0]
    prefill = prefills.endpoints[first]
    group = prefill.group
    same = decodes.in_group.get(group)
    if same is None:
        keys, notsame = cross_key, None
    elif groups == 1:
        keys, notsame = same_key, None
    else:
        keys, notsame = np.where(same > 0.0, same_key, cross_key), 1.0 - same
    ranked = _top(keys, want, tiebreak, decodes.requests, notsame)
    out = decodes.endpoints
    picked = [out[i] for i in ranked]
    chosen = ranked[0]
    decode = picked[0]
    home_pick = decode.group == group
    margin = None
    if notsame is not None:
        outside = decodes.outside[group]
        others = keys.min(where=outside if home_pick else ~outside, initial=np.inf)
        margin = float(others - keys[chosen]) / _SCALE_F
    moved = lack if dhits is None else int(lack[chosen])
    estimate = Estimate(
        float(prefill_s[first]), model.transfer_s(moved, home_pick), float(wait[chosen]), margin
    )
    return Decision(prefill, decode, tuple(picked[1:]), _SAME if home_pick else _CROSS, estimate)


def _top(
    keys: Keys,
    n: int,
    tiebreak: int,
    requests: Ints,
    notsame: Floats | None = None,
    index: Positions | None = None,
) -> list[int]:
    """The pool positions of the first ``min(n, m)`` of m (>= 1) ranked endpoints, in ranking order.

    ``keys[j]`` is the exact integer key (integral float64 or Python int) of the endpoint at pool
    position ``index[j]`` (``j`` when ``index`` is ``None``; ``index`` ascends); ``requests`` and
    ``notsame`` (1.0 outside the prefill's group: a secondary key; ``None``: none) are indexed by pool
    position. Only the endpoints at or below the n-th key can be in the answer; those are ranked by
    :func:`_exact`.
    """
    m = len(keys)
    if m == 1:
        return [0 if index is None else int(index[0])]
    n = min(n, m)
    if keys.dtype == object:
        near = np.arange(m, dtype=np.intp)
    elif n == 1:
        near = np.flatnonzero(keys == keys.min())
        if len(near) == 1:
            return [int(near[0]) if index is None else int(index[near[0]])]
    elif n == m:
        near = np.arange(m, dtype=np.intp)
    else:
        near = np.flatnonzero(keys <= np.partition(keys, n - 1)[n - 1])
    picked = keys[near]
    if index is not None:
        near = index[near]
    return _exact(near, picked, None if notsame is None else notsame[near], requests, n, tiebreak)


def _exact(
    near: Positions, keys: Keys, notsame: Floats | None, requests: Ints, n: int, tiebreak: int
) -> list[int]:
    """The first ``n`` of the ``near`` pool positions (ascending) by ``(keys, notsame, requests)``,
    tie classes rotated.

    With ``notsame``, the first two keys are encoded order-preservingly as the integer
    ``2 * key + notsame`` (exact in float64 below 2**51, else on Python ints). One ``np.lexsort``
    orders the keys; each tie class needed (at most n) is then delimited by bisection, in a short
    Python window of the sorted keys or, for a class running past it, in the arrays themselves, so
    no step but the sort grows with the number of tied endpoints.
    """
    t = keys
    if notsame is not None:
        if t.dtype != object and np.abs(t).max() < _EXACT:
            t = t + t + notsame
        else:
            t = 2 * _ints(t) + notsame.astype(np.int64).astype(object)
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
