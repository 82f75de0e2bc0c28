"""The routing decision: one prefill, one decode and a few decode fallbacks for a request.

:func:`choose` is a pure function of its arguments (no I/O, clock or randomness; ``tiebreak`` is the
only source of variation), so equal inputs always give an equal result.

Units. Token counts (``Cost``, ``Candidate.active_tokens``, ``Candidate.token_capacity``) are tokens.
The utilisation of an endpoint, ``u = (active_tokens + cost) / token_capacity`` (exactly
:meth:`Candidate.utilisation`; ``cost`` is ``Cost.prefill_tokens`` for prefills and
``Cost.decode_tokens`` for decodes), is dimensionless, 1.0 meaning full. ``Policy.bonus`` is in the
same units.

Ranking. Every pool of endpoints is ranked by the ascending key
``(ticks(u) - bonus_ticks * same, not same, active_requests)``, where ``same`` says the endpoint is
in the chosen prefill's ``pdGroupID`` group (only used in ``prefer`` mode; it is 0 otherwise).
Endpoints whose keys are equal form a tie class; a class is taken in input order and rotated left by
``tiebreak % len(class)``, so a round-robin ``tiebreak`` spreads picks over every tied endpoint.

Float robustness. Utilisations and the bonus are compared on a grid of ``EPS = 1e-9``:
``ticks(x) = round(x * SCALE)`` with ``SCALE = 1e9`` turns them into integers before any tie or
bonus comparison, so float noise (``0.6 + 0.3 < 0.9``) never flips a decision and a decode exactly
at the bonus counts as within it. Float scores only pre-select, with a safety margin, the few
endpoints that can appear in the answer; ranking those is exact integer arithmetic.

Cost: each ``u`` is computed once; selecting the best k = ``fallback_count + 1`` is O(n log k) with
``heapq.nsmallest`` (pools of at most 64 are sorted in C instead, which is cheaper at that size).
"""

from __future__ import annotations

from collections.abc import Sequence
from heapq import nsmallest
from itertools import groupby

from ext_proc.affinity.model import (
    Cost,
    Decision,
    E,
    Locality,
    Mode,
    Policy,
    Rejection,
    RejectReason,
)

EPS = 1e-9
"""Resolution of utilisation comparisons."""
SCALE = 1_000_000_000
"""``1 / EPS``: utilisation ticks per unit of utilisation."""
_SLACK = 4 * EPS  # pre-selection margin; covers the two roundings and float error of a score
_SORT_MAX = 64  # up to this pool size a C sort of the scores beats heapq.nsmallest's Python loop
# Enum members bound once: attribute access on an Enum class costs ~0.25 µs per lookup on CPython 3.11.
_STRICT, _PREFER = Mode.STRICT, Mode.PREFER
_SAME, _CROSS, _DECODE_ONLY = Locality.SAME_GROUP, Locality.CROSS_GROUP, Locality.DECODE_ONLY


def ticks(x: float) -> int:
    """``x`` (a utilisation or bonus) on the integer grid of ``EPS``: ``round(x * SCALE)``."""
    return round(x * SCALE)


def choose(
    cost: Cost,
    prefills: Sequence[E],
    decodes: Sequence[E],
    policy: Policy,
    tiebreak: int,
) -> Decision[E] | Rejection:
    """Pick where one request runs, from healthy endpoints only.

    * No decodes: ``Rejection(NO_DECODE_ENDPOINT)``.
    * No prefills: decode-only routing in every mode (``prefill=None``, ``Locality.DECODE_ONLY``,
      decode and fallbacks ranked as in ``off``).
    * Prefill: the lowest ``u``; in ``strict`` mode only among prefills whose group has a decode
      (none → ``Rejection(NO_SAME_GROUP_DECODE)``).
    * Decode, with S = decodes in the prefill's group and A = all decodes: ``off`` → best of A;
      ``strict`` → best of S (empty → ``Rejection(NO_SAME_GROUP_DECODE)``); ``prefer`` → the best of
      S if ``u(best S) <= u(best A) + bonus``, else the best of A.
    * Fallbacks: the next ``policy.fallback_count`` decodes of the same ranking (``strict``: within
      S; ``prefer``: same-group endpoints scored ``u - bonus`` and winning ties), all distinct.

    ``tiebreak`` (e.g. a round-robin counter) rotates among endpoints tied on ``u`` and
    ``active_requests``; see the module docstring for the exact ranking and float handling.
    """
    if not decodes:
        return Rejection(
            RejectReason.NO_DECODE_ENDPOINT,
            f"no healthy decode endpoint (healthy prefill endpoints: {len(prefills)})",
        )
    dc = cost.decode_tokens
    want = policy.fallback_count + 1 if policy.fallback_count > 0 else 1
    if not prefills:
        scores = [(d.active_tokens + dc) / d.token_capacity for d in decodes]
        ranked = _rank(decodes, scores, want, dc, None, 0, tiebreak)
        return Decision(None, ranked[0], tuple(ranked[1:]), _DECODE_ONLY)

    mode = policy.mode
    pc = cost.prefill_tokens
    pool, groups = prefills, None  # groups: the decode groups, in strict mode only
    if mode is _STRICT:
        groups = {d.group for d in decodes}
        if not {p.group for p in prefills} <= groups:  # cheaper than filtering in the usual case
            pool = [p for p in prefills if p.group in groups]
        if not pool:
            names = ", ".join(sorted({repr(p.group) for p in prefills}))
            return Rejection(
                RejectReason.NO_SAME_GROUP_DECODE,
                f"strict pdGroupID affinity: no healthy decode endpoint in the group of any of the "
                f"{len(prefills)} healthy prefill endpoints (prefill groups: {names})",
            )
    scores = [(p.active_tokens + pc) / p.token_capacity for p in pool]
    prefill = _rank(pool, scores, 1, pc, None, 0, tiebreak)[0]
    group = prefill.group

    if mode is _PREFER:
        bonus = policy.bonus
        scores = [
            (d.active_tokens + dc) / d.token_capacity - (bonus if d.group == group else 0.0) for d in decodes
        ]
        ranked = _rank(decodes, scores, want, dc, group, ticks(bonus), tiebreak)
    else:
        if groups is not None and len(groups) > 1:  # strict; with one group, S is all decodes
            decodes = [d for d in decodes if d.group == group]
            if not decodes:
                return Rejection(
                    RejectReason.NO_SAME_GROUP_DECODE,
                    f"strict pdGroupID affinity: no healthy decode endpoint in group {group!r} "
                    f"of prefill {prefill.address}",
                )
        scores = [(d.active_tokens + dc) / d.token_capacity for d in decodes]
        ranked = _rank(decodes, scores, want, dc, None, 0, tiebreak)
    decode = ranked[0]
    locality = _SAME if decode.group == group else _CROSS
    return Decision(prefill, decode, tuple(ranked[1:]), locality)


def _rank(
    pool: Sequence[E],
    scores: list[float],
    n: int,
    cost: int,
    group: str | None,
    bonus_ticks: int,
    tiebreak: int,
) -> list[E]:
    """The first ``min(n, len(pool))`` endpoints of ``pool`` (non-empty) in ranking order.

    ``scores[i]`` is the float estimate of endpoint i's score (``u``, minus the bonus when its
    group is ``group``); it only pre-selects the endpoints within ``_SLACK`` of the n-th best,
    whose exact keys are then computed on the tick grid. ``group=None`` disables the bonus.
    """
    size = len(pool)
    if n >= size:
        if size == 1:
            return [pool[0]]
        n = size
    small = sorted(scores) if size <= _SORT_MAX else nsmallest(n + 1, scores)
    # Fast path: the n best scores are more than the slack apart from each other and from the next
    # one, so their exact keys are in the same order and nothing ties: no key needs computing.
    last = n if n < size else n - 1
    slack = _SLACK * (1.0 + abs(small[0]) + abs(small[last]))
    if n == 1:
        if small[1] - small[0] > slack:
            return [pool[scores.index(small[0])]]
    else:
        for i in range(last):
            if small[i + 1] - small[i] <= slack:
                break
        else:
            return [pool[scores.index(s)] for s in small[:n]]
    limit = small[n - 1] + slack
    near = [c for c, s in zip(pool, scores, strict=True) if s <= limit]
    keys = []
    for c in near:
        u = round((c.active_tokens + cost) / c.token_capacity * SCALE)
        if c.group == group:
            keys.append((u - bonus_ticks, False, c.active_requests))
        else:
            keys.append((u, True, c.active_requests))
    order = sorted(range(len(near)), key=keys.__getitem__)
    if len(set(keys)) == len(keys):
        return [near[i] for i in order[:n]]
    out: list[E] = []
    for _, tied in groupby(order, keys.__getitem__):
        cls = list(tied)
        r = tiebreak % len(cls)
        out.extend(near[i] for i in cls[r:] + cls[:r])
        if len(out) >= n:
            break
    return out[:n]
