"""The ``kv-events`` index's block size, learned from the engines' events (pure).

Each ``BlockStored`` event carries its engine's block size in tokens (vLLM's ``--block-size``: 16 by
default on a GPU, 128 for its CPU engines). A request is looked up by one chain, hashed at one size,
so the engines a gateway routes to share one size, *the pool's*:

- until an engine reports a size, the pool's is the configured ``affinity.prefix.block_tokens``;
- while no known publisher reports the pool's size, the first size reported becomes the pool's (the
  first engine heard sets it; a pool whose engines all changed size, or the only one restarted with
  another, takes the new one);
- a publisher reporting another size than the pool's is *unusable*: its blocks could never match a
  request's chain, so the index drops them (counted ``block_size``) until it reports the pool's size
  or the pool takes its size (the last publisher of the pool's size forgotten).

Learned per publisher (an engine, or one data-parallel rank of it: :mod:`ext_proc.prefix.ranks`). No
clock and no I/O.
"""

from __future__ import annotations

from collections import Counter


class BlockSizes:
    """The block size of each publisher and of the pool, in tokens.

    ``block_tokens``: the pool's size until a publisher reports one (the configuration's)."""

    def __init__(self, block_tokens: int) -> None:
        self.tokens = block_tokens
        """The pool's size: the size the index keys blocks by and a request's chain is hashed at."""
        self._of: dict[str, int] = {}  # publisher → the size its last BlockStored reported
        self._reporting: Counter[int] = Counter()  # size → publishers reporting it

    def usable(self, address: str, size: int) -> bool:
        """``address`` reported blocks of ``size`` tokens (a positive integer): whether they can be indexed.

        They can when ``size`` is the pool's, which it becomes when no other publisher reports the
        pool's size (module docstring)."""
        last = self._of.get(address)
        if last != size:
            if last is not None:
                self._drop(last)
            self._of[address] = size
            self._reporting[size] += 1
        if size != self.tokens and not self._reporting[self.tokens]:
            self.tokens = size
        return size == self.tokens

    def forget(self, address: str) -> None:
        """``address`` is no longer listened to: its size no longer holds the pool's."""
        size = self._of.pop(address, None)
        if size is not None:
            self._drop(size)

    def of(self, address: str) -> int | None:
        """The size ``address`` reports (``None``: no ``BlockStored`` yet, or forgotten)."""
        return self._of.get(address)

    def reporting(self, size: int) -> int:
        """How many publishers report blocks of ``size`` tokens."""
        return self._reporting[size]

    def unusable(self) -> dict[str, int]:
        """The publishers whose size is not the pool's, with their size."""
        return {address: size for address, size in self._of.items() if size != self.tokens}

    def _drop(self, size: int) -> None:
        self._reporting[size] -= 1
        if not self._reporting[size]:
            del self._reporting[size]
