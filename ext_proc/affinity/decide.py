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

from ext_proc.affinity.auto import AutoModel
from ext_proc.affinity.extremes import LIST_MAX, largest, smallest
from ext_proc.affinity.model import (
    Cost,
    Decision,
    E,
    Estimate,
    Hits,
    Lacks,
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


def _loads(
    prefills: Pool[E], decodes: Pool[E], hits: Hits | None
) -> tuple[Ints | Floats | int | float | None, ...]:
    """The load and hits the rule reads, in the form its arithmetic runs on: ``(prefill tokens,
    decode tokens, decode capacity, prefill hits, decode hits, prefill CPU-tier hits, decode CPU-tier
    hits)``, the hits ``None`` without :class:`Hits`.

    The pools' arrays; or, for one decode and at most one prefill (no key is computed: the pair is the
    answer; pools of one are below :data:`LIST_MAX`, unless a test sets it to 0 for the general form),
    their elements as Python numbers (``None`` for an empty prefill pool's), on which the same
    expressions give the floats numpy gives (an int converts to the nearest float either way) at a
    tenth of numpy's cost per operation.
    """
    arrays = (prefills.tokens, decodes.tokens, decodes.capacity, *((None,) * 4 if hits is None else hits))
    if decodes.size != 1 or prefills.size > 1 or LIST_MAX < 1:
        return arrays
    return tuple([None if a is None or not len(a) else a.item(0) for a in arrays])  # type: ignore[return-value]


def _at(term: Ints | Floats | int | float, i: int) -> int | float:
    """Element ``i`` of a per-endpoint term as a Python number; the term itself when it is one (from
    :func:`_loads`' Python numbers, or the same for every endpoint)."""
    return term.item(i) if isinstance(term, np.ndarray) else term


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


def _tick(mask: NDArray[np.bool_], exact: bool) -> Keys:
    """One tick where ``mask`` is true, 0 elsewhere, as keys (float64 when ``exact``, else Python ints)."""
    return mask.astype(np.float64) if exact else mask.astype(np.int64).astype(object)


def prefill_utilisation(prefills: Pool[E], decodes: Pool[E], uncached: int | Ints, mode: Mode) -> Floats:
    """Each prefill's utilisation with the request placed (``off``, ``prefer``, ``strict``).

    Its tokens in flight (weighed by ``r(g)`` unless ``off``: docs/routing.md) plus the ``uncached``
    prompt tokens it would compute, over its capacity: its key before credit."""
    inflight = prefills.tokens
    if mode is not _OFF and prefills.size:
        inflight = inflight * prefills.share_ratios_in(decodes)
    return (inflight + uncached) / prefills.capacity


def endpoint_keys(
    utilisation: Floats,
    hits: Ints | None,
    cpu: Ints | None,
    lacking: NDArray[np.bool_] | None,
    prompt: int,
    policy: Policy,
    exact: bool,
) -> Keys:
    """The key of each endpoint of one pool in ``off``, ``prefer`` and ``strict``, in ticks.

    docs/routing.md "The exact rule": ``ticks(utilisation) - credit(hits)``, one tick more where
    ``lacking`` (the request's adapter). Integral float64 when ``exact`` (the caller checked the
    magnitudes), else Python ints."""
    keys = _ticks(utilisation, exact) - _credit(hits, cpu, prompt, policy, exact)
    return keys if lacking is None else keys + _tick(lacking, exact)


def auto_wait(
    prompt: int, u: Floats | float, dhits: Ints | int | None, lacks: Lacks | None, model: AutoModel
) -> tuple[Floats | float, Ints | int]:
    """``auto``'s per-decode terms ``(wait, lack)``.

    The wait at each decode (``u``: its utilisation with the request placed; its adapter's load included
    when it lacks it) and the prompt tokens it lacks."""
    wait = model.wait_s(u)
    if lacks is not None:
        wait = wait + model.lora_load_s(lacks.decode)
    return wait, prompt if dhits is None else prompt - dhits


def auto_seconds(
    wait: Floats,
    lack: int | Ints,
    priced: Ints,
    pcpu: Ints | None,
    dcpu: Ints | None,
    lacks: Lacks | None,
    model: AutoModel,
) -> tuple[Floats, Floats, Floats]:
    """``auto``'s costs in seconds, ``(prefill, S(d), C(d))`` (docs/routing.md "The exact rule").

    ``wait``, ``lack``: :func:`auto_wait`'s; ``priced``: the tokens each prefill's cost is priced at
    (a miss priced twice); ``pcpu``/``dcpu``: the hit tokens held only in a CPU tier (their load added);
    ``lacks``: the prefills lacking the adapter pay its load (the decodes' is in ``wait``)."""
    same_s = wait + lack * model.seconds_per_token(True)
    cross_s = wait + lack * model.seconds_per_token(False)
    prefill_s = model.prefill_s(priced)
    if dcpu is not None:
        dload = model.cpu_load_s(dcpu)
        same_s, cross_s = same_s + dload, cross_s + dload
    if pcpu is not None:
        prefill_s = prefill_s + model.cpu_load_s(pcpu)
    if lacks is not None:
        prefill_s = prefill_s + model.lora_load_s(lacks.prefill)
    return prefill_s, same_s, cross_s


def choose(
    cost: Cost,
    prefills: Pool[E],
    decodes: Pool[E],
    policy: Policy,
    tiebreak: int,
    hits: Hits | None = None,
    lacks: Lacks | None = None,
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
    counts must fit in int64 (numpy raises ``OverflowError`` on the pools' arrays otherwise); the
    pools are only read. ``lacks`` (optional, a request for a LoRA adapter): the endpoints known to lack
    it (docs/routing.md "LoRA adapters").
    """
    if not decodes.size:
        return NoPair(
            NoPairReason.NO_DECODE_ENDPOINT,
            f"no healthy decode endpoint (healthy prefill endpoints: {prefills.size})",
        )
    want = policy.fallback_count + 1
    prompt = cost.prefill_tokens
    ptokens, dtokens, capacity, phits, dhits, pcpu, dcpu = _loads(prefills, decodes, hits)
    u = (dtokens + cost.decode_tokens) / capacity
    out = decodes.endpoints
    mode = policy.mode
    uncached = prompt if phits is None else prompt - phits
    if mode is _AUTO and prefills.size:
        backlog = ptokens + uncached
        return _choose_auto(
            prompt, prefills, decodes, u, backlog, uncached, dhits, pcpu, dcpu, lacks, want, tiebreak, policy
        )
    groups = len(decodes.groups)
    eligible = None
    if mode is _STRICT and prefills.size:
        slots = prefills.slots_in(decodes)
        if largest(slots) >= groups:  # some prefill group has no decode: only the others may serve
            eligible = np.flatnonzero(slots < groups)
            if not len(eligible):
                names = ", ".join(sorted(repr(g) for g in prefills.groups))
                return NoPair(
                    NoPairReason.NO_SAME_GROUP_DECODE,
                    f"strict pdGroupID affinity: no healthy decode endpoint in the group of any of "
                    f"the {prefills.size} healthy prefill endpoints (prefill groups: {names})",
                )
    if prefills.size <= 1 and decodes.size == 1:  # one decode, one prefill or none: no key is computed
        first, ranked = (0 if prefills.size else None), [0]
    else:
        first, ranked = _rank(
            prompt, prefills, decodes, u, uncached, hits, lacks, eligible, want, tiebreak, policy
        )
    picked = [out[i] for i in ranked]
    decode = picked[0]
    if first is None:
        return Decision(None, decode, tuple(picked[1:]), _DECODE_ONLY)
    prefill = prefills.endpoints[first]
    return Decision(prefill, decode, tuple(picked[1:]), _SAME if decode.group == prefill.group else _CROSS)


def _rank(
    prompt: int,
    prefills: Pool[E],
    decodes: Pool[E],
    u: Floats,
    uncached: int | Ints,
    hits: Hits | None,
    lacks: Lacks | None,
    eligible: Positions | None,
    want: int,
    tiebreak: int,
    policy: Policy,
) -> tuple[int | None, list[int]]:
    """``off``, ``prefer`` and ``strict``'s ranking: the prefill's pool position (``None`` without
    prefills: decode-only) and the decodes' (chosen first, then fallbacks).

    ``u`` holds the decodes' utilisations with the request placed, ``uncached`` the prompt tokens each
    prefill would compute; ``eligible`` (``strict``): the prefills whose group has a decode, ``None``
    when all have one. An endpoint in ``lacks`` ranks one tick behind (its key + 1)."""
    mode = policy.mode
    phits, dhits, pcpu, dcpu = (None, None, None, None) if hits is None else hits
    pu = prefill_utilisation(prefills, decodes, uncached, mode)
    top = float(largest(u)) + (float(largest(pu)) if prefills.size else 0.0)
    exact = top + 2.0 * policy.prefix_weight + policy.bonus < _SAFE_U
    dkey = endpoint_keys(u, dhits, dcpu, None if lacks is None else lacks.decode, prompt, policy, exact)
    requests = decodes.requests
    if not prefills.size:
        return None, _top(dkey, want, tiebreak, requests)
    keys = endpoint_keys(pu, phits, pcpu, None if lacks is None else lacks.prefill, prompt, policy, exact)
    groups = len(decodes.groups)
    if mode is not _OFF:  # off: the decode does not depend on the prefill's group
        pair = np.empty(groups + 1, dtype=dkey.dtype)  # the last: a prefill group without decodes
        best = np.minimum.reduceat(dkey[decodes.group_order], decodes.group_starts)
        if mode is _STRICT:
            pair[:groups], pair[groups] = best, 0
        else:
            spill = smallest(best) + ticks(policy.bonus)
            pair[:groups], pair[groups] = np.minimum(best, spill), spill
        keys = keys + pair[prefills.slots_in(decodes)]
    if eligible is None:
        first = _top(keys, 1, tiebreak, prefills.requests)[0]
    else:
        first = _top(keys[eligible], 1, tiebreak, prefills.requests, eligible)[0]
    group = prefills.endpoints[first].group
    if mode is _PREFER and groups > 1 and group in decodes.in_group:
        # (key - bonus * same, not same) as one integer, order-preserving: 2 * key - (2 * bonus + 1) * same
        step = 2 * ticks(policy.bonus) + 1
        same = decodes.in_group[group] if exact else decodes.in_group[group].astype(np.int64).astype(object)
        return first, _top(dkey + dkey - step * same, want, tiebreak, requests)
    if mode is _STRICT and groups > 1:
        sub = decodes.members[group]
        return first, _top(dkey[sub], want, tiebreak, requests, sub)
    return first, _top(dkey, want, tiebreak, requests)  # off, or one decode group: the bonus for none or all


def _choose_auto(
    prompt: int,
    prefills: Pool[E],
    decodes: Pool[E],
    u: Floats | float,
    backlog: Ints | int,
    uncached: Ints | int,
    dhits: Ints | int | None,
    pcpu: Ints | int | None,
    dcpu: Ints | int | None,
    lacks: Lacks | None,
    want: int,
    tiebreak: int,
    policy: Policy,
) -> Decision[E]:
    """``auto``'s pair and fallbacks (docs/routing.md "The exact rule"), with the estimate.

    ``u`` holds the decodes' utilisations with the request placed, ``backlog`` each prefill's prompt
    tokens in flight plus the ones this request makes it compute (``uncached``), ``dhits`` the prompt
    tokens each decode holds, ``pcpu``/``dcpu`` the hit tokens held only in a CPU tier (``None``: no
    hits), all as :func:`_loads` gives them; ``want`` = 1 + fallbacks. A hit held only in a CPU tier
    adds its load (:meth:`AutoModel.cpu_load_s`) to the prefill's time at a prefill, to the
    transfer's at a decode. An endpoint in ``lacks`` adds loading the request's LoRA adapter
    (:meth:`AutoModel.lora_load_s`): to the prefill's time at a prefill, to the wait at a decode. One
    prefill and one decode make the only pair: no key is computed (:func:`_top` reads none for one
    endpoint).
    """
    model = policy.auto
    wait, lack = auto_wait(prompt, u, dhits, lacks, model)
    if prefills.size == decodes.size == 1:
        first, ranked, margin = 0, [0], None
    else:
        first, ranked, margin = _rank_auto(
            prefills, decodes, wait, lack, backlog + uncached, pcpu, dcpu, lacks, want, tiebreak, model
        )
    prefill = prefills.endpoints[first]
    out = decodes.endpoints
    picked = [out[i] for i in ranked]
    chosen = ranked[0]
    decode = picked[0]
    home_pick = decode.group == prefill.group
    prefill_first = model.prefill_s(_at(backlog, first))
    transfer = model.transfer_s(_at(lack, chosen), home_pick)
    if pcpu is not None:
        prefill_first += model.cpu_load_s(_at(pcpu, first))
    if lacks is not None and lacks.prefill[first]:
        prefill_first += model.lora_load_ms / 1e3
    if dcpu is not None:
        transfer += model.cpu_load_s(_at(dcpu, chosen))
    estimate = Estimate(prefill_first, transfer, _at(wait, chosen), margin)
    return Decision(prefill, decode, tuple(picked[1:]), _SAME if home_pick else _CROSS, estimate)


def _rank_auto(
    prefills: Pool[E],
    decodes: Pool[E],
    wait: Floats,
    lack: int | Ints,
    priced: Ints,
    pcpu: Ints | None,
    dcpu: Ints | None,
    lacks: Lacks | None,
    want: int,
    tiebreak: int,
    model: AutoModel,
) -> tuple[int, list[int], float | None]:
    """``auto``'s ranking: the prefill's pool position, the decodes' (chosen first, then fallbacks)
    and the estimate's margin (``None`` when every decode has the chosen one's locality).

    ``wait`` per decode (its adapter load included), ``lack`` the prompt tokens each decode lacks,
    ``priced`` the tokens each prefill's cost is priced at (a miss priced twice: docs/routing.md "The
    exact rule")."""
    prefill_s, same_s, cross_s = auto_seconds(wait, lack, priced, pcpu, dcpu, lacks, model)
    exact = max(largest(cross_s), largest(same_s), largest(prefill_s)) < _EXACT / 4 / _SCALE_F
    same_key, cross_key = _ticks(same_s, exact), _ticks(cross_s, exact)
    order, starts = decodes.group_order, decodes.group_starts
    groups = len(starts)
    pair = np.empty(groups + 1, dtype=same_key.dtype)  # per group of the prefill; the last: no decodes
    home = np.minimum.reduceat(same_key[order], starts)  # per decode group: its best from a prefill in it
    if groups == 1:
        pair[0], pair[1] = home[0], smallest(cross_key)
    else:  # from a prefill of group g, the best cross-group decode is the least ``away`` of the others
        away = np.minimum.reduceat(cross_key[order], starts)
        low = int(away.argmin())
        least = away[low]
        second = np.partition(away, 1)[1] if exact else sorted(away.tolist())[1]  # == least on a tie
        pair[:groups] = np.minimum(home, least)
        pair[low] = min(home[low], second)
        pair[groups] = least
    slots = prefills.slots_in(decodes)
    first = _top(_ticks(prefill_s, exact) + pair[slots], 1, tiebreak, prefills.requests)[0]
    group = prefills.endpoints[first].group
    same = decodes.in_group.get(group)
    if same is None:
        keys = ranked_keys = cross_key
    elif groups == 1:
        keys = ranked_keys = same_key
    else:  # (S or C, not same) as one integer, order-preserving: 2 * key + not same
        keys = np.where(same > 0.0, same_key, cross_key)
        ranked_keys = keys + keys + (1.0 - same if exact else (1 - same).astype(np.int64).astype(object))
    ranked = _top(ranked_keys, want, tiebreak, decodes.requests)
    if same is None or groups == 1:
        return first, ranked, None
    chosen = ranked[0]
    outside = decodes.outside[group]
    others = smallest(keys[outside if decodes.endpoints[chosen].group == group else ~outside])
    return first, ranked, float(others - keys[chosen]) / _SCALE_F


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
    if m <= LIST_MAX or keys.dtype == object:
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
