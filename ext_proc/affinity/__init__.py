"""pdGroupID affinity: the pure prefill/decode routing decision and its value types."""

from ext_proc.affinity.decide import choose
from ext_proc.affinity.model import (
    Candidate,
    Cost,
    Decision,
    Endpoint,
    Locality,
    Mode,
    Policy,
    Rejection,
    RejectReason,
)
from ext_proc.affinity.pool import Pool

__all__ = [
    "Candidate",
    "Cost",
    "Decision",
    "Endpoint",
    "Locality",
    "Mode",
    "Policy",
    "Pool",
    "RejectReason",
    "Rejection",
    "choose",
]
