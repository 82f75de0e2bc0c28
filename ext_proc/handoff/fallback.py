"""What the answer-after-I/O handoffs share: up to two prefill attempts, then the failure policy.

The handoffs are ``kv-transfer-params`` and ``vllm-mooncake``: one request's attempts on at most
two prefills, and what follows when both failed (``handoff.on_prefill_failure``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ext_proc.handoff.base import DecodeRoute, FailurePolicy, Rerouter
from ext_proc.handoff.leg import LegOutcome, PrefillClient
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.outcome import HandoffJob, Placement, Refused, Routed
from ext_proc.refusal import refuse
from ext_proc.registry import EndpointState

if TYPE_CHECKING:
    from ext_proc.handoff.config import HandoffConfig

log = logging.getLogger(__name__)


class LegHandoff:
    """The state of the handoffs that talk to a prefill before they answer.

    They hold the decode ``route``, the prefill ``client``, ``metrics``, and of ``settings`` the
    ``on_failure`` policy (``on_prefill_failure``) and whether a streamed answer is watched for a
    failed KV pull (``watch_streams``: ``watch_streamed_answers``)."""

    hands_kv = True
    pins_ranks = True

    def __init__(
        self, settings: HandoffConfig, *, route: DecodeRoute, client: PrefillClient, metrics: Metrics
    ) -> None:
        self.route = route
        self.client = client
        self.metrics = metrics
        self.on_failure = settings.on_prefill_failure
        self.watch_streams = settings.watch_streamed_answers
        self.routing_headers = route.routing_headers

    async def close(self) -> None:
        """Close the prefill legs' connections."""
        await self.client.close()


class Attempts:
    """One request's I/O with its prefill before the answer, with one retry on another prefill.

    A :class:`~ext_proc.outcome.PendingAnswer` once a subclass adds ``timeout`` and ``complete``.
    ``lease`` holds the current placement's charges; a failed prefill may be swapped once for the
    next-ranked one (:meth:`retry`), then :meth:`give_up` applies the policy."""

    def __init__(
        self, handoff: LegHandoff, job: HandoffJob, placement: Placement, router: Rerouter, request_id: str
    ) -> None:
        self.lease: Lease = placement.lease
        self._settings = handoff
        self._job = job
        self._placement = placement
        self._router = router
        self._request_id = request_id
        self._tried: frozenset[str] = frozenset()

    def retry(self, failed: EndpointState, outcome: LegOutcome) -> bool:
        """Eject the ``failed`` prefill and, on the first failure, move to the next-ranked one.

        ``failed`` failed with ``outcome`` (not a 4xx). The next prefill's charges replace the current
        ones; ``False`` when there is none."""
        self._router.leg_failed(failed.address, outcome.value)
        self._tried |= {failed.address}
        retry = (
            self._router.retry(self._job, self._placement.decision, self._tried)
            if len(self._tried) == 1
            else None
        )
        if retry is None:
            return False
        self.lease.release()
        self._placement, self.lease = retry, retry.lease
        return True

    def decode_only(self) -> Routed:
        """The client's body, without its handoff fields, to the current decode."""
        return self._settings.route.decode_only(self._job, self._placement, self._request_id)

    def give_up(self, outcome: LegOutcome, failure: str) -> Routed | Refused:
        """Count the fallback, then apply the policy: go decode-only, or answer a 504 or 502.

        Policy ``decode-only`` goes decode-only; otherwise the charges are released and the answer is
        ``504 prefill_timeout`` (a timeout) or ``502 prefill_failed``. ``failure`` says what failed, e.g.
        "the prefill engine 10.0.0.1:8000 failed: server_error (HTTP 503)"."""
        policy = self._settings.on_failure
        self._settings.metrics.prefill_fallback(policy.value)
        if policy is FailurePolicy.DECODE_ONLY:
            decode = self._placement.decision.decode.address
            log.warning("no prefill succeeded; request %s goes decode-only to %s", self._request_id, decode)
            return self.decode_only()
        self.lease.release()
        if outcome is LegOutcome.TIMEOUT:
            return refuse(self._settings.metrics, 504, failure, "prefill_timeout")
        return refuse(self._settings.metrics, 502, failure, "prefill_failed")
