"""Passive ejection of endpoints that failed (Envoy's outlier detection in miniature): prefills, dead decodes.

A dead prefill that discovery still lists answers every leg at once with a failure, so it never carries
load and the least-loaded rule would pick it first for every request: each request then pays a failed
leg and a retry (``kv-transfer-params``) or fails on its decode (``sglang-bootstrap``, whose decode
is already on its way). After a failed leg the prefill is left out of the candidates for
``seconds``; a later failure restarts its time. Ejection never empties the candidates: when every
prefill is ejected, all are candidates again (as Envoy's panic threshold does), so a cluster-wide
blip cannot turn into decode-only routing for everyone.

A decode whose engine core died (``decode_engine_dead``) is ejected the same way, for the same time.

The same set also holds the endpoints Envoy itself marks as failed (:meth:`Ejections.hold`, fed by
:mod:`ext_proc.envoy_health`): Envoy's override_host policy forwards to the host pd-extproc names even
when Envoy's outlier detection ejected it, so only pd-extproc can stop naming it. The router keeps
one instance per role.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ext_proc.affinity import Pool
from ext_proc.metrics import Metrics
from ext_proc.registry import EndpointState

log = logging.getLogger(__name__)


class Ejections:
    """Endpoints left out of routing after a failure, by address.

    Addresses are ejected until a ``clock()`` time (seconds; monotonic by default), plus those held
    out by :meth:`hold` until the next call.

    ``seconds`` = 0 turns timed ejection off. ``role`` (``prefill``, ``decode``) names the endpoints in
    logs and metrics. Cost while nothing is ejected: two tests per decision.
    """

    def __init__(
        self,
        seconds: float,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        role: str = "prefill",
    ) -> None:
        self.seconds = seconds
        self.role = role
        self._metrics = metrics
        self._clock = clock
        self._until: dict[str, float] = {}
        self._held: frozenset[str] = frozenset()

    def hold(self, addresses: frozenset[str]) -> None:
        """Leave exactly ``addresses`` out (besides the timed ejections) until the next call."""
        self._held = addresses

    @property
    def held(self) -> frozenset[str]:
        """The addresses the last :meth:`hold` left out."""
        return self._held

    def eject(self, address: str, outcome: str) -> None:
        """Leave ``address`` out for :attr:`seconds` from now: it failed with ``outcome``.

        A prefill leg to it failed, a decode could not pull its KV, or (a decode) its engine core died."""
        if self.seconds <= 0:
            return
        self._until[address] = self._clock() + self.seconds
        self._metrics.ejected(self.role, outcome)
        log.warning("%s %s ejected for %g s after a failure (%s)", self.role, address, self.seconds, outcome)

    def ejected(self) -> frozenset[str]:
        """The addresses ejected or held out now (expired ejections are forgotten)."""
        if not self._until:
            return self._held
        now = self._clock()
        for address in [a for a, until in self._until.items() if until <= now]:
            del self._until[address]
        return self._held.union(self._until)

    def keep(self, pool: Pool[EndpointState]) -> Pool[EndpointState]:
        """``pool`` without the ejected endpoints.

        ``pool`` itself when none of its endpoints is ejected or all of them are."""
        out = self.ejected()
        if not out:
            return pool
        kept = {e.address for e in pool.endpoints if e.address not in out}
        if not kept or len(kept) == pool.size:
            return pool
        return pool.only(kept)
