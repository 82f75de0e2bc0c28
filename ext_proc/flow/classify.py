"""Which band and flow a request joins, by its headers: pure, and nothing a client sends is trusted.

``x-gateway-inference-objective`` names an objective: its configured priority is the band, an unknown
or absent one the default objective's. ``x-gateway-inference-fairness-id`` names the flow, cut to
:data:`MAX_FAIRNESS_ID_CHARS`; the queue bounds how many flows it tracks. Neither is ever a metric label
(the bands are labelled by their configured priority).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_FAIRNESS_ID_CHARS = 64
"""The longest fairness id kept; a longer one is cut to this many characters."""


@dataclass(frozen=True, slots=True)
class Objectives:
    """Priority per objective name, and the priority of a request naming none or an unknown one."""

    priorities: Mapping[str, int]
    default: int

    def priority(self, objective: str | None) -> tuple[int, bool]:
        """The band of ``objective`` and whether it was known (``None``, absent: known, the default)."""
        if objective is None:
            return self.default, True
        priority = self.priorities.get(objective)
        return (self.default, False) if priority is None else (priority, True)


def flow_of(fairness_id: str | None) -> str:
    """The flow a fairness id stands for: the id cut to :data:`MAX_FAIRNESS_ID_CHARS` (``""``: none)."""
    return "" if fairness_id is None else fairness_id[:MAX_FAIRNESS_ID_CHARS]
