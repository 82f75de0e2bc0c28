"""The ``approximate`` prefix source: one request's lookup, its placement, the engines' counters.

:class:`PrefixTracker` is the thin stateful layer around the pure parts: it hashes a request's prompt
(:mod:`ext_proc.prefix.blocks`), looks the chain up in the :class:`~ext_proc.prefix.index.PrefixIndex`
and hands the decision its hit estimates as arrays aligned with the pools; after the decision it
records the prompt on the chosen prefill and decode, counts what it predicted, and, from each engine
sample with prefix-cache counters, corrects that endpoint's LRU size
(:mod:`ext_proc.prefix.correction`). No clock and no I/O; the metrics are the only side effect.
"""

from __future__ import annotations

from collections.abc import Sequence

from ext_proc.affinity import Decision, Pool
from ext_proc.affinity.model import E
from ext_proc.prefix.blocks import Chain, prompt_chain
from ext_proc.prefix.correction import Interval, corrected_scale
from ext_proc.prefix.index import PrefixIndex
from ext_proc.prefix.lookup import Holder, Lookup, Placed, PredictionSink, PromptLookups, predict, prefill_hit
from ext_proc.prefix.settings import PrefixSettings


class PrefixTracker(PromptLookups):
    """Owns the index of one router; ``sink`` gets the predictions and the engine-reported counters."""

    def __init__(self, settings: PrefixSettings, sink: PredictionSink) -> None:
        self.settings = settings
        self.index = PrefixIndex(settings.block_tokens)
        self._sink = sink
        self._capacity: dict[str, float] = {}
        self._pending: dict[str, list[float]] = {}  # address → [placed, predicted] since its last sample
        self._counters: dict[str, tuple[float, float]] = {}  # address → the engine's last (queries, hits)

    @property
    def block_tokens(self) -> int:
        """Tokens a block of the chains it hashes: the settings' ``block_tokens``."""
        return self.settings.block_tokens

    def events(self) -> None:
        """No feed: this kind learns from placements, not from the engines' KV-cache events."""

    def chain(
        self, body: dict[str, object], tokens: Sequence[int] | None = None, adapter: bool = False
    ) -> Chain:
        """The chained block hashes of the request's prompt, or of ``tokens`` (:func:`prompt_chain`).

        Every chain is seeded with the model, an adapter's (``adapter``) as any other's."""
        settings = self.settings
        return prompt_chain(body, settings.block_tokens, settings.max_blocks, tokens)

    def lookup(
        self, hashes: Chain, prefills: Pool[E], decodes: Pool[E], prompt_tokens: int, pinned: bool = False
    ) -> Lookup:
        """What the candidate endpoints hold of ``hashes`` (estimated per endpoint: ``pinned`` is moot)."""
        matched = self.index.match(hashes) if len(hashes) else {}
        return Lookup(hashes, matched, self.index.hit_arrays.hits(matched, prefills, decodes, prompt_tokens))

    def placed(self, lookup: Lookup, decision: Decision[E], prompt_tokens: int) -> Placed:
        """Record the request placed by ``decision`` and count the hits predicted at each endpoint.

        Its prompt is now on the prefill (which computes it) and the decode (which receives it): the
        endpoints it was recorded on, with their capacities, are returned (for the peer replicas), with
        the hit predicted at the prefill."""
        predicted = predict(lookup, decision, self.settings.block_tokens, prompt_tokens, self._sink)
        holders: list[Holder] = []
        for endpoint, hit in predicted:
            address = endpoint.address
            pending = self._pending.setdefault(address, [0.0, 0.0])  # both engines look the prompt up
            pending[0] += prompt_tokens
            pending[1] += hit
            if len(lookup.hashes):
                self._capacity[address] = endpoint.token_capacity
                self.index.record(lookup.hashes, address, endpoint.token_capacity)
                holders.append((address, endpoint.token_capacity))
        return Placed(tuple(holders), prefill_hit(decision, predicted))

    def learned(self, hashes: Chain, holders: Sequence[Holder]) -> None:
        """A peer replica placed the chain ``hashes`` on ``holders``: record it there as if placed here.

        Nothing is predicted or counted: the peer counted it."""
        for address, capacity in holders:
            self._capacity.setdefault(address, capacity)
            self.index.record(hashes, address, capacity)

    def snapshot(self) -> list[tuple[str, float, Chain]]:
        """What the index holds, to hand a replica that starts.

        Per endpoint, its name, capacity and blocks (most recently used first; :meth:`learned` of each
        rebuilds the same order)."""
        return [
            (address, self._capacity[address], self.index.held(address))
            for address in self.index.addresses
            if address in self._capacity
        ]

    def observe(self, address: str, queries: float | None, hits: float | None) -> None:
        """Take an engine sample's prefix-cache counters: report the increments, correct the LRU size.

        The counters are totals since the engine started, in tokens (``None`` when the page has none).
        The endpoint's LRU is resized (with ``self_correct`` only) by what this gateway predicted there
        since the last sample."""
        if queries is None or hits is None:
            return
        last = self._counters.get(address)
        self._counters[address] = (queries, hits)
        pending = self._pending.pop(address, [0.0, 0.0])
        if last is None or queries < last[0] or hits < last[1]:  # first sample, or the engine restarted
            return
        seen = Interval(pending[0], pending[1], queries - last[0], hits - last[1])
        scale = self.index.scale(address)
        capacity = self._capacity.get(address)
        if self.settings.self_correct and capacity is not None:
            corrected = corrected_scale(scale, seen)
            if corrected != scale:
                self.index.set_scale(address, corrected, capacity)
                scale = corrected
        self._sink.prefix_engine(address, seen.queries, seen.hits, scale)

    def retain(self, addresses: set[str]) -> None:
        """Forget every endpoint not in ``addresses``."""
        self.index.retain(addresses)
        for table in (self._capacity, self._pending, self._counters):
            for address in [a for a in table if a not in addresses]:
                del table[address]
