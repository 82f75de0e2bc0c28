"""The Gateway API Inference Extension's saturation rule on the engines' own signals, pure.

An engine has room while fewer than ``queue_depth_threshold`` requests wait in it and less than
``kv_cache_threshold`` of its KV cache is in use; the pool is saturated when no engine has room. As a
count: the requests the pool can still take before it is saturated (its headroom) is, over the
engines with KV room, the sum of ``queue_depth_threshold - waiting``. The shell subtracts what it
dispatched since the samples landed, so a queue does not burst into the pool between two scrapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def headroom(samples: Iterable[tuple[float, float]], queue_threshold: int, kv_threshold: float) -> int | None:
    """Requests the engines of ``samples`` ``(waiting, kv_usage)`` can take before all are saturated.

    ``None`` without a sample: nothing known, no limit from the engines (local accounting alone)."""
    room: int | None = None
    for waiting, kv_usage in samples:
        free = max(0, math.ceil(queue_threshold - waiting)) if kv_usage < kv_threshold else 0
        room = free if room is None else room + free
    return room
