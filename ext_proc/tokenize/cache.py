"""Recent rendered-text prefixes and their token ids: the prompt tokenizer's cache.

Bounded in entries and token ids, each entry kept ``ttl_s`` after its last use; looked up by the
prefix's length and its last :data:`KEY_CHARS` characters, a hit then compared whole with the text.
Pure: the clock is an argument (``now``, seconds). Not thread-safe.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

KEY_CHARS = 64
"""The last characters of a prefix that, with its length, look it up in the :class:`PrefixTokenCache`."""


@dataclass(slots=True)
class _Prefix:
    """A rendered text up to a boundary, its token ids, and when the entry is dropped unless used again.

    ``ids`` are unsigned 32-bit (4 bytes a token id, a tenth of a Python list's); ``expires`` in seconds."""

    text: str
    ids: array[int]
    expires: float


class PrefixTokenCache:
    """Recent rendered-text prefixes and their token ids, least recently used first.

    At most ``max_entries`` entries and ``max_tokens`` token ids in all (4 bytes each, and the prefix's
    text: about as much again for English text); an entry unused for ``ttl_s`` seconds is dropped. An
    entry is found by its text's length and last :data:`KEY_CHARS` characters, and answers only when
    its whole text is the one asked for."""

    def __init__(self, max_entries: int, max_tokens: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[int, str], _Prefix] = OrderedDict()
        self.tokens = 0
        """Token ids held, all entries together."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str, end: int, now: float) -> array[int] | None:
        """The ids of ``text[:end]`` (made most recent, kept ``ttl_s`` more); ``None`` when not held.

        The caller leaves them unchanged. O(``end``) at most (one compare), O(:data:`KEY_CHARS`) on a miss."""
        key = _key(text, end)
        entry = self._entries.get(key)
        if entry is None or not text.startswith(entry.text):
            return None
        if entry.expires <= now:
            self._drop(key)
            return None
        entry.expires = now + self.ttl_s
        self._entries.move_to_end(key)
        return entry.ids

    def put(self, text: str, end: int, ids: array[int], now: float) -> None:
        """Hold ``ids`` as those of ``text[:end]``, then evict to the bounds.

        ``ids`` is kept, not copied: the caller leaves it unchanged. It replaces what was held for a text
        of that length and ending."""
        key = _key(text, end)
        if key in self._entries:
            self._drop(key)
        if len(ids) > self.max_tokens or self.max_entries < 1:
            return
        self._entries[key] = _Prefix(text[:end], ids, now + self.ttl_s)
        self.tokens += len(ids)
        while self._entries and (
            len(self._entries) > self.max_entries
            or self.tokens > self.max_tokens
            or next(iter(self._entries.values())).expires <= now
        ):
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, str]) -> None:
        self.tokens -= len(self._entries.pop(key).ids)


def _key(text: str, end: int) -> tuple[int, str]:
    """The cache key of ``text[:end]``: its length and its last :data:`KEY_CHARS` characters."""
    return end, text[max(0, end - KEY_CHARS) : end]
