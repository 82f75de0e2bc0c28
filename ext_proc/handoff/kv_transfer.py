"""The kv-transfer-params handoff: vLLM NixlConnector / vllm-ascend MooncakeConnector, prefill first.

1. The prefill leg (:func:`~ext_proc.handoff.body.prefill_leg_body`, a gateway-made ``x-request-id``,
   the client's ``authorization``) goes to the chosen prefill through Envoy's prefill-leg listener.
2. The ``kv_transfer_params`` of its answer are added, verbatim, to the client's own body, which
   Envoy then forwards to the chosen decode (same ``x-request-id``): the decode pulls the KV cache.

The prefill charge is released when the leg returns. A prefill answer without ``kv_transfer_params``
(a connector that is not prefill-first, or none) sends the plain body to the decode, which prefills the
prompt again: counted per prefill and logged at WARNING the first time for each prefill. A failed leg
(connect error, 5xx, 408/429, timeout, unusable answer) is retried once on the next-ranked prefill,
then leads to decode-only routing or an error (:class:`~ext_proc.handoff.base.FailurePolicy`). Any
other 4xx is the client's request being bad: the engine's error goes back to the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from ext_proc.handoff.base import DecodeRoute, Rerouter, new_request_id, prefill_leg_headers
from ext_proc.handoff.body import (
    HANDOFF_FIELDS,
    KV_TRANSFER_PARAMS,
    prefill_leg_body,
    with_fields,
)
from ext_proc.handoff.fallback import Attempts, LegHandoff
from ext_proc.handoff.kv_failure import KvPullWatcher
from ext_proc.handoff.leg import LegError, LegOutcome, LegReply, PrefillClient
from ext_proc.metrics import Metrics
from ext_proc.outcome import HandoffJob, Placement, Refused, Routed
from ext_proc.refusal import refuse
from ext_proc.registry import EndpointState

if TYPE_CHECKING:
    from ext_proc.handoff.config import HandoffConfig
    from ext_proc.handoff.routing import RoutingConfig

log = logging.getLogger(__name__)

TIMEOUT_MARGIN_SECONDS = 5.0
"""Added to the legs' worst case when asking Envoy to wait for the body answer."""
NO_PARAMS_CONSEQUENCE = (
    "the decode prefills the prompt again; a prefill that never returns them runs a connector whose "
    "handoff is not prefill-first (vLLM's MooncakeConnector: handoff.mode vllm-mooncake) or none "
    "(pd_extproc_prefill_no_kv_transfer_params_total; warned once per prefill)"
)
_RETRYABLE_4XX = frozenset({408, 429})
_MAX_DETAIL = 300


def read_prefill_reply(reply: LegReply) -> tuple[LegOutcome, dict[str, object] | None, str]:
    """Classify a prefill answer: ``(outcome, kv_transfer_params or None, detail for logs)``."""
    status = reply.status
    if 200 <= status < 300:
        try:
            answer = json.loads(reply.body)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            return LegOutcome.BAD_RESPONSE, None, f"answer is not JSON: {exc}"
        if not isinstance(answer, dict):
            return LegOutcome.BAD_RESPONSE, None, "answer is not a JSON object"
        params = answer.get(KV_TRANSFER_PARAMS)
        if params is None:
            return LegOutcome.NO_KV_TRANSFER_PARAMS, None, "answer has no kv_transfer_params"
        if not isinstance(params, dict):
            return LegOutcome.BAD_RESPONSE, None, f"kv_transfer_params is a {type(params).__name__}"
        return LegOutcome.OK, params, "ok"
    detail = f"HTTP {status}: {reply.body[:_MAX_DETAIL].decode(errors='replace')}"
    if 400 <= status < 500 and status not in _RETRYABLE_4XX:
        return LegOutcome.CLIENT_ERROR, None, detail
    if status >= 500 or status in _RETRYABLE_4XX:
        return LegOutcome.SERVER_ERROR, None, detail
    return LegOutcome.BAD_RESPONSE, None, detail


def engine_error(reply: LegReply) -> tuple[str, bytes | None]:
    """What the client gets for a prefill's 4xx: ``(message, body)``.

    ``body`` is the engine's own error when it is an OpenAI-style JSON error (sent verbatim), else
    ``None`` (a gateway error quoting the engine is built)."""
    try:
        answer = json.loads(reply.body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        answer = None
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"], reply.body
    text = reply.body[:_MAX_DETAIL].decode(errors="replace")
    return f"the prefill engine refused the request: {text}", None


def build(routing: RoutingConfig, settings: HandoffConfig, metrics: Metrics) -> KvTransferParamsHandoff:
    """The kv-transfer-params handoff of ``routing`` and ``settings`` (the ``handoff`` section)."""
    route, client = DecodeRoute.of(routing), PrefillClient.of(routing, settings)
    return KvTransferParamsHandoff(settings, route=route, client=client, metrics=metrics)


class KvTransferParamsHandoff(LegHandoff):
    """The P-first handoff; see the module docstring.

    Envoy is asked to wait for two legs of ``settings.prefill_timeout_seconds`` each, plus a margin."""

    def __init__(
        self, settings: HandoffConfig, *, route: DecodeRoute, client: PrefillClient, metrics: Metrics
    ) -> None:
        super().__init__(settings, route=route, client=client, metrics=metrics)
        self.answer_timeout = 2 * settings.prefill_timeout_seconds + TIMEOUT_MARGIN_SECONDS
        self._warned_without_params: set[str] = set()

    def answered_without_params(self, prefill: str) -> int:
        """Count a leg ``prefill`` answered without ``kv_transfer_params``; return the log level to say so.

        WARNING the first time for that prefill, INFO after (every such prompt is prefilled twice)."""
        self.metrics.prefill_without_kv_transfer_params(prefill)
        if prefill in self._warned_without_params:
            return logging.INFO
        self._warned_without_params.add(prefill)
        return logging.WARNING

    def hand_off(self, job: HandoffJob, placement: Placement, router: Rerouter) -> Routed | PrefillFirst:
        """Decode-only at once when no prefill was chosen; else the prefill leg first."""
        if placement.decision.prefill is None:
            return self.route.decode_only(job, placement, None)
        return PrefillFirst(self, job, placement, router)


class PrefillFirst(Attempts):
    """One request's prefill leg(s) and the decode answer that follows.

    A :class:`~ext_proc.outcome.PendingAnswer`."""

    def __init__(
        self, handoff: KvTransferParamsHandoff, job: HandoffJob, placement: Placement, router: Rerouter
    ) -> None:
        super().__init__(handoff, job, placement, router, new_request_id())
        self.timeout = handoff.answer_timeout
        self._handoff = handoff

    def _log(self, level: int, prefill: EndpointState, outcome: LegOutcome, detail: str) -> None:
        log.log(
            level,
            "prefill leg to %s: %s (%s); request %s, client request id %s",
            prefill.address,
            outcome.value,
            detail,
            self._request_id,
            self._job.meta.client_request_id,
        )

    async def _leg(
        self, prefill: EndpointState, body: bytes
    ) -> tuple[LegOutcome, LegReply | None, dict[str, object] | None, str]:
        """One leg: ``(outcome, the HTTP answer if any, kv_transfer_params when OK, detail for logs)``."""
        headers = prefill_leg_headers(self._request_id, self._job, self._placement)
        metrics = self._handoff.metrics
        try:
            reply = await self._handoff.client.send(prefill.address, self._job.meta.path, body, headers)
        except LegError as exc:
            metrics.prefill_leg(exc.outcome.value, None)
            return exc.outcome, None, None, str(exc)
        except asyncio.CancelledError:
            metrics.prefill_leg(LegOutcome.CANCELLED.value, None)
            raise
        outcome, params, detail = read_prefill_reply(reply)
        metrics.prefill_leg(outcome.value, reply.seconds)
        if reply.upstream is not None and reply.upstream != prefill.address:
            log.warning(
                "prefill leg for %s was served by %s: Envoy's prefill cluster does not list it yet",
                prefill.address,
                reply.upstream,
            )
        return outcome, reply, params, detail

    async def complete(self) -> Routed | Refused:
        """Run the prefill leg (and at most one retry), then answer for the decode."""
        handoff, job = self._handoff, self._job
        leg_body = prefill_leg_body(job.body)
        while True:
            decision = self._placement.decision
            prefill = decision.prefill
            assert prefill is not None
            outcome, reply, params, detail = await self._leg(prefill, leg_body)
            self.lease.release_prefill()
            if outcome is LegOutcome.OK:
                body = with_fields(job.raw, job.body, {KV_TRANSFER_PARAMS: params}, HANDOFF_FIELDS)
                watcher = KvPullWatcher(
                    prefill.address, self.lease, handoff.metrics, self._router, handoff.watch_streams
                )
                return handoff.route.routed(self._placement, self._request_id, body, watcher=watcher)
            if outcome is LegOutcome.CLIENT_ERROR:
                assert reply is not None
                self._log(logging.INFO, prefill, outcome, detail)
                self.lease.release()
                message, body = engine_error(reply)
                return refuse(handoff.metrics, reply.status, message, "prefill_rejected", body=body)
            if outcome is LegOutcome.NO_KV_TRANSFER_PARAMS:
                level = handoff.answered_without_params(prefill.address)
                self._log(level, prefill, outcome, NO_PARAMS_CONSEQUENCE)
                return self.decode_only()
            self._log(logging.WARNING, prefill, outcome, detail)
            if not self.retry(prefill, outcome):
                if outcome is LegOutcome.TIMEOUT:
                    failure = f"the prefill engine {prefill.address} did not answer in time ({detail})"
                else:
                    failure = f"the prefill engine {prefill.address} failed: {outcome.value} ({detail})"
                return self.give_up(outcome, failure)
