"""What every prefix source answers and reports: one request's lookup, its placement, the prediction sink.

The words the kinds share (:mod:`ext_proc.prefix.kinds`): a :class:`Lookup` is what the candidates hold
of one prompt, with the decision's hit arrays (:mod:`ext_proc.prefix.hits`); :class:`Placed` is what
recording the decision tells the router; a :class:`Holder` is where a placement put the prompt (what
the peer replicas learn); a :class:`PredictionSink` counts what each source predicted. Values only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, Protocol

from ext_proc.affinity import Decision, Hits, Pool
from ext_proc.affinity.model import E
from ext_proc.prefix.blocks import Chain


class Lookup(NamedTuple):
    """One request's view of the index.

    Its prompt's chain (:func:`~ext_proc.prefix.blocks.block_hashes`), the blocks each endpoint holds
    of it (by address), the decision's :class:`Hits` (``None`` when no candidate holds anything), and
    the data-parallel rank whose blocks an endpoint of several ranks was credited with, by address (the
    request is pinned to it there: :mod:`ext_proc.prefix.ranks`)."""

    hashes: Chain
    matched: dict[str, int]
    hits: Hits | None
    ranks: Mapping[str, int] = MappingProxyType({})


class PromptLookups(ABC):
    """A prompt looked up the one way every prefix kind does: its :meth:`chain`, then :meth:`lookup`."""

    @abstractmethod
    def chain(
        self, body: dict[str, object], tokens: Sequence[int] | None = None, adapter: bool = False
    ) -> Chain:
        """The prompt's chain of block hashes (empty: no whole block)."""

    @abstractmethod
    def lookup(
        self, hashes: Chain, prefills: Pool[E], decodes: Pool[E], prompt_tokens: int, pinned: bool = False
    ) -> Lookup:
        """What the candidates hold of ``hashes``, with the decision's hit arrays."""

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
        """The prompt's :meth:`chain` looked up (:meth:`lookup`); ``None`` when it has no block."""
        hashes = self.chain(body, tokens, adapter)
        return self.lookup(hashes, prefills, decodes, prompt_tokens, pinned) if len(hashes) else None


Holder = tuple[str, float]
"""Where a placement put a prompt: an endpoint's name (its address, or ``address@dp<rank>`` for one
data-parallel rank of it) and its KV capacity in tokens."""


class Placed(NamedTuple):
    """What recording a placement tells the router.

    ``holders``: where the prompt is now kept (what the peer replicas learn); ``prefill_hit``: the hit
    tokens predicted at the chosen prefill (0 without one), which it is not charged for computing."""

    holders: tuple[Holder, ...]
    prefill_hit: int


class PredictionSink(Protocol):
    """Where a prefix source reports (:class:`ext_proc.metrics.Metrics` is one)."""

    def prefix_predicted(self, role: str, address: str, placed: int, hit: int) -> None:
        """``hit`` of the ``placed`` prompt tokens sent to ``address`` as ``role`` were predicted cached."""
        ...

    def prefix_engine(self, address: str, queries: float, hits: float, scale: float) -> None:
        """An engine's prefix-cache counters since its last sample, and its index's size ``scale`` now."""
        ...


def hit_tokens(lookup: Lookup, address: str, block_tokens: int, prompt_tokens: int) -> int:
    """The hit tokens ``lookup`` predicts at ``address``: its matched blocks, at most ``prompt_tokens``."""
    return min(lookup.matched.get(address, 0) * block_tokens, prompt_tokens)


def predict(
    lookup: Lookup, decision: Decision[E], block_tokens: int, prompt_tokens: int, sink: PredictionSink
) -> list[tuple[E, int]]:
    """The endpoints ``decision`` placed the prompt on, each with the hit tokens predicted there.

    The prefill, if any, first; the hit tokens are :func:`hit_tokens` of ``lookup``, each reported to
    ``sink``."""
    predicted: list[tuple[E, int]] = []
    for role, endpoint in (("prefill", decision.prefill), ("decode", decision.decode)):
        if endpoint is not None:
            hit = hit_tokens(lookup, endpoint.address, block_tokens, prompt_tokens)
            sink.prefix_predicted(role, endpoint.address, prompt_tokens, hit)
            predicted.append((endpoint, hit))
    return predicted


def prefill_hit(decision: Decision[E], predicted: list[tuple[E, int]]) -> int:
    """The hit :func:`predict` predicted at ``decision``'s prefill (0 without one)."""
    return 0 if decision.prefill is None else predicted[0][1]
