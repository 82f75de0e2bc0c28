"""Open-addressing hash tables of block hashes as numpy arrays, and the numba kernels that use them (pure).

The prefix indexes keep their per-endpoint blocks in such tables, so a match or a recording is one
compiled call and never a Python int per block: the approximate index's LRUs
(:mod:`~ext_proc.prefix.index`), the recent placements (:mod:`~ext_proc.prefix.recent`) and the
event-fed index (:mod:`~ext_proc.prefix.event_index`).

A table is a ``(slots, columns)`` int64 array, ``slots`` a power of two, ``columns`` >= 2: per slot a
block hash (column 0) and values, column 1 ``EMPTY`` (-1) in an empty slot and >= 0 in a held one (so
every int64 hash value can be held). Linear probing from the hash's home slot (Fibonacci hashing: the
top bits of the hash times 2^64 / golden ratio, ``shift`` = 64 - log2(slots)); deletion by backward
shift, no tombstones. The owner keeps each table at most half full (:func:`slots_for`) and rebuilds it
(:func:`rehash`) larger or smaller. A hash is a signed 64-bit value (a chain of
:func:`~ext_proc.prefix.blocks.block_hashes` viewed as int64).
"""

from __future__ import annotations

import numba
import numpy as np

EMPTY = -1
"""Column 1 of an empty slot (a held block's values there are >= 0)."""
MIN_SLOTS = 16
"""The fewest slots a table has."""
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio, odd: a home is the top bits of hash x it


def power_of_two(count: int) -> int:
    """The least power of two >= ``count`` (>= 1)."""
    return 1 << (count - 1).bit_length()


def shift_of(slots: int) -> int:
    """The right shift that maps a hash to its home slot in a table of ``slots``.

    A hash times the Fibonacci constant, shifted right by it, is its home in ``slots`` (a power of two)."""
    return 64 - slots.bit_length() + 1


def slots_for(held: int) -> int:
    """The slots of a table rebuilt to hold ``held`` blocks.

    A quarter full at most (at least :data:`MIN_SLOTS`), so at least as many blocks again are added before
    it is half full."""
    return max(MIN_SLOTS, power_of_two(4 * held))


def empty(slots: int, columns: int) -> np.ndarray:
    """A table of ``slots`` (a power of two) holding nothing, ``columns`` int64 values a slot."""
    return np.full((slots, columns), EMPTY, dtype=np.int64)


@numba.njit(nogil=True)
def home(h: int, shift: int) -> int:
    """The slot where a search for the hash ``h`` starts (Fibonacci hashing: the product's top bits)."""
    return np.int64((np.uint64(h) * _FIBONACCI) >> np.uint64(shift))


@numba.njit(nogil=True)
def probe(table: np.ndarray, shift: int, h: int) -> int:
    """The slot of the hash ``h``, else the empty slot where it would go.

    The table is never full."""
    mask = len(table) - 1
    i = home(h, shift)
    while table[i, 1] != EMPTY and table[i, 0] != h:
        i = (i + 1) & mask
    return i


@numba.njit(nogil=True)
def find(table: np.ndarray, shift: int, h: int) -> int:
    """The slot holding the hash ``h``, or -1."""
    i = probe(table, shift, h)
    return -1 if table[i, 1] == EMPTY else i


@numba.njit(nogil=True)
def put(table: np.ndarray, shift: int, h: int, value: int) -> bool:
    """Set column 1 of the hash ``h`` to ``value``; whether ``h`` was added.

    ``value`` >= 0; ``h`` is added where it is not held."""
    i = probe(table, shift, h)
    added = table[i, 1] == EMPTY
    table[i, 0] = h
    table[i, 1] = value
    return added


@numba.njit(nogil=True)
def remove(table: np.ndarray, shift: int, i: int) -> None:
    """Empty slot ``i`` without a tombstone, keeping every held hash reachable.

    Each later entry of its probe run that may then sit closer to (or at) its home slot moves back: every
    held hash stays reachable from its home without a gap."""
    mask = len(table) - 1
    j = i
    while True:
        j = (j + 1) & mask
        if table[j, 1] == EMPTY:
            break
        if ((j - home(table[j, 0], shift)) & mask) >= ((j - i) & mask):  # slot i lies on its way home → j
            for column in range(table.shape[1]):
                table[i, column] = table[j, column]
            i = j
    table[i, 1] = EMPTY


@numba.njit(nogil=True)
def rehash(old: np.ndarray, new: np.ndarray, shift: int, floor: int) -> int:
    """Copy the held hashes of ``old`` from ``floor`` on into ``new``; how many.

    Every held hash of the table ``old`` whose column 1 is at least ``floor`` (>= 0), with its
    values, into the empty table ``new`` (of the same columns, ``shift`` its shift); how many."""
    count = 0
    for i in range(len(old)):
        if old[i, 1] >= floor:
            slot = probe(new, shift, old[i, 0])
            for column in range(old.shape[1]):
                new[slot, column] = old[i, column]
            count += 1
    return count
