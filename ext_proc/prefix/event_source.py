"""The ``kv-events`` prefix source: what the engines' KV-cache events say they hold, plus recent placements.

The router's view (:class:`~ext_proc.prefix.kinds.PrefixSource`) of an
:class:`~ext_proc.prefix.event_index.EventIndex`, which the subscribers (:mod:`ext_proc.kv_subscribers`)
feed, and of the :class:`~ext_proc.prefix.recent.RecentPlacements` of the last
``kv_events.recent_seconds``, which the router feeds. A request's hit at an endpoint is the longer of
the two matches.

The events name blocks by token ids, so only a prompt in token ids can match them: given so
(completions' ``prompt`` as a list of ints, or a list of such lists), or put so by the gateway's
tokenizer (``affinity.prefix.tokenizer``; :mod:`ext_proc.tokenize.gateway`); its chain is started at
:data:`~ext_proc.prefix.event_index.ROOT`, as the events' chains are (one engine serves one model). A
text prompt not tokenized has the approximate index's chain (text in 4-character tokens, seeded with
the model): it matches the recent placements only. Either chain is hashed at the pool's block size,
which the engines' events give (:mod:`ext_proc.prefix.block_sizes`; ``block_tokens`` until then). An
engine of several data-parallel ranks is indexed rank by rank (:mod:`ext_proc.prefix.ranks`). The
engines' prefix-cache counters correct nothing here: the events say what each engine holds. No I/O; the
clock is injectable (seconds, monotonic).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ext_proc.affinity import Decision, Pool
from ext_proc.affinity.model import E
from ext_proc.prefix import event_index, recent
from ext_proc.prefix.blocks import Chain, block_hashes, model_seed, prompt_chain, prompt_content
from ext_proc.prefix.event_index import ROOT, EventIndex
from ext_proc.prefix.event_sink import EventFeed
from ext_proc.prefix.hits import HitArrays
from ext_proc.prefix.lookup import Holder, Lookup, Placed, PredictionSink, PromptLookups, predict, prefill_hit
from ext_proc.prefix.ranks import credited, credited_publisher
from ext_proc.prefix.recent import RecentPlacements
from ext_proc.prefix.settings import PrefixSettings


class KvEventSource(PromptLookups):
    """The event-fed index of one router and its recent placements; ``sink`` gets the predictions."""

    def __init__(
        self, settings: PrefixSettings, sink: PredictionSink, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        events = settings.kv_events
        self.index = EventIndex(
            settings.block_tokens, events.stale_after_seconds, events.max_blocks_per_endpoint
        )
        self.recent = RecentPlacements(events.recent_seconds)
        self.hit_arrays = HitArrays(settings.block_tokens)
        self.clock = clock
        self._sink = sink

    @property
    def block_tokens(self) -> int:
        """Tokens a block of the chains it hashes: the pool's size (:attr:`EventIndex.block_tokens`)."""
        return self.index.block_tokens

    def events(self) -> EventFeed:
        """Its ``kv_events`` settings and the index the subscribers feed."""
        return EventFeed(self.settings.kv_events, self.index)

    def chain(
        self, body: dict[str, object], tokens: Sequence[int] | None = None, adapter: bool = False
    ) -> Chain:
        """The prompt's chain over its token ids from :data:`ROOT`, else the approximate text chain.

        The token ids are ``tokens`` (the gateway tokenized the prompt), else the body's own; blocks of
        :attr:`block_tokens` tokens. For an ``adapter`` (a LoRA adapter's request), token ids are
        chained from the adapter's seed instead of :data:`ROOT`: the index holds no adapter's blocks
        (their events name adapters by an id the gateway cannot map), so it matches only the recent
        placements of the same adapter, never the base model's blocks."""
        size = self.index.block_tokens
        content = prompt_content(body) if tokens is None else tokens
        if content and not isinstance(content, str):
            model = body.get("model")
            root = model_seed(model) if adapter and isinstance(model, str) else ROOT
            return block_hashes(content, size, self.settings.max_blocks, root)
        return prompt_chain(body, size, self.settings.max_blocks)

    def lookup(
        self, hashes: Chain, prefills: Pool[E], decodes: Pool[E], prompt_tokens: int, pinned: bool = False
    ) -> Lookup:
        """What the fresh endpoints reported holding of ``hashes``, or were given of it lately.

        A block recently placed counts as held in GPU memory; one reported only in a CPU tier as held
        there (the decision's :class:`~ext_proc.affinity.Hits` ``prefill_cpu``, ``decode_cpu``). An
        endpoint of several data-parallel ranks is credited one rank's blocks, and only when
        ``pinned`` (:func:`~ext_proc.prefix.ranks.credited`)."""
        now = self.clock()
        held = self.index.match(hashes, now)
        gpu = self.index.match_gpu(hashes, held)
        for name, blocks in self.recent.match(hashes, now).items():
            if blocks > held.get(name, 0):
                held[name] = blocks
            if gpu is not None and blocks > gpu.get(name, 0):
                gpu[name] = blocks
        matched, ranks = credited(held, pinned)
        if gpu is not None and ranks:
            gpu = {a: gpu.get(credited_publisher(a, ranks), 0) for a in matched}
        if self.hit_arrays.block_tokens != self.block_tokens:  # the engines' events set it
            self.hit_arrays = HitArrays(self.block_tokens)
        hits = self.hit_arrays.hits(matched, prefills, decodes, prompt_tokens, gpu)
        return Lookup(hashes, matched, hits, ranks)

    def placed(self, lookup: Lookup, decision: Decision[E], prompt_tokens: int) -> Placed:
        """Count the hits predicted at the chosen endpoints and keep the prompt as recently placed there.

        At an endpoint of several data-parallel ranks, on the rank the request is pinned to; nowhere
        when it is not pinned (the rank that serves it is not known). Returns where it was kept (for
        the peer replicas) and the hit predicted at the prefill."""
        now = self.clock()
        holders: list[Holder] = []
        predicted = predict(lookup, decision, self.block_tokens, prompt_tokens, self._sink)
        for endpoint, _ in predicted:
            address = endpoint.address
            if endpoint.data_parallel_size == 1 or address in lookup.ranks:
                name = credited_publisher(address, lookup.ranks)
                self.recent.record(lookup.hashes, name, now)
                holders.append((name, endpoint.token_capacity))
        return Placed(tuple(holders), prefill_hit(decision, predicted))

    def learned(self, hashes: Chain, holders: Sequence[Holder]) -> None:
        """A peer replica placed the chain ``hashes`` on ``holders``: keep it as recently placed there."""
        now = self.clock()
        for name, _ in holders:
            self.recent.record(hashes, name, now)

    def snapshot(self) -> list[tuple[str, float, Chain]]:
        """Nothing: a starting replica learns from the engines' events itself.

        It reads the engines' events (and their replay), and the recent placements last
        ``recent_seconds`` only."""
        return []

    def observe(self, address: str, queries: float | None, hits: float | None) -> None:
        """Nothing to learn from an engine's prefix-cache counters: its events say what it holds."""

    def retain(self, addresses: set[str]) -> None:
        """Forget every endpoint not in ``addresses`` (all its ranks)."""
        self.index.retain(addresses)
        self.recent.retain(addresses)


def warm() -> None:
    """Compile the event index's and the recent placements' kernels now, not on a request (numba)."""
    event_index.warm()
    recent.warm()
