"""Count, log and describe an error answer: how every :class:`~ext_proc.outcome.Refused` is made.

The router (an invalid request, no endpoint, overload), the handoffs (a failed prefill leg, a failed
KV pull) and the shell (the stream's own errors: a body too large, a misconfigured or broken ext_proc
exchange, an internal error) all refuse through :func:`refuse`, with the server's metrics: every
refusal is counted in ``pd_extproc_rejected_total`` by its code and logged once, and nobody calls
back into the router to refuse.
"""

from __future__ import annotations

import logging

from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused

log = logging.getLogger(__name__)


def refuse(
    metrics: Metrics,
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    body: bytes | None = None,
    retry_after: int | None = None,
) -> Refused:
    """Count, log and describe an error answer.

    Counted in ``rejected_total`` with reason ``code``, logged at INFO below 500, else WARNING.
    ``body``: an exact error body to send; ``retry_after``: seconds for a ``retry-after`` header."""
    metrics.rejected(code)
    log.log(logging.INFO if status < 500 else logging.WARNING, "answered %d %s: %s", status, code, message)
    return Refused(status, message, code, param, body, retry_after)
