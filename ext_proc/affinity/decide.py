"""The routing decision: one prefill, one decode and a few decode fallbacks for a request.

:func:`choose` is a pure function of its arguments (no I/O, clock or randomness; ``tiebreak`` is the
only source of variation), so equal inputs always give an equal result. It reads endpoint load from
the arrays of two :class:`~ext_proc.affinity.Pool` values and returns their endpoint objects.

Units. Token counts (``Cost``, ``Pool.tokens``, ``Pool.capacity``) are tokens. The utilisation of an
endpoint, ``u = (tokens + cost) / capacity`` (bit for bit :meth:`Candidate.utilisation`: the int64
sum is exact and converted to float64 once; ``cost`` is ``Cost.prefill_tokens`` for prefills and
``Cost.decode_tokens`` for decodes), is dimensionless, 1.0 meaning full. ``Policy.bonus`` is in the
same units.

Ranking. Every pool of endpoints is ranked by the ascending key
``(ticks(v) - bonus_ticks * same, not same, active_requests)``, where ``v`` is ``u`` (``auto``: the
wait estimate in seconds, see below) and ``same`` says the endpoint is in the chosen prefill's
``pdGroupID`` group (only used in ``prefer`` and ``auto`` modes; it is 0 otherwise).
Endpoints whose keys are equal form a tie class; a class is taken in input order and rotated left by
``tiebreak % len(class)``, so a round-robin ``tiebreak`` spreads picks over every tied endpoint.

``auto`` (:mod:`ext_proc.affinity.auto`). The decodes are ranked by ``v = wait_s(u)`` with the
request's transfer penalty ``penalty_s(prompt_tokens)`` as the bonus: the key orders decodes by the
estimated delay ``transfer + wait`` (both in seconds), on a grid of 1 ns. When the penalty is 0 on that
grid (equal bandwidths, an empty prompt) or every decode is in one group, transfers cannot tell the
decodes apart and the order is exactly ``off``'s.

Float robustness. Utilisations and the bonus are compared on a grid of ``EPS = 1e-9``:
``ticks(x) = round(x * SCALE)`` with ``SCALE = 1e9`` turns them into integers before any tie or
bonus comparison, so float noise (``0.6 + 0.3 < 0.9``) never flips a decision and a decode exactly
at the bonus counts as within it. Float scores only pre-select, with a safety margin, the endpoints
that can appear in the answer; ranking those is exact integer arithmetic (integral float64 below
2**53, Python ints beyond).

Cost: scoring is a few numpy operations over the pool's arrays. Pre-selecting the best
k = ``fallback_count + 1`` sorts the scores as a Python list for pools of at most ``_LIST_MAX``
(numpy calls cost more than they save there) and is a partition plus a scan above. When the k best
are more than the margin apart from each other and from the rest (the usual case under load), they
are the answer; otherwise all endpoints within the margin (a whole idle pool, say) are ranked exactly
with one ``np.lexsort``, and only the endpoints returned are touched in Python.
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
    Locality,
    Mode,
    Policy,
    Rejection,
    RejectReason,
)
from ext_proc.affinity.pool import Pool

EPS = 1e-9
"""Resolution of utilisation comparisons."""
SCALE = 1_000_000_000
"""``1 / EPS``: utilisation ticks per unit of utilisation."""
_SCALE_F = float(SCALE)  # the same product as ``x * SCALE`` for a float x; a float scalar is cheaper in numpy
_SLACK = 4 * EPS  # pre-selection margin; covers the two roundings and float error of a score
_LIST_MAX = 128  # up to this many endpoints, sorting a Python list beats numpy partition + scan
# Enum members bound once: attribute access on an Enum class costs ~0.25 µs per lookup on CPython 3.11.
_STRICT, _PREFER, _AUTO = Mode.STRICT, Mode.PREFER, Mode.AUTO
_SAME, _CROSS, _DECODE_ONLY = Locality.SAME_GROUP, Locality.CROSS_GROUP, Locality.DECODE_ONLY

Floats = NDArray[np.float64]
Ints = NDArray[np.int64]
Positions = NDArray[np.intp]
_FLOAT_INTS = 2**53  # float64 holds every integer below this exactly
_WINDOW = 64  # sorted keys copied (beyond n) to Python lists to delimit tie classes


def ticks(x: float) -> int:
    """``x`` (a utilisation or bonus) on the integer grid of ``EPS``: ``round(x * SCALE)``."""
    return round(x * SCALE)


def choose(
    cost: Cost,
    prefills: Pool[E],
    decodes: Pool[E],
    policy: Policy,
    tiebreak: int,
) -> Decision[E] | Rejection:
    """Pick where one request runs, from healthy endpoints only (the pools hold no others).

    * No decodes: ``Rejection(NO_DECODE_ENDPOINT)``.
    * No prefills: decode-only routing in every mode (``prefill=None``, ``Locality.DECODE_ONLY``,
      decode and fallbacks ranked as in ``off``).
    * Prefill: the lowest ``u``; in ``strict`` mode only among prefills whose group has a decode
      (none → ``Rejection(NO_SAME_GROUP_DECODE)``).
    * Decode, with S = decodes in the prefill's group and A = all decodes: ``off`` → best of A;
      ``strict`` → best of S (empty → ``Rejection(NO_SAME_GROUP_DECODE)``); ``prefer`` → the best of
      S if ``u(best S) <= u(best A) + bonus``, else the best of A; ``auto`` → the decode of A with the
      least estimated delay ``transfer + wait`` (``policy.auto``), with its :class:`Estimate`.
    * Fallbacks: the next ``policy.fallback_count`` decodes of the same ranking (``strict``: within
      S; ``prefer``: same-group endpoints scored ``u - bonus`` and winning ties; ``auto``: by
      estimated delay, same-group endpoints winning ties), all distinct.

    ``tiebreak`` (e.g. a round-robin counter) rotates among endpoints tied on ``u`` and
    ``active_requests``; see the module docstring for the exact ranking and float handling.
    Token counts must fit in int64 (``OverflowError`` otherwise); the pools are only read.
    """
    if not decodes.size:
        return Rejection(
            RejectReason.NO_DECODE_ENDPOINT,
            f"no healthy decode endpoint (healthy prefill endpoints: {prefills.size})",
        )
    want = policy.fallback_count + 1
    u = (decodes.tokens + cost.decode_tokens) / decodes.capacity
    out = decodes.endpoints
    if not prefills.size:
        picked = [out[i] for i in _rank(u, want, tiebreak, u, decodes.requests)]
        return Decision(None, picked[0], tuple(picked[1:]), _DECODE_ONLY)

    mode = policy.mode
    pu = (prefills.tokens + cost.prefill_tokens) / prefills.capacity
    requests = prefills.requests
    eligible = None  # strict mode, when some prefill group has no decode: the prefills that may serve
    if mode is _STRICT and not prefills.members.keys() <= decodes.members.keys():
        groups = [prefills.members[g] for g in prefills.members if g in decodes.members]
        if not groups:
            names = ", ".join(sorted(repr(g) for g in prefills.members))
            return Rejection(
                RejectReason.NO_SAME_GROUP_DECODE,
                f"strict pdGroupID affinity: no healthy decode endpoint in the group of any of the "
                f"{prefills.size} healthy prefill endpoints (prefill groups: {names})",
            )
        eligible = np.sort(np.concatenate(groups))
    if eligible is None:
        first = _rank(pu, 1, tiebreak, pu, requests)[0]
    else:
        first = _rank(pu[eligible], 1, tiebreak, pu, requests, None, 0.0, eligible)[0]
    prefill = prefills.endpoints[first]
    group = prefill.group

    requests = decodes.requests
    # In prefer mode with decodes of other groups; else the bonus is for none or all: order as in off.
    same = decodes.in_group.get(group) if mode is _PREFER and len(decodes.members) > 1 else None
    if same is not None:
        bonus = policy.bonus
        ranked = _rank(u - decodes.bonus_in(group, bonus), want, tiebreak, u, requests, same, bonus)
    elif mode is _STRICT and len(decodes.members) > 1:  # with one group, S is all decodes
        sub = decodes.members.get(group)
        if sub is None:
            return Rejection(
                RejectReason.NO_SAME_GROUP_DECODE,
                f"strict pdGroupID affinity: no healthy decode endpoint in group {group!r} "
                f"of prefill {prefill.address}",
            )
        ranked = _rank(u[sub], want, tiebreak, u, requests, None, 0.0, sub)
    elif mode is _AUTO:
        return _choose_auto(cost.prefill_tokens, prefill, decodes, u, want, tiebreak, policy)
    else:
        ranked = _rank(u, want, tiebreak, u, requests)
    picked = [out[i] for i in ranked]
    decode = picked[0]
    return Decision(prefill, decode, tuple(picked[1:]), _SAME if decode.group == group else _CROSS)


def _choose_auto(
    prompt_tokens: int, prefill: E, decodes: Pool[E], u: Floats, want: int, tiebreak: int, policy: Policy
) -> Decision[E]:
    """``auto``'s decode and fallbacks for ``prefill`` (see the module docstring), with the estimate.

    ``u`` holds the decodes' utilisations with the request placed; ``want`` = 1 + fallbacks.
    """
    model = policy.auto
    group = prefill.group
    wait = model.wait_s(u)
    penalty = model.penalty_s(prompt_tokens)
    same = decodes.in_group.get(group) if len(decodes.members) > 1 else None
    if same is None or ticks(penalty) == 0:  # every decode costs the same transfer: off's order
        ranked = _rank(u, want, tiebreak, u, decodes.requests)
        delay = wait
    else:
        delay = wait - penalty * same  # the estimate minus the cross-group transfer time
        ranked = _rank(delay, want, tiebreak, wait, decodes.requests, same, penalty)
    out = decodes.endpoints
    picked = [out[i] for i in ranked]
    first = ranked[0]
    decode = picked[0]
    home = decode.group == group
    margin = None
    if same is not None:
        outside = decodes.outside[group]
        others = delay.min(where=outside if home else ~outside, initial=np.inf)
        margin = float(others - delay[first])
    estimate = Estimate(model.transfer_s(prompt_tokens, home), float(wait[first]), margin)
    return Decision(prefill, decode, tuple(picked[1:]), _SAME if home else _CROSS, estimate)


def _rank(
    scores: Floats,
    n: int,
    tiebreak: int,
    u: Floats,
    requests: Ints,
    same: Floats | None = None,
    bonus: float = 0.0,
    index: Positions | None = None,
) -> list[int]:
    """The pool positions of the first ``min(n, m)`` of m (>= 1) ranked endpoints, in ranking order.

    ``scores[j]`` estimates the ranking score (``u``, minus ``bonus`` when same) of the endpoint at
    pool position ``index[j]`` (``j`` when ``index`` is ``None``; ``index`` ascends). ``u``,
    ``requests`` and ``same`` (1.0 in the prefill's group; ``None``: no bonus) are indexed by pool
    position. Scores only pre-select the endpoints within the slack of the n-th best; when those are
    n and pairwise more than the slack apart, their exact keys are in score order and nothing ties:
    no key is computed. Otherwise :func:`_exact` ranks them.
    """
    m = len(scores)
    if n >= m:
        if m == 1:
            return [0 if index is None else int(index[0])]
        n = m
    if m <= _LIST_MAX:
        listed = scores.tolist()
        small = sorted(listed)
        high = small[n - 1]
        slack = _SLACK * (1.0 + abs(small[0]) + abs(high))
        limit = high + slack
        if n == m or small[n] > limit:  # then the n best are the candidates; are they apart?
            if n == 1:
                best = [listed.index(high)]
                return best if index is None else [int(index[best[0]])]
            prev = small[0]
            best = [listed.index(prev)]
            for s in small[1:n]:
                if s - prev <= slack:
                    break
                best.append(listed.index(s))
                prev = s
            else:
                return best if index is None else [int(index[j]) for j in best]
        near = np.array([j for j, s in enumerate(listed) if s <= limit], dtype=np.intp)
    else:
        if n == 1:
            low = high = float(scores[scores.argmin()])
        else:
            part = np.partition(scores, (0, n - 1))
            low, high = float(part[0]), float(part[n - 1])
        slack = _SLACK * (1.0 + abs(low) + abs(high))
        limit = high + slack
        near = np.flatnonzero(scores <= limit)
        if len(near) == n:
            pairs = sorted(zip(scores[near].tolist(), near.tolist(), strict=True))
            for i in range(1, n):
                if pairs[i][0] - pairs[i - 1][0] <= slack:
                    break
            else:
                best = [j for _, j in pairs]
                return best if index is None else [int(index[j]) for j in best]
    if index is not None:
        near = index[near]
    bonus_ticks = ticks(bonus)
    # Every u of a near endpoint is at most limit + bonus, so every 2 * ticks(u) is below this bound:
    floats_exact = 2 * (abs(limit) * SCALE + bonus_ticks + 2) < _FLOAT_INTS
    return _exact(near, u, same, requests, n, bonus_ticks, tiebreak, floats_exact)


def _exact(
    near: Positions,
    u: Floats,
    same: Floats | None,
    requests: Ints,
    n: int,
    bonus_ticks: int,
    tiebreak: int,
    floats_exact: bool,
) -> list[int]:
    """The first ``n`` of the ``near`` pool positions (ascending) by exact key, tie classes rotated.

    ``np.rint(u * SCALE)`` is :func:`ticks` of each ``u`` exactly (the same float product, rounded
    half to even) as an integral float64. With the bonus, ``(t - bonus_ticks * same, not same)`` is
    encoded order-preservingly as the integer ``2 * t - (2 * bonus_ticks + 1) * same``; that is
    exact in float64 when ``floats_exact`` (every term below 2**53), else computed on Python ints.
    One ``np.lexsort`` orders the keys; each tie class needed (at most n) is then delimited by
    bisection, in a short Python window of the sorted keys or, for a class running past it, in the
    arrays themselves, so no step but the sort grows with the number of tied endpoints.
    """
    t = np.rint(u[near] * _SCALE_F)
    if same is not None:
        g, step = same[near], 2 * bonus_ticks + 1
        if floats_exact:
            t = t + t - float(step) * g
        else:
            ints = np.array([int(x) for x in t.tolist()], dtype=object)
            t = 2 * ints - step * g.astype(np.int64).astype(object)
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
