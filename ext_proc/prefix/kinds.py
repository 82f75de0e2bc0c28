"""The prefix-source seam: the :class:`PrefixSource` protocol and its kinds, one module each.

A prefix source tells the router, per request, which endpoints are estimated to hold the prompt's
leading blocks, and learns from placements and the engines' prefix-cache counters. ``approximate``
(:class:`~ext_proc.prefix.tracker.PrefixTracker`) estimates from this gateway's own placements;
``kv-events`` (:class:`~ext_proc.prefix.event_source.KvEventSource`) reads what the engines report
holding in their KV-cache events. A new kind is a module with its source, one
:class:`~ext_proc.prefix.settings.PrefixSourceKind` member, one line in :data:`KINDS` and one in
``_KERNELS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol

from ext_proc.affinity import Decision, Pool
from ext_proc.affinity.model import E
from ext_proc.prefix import blocks, event_source, index
from ext_proc.prefix.blocks import Chain
from ext_proc.prefix.event_sink import EventFeed
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.lookup import Holder, Lookup, Placed, PredictionSink
from ext_proc.prefix.settings import PrefixSettings, PrefixSourceKind
from ext_proc.prefix.tracker import PrefixTracker


class PrefixSource(Protocol):
    """What the router, the shared state and the KV-event subscribers ask of a prefix source (in tokens).

    A request makes two calls: :meth:`lookup_prompt` before the decision, :meth:`placed` after it.
    ``settings`` hold its hashing (``block_tokens``, ``max_blocks``) and may be replaced live when the
    hashing stays the same.
    """

    settings: PrefixSettings

    @property
    def block_tokens(self) -> int:
        """Tokens a block of the chains it hashes now (``kv-events``: the engines' events give it)."""
        ...

    def events(self) -> EventFeed | None:
        """What its KV-event subscribers feed (``None``: it learns from no engine event)."""
        ...

    def chain(
        self, body: dict[str, object], tokens: Sequence[int] | None = None, adapter: bool = False
    ) -> Chain:
        """The chained block hashes of the request's prompt (empty without a prompt).

        A 1-D int64 array (:func:`~ext_proc.prefix.blocks.block_hashes`).

        ``tokens``: the prompt in the engine's token ids when the gateway tokenized it (the chain is
        then over them, whatever the body's prompt). ``adapter``: the body's ``model`` is a LoRA
        adapter, whose cache the engines keep apart from the base model's (the chain is keyed by it)."""
        ...

    def lookup_prompt(
        self,
        body: dict[str, object],
        tokens: Sequence[int] | None,
        prefills: Pool[E],
        decodes: Pool[E],
        prompt_tokens: int,
        pinned: bool = False,
        adapter: bool = False,
    ) -> Lookup | None:
        """What the candidate endpoints hold of the prompt's :meth:`chain`, with the decision's hit arrays.

        ``None`` when the prompt has no block (nothing to look up, nothing to record). ``pinned``: the
        handoff pins the engine requests to the data-parallel rank the lookup credits
        (:attr:`Lookup.ranks`); without, an endpoint of several ranks is credited only what it is known
        to hold whichever rank serves. ``adapter``: as for :meth:`chain`."""
        ...

    def placed(self, lookup: Lookup, decision: Decision[E], prompt_tokens: int) -> Placed:
        """The request was placed by ``decision``: its prompt is now on the chosen endpoints.

        Returns the names it was kept under (what the peer replicas learn) and the hit tokens
        predicted at the prefill (at most ``prompt_tokens``), which it does not compute."""
        ...

    def learned(self, hashes: Chain, holders: Sequence[Holder]) -> None:
        """A peer replica placed the chain ``hashes`` on ``holders`` (its :meth:`placed`)."""
        ...

    def snapshot(self) -> list[tuple[str, float, Chain]]:
        """What a replica that starts is to learn of this index.

        Per endpoint: its name, capacity in tokens and blocks most recently used first, each to be
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

_KERNELS: dict[PrefixSourceKind, ModuleType] = {
    PrefixSourceKind.APPROXIMATE: index,
    PrefixSourceKind.KV_EVENTS: event_source,
}
"""The module whose ``warm()`` compiles each kind's own kernels (numba), beside the hashing's."""


def build(settings: PrefixSettings, sink: PredictionSink) -> PrefixSource:
    """The prefix source of the kind ``settings.source`` names, its kernels compiled first.

    Compiling takes once a process ~0.6 s for the hashing, ~1 s more for the placements' LRU or the
    ``kv-events`` index's tables: at start or at the reload that asks for it, not on a request."""
    kind = PrefixSourceKind(settings.source)
    blocks.warm()
    _KERNELS[kind].warm()
    return KINDS[kind](settings, sink)


def keeps_state(running: PrefixSettings, new: PrefixSettings) -> bool:
    """Whether a source built with ``running`` may go on with ``new`` (else one starts empty).

    Its kind and its prompt chain must stay (an index built with other values cannot be looked up)
    and, for ``kv-events``, the settings its index was built with."""
    return _identity(running) == _identity(new)


def _identity(settings: PrefixSettings) -> tuple[object, ...]:
    own = settings.kv_events if settings.source == PrefixSourceKind.KV_EVENTS else None
    return settings.source, settings.block_tokens, settings.max_blocks, own
