"""The prefix source's settings (``affinity.prefix``), which every kind reads: the hashing, the kind, its own.

Values only: :mod:`ext_proc.prefix.config` checks and builds them from the configuration.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    """The ``kv-events`` prefix source's settings (``affinity.prefix.kv_events``).

    ``port``: the engines' KV-event PUB port (an endpoint's ``kv_events_port`` metadata overrides it);
    ``replay_port``: their replay (ROUTER) port (an endpoint's ``kv_events_replay_port`` overrides it),
    ``0`` when they have none: a gap then drops the endpoint's entries; data-parallel rank ``r``
    publishes on both plus ``r``; ``stale_after_seconds``: an engine that published nothing for this long is
    routed as holding nothing; ``recent_seconds``: how long this gateway's own placements count as held
    before the events confirm them; ``max_blocks_per_endpoint``: the most blocks indexed per engine;
    ``queue_batches``: the most batches waiting per engine (more are dropped: a flood is bounded)."""

    port: int = 5557
    replay_port: int = 0
    stale_after_seconds: float = 300.0
    recent_seconds: float = 5.0
    max_blocks_per_endpoint: int = 1 << 20
    queue_batches: int = 10_000


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """The prefix index's settings (``affinity.prefix``).

    ``block_tokens``: tokens per hashed block (4 characters a token for text); ``max_blocks``: the
    most blocks of one prompt hashed (longer prompts match on their head only); ``self_correct``: size
    each endpoint's LRU from its engine's prefix-cache counters too (needs engine metrics); ``source``: the
    kind of prefix source (:class:`PrefixSourceKind`'s values); ``kv_events``:
    the ``kv-events`` source's settings; ``tokenizer``: the model's tokenizer folder (``""``: none)."""

    block_tokens: int = 16
    max_blocks: int = 2048
    self_correct: bool = True
    source: str = "approximate"
    kv_events: KvEventsSettings = field(default_factory=KvEventsSettings)
    tokenizer: str = ""


class PrefixSourceKind(enum.StrEnum):
    """The kinds of prefix source (``affinity.prefix.source``), built by ``prefix.kinds.KINDS``."""

    APPROXIMATE = "approximate"
    KV_EVENTS = "kv-events"
