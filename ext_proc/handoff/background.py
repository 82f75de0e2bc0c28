"""Prefill legs that run alongside the decode, drained here for the concurrent handoffs.

The concurrent handoffs are ``sglang-bootstrap`` and ``vllm-mooncake``: the decode answer goes out
at once and the prefill leg is drained here.

A leg's charge is released when it returns; it is cancelled if the client's exchange ends first
(the server cancels :attr:`~ext_proc.handoff.base.Routed.background`) or at shutdown. A failed leg
is logged and counted and, unless a 4xx, ejects that prefill (``router.leg_failed``): the decode
then fails the request itself once its wait for the KV cache ends (docs/handoffs.md "Handoff modes").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ext_proc.handoff.base import REQUEST_ID_HEADER, Rerouter
from ext_proc.handoff.leg import LegError, LegOutcome, PrefillClient
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.registry import EndpointState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Leg:
    """One background leg: where it goes, what it carries, the charges it releases, whom to tell."""

    prefill: EndpointState
    path: str
    body: bytes
    headers: dict[str, str]
    lease: Lease
    router: Rerouter
    on_failure: Callable[[], None] | None


class BackgroundLegs:
    """The running prefill legs of one concurrent handoff.

    ``consequence`` completes the warning of a failed leg: what the client will see (e.g. "its
    decode fails once its bootstrap wait ends").
    """

    def __init__(self, client: PrefillClient, metrics: Metrics, consequence: str) -> None:
        self.client = client
        self.metrics = metrics
        self.consequence = consequence
        self._legs: set[asyncio.Task[None]] = set()

    def start(
        self,
        prefill: EndpointState,
        path: str,
        body: bytes,
        headers: dict[str, str],
        lease: Lease,
        router: Rerouter,
        on_failure: Callable[[], None] | None = None,
    ) -> asyncio.Task[None]:
        """Send the leg in a task, returned for the server to cancel when the exchange ends.

        ``headers`` must hold the request id; ``on_failure`` runs after a failure other than a 4xx."""
        leg = _Leg(prefill, path, body, headers, lease, router, on_failure)
        task = asyncio.get_running_loop().create_task(
            self._drain(leg), name=f"prefill-leg-{headers[REQUEST_ID_HEADER]}"
        )
        self._legs.add(task)
        task.add_done_callback(self._legs.discard)
        return task

    async def _drain(self, leg: _Leg) -> None:
        """Send the prefill leg, read its answer to the end, count it, release the prefill charge."""
        prefill = leg.prefill
        try:
            reply = await self.client.send(prefill.address, leg.path, leg.body, leg.headers)
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
            leg.lease.release_prefill()
        self.metrics.prefill_leg(outcome.value, seconds)
        if outcome not in (LegOutcome.OK, LegOutcome.CLIENT_ERROR):
            leg.router.leg_failed(prefill.address, outcome.value)
            if leg.on_failure is not None:
                leg.on_failure()
        if outcome is not LegOutcome.OK:
            log.warning(
                "prefill leg to %s: %s (%s); request %s: %s",
                prefill.address,
                outcome.value,
                detail,
                leg.headers[REQUEST_ID_HEADER],
                self.consequence,
            )

    async def close(self) -> None:
        """Cancel the legs still running and close their connections."""
        legs = list(self._legs)
        for leg in legs:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)
        await self.client.close()
