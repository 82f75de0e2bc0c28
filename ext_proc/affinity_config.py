"""The ``affinity`` section: the decision's mode and bonus, its ``auto`` model, the prefix index's keys.

- A leaf: :mod:`ext_proc.config` reads it without loading the router, the compiled index or any I/O
  library (docs/configuration.md).
- It sits above both the decision (:mod:`ext_proc.affinity`, whose ``config`` holds ``auto``) and the
  prefix index (:mod:`ext_proc.prefix`, whose ``config`` holds ``prefix``): the prefix index reads the
  decision's types, so the decision's package may not import the prefix's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ext_proc.affinity.config import AutoConfig
from ext_proc.affinity.model import Mode, Policy
from ext_proc.checks import ConfigError
from ext_proc.prefix.config import PrefixConfig


@dataclass(frozen=True)
class AffinityConfig:
    """The ``affinity`` section: the router's decision policy and prefix index.

    ``mode``: off | prefer | strict | auto. ``bonus``: utilisation slack in [0, 1] for ``prefer``.
    ``auto``: the time model of ``auto``. ``prefix``: prefix-cache aware routing. The whole section
    applies live (:mod:`ext_proc.reload`: the router's ``set_policy`` with :meth:`policy`,
    :meth:`ext_proc.live.LiveParts.set_prefix` with ``prefix.settings()``).
    """

    mode: Mode = Mode.PREFER
    bonus: float = 0.3
    auto: AutoConfig = field(default_factory=AutoConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)

    def policy(self, fallback_count: int) -> Policy:
        """The decision's policy for this section, with ``fallback_count`` (``routing.fallback_count``)."""
        prefix = self.prefix
        weight = prefix.weight if prefix.enabled else 0.0
        model = self.auto.model()
        return Policy(self.mode, self.bonus, fallback_count, model, weight, prefix.cpu_tier_weight)

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first out-of-range key of the section or its subsections."""
        if not 0.0 <= self.bonus <= 1.0:
            raise ConfigError(f"affinity.bonus: {self.bonus} is not allowed; use a number in [0, 1]")
        self.auto.check()
        self.prefix.check()
