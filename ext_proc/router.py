"""One request's routing, free of gRPC: parse, decide, charge, and describe the answer.

The server calls :meth:`Router.route_body` (or :meth:`Router.route_bodiless`) and maps the
outcome onto ext_proc messages. Every failure comes back as a :class:`Refused` with an HTTP
status, a precise message and a machine-readable code.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ext_proc.affinity import Cost, Policy, Pool, Rejection, choose
from ext_proc.handoff import Handoff, RoutingInstructions
from ext_proc.load import Lease
from ext_proc.metrics import Metrics
from ext_proc.registry import EndpointState, Registry
from ext_proc.request import RequestError, parse_request

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Routed:
    """The request goes ahead: ``instructions`` for Envoy, ``lease`` to release when it ends."""

    instructions: RoutingInstructions
    lease: Lease


@dataclass(frozen=True, slots=True)
class Refused:
    """The request is answered with an error. ``code`` is also the ``rejected_total`` reason."""

    status: int
    message: str
    code: str
    param: str | None = None


class Router:
    """Routes requests over ``registry`` with ``policy``; owns the round-robin tie-break counter."""

    def __init__(
        self, registry: Registry, policy: Policy, handoff: Handoff, metrics: Metrics, default_max_tokens: int
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.handoff = handoff
        self.metrics = metrics
        self._default_max_tokens = default_max_tokens
        self._mode = policy.mode.value
        self._ticket = 0
        self._no_prefills: Pool[EndpointState] = Pool.of(())

    def refuse(self, status: int, message: str, code: str, param: str | None = None) -> Refused:
        """Count, log and describe an error answer."""
        self.metrics.rejected(code)
        log.log(
            logging.INFO if status < 500 else logging.WARNING, "answered %d %s: %s", status, code, message
        )
        return Refused(status, message, code, param)

    def route_body(self, raw: bytes, subset: frozenset[str] | None = None) -> Routed | Refused:
        """Route a request by its full JSON body: prefill then decode, per the affinity policy.

        ``subset`` (the data plane's endpoint-subset hint) restricts the decode endpoints.
        """
        try:
            info = parse_request(raw, self._default_max_tokens)
        except RequestError as exc:
            return self.refuse(400, str(exc), "invalid_request", exc.param)
        prompt = info.prompt_tokens
        return self._route(Cost(prompt, prompt + info.output_budget), self.registry.prefill_pool, subset)

    def route_bodiless(self, subset: frozenset[str] | None = None) -> Routed | Refused:
        """Route a request without a body (e.g. ``GET /v1/models``) to the least-loaded decode."""
        return self._route(Cost(0, 0), self._no_prefills, subset)

    def _route(
        self, cost: Cost, prefills: Pool[EndpointState], subset: frozenset[str] | None
    ) -> Routed | Refused:
        started = time.perf_counter()
        decodes = self.registry.decode_pool
        if subset is not None:
            decodes = decodes.only(subset)
            if not decodes.size:
                message = (
                    f"none of the {len(subset)} endpoints in the data plane's subset hint is a healthy decode"
                )
                return self.refuse(503, message, "no_endpoint_in_subset")
        self._ticket += 1
        result = choose(cost, prefills, decodes, self.policy, self._ticket)
        if isinstance(result, Rejection):
            return self.refuse(503, result.message, result.reason.value)
        lease = Lease(result.prefill, cost.prefill_tokens, result.decode, cost.decode_tokens)
        instructions = self.handoff.instructions(result)
        self.metrics.decided(self._mode, result.locality.value, time.perf_counter() - started)
        return Routed(instructions, lease)
