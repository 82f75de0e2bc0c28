"""vLLM-style automatic prefix caching of one simulated engine (pure bookkeeping).

The engine's KV cache is ``capacity`` blocks of ``block_size`` tokens. A block a sequence computed in
full is *cached* under the hash of its tokens chained over the blocks before it, so it stands for the
whole prefix up to its end (vLLM v1's ``BlockHash``). A new sequence first takes, by reference, the
longest run of leading blocks of its prompt that are cached, at most the prompt minus one token (vLLM
computes at least one token: ``num_tokens - 1``), and is given fresh blocks for the rest; it computes
only the tokens past the cached run (a decode pulling a remote KV pulls only those). A cached block
no sequence references is *free* but keeps its content until a fresh block is needed and none is
empty: the free cached blocks are evicted least recently freed first, and a finished sequence frees
its blocks tail first, so its prompt's head outlives its tail (vLLM's ``FreeKVCacheBlockQueue``).
Blocks in use are never evicted. Two sequences computing the same block at once keep a copy each;
the first to finish it caches it.

With a CPU tier (``cpu_capacity`` blocks, vLLM's native KV offloading), a block evicted from the KV
cache is copied there, and the tier drops its least recently used blocks when full. A prompt's cached
run then continues past its KV-cache hit into the CPU tier: those blocks are given fresh KV blocks,
loaded (the engine charges the copy at the CPU-to-GPU bandwidth, :mod:`sim.engine`) and cached again,
and are neither computed nor pulled. Hits are counted per tier.

With an event sink (``events``) the cache reports its changes as vLLM's KV-cache events do
(:mod:`ext_proc.prefix.kv_events`), one batch a change, each stored run of blocks a ``BlockStored``
with its parent's hash and its token ids: the blocks a sequence newly cached (medium
:data:`MEDIUM_GPU`); an admission's evictions, each block copied to the CPU tier reported stored there
(:data:`MEDIUM_CPU`) and removed from the KV cache, the blocks the tier dropped removed from it, the
blocks loaded from it stored in the KV cache again (as vLLM's offloading reports them); a reset
(``AllBlocksCleared``, both tiers emptied). Block hashes are the cache's own (Python's ``hash``,
salted per process): opaque to a subscriber.

The "tokens" of a text prompt are its characters in fours (the gateway's and the simulator's token
estimate, :mod:`ext_proc.request`), so a block is ``4 * block_size`` characters of the concatenated
prompt text (:func:`token_ids` numbers those tokens for the events); token-id prompts are blocks of
ids. Generated tokens extend the text (the simulator generates a fixed cycle of four-character tokens,
:func:`sim.protocol.token_text`), so a chat's next turn, which carries the reply, hits the blocks its
reply filled on the engine that generated it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ext_proc.prefix.blocks import CHARS_PER_TOKEN
from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from sim.protocol import token_text

MEDIUM_GPU = "GPU"
"""The ``medium`` of the KV cache's blocks in the events (vLLM's name for its GPU memory)."""
MEDIUM_CPU = "CPU"
"""The ``medium`` of the CPU tier's blocks in the events (vLLM's offloading names it so)."""
EventSink = Callable[[list[Event]], None]
"""Where a :class:`BlockCache` reports one batch of KV-cache events."""
_ASCII_TOKEN = np.dtype(f">u{CHARS_PER_TOKEN}")
"""One whole token of ASCII text read as a big-endian integer."""


def token_ids(content: str | Sequence[int]) -> list[int]:
    """The simulator's token ids of ``content``.

    Token ids as they are; text in tokens of ``CHARS_PER_TOKEN`` characters, each its UTF-8 bytes read as a
    big-endian integer when they are at most 8 (any ASCII token), else the first 8 bytes of their BLAKE2b
    digest (ids below ``2**64``)."""
    if not isinstance(content, str):
        return list(content)
    if content.isascii():  # every token its bytes: read them all at once (the trace replay's hot path)
        raw = content.encode("ascii")
        whole = len(raw) - len(raw) % CHARS_PER_TOKEN
        ids = np.frombuffer(raw, _ASCII_TOKEN, whole // CHARS_PER_TOKEN).tolist()
        if whole < len(raw):
            ids.append(int.from_bytes(raw[whole:], "big"))
        return ids
    ids = []
    for start in range(0, len(content), CHARS_PER_TOKEN):
        raw = content[start : start + CHARS_PER_TOKEN].encode()
        if len(raw) > 8:
            raw = hashlib.blake2b(raw, digest_size=8).digest()
        ids.append(int.from_bytes(raw, "big"))
    return ids


def block_content(content: str | Sequence[int], block_size: int, index: int) -> str | Sequence[int]:
    """Block ``index`` of ``content`` (``block_size`` tokens; text ``CHARS_PER_TOKEN`` characters a token)."""
    size = CHARS_PER_TOKEN * block_size if isinstance(content, str) else block_size
    return content[index * size : (index + 1) * size]


def chain(content: str | Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of ``content``.

    The chained hashes of every full block of ``content`` (text: ``CHARS_PER_TOKEN * block_size``
    characters a block; token ids: ``block_size`` ids a block)."""
    text = isinstance(content, str)
    size = CHARS_PER_TOKEN * block_size if text else block_size
    hashes, h = [], 0
    for start in range(0, len(content) - size + 1, size):
        block = content[start : start + size]
        h = hash((h, block if text else tuple(block)))
        hashes.append(h)
    return hashes


@dataclass
class PromptBlocks:
    """What an engine caches of one request: its prompt ``content`` (text or token ids)."""

    content: str | list[int]
    block_size: int
    hashes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.hashes = chain(self.content, self.block_size)

    def with_output(self, generated: int) -> list[int]:
        """The chained hashes of the prompt's full blocks followed by ``generated`` tokens.

        The chained hashes of the full blocks of the prompt followed by ``generated`` output
        tokens (token-id prompts: the prompt's alone, the generated ids being unknown)."""
        if not isinstance(self.content, str) or generated <= 0:
            return self.hashes
        return chain(self.output_content(generated), self.block_size)

    def output_content(self, generated: int) -> str | list[int]:
        """The content :meth:`with_output` chains: the prompt's followed by ``generated`` output tokens'."""
        if not isinstance(self.content, str) or generated <= 0:
            return self.content
        return self.content + token_text(0, generated)


@dataclass
class Holding:
    """The blocks one sequence holds.

    ``refs``, the cached blocks it references (by hash), and ``private``, fresh blocks not (or not yet)
    cached."""

    refs: list[int] = field(default_factory=list)
    private: int = 0


class BlockCache:
    """An engine's KV blocks: in use, free and cached, or free and empty; see the module docstring.

    ``used`` counts blocks in use (private ones plus cached ones with references). ``queries`` and
    ``hits`` count prompt tokens looked up and found in the KV cache (vLLM's ``prefix_cache_queries`` /
    ``_hits``), ``cpu_hits`` those found in the CPU tier (``cpu_capacity`` blocks, 0: none).
    ``events``: where the changes are reported (``None``: nowhere).
    """

    def __init__(
        self, capacity: int, block_size: int, cpu_capacity: int = 0, *, events: EventSink | None = None
    ) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.cpu_capacity = cpu_capacity
        self.events = events
        self.used = 0
        self.queries = 0
        self.hits = 0
        self.cpu_hits = 0
        self._refs: dict[int, int] = {}  # cached block hash → sequences referencing it
        self._free: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references, LRU first
        self._cpu: OrderedDict[int, None] = OrderedDict()  # the CPU tier's blocks, least recently used first
        self._blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # with events: parent, token ids

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a cached prefix, in use or free."""
        return len(self._refs)

    def lookup(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """How many leading blocks of ``hashes`` are cached.

        How many leading blocks of ``hashes`` are cached, at most ``(prompt_tokens - 1) //
        block_size`` (at least one prompt token is always computed)."""
        limit = self._limit(hashes, prompt_tokens)
        hit = 0
        while hit < limit and hashes[hit] in self._refs:
            hit += 1
        return hit

    def lookup_cpu(self, hashes: Sequence[int], prompt_tokens: int, start: int) -> int:
        """How many blocks of ``hashes`` from ``start`` on are in the CPU tier only.

        How many blocks of ``hashes`` from ``start`` on (the KV-cache hit's end) are in the CPU tier
        and not in the KV cache, within :meth:`lookup`'s limit."""
        limit = self._limit(hashes, prompt_tokens)
        end = start
        while end < limit and hashes[end] in self._cpu and hashes[end] not in self._refs:
            end += 1
        return end - start

    def _limit(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        return min(len(hashes), max(0, prompt_tokens - 1) // self.block_size)

    def fits(self, hit: Sequence[int], fresh: int) -> bool:
        """Whether ``fresh`` new blocks fit once the cached blocks ``hit`` are taken.

        Whether ``fresh`` new blocks fit once the cached blocks ``hit`` are taken (free ones among
        them stop being evictable)."""
        taken = sum(1 for h in hit if self._refs[h] == 0)
        return self.used + taken + fresh <= self.capacity

    def take(self, hit: Sequence[int], fresh: int, prompt_tokens: int, loaded: Sequence[int] = ()) -> Holding:
        """Reference the cached blocks ``hit`` and allocate ``fresh`` blocks.

        Reference the cached blocks ``hit`` and allocate ``fresh`` blocks (evicting free cached
        ones as needed, into the CPU tier; :meth:`fits` must hold), the first ``len(loaded)`` of them
        filled from the CPU tier's blocks ``loaded`` (:meth:`lookup_cpu`) and cached; count the lookup
        of ``prompt_tokens`` tokens."""
        for h in hit:
            if self._refs[h] == 0:
                del self._free[h]
                self.used += 1
            self._refs[h] += 1
        for h in loaded:  # used now: not the tier's next to drop
            self._cpu.move_to_end(h)
        empty = self.capacity - self.used - len(self._free)
        evicted = [self._free.popitem(last=False)[0] for _ in range(max(0, fresh - empty))]
        for h in evicted:
            del self._refs[h]
        offloaded, dropped = self._offload(evicted)
        self.used += fresh
        for h in loaded:
            self._refs[h] = 1
        self.queries += prompt_tokens
        self.hits += len(hit) * self.block_size
        self.cpu_hits += len(loaded) * self.block_size
        if self.events is not None and (evicted or loaded):
            self.events(
                [
                    *self._runs(offloaded, MEDIUM_CPU),
                    *([BlockRemoved(tuple(evicted), MEDIUM_GPU)] if evicted else []),
                    *([BlockRemoved(tuple(dropped), MEDIUM_CPU)] if dropped else []),
                    *self._runs(loaded, MEDIUM_GPU),
                ]
            )
            for h in [*evicted, *dropped]:
                if h not in self._refs and h not in self._cpu:
                    self._blocks.pop(h, None)
        return Holding([*hit, *loaded], fresh - len(loaded))

    def _offload(self, blocks: list[int]) -> tuple[list[int], list[int]]:
        """Keep evicted ``blocks`` in the CPU tier (if any), dropping its least recently used ones when
        full; the blocks new to the tier, and those it dropped."""
        added: list[int] = []
        dropped: list[int] = []
        if not self.cpu_capacity:
            return added, dropped
        for block in blocks:
            if block not in self._cpu:
                added.append(block)
            self._cpu[block] = None
            self._cpu.move_to_end(block)
            if len(self._cpu) > self.cpu_capacity:
                dropped.append(self._cpu.popitem(last=False)[0])
        return added, dropped

    def cache(self, holding: Holding, hashes: Sequence[int], content: str | Sequence[int] = "") -> None:
        """Cache the blocks ``hashes`` that the sequence of ``holding`` computed.

        The sequence of ``holding`` computed the blocks ``hashes`` (its chain over ``content``, from
        the start): each one not cached yet becomes a cached block referenced by it (one private block
        less), reported in one batch."""
        held = set(holding.refs)
        new: list[int] = []  # indexes in ``hashes`` of the blocks cached now
        for index, h in enumerate(hashes):
            if holding.private == 0:
                break
            if h not in held and h not in self._refs:
                self._refs[h] = 1
                holding.refs.append(h)
                holding.private -= 1
                new.append(index)
        if new and self.events is not None:
            size = self.block_size
            for index in new:
                parent = hashes[index - 1] if index else None
                self._blocks[hashes[index]] = (parent, tuple(token_ids(block_content(content, size, index))))
            self.events(self._runs([hashes[i] for i in new], MEDIUM_GPU))

    def _runs(self, blocks: Sequence[int], medium: str) -> list[Event]:
        """``blocks`` (each a child of the one before or of a block already reported) stored in
        ``medium``: one ``BlockStored`` per run of blocks chained to each other."""
        runs: list[list[int]] = []
        for h in blocks:
            if runs and self._blocks[h][0] == runs[-1][-1]:
                runs[-1].append(h)
            else:
                runs.append([h])
        return [
            BlockStored(
                tuple(run),
                self._blocks[run[0]][0],
                tuple(t for h in run for t in self._blocks[h][1]),
                self.block_size,
                None,
                medium,
            )
            for run in runs
        ]

    def reset(self) -> bool:
        """Drop every cached block, the CPU tier's too, as vLLM's ``reset_prefix_cache``.

        Only while no block is in use (whether it did)."""
        if self.used:
            return False
        self._refs.clear()
        self._free.clear()
        self._cpu.clear()
        self._blocks.clear()
        if self.events is not None:
            self.events([AllBlocksCleared()])
        return True

    def release(self, holding: Holding) -> None:
        """Free every block of ``holding``.

        Private ones become empty, cached ones free (evictable), tail first so a prompt's head is evicted
        last."""
        self.used -= holding.private
        for h in reversed(holding.refs):
            left = self._refs[h] - 1
            self._refs[h] = left
            if left == 0:
                self._free[h] = None
                self.used -= 1
        holding.refs, holding.private = [], 0
