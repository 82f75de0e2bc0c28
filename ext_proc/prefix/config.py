"""The ``affinity.prefix`` section: prefix-cache aware routing, and its checks (docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.checks import in_range
from ext_proc.prefix.tracker import PrefixSettings

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
    ``_hits`` too (with ``engine_metrics.enabled``).
    """

    enabled: bool = False
    block_tokens: int = 16
    max_blocks: int = 2048
    weight: float = 0.1
    self_correct: bool = True

    def settings(self) -> PrefixSettings | None:
        """The prefix tracker's settings, ``None`` when disabled."""
        if not self.enabled:
            return None
        return PrefixSettings(self.block_tokens, self.max_blocks, self.self_correct)

    def check(self) -> None:
        """Raise :class:`~ext_proc.checks.ConfigError` naming the first key out of range."""
        key = "affinity.prefix"
        in_range(f"{key}.block_tokens", self.block_tokens, 1, 4096, kind="an integer")
        in_range(f"{key}.max_blocks", self.max_blocks, 1, MAX_PREFIX_BLOCKS, kind="an integer")
        in_range(f"{key}.weight", self.weight, 0, 100, note="utilisation units")
