"""pdGroupID affinity: the pure prefill/decode routing decision and its value types."""

from ext_proc.affinity.auto import AutoModel
from ext_proc.affinity.decide import choose
from ext_proc.affinity.model import (
    Candidate,
    Cost,
    Decision,
    Endpoint,
    Estimate,
    Hits,
    Lacks,
    Locality,
    Mode,
    NoPair,
    NoPairReason,
    Policy,
)
from ext_proc.affinity.pool import Pool

__all__ = [
    "AutoModel",
    "Candidate",
    "Cost",
    "Decision",
    "Endpoint",
    "Estimate",
    "Hits",
    "Lacks",
    "Locality",
    "Mode",
    "NoPair",
    "NoPairReason",
    "Policy",
    "Pool",
    "choose",
]
