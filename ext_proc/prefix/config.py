"""The ``affinity.prefix`` section: prefix-cache aware routing, and its checks (docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ext_proc.checks import in_range
from ext_proc.prefix.settings import KvEventsSettings, PrefixSettings, PrefixSourceKind

MAX_PREFIX_BLOCKS = 1 << 16
"""Upper bound of ``affinity.prefix.max_blocks`` (65,536 blocks: a million tokens at 16)."""


@dataclass(frozen=True)
class PrefixConfig:
    """Prefix-cache aware routing (docs/routing.md "Prefix-cache aware routing"; :mod:`ext_proc.prefix`).

    ``enabled``: keep the prefix index and route by it. ``block_tokens``: tokens per hashed block
    (token ids as they are; text in chunks of 4 characters a token). ``max_blocks``: the most blocks of
    one prompt hashed. ``weight``: in ``off``, ``prefer`` and ``strict``, what a prompt held whole in an
    endpoint's cache is worth in utilisation units (``auto`` prices hits in seconds instead).
    ``self_correct``: size each endpoint's index from its engine's ``vllm:prefix_cache_queries`` /
    ``_hits`` too (with ``engine_metrics.enabled``; the ``approximate`` source only). ``source``: where
    the index learns what each engine holds: ``approximate`` (this gateway's own placements) or
    ``kv-events`` (the engines' KV-cache events). ``kv_events``: the ``kv-events`` source's settings.
    ``tokenizer``: the model's tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``; ``""``:
    none): text prompts are then put in the engine's token ids before they are routed, so the
    ``kv-events`` index can match them, and their token counts are exact. ``cpu_tier_weight``: in
    ``off``, ``prefer`` and ``strict``, what a prompt token held in a CPU tier (an event's ``medium``
    other than GPU memory) is worth against one held in GPU memory (``auto`` prices its load instead).
    """

    enabled: bool = False
    block_tokens: int = 16
    max_blocks: int = 2048
    weight: float = 0.1
    self_correct: bool = True
    source: PrefixSourceKind = PrefixSourceKind.APPROXIMATE
    kv_events: KvEventsSettings = field(default_factory=KvEventsSettings)
    tokenizer: str = ""
    cpu_tier_weight: float = 0.5

    def settings(self) -> PrefixSettings | None:
        """The prefix tracker's settings, ``None`` when disabled."""
        if not self.enabled:
            return None
        return PrefixSettings(
            self.block_tokens, self.max_blocks, self.self_correct, self.source, self.kv_events, self.tokenizer
        )

    def check(self) -> None:
        """Raise :class:`~ext_proc.checks.ConfigError` naming the first key out of range."""
        key = "affinity.prefix"
        in_range(f"{key}.block_tokens", self.block_tokens, 1, 4096, kind="an integer")
        in_range(f"{key}.max_blocks", self.max_blocks, 1, MAX_PREFIX_BLOCKS, kind="an integer")
        in_range(f"{key}.weight", self.weight, 0, 100, note="utilisation units")
        in_range(f"{key}.cpu_tier_weight", self.cpu_tier_weight, 0, 1, note="a GPU-held token is 1")
        events, key = self.kv_events, f"{key}.kv_events"
        in_range(f"{key}.port", events.port, 1, 65535, kind="a port")
        in_range(f"{key}.replay_port", events.replay_port, 0, 65535, kind="a port", note="0: none")
        in_range(f"{key}.stale_after_seconds", events.stale_after_seconds, 0, 86400, low_open=True)
        in_range(f"{key}.recent_seconds", events.recent_seconds, 0, 600)
        in_range(
            f"{key}.max_blocks_per_endpoint", events.max_blocks_per_endpoint, 1, 1 << 24, kind="an integer"
        )
        in_range(f"{key}.queue_batches", events.queue_batches, 1, 1_000_000, kind="an integer")
