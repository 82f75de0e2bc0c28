"""What follows when no prefill could take a request (``handoff.on_prefill_failure``), for the
handoffs that talk to a prefill before they answer (``kv-transfer-params``, ``vllm-mooncake``)."""

from __future__ import annotations

import logging

from ext_proc.affinity import Decision
from ext_proc.handoff.base import DecodeRoute, FailurePolicy, HandoffJob, Refused, Rerouter, Routed
from ext_proc.handoff.body import HANDOFF_FIELDS, without_fields
from ext_proc.handoff.leg import LegOutcome
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.registry import EndpointState

log = logging.getLogger(__name__)


def decode_only(
    route: DecodeRoute, job: HandoffJob, decision: Decision[EndpointState], request_id: str, lease: Lease
) -> Routed:
    """The client's body, without its handoff fields, to the decode already chosen."""
    plain = without_fields(job.raw, job.body, HANDOFF_FIELDS)
    return Routed(route.instructions(decision, request_id, plain), lease)


def give_up(
    policy: FailurePolicy,
    metrics: Metrics,
    router: Rerouter,
    route: DecodeRoute,
    job: HandoffJob,
    decision: Decision[EndpointState],
    request_id: str,
    lease: Lease,
    outcome: LegOutcome,
    failure: str,
) -> Routed | Refused:
    """Count the fallback, then go decode-only (policy ``decode-only``) or release ``lease`` and
    answer ``504 prefill_timeout`` (a timeout) or ``502 prefill_failed``; ``failure`` says what
    failed, e.g. "the prefill engine 10.0.0.1:8000 failed: server_error (HTTP 503)"."""
    metrics.prefill_fallback(policy.value)
    if policy is FailurePolicy.DECODE_ONLY:
        log.warning(
            "no prefill succeeded; request %s goes decode-only to %s", request_id, decision.decode.address
        )
        return decode_only(route, job, decision, request_id, lease)
    lease.release()
    if outcome is LegOutcome.TIMEOUT:
        return router.refuse(504, failure, "prefill_timeout")
    return router.refuse(502, failure, "prefill_failed")
