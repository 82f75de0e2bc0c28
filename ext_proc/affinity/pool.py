"""The endpoints of one role as the decision reads them: a struct of numpy arrays.

A :class:`Pool` pairs a tuple of endpoint objects (what a decision returns) with index-aligned arrays
of their load and capacity (what a decision reads). The arrays may be views of live arrays that the
load accounting writes in place (the registry's pools are), so building a pool is the only O(n)
Python work: choosing over it reads the arrays without touching the objects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Generic

import numpy as np
from numpy.typing import NDArray

from ext_proc.affinity.model import E

_SLOTS_KEPT = 8  # other pools whose group slots a pool keeps (a decision reads one; subsets make more)


class Pool(Generic[E]):
    """Candidate endpoints of one role with their load, as the arrays the decision reads.

    ``endpoints[i]`` has ``tokens[i]`` in-flight tokens, ``requests[i]`` in-flight requests and
    ``capacity[i]`` tokens of capacity (> 0).

    Contract: the arrays have one entry per endpoint; ``tokens`` and ``requests`` are int64 and may
    change between decisions (never during one); ``capacity`` is float64 and, like the endpoints and
    their groups, fixed for the pool's lifetime. Derived at construction, by ``pdGroupID``, in order
    of first appearance: ``groups`` the group names; ``members[g]`` the positions of group ``g``
    (ascending) and ``in_group[g]`` a float64 mask, 1.0 at those positions and 0.0 elsewhere;
    ``outside[g]`` a boolean mask, true at the positions of every other group; ``group_order`` every
    position, group by group (the concatenation of ``members`` in ``groups`` order) and
    ``group_starts`` where each group begins in it, so that ``np.minimum.reduceat(x[group_order],
    group_starts)`` is each group's minimum of ``x`` in one pass; ``shares[g]`` the group's share of
    the pool's capacity, ``math.fsum`` of its members' over the whole pool's (correctly rounded, so
    independent of summation order), in (0, 1].
    """

    __slots__ = (
        "_slots",
        "capacity",
        "endpoints",
        "group_order",
        "group_starts",
        "groups",
        "in_group",
        "members",
        "outside",
        "requests",
        "shares",
        "size",
        "tokens",
    )

    def __init__(
        self,
        endpoints: Sequence[E],
        tokens: NDArray[np.int64],
        requests: NDArray[np.int64],
        capacity: NDArray[np.float64],
    ) -> None:
        self.endpoints: tuple[E, ...] = tuple(endpoints)
        self.size = len(self.endpoints)
        if not len(tokens) == len(requests) == len(capacity) == self.size:
            raise ValueError("a pool needs one tokens, requests and capacity entry per endpoint")
        self.tokens = tokens
        self.requests = requests
        self.capacity = capacity
        positions: dict[str, list[int]] = {}
        for i, endpoint in enumerate(self.endpoints):
            positions.setdefault(endpoint.group, []).append(i)
        self.groups: tuple[str, ...] = tuple(positions)
        self.members: dict[str, NDArray[np.intp]] = {
            g: np.array(p, dtype=np.intp) for g, p in positions.items()
        }
        self.in_group: dict[str, NDArray[np.float64]] = {}
        self.outside: dict[str, NDArray[np.bool_]] = {}
        for g, p in self.members.items():
            mask = np.zeros(self.size)
            mask[p] = 1.0
            self.in_group[g] = mask
            self.outside[g] = mask == 0.0
        self.group_order = np.array([i for p in positions.values() for i in p], dtype=np.intp)
        self.group_starts = np.cumsum([0, *[len(p) for p in positions.values()][:-1]], dtype=np.intp)
        total = math.fsum(self.capacity.tolist())
        self.shares: dict[str, float] = {
            g: math.fsum(self.capacity[p].tolist()) / total for g, p in self.members.items()
        }
        self._slots: dict[int, tuple[Pool[E], NDArray[np.intp], NDArray[np.float64]]] = {}

    @classmethod
    def of(cls, endpoints: Sequence[E]) -> Pool[E]:
        """A snapshot of ``endpoints`` (e.g. :class:`~ext_proc.affinity.Candidate` values).

        Their ``active_tokens``, ``active_requests`` and ``token_capacity`` are copied into fresh
        arrays."""
        return cls(
            endpoints,
            np.array([e.active_tokens for e in endpoints], dtype=np.int64),
            np.array([e.active_requests for e in endpoints], dtype=np.int64),
            np.array([e.token_capacity for e in endpoints], dtype=np.float64),
        )

    def only(self, addresses: AbstractSet[str]) -> Pool[E]:
        """The endpoints whose ``address`` is in ``addresses``, in pool order, with their load copied.

        A snapshot for one decision: the live arrays stay with this pool."""
        keep = [i for i, e in enumerate(self.endpoints) if e.address in addresses]
        positions = np.array(keep, dtype=np.intp)
        return Pool(
            [self.endpoints[i] for i in keep],
            self.tokens[positions],
            self.requests[positions],
            self.capacity[positions],
        )

    def slots_in(self, other: Pool[E]) -> NDArray[np.intp]:
        """Per position of this pool, the index in ``other.groups`` of its endpoint's group.

        ``len(other.groups)`` where ``other`` has no endpoint of that group; read-only.

        Computed on first use for ``other`` and kept for the last few pools asked about (the groups of
        both never change), so the decision pays one dictionary lookup, not O(size) Python work.
        """
        return self._pairing(other)[1]

    def share_ratios_in(self, other: Pool[E]) -> NDArray[np.float64]:
        """Per position of this pool, ``shares[g] / other.shares[g]`` for its endpoint's group ``g``.

        How much more of this pool's capacity than of ``other``'s the group holds; 1.0 when ``other``
        has no endpoint of ``g`` (read-only; kept like :meth:`slots_in`)."""
        return self._pairing(other)[2]

    def _pairing(self, other: Pool[E]) -> tuple[Pool[E], NDArray[np.intp], NDArray[np.float64]]:
        kept = self._slots.get(id(other))
        if kept is not None and kept[0] is other:
            return kept
        index = {g: i for i, g in enumerate(other.groups)}
        slots = np.empty(self.size, dtype=np.intp)
        ratios = np.ones(self.size)
        for g, positions in self.members.items():
            slots[positions] = index.get(g, len(other.groups))
            if g in other.shares:
                ratios[positions] = self.shares[g] / other.shares[g]
        slots.flags.writeable = ratios.flags.writeable = False
        if len(self._slots) >= _SLOTS_KEPT:
            self._slots.pop(next(iter(self._slots)))
        pairing = self._slots[id(other)] = (other, slots, ratios)
        return pairing

    def __repr__(self) -> str:
        return f"Pool(size={self.size}, groups={list(self.members)})"
