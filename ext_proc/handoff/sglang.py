"""The sglang-bootstrap handoff: SGLang's PD disaggregation, prefill and decode at the same time.

The body gets ``bootstrap_host`` (the prefill's IP), ``bootstrap_port`` (its ``bootstrap_port``
endpoint metadata, else the configured default) and ``bootstrap_room`` (a random 63-bit integer, the
rendezvous key: no client can choose or predict it). Envoy forwards it to the decode while the same
body goes to the prefill through the prefill-leg listener, concurrently: the prefill waits for the
decode to connect before it sends the KV cache, so waiting for the prefill first would deadlock.
The prefill leg is drained in the background; its charge is released when it returns, and it is
cancelled if the client's exchange ends first. A failed prefill leg is logged and counted, and (unless a
4xx) ejects that prefill for a while (``ext_proc/ejection.py``); the decode engine then fails the
request itself once its bootstrap wait times out (README "Handoff modes").
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from ext_proc.handoff.base import (
    REQUEST_ID_HEADER,
    DecodeRoute,
    HandoffJob,
    Placement,
    Rerouter,
    Routed,
    new_request_id,
)
from ext_proc.handoff.body import HANDOFF_FIELDS, with_fields, without_fields
from ext_proc.handoff.leg import LegError, LegOutcome, PrefillClient
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.registry import EndpointState

log = logging.getLogger(__name__)


def bootstrap_host(address: str) -> str:
    """The IP of an ``"ip:port"`` / ``"[ipv6]:port"`` address, as SGLang expects ``bootstrap_host``."""
    return address.rpartition(":")[0].strip("[]")


class SglangBootstrapHandoff:
    """The concurrent handoff; see the module docstring."""

    def __init__(
        self,
        route: DecodeRoute,
        client: PrefillClient,
        metrics: Metrics,
        default_bootstrap_port: int,
        watch_streams: bool = True,
    ) -> None:
        self.route = route
        self.client = client
        self.metrics = metrics
        self.default_bootstrap_port = default_bootstrap_port
        self.routing_headers = route.routing_headers
        self.hands_kv = True
        self.watch_streams = watch_streams
        self._legs: set[asyncio.Task[None]] = set()

    def hand_off(self, job: HandoffJob, placement: Placement, router: Rerouter) -> Routed:
        """Answer at once: the decode gets the bootstrap fields, the prefill leg starts alongside."""
        decision, lease = placement.decision, placement.lease
        prefill = decision.prefill
        if prefill is None:
            plain = without_fields(job.raw, job.body, HANDOFF_FIELDS)
            return self.route.routed(decision, None, plain, lease, kv_source=None)
        fields: dict[str, object] = {
            "bootstrap_host": bootstrap_host(prefill.address),
            "bootstrap_port": prefill.bootstrap_port or self.default_bootstrap_port,
            "bootstrap_room": secrets.randbits(63),
        }
        body = with_fields(job.raw, job.body, fields, HANDOFF_FIELDS)
        request_id = new_request_id()
        headers = {REQUEST_ID_HEADER: request_id}
        if job.meta.authorization is not None:
            headers["authorization"] = job.meta.authorization
        leg = asyncio.get_running_loop().create_task(
            self._drain(prefill, job.meta.path, body, headers, lease, router),
            name=f"prefill-leg-{request_id}",
        )
        self._legs.add(leg)
        leg.add_done_callback(self._legs.discard)
        return self.route.routed(decision, request_id, body, lease, kv_source=prefill.address, background=leg)

    async def _drain(
        self,
        prefill: EndpointState,
        path: str,
        body: bytes,
        headers: dict[str, str],
        lease: Lease,
        router: Rerouter,
    ) -> None:
        """Send the prefill leg, read its answer to the end, count it, release the prefill charge; a
        failure other than a 4xx ejects the prefill (``router.leg_failed``)."""
        try:
            reply = await self.client.send(prefill.address, path, body, headers)
        except LegError as exc:
            outcome, seconds, detail = exc.outcome, None, str(exc)
        except asyncio.CancelledError:
            self.metrics.prefill_leg(LegOutcome.CANCELLED.value, None)
            raise
        else:
            seconds, detail = reply.seconds, f"HTTP {reply.status}"
            if 200 <= reply.status < 300:
                outcome = LegOutcome.OK
            elif 400 <= reply.status < 500:
                outcome = LegOutcome.CLIENT_ERROR
            else:
                outcome = LegOutcome.SERVER_ERROR
        finally:
            lease.release_prefill()
        self.metrics.prefill_leg(outcome.value, seconds)
        if outcome not in (LegOutcome.OK, LegOutcome.CLIENT_ERROR):
            router.leg_failed(prefill.address, outcome.value)
        if outcome is not LegOutcome.OK:
            log.warning(
                "prefill leg to %s: %s (%s); request %s: its decode fails once its bootstrap wait ends",
                prefill.address,
                outcome.value,
                detail,
                headers[REQUEST_ID_HEADER],
            )

    async def close(self) -> None:
        """Cancel the prefill legs still running and close their connections."""
        legs = list(self._legs)
        for leg in legs:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)
        await self.client.close()
