"""The prefix-source seam: the :class:`PrefixSource` protocol and its kinds, one module each.

A prefix source tells the router, per request, which endpoints are estimated to hold the prompt's
leading blocks, and learns from placements and the engines' prefix-cache counters. ``approximate``
(:class:`~ext_proc.prefix.tracker.PrefixTracker`) estimates from this gateway's own placements;
``kv-events`` (:class:`~ext_proc.prefix.event_source.KvEventSource`) reads what the engines report
holding in their KV-cache events. A new kind is a module with its source, one
:class:`~ext_proc.prefix.settings.PrefixSourceKind` member and one line in :data:`KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ext_proc.affinity import Decision, Pool
from ext_proc.affinity.model import E
from ext_proc.prefix.blocks import Chain
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.settings import PrefixSettings, PrefixSourceKind
from ext_proc.prefix.tracker import Holder, Lookup, PredictionSink, PrefixTracker


class PrefixSource(Protocol):
    """What the router asks of the prefix index (all in tokens unless said otherwise).

    ``settings`` hold its hashing (``block_tokens``, ``max_blocks``) and may be replaced live when the
    hashing stays the same.
    """

    settings: PrefixSettings

    @property
    def block_tokens(self) -> int:
        """Tokens a block of the chains it hashes now (``kv-events``: the engines' events give it)."""
        ...

    def chain(self, body: dict[str, object], tokens: Sequence[int] | None = None) -> Chain:
        """The chained block hashes of the request's prompt (empty without a prompt).

        A 1-D int64 array (:func:`~ext_proc.prefix.blocks.block_hashes`).

        ``tokens``: the prompt in the engine's token ids when the gateway tokenized it (the chain is
        then over them, whatever the body's prompt)."""
        ...

    def lookup(
        self, hashes: Chain, prefills: Pool[E], decodes: Pool[E], prompt_tokens: int, pinned: bool = False
    ) -> Lookup:
        """What the candidate endpoints hold of ``hashes``, with the decision's hit arrays.

        ``pinned``: the handoff pins the engine requests to the data-parallel rank the lookup credits
        (:attr:`Lookup.ranks`); without, an endpoint of several ranks is credited only what it is known
        to hold whichever rank serves."""
        ...

    def predicted(self, lookup: Lookup, address: str, prompt_tokens: int) -> int:
        """The hit tokens ``lookup`` predicts at ``address`` (at most ``prompt_tokens``)."""
        ...

    def placed(self, lookup: Lookup, decision: Decision[E], prompt_tokens: int) -> tuple[Holder, ...]:
        """Record that ``decision`` placed the request; the names its prompt is kept under.

        The request was placed by ``decision``: its prompt is now on the chosen endpoints, which are
        returned as the names it was kept under (what the peer replicas learn)."""
        ...

    def learned(self, hashes: Chain, holders: Sequence[Holder]) -> None:
        """A peer replica placed the chain ``hashes`` on ``holders`` (its :meth:`placed`)."""
        ...

    def snapshot(self) -> list[tuple[str, float, Chain]]:
        """What a replica that starts is to learn of this index, per endpoint.

        (name, capacity in tokens, blocks most recently used first) per endpoint, each to be
        :meth:`learned` in turn."""
        ...

    def observe(self, address: str, queries: float | None, hits: float | None) -> None:
        """An engine's prefix-cache counters (totals since it started; ``None`` when unknown)."""
        ...

    def retain(self, addresses: set[str]) -> None:
        """Forget every endpoint not in ``addresses``."""
        ...


KINDS: dict[PrefixSourceKind, Callable[[PrefixSettings, PredictionSink], PrefixSource]] = {
    PrefixSourceKind.APPROXIMATE: PrefixTracker,
    PrefixSourceKind.KV_EVENTS: KvEventSource,
}
"""How to build each kind of prefix source from its settings and where it reports."""
