"""The largest and smallest element of a decision's array, at Python's cost on small pools.

numpy's reductions cost ~2 µs a call whatever the size (its Python wrappers and the ufunc machinery);
below :data:`LIST_MAX` elements the builtins over ``tolist()`` give the same value in a tenth of that.
"""

from __future__ import annotations

from typing import Any

from numpy.typing import NDArray

LIST_MAX = 128
"""Up to this many elements, Python lists beat numpy's per-call cost (reductions, ranking)."""


def largest(a: NDArray[Any]) -> Any:
    """The largest element of ``a``, computed the cheaper way for its size.

    ``a.max()`` (``a`` non-empty, without NaN), as the Python number ``a.tolist()`` holds below
    :data:`LIST_MAX` elements and as numpy's scalar above: equal values either way."""
    return max(a.tolist()) if len(a) <= LIST_MAX else a.max()


def smallest(a: NDArray[Any]) -> Any:
    """``a.min()`` (``a`` non-empty, without NaN): equal values, as :func:`largest`."""
    return min(a.tolist()) if len(a) <= LIST_MAX else a.min()
