"""One request's routing, free of gRPC: read, place (decide and charge), and hand off to the engines.

The router only reads the live parts (:mod:`ext_proc.live`: the prefix source, the gateway tokenizer,
the shared state), which change and start and stop elsewhere. The server reads a body
(:meth:`Router.read`; an ``x-gateway-model-name-rewrite`` header replaces its ``model``), awaits its
prompt's token ids when the gateway tokenizes it (:meth:`Router.wants_tokens`,
:meth:`Router.prompt_tokens`), routes it (:meth:`Router.route`; :meth:`Router.route_body` does both
steps without tokens; a request without a body: :meth:`Router.route_bodiless`) and maps the outcome
(:mod:`ext_proc.outcome`) onto ext_proc messages: :class:`Routed`, :class:`Refused` (an HTTP status, a
precise message and a machine-readable code), :class:`Answered` (``GET /v1/models``: the models the
endpoints serve), or a :class:`PendingAnswer` to complete after a prefill leg. A request naming a model
goes only to endpoints serving it (:meth:`~ext_proc.registry.Registry.pools_for`), prefill and decode
alike; one that no endpoint serves is answered 404 ``model_not_found``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

from ext_proc.affinity import Cost, Decision, Hits, Mode, NoPair, Policy, Pool, choose
from ext_proc.affinity.explain import Explanation, explain
from ext_proc.ejection import Ejections
from ext_proc.handoff.body import with_fields
from ext_proc.handoff.kinds import Handoff
from ext_proc.live import LiveParts
from ext_proc.load import Admission, Lease
from ext_proc.metrics import Metrics
from ext_proc.models import ModelNameError, check_model_name, model_list_body
from ext_proc.outcome import (
    MODEL_REWRITE_HEADER,
    Answered,
    HandoffJob,
    PendingAnswer,
    Placement,
    Ranks,
    Refused,
    RequestMeta,
    Routed,
    Trace,
)
from ext_proc.prefix.blocks import prompt_content
from ext_proc.prefix.lookup import Lookup
from ext_proc.refusal import refuse
from ext_proc.registry import EndpointState, Registry
from ext_proc.request import RequestError, RequestInfo, describe, parse_body

log = logging.getLogger(__name__)

DISAGGREGATED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Paths whose requests get a prefill endpoint; every other path is routed decode-only."""
MODELS_PATH = "/v1/models"
"""The path of OpenAI's model list, which the gateway answers itself once endpoints name their models."""
TOKENIZED_PATHS = DISAGGREGATED_PATHS | {"/v1/embeddings"}
"""Paths whose text prompts the gateway tokenizer puts in token ids (``affinity.prefix.tokenizer``)."""


@dataclass(slots=True)
class BodyRequest:
    """A request's body as read, before it is routed.

    ``raw`` as received, ``body`` its JSON object, ``info`` its estimated prompt tokens and output
    budget, ``meta`` what its headers said; ``rewritten``: ``raw`` and ``body`` carry the gateway's fields
    instead of the client's (the model of ``meta.model_rewrite``, the engines' ``priority``). Never
    modified once built; not frozen, as :mod:`ext_proc.outcome`'s per-request records (a frozen
    dataclass costs more to build)."""

    raw: bytes
    body: dict[str, object]
    info: RequestInfo
    meta: RequestMeta
    rewritten: bool = False


class Explained(NamedTuple):
    """What :meth:`Router.explain` saw and found.

    The request's ``cost``, the candidate ``prefills`` and ``decodes`` with their load, the prefix
    ``hits`` credited (``None``: none) and the ``explanation``."""

    cost: Cost
    prefills: Pool[EndpointState]
    decodes: Pool[EndpointState]
    hits: Hits | None
    explanation: Explanation[EndpointState]


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The router's own numbers (their configuration keys in parentheses).

    ``default_max_tokens``: the output budget charged when a body sets none (``load.default_max_tokens``).
    ``pd_threshold_tokens``: prompts estimated below it are routed decode-only
    (``routing.pd_threshold_tokens``). ``max_inflight_requests``: the most requests in flight at once
    (0 = unlimited; ``limits.max_inflight_requests``); beyond it :meth:`Router.admit` answers 429
    ``overloaded`` with ``Retry-After: retry_after_seconds`` (``limits.retry_after_seconds``).
    ``eject_seconds``: how long a prefill whose leg failed (:meth:`Router.leg_failed`), or a decode whose
    engine died (:meth:`Router.decode_failed`), is no candidate (``handoff.eject_failed_prefill_seconds``).
    """

    default_max_tokens: int
    pd_threshold_tokens: int = 0
    max_inflight_requests: int = 0
    retry_after_seconds: int = 1
    eject_seconds: float = 0.0


class Router:
    """Routes requests over ``registry`` with ``policy`` and ``settings``.

    It owns the round-robin tie-break counter and the :class:`Admission` count of requests in flight
    (exposed as ``pd_extproc_inflight_requests``).

    ``handoff`` turns each placement into what Envoy and the engines need; ``metrics`` counts.
    ``ejections`` / ``decode_ejections``: the prefills / decodes left out of the candidates (failed legs,
    and what Envoy marks as failed: :mod:`ext_proc.envoy_health`). ``live``: the prefix source, gateway
    tokenizer and shared state in force (:mod:`ext_proc.live`, which swaps, starts and stops them; the
    router reads them per request; ``None``: none of them). With a prefix source the decision gets
    each endpoint's estimated cache hit and a prefill is charged only the prompt tokens it is estimated
    to compute; with a tokenizer, prompts are put in token ids first (:meth:`wants_tokens`).
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        registry: Registry,
        policy: Policy,
        handoff: Handoff,
        metrics: Metrics,
        live: LiveParts | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.handoff = handoff
        self.metrics = metrics
        self.live = LiveParts(None, metrics) if live is None else live
        self._default_max_tokens = settings.default_max_tokens
        self._pd_threshold = settings.pd_threshold_tokens
        self._mode = policy.mode.value
        self._ticket = 0
        self._no_prefills: Pool[EndpointState] = Pool.of(())
        self.admission = Admission(settings.max_inflight_requests, settings.retry_after_seconds)
        self.ejections = Ejections(settings.eject_seconds, metrics)
        self.decode_ejections = Ejections(settings.eject_seconds, metrics, role="decode")
        metrics.count_inflight(lambda: self.admission.inflight)

    def set_policy(self, policy: Policy) -> None:
        """Route every later decision with ``policy`` (a live configuration reload).

        Requests already placed keep their endpoints and charges."""
        self.policy = policy
        self._mode = policy.mode.value

    def admit(self) -> Refused | None:
        """Take an in-flight slot for a request about to be routed, or refuse 429 when none is free.

        Returns ``None`` when taken (the caller gives it back with ``admission.release()`` exactly once,
        when the request is refused or its stream ends), or a 429 ``overloaded`` when all
        ``max_inflight_requests`` are taken (nothing taken).
        """
        admission = self.admission
        if admission.admit():
            return None
        return refuse(
            self.metrics,
            429,
            f"the gateway is overloaded: {admission.limit} requests are in flight, the most it admits "
            f"(limits.max_inflight_requests); retry after {admission.retry_after_seconds} s",
            "overloaded",
            retry_after=admission.retry_after_seconds,
        )

    def route_body(
        self, raw: bytes, meta: RequestMeta, subset: frozenset[str] | None = None
    ) -> Routed | Refused | PendingAnswer:
        """Route a request by its full JSON body (:meth:`read`, then :meth:`route` without tokens)."""
        request = self.read(raw, meta)
        return request if isinstance(request, Refused) else self.route(request, subset)

    def read(self, raw: bytes, meta: RequestMeta, priority: int | None = None) -> BodyRequest | Refused:
        """Parse the JSON body ``raw`` of the request ``meta`` describes; 400 ``invalid_request`` if bad.

        ``priority``: the engines' scheduling priority to write into the body (:meth:`parse`)."""
        try:
            return self.parse(raw, meta, priority)
        except RequestError as exc:
            return refuse(self.metrics, 400, str(exc), "invalid_request", exc.param)

    def parse(self, raw: bytes, meta: RequestMeta, priority: int | None = None) -> BodyRequest:
        """:meth:`read` without the refusal: raises :class:`RequestError` (nothing counted or logged).

        Also for a ``meta.model_rewrite`` that is no model name; with a valid one, the body's ``model`` is
        replaced by it. ``priority`` (``None``: the client's body keeps its own ``priority``, if any):
        the body's ``priority`` becomes it, whatever the client sent (``flow_control.engine_priority``).
        This is the one place the gateway rewrites a client's fields: every handoff's engine requests,
        the prefill leg's included, are built from the rewritten ``raw`` and ``body``."""
        body = parse_body(raw)
        fields: dict[str, object] = {}
        rewrite = meta.model_rewrite
        if rewrite is not None and body.get("model") != rewrite:
            try:
                check_model_name(rewrite, f"the {MODEL_REWRITE_HEADER} header")
            except ModelNameError as exc:
                raise RequestError(str(exc)) from None
            fields["model"] = rewrite
        if priority is not None and body.get("priority") != priority:
            fields["priority"] = priority
        if fields:
            raw = with_fields(raw, body, fields, tuple(fields))
            body.update(fields)
        return BodyRequest(raw, body, describe(body, self._default_max_tokens), meta, bool(fields))

    def wants_tokens(self, request: BodyRequest) -> bool:
        """Whether ``request``'s prompt is to be put in token ids (:meth:`prompt_tokens`) before routing.

        With a tokenizer configured, for a path it tokenizes (:data:`TOKENIZED_PATHS`) and a prompt not
        already given as token ids (those are used as they are)."""
        return (
            self.live.tokenizer is not None
            and urlsplit(request.meta.path).path in TOKENIZED_PATHS
            and not isinstance(prompt_content(request.body), list)
        )

    async def prompt_tokens(self, request: BodyRequest) -> Sequence[int] | None:
        """The engine's token ids of ``request``'s prompt; ``None`` (counted, logged) when unknown.

        Tokenized off the event loop by the tokenizer configured now (:mod:`ext_proc.tokenize.gateway`)."""
        tokenizer = self.live.tokenizer
        if tokenizer is None:  # removed by a reload since wants_tokens
            return None
        return await tokenizer.prompt_tokens(request.body, request.meta.path)

    def decision_wait(self) -> float:
        """Seconds a request would wait now for this replica's decision slot (0.0: none; ``shared_state``)."""
        return self.live.shared.decision_wait() or 0.0

    async def decision_turn(self) -> float:
        """Wait for this replica's decision slot (:mod:`ext_proc.shared.slots`); the seconds waited.

        Without slots, at once (0.0); with them, the wait is recorded
        (``pd_extproc_decision_slot_wait_seconds``). Cancelled with the request (its client left):
        nothing is charged yet."""
        wait = self.live.shared.decision_wait()
        if wait is None:
            return 0.0
        self.metrics.decision_slot_waited(wait)
        if wait > 0:
            await asyncio.sleep(wait)
        return wait

    def route(
        self,
        request: BodyRequest,
        subset: frozenset[str] | None = None,
        tokens: Sequence[int] | None = None,
        trace: Trace | None = None,
    ) -> Routed | Refused | PendingAnswer:
        """Route a read request: prefill then decode, per the affinity policy.

        ``subset`` (the data plane's endpoint-subset hint) restricts the decode endpoints; the path
        (``request.meta``) says whether a prefill is wanted: only completions and chat completions whose
        prompt reaches ``pd_threshold_tokens`` get one. ``tokens``: the prompt's token ids from
        :meth:`prompt_tokens` (``None``: unknown); when known, the prompt is charged and compared to
        the threshold at their exact count instead of the estimate, and the prefix index looks up
        their chain. ``trace``: the request's span (tracing on), told the decision.
        """
        model = request.info.model
        pools = self.registry.pools_for(model)
        if pools is None:
            return self._unknown_model(str(model))
        cost, prefills = self._cost(request, tokens, pools[0])
        placed = self._place(cost, prefills, pools[1], subset, request.body, tokens, trace)
        if isinstance(placed, Refused):
            return placed
        self.metrics.model_routed(self.registry.model_label(model))
        job = HandoffJob(
            request.raw, request.body, request.meta, cost, subset, tokens, trace, request.rewritten
        )
        return self.handoff.hand_off(job, placed, self)

    def _unknown_model(self, model: str) -> Refused:
        """The 404 ``model_not_found`` of a request for ``model``, which no known decode serves."""
        message = (
            f"the model {model!r} does not exist here: no endpoint serves it "
            "(GET /v1/models lists those that do)"
        )
        return refuse(self.metrics, 404, message, "model_not_found", "model")

    def explain(
        self, request: BodyRequest, tokens: Sequence[int] | None = None, limit: int = 10
    ) -> Explained:
        """What :meth:`route` would decide for ``request`` now, and why, booking nothing.

        The same candidates (ejections applied; no subset hint), prefix hits and next round-robin
        ticket as :meth:`route`; nothing is charged, recorded in the prefix index, told to the peers or
        counted (:func:`ext_proc.affinity.explain.explain`: the ``limit`` least-cost pairs)."""
        pools = self.registry.pools_for(request.info.model) or (self._no_prefills, self._no_prefills)
        cost, prefills = self._cost(request, tokens, pools[0])
        decodes = self.decode_ejections.keep(pools[1])
        lookup = self._lookup(request.body, tokens, prefills, decodes, cost.prefill_tokens)
        hits = None if lookup is None else lookup.hits
        lacks = self.registry.lacks(request.info.model, prefills, decodes)
        explained = explain(cost, prefills, decodes, self.policy, self._ticket + 1, hits, limit, lacks)
        return Explained(cost, prefills, decodes, hits, explained)

    def answer_bodiless(self, meta: RequestMeta) -> Answered | None:
        """The gateway's own answer to a request without a body; ``None``: route it (:meth:`route_bodiless`).

        ``GET /v1/models`` (``meta.path``) is answered here, the union of the models the decodes name
        (:meth:`~ext_proc.registry.Registry.served_models`) in OpenAI's list shape, when any names them;
        otherwise (every endpoint serves every model) it goes to a decode, which answers its own list."""
        if urlsplit(meta.path).path == MODELS_PATH:
            models = self.registry.served_models()
            if models is not None:
                return Answered(200, model_list_body(models))
        return None

    def route_bodiless(
        self, subset: frozenset[str] | None = None, trace: Trace | None = None
    ) -> Routed | Refused:
        """Route a request without a body to the least-loaded decode.

        One that :meth:`answer_bodiless` does not answer itself."""
        cost = Cost(0, 0)
        placed = self._place(cost, self._no_prefills, self.registry.decode_pool, subset, None, None, trace)
        if isinstance(placed, Refused):
            return placed
        routed = self.handoff.hand_off(HandoffJob(b"", {}, RequestMeta(), cost, subset), placed, self)
        assert isinstance(routed, Routed)  # without a prefill every handoff answers at once
        return routed

    def retry(
        self, job: HandoffJob, failed: Decision[EndpointState], exclude: frozenset[str]
    ) -> Placement | None:
        """A new placement on the next-ranked prefill, the decode chosen again; ``None`` if there is none.

        The prefill is not in ``exclude`` (``strict``: in the failed prefill's group), and the decode is
        chosen again by the same rule."""
        group = failed.prefill.group if failed.prefill is not None else ""
        strict = self.policy.mode is Mode.STRICT
        pools = self.registry.pools_for(_model_of(job.body))
        if pools is None:  # no longer served by any endpoint
            return None
        pool = self.ejections.keep(pools[0])
        keep = {
            e.address for e in pool.endpoints if e.address not in exclude and (not strict or e.group == group)
        }
        if not keep:
            return None
        placed = self._place(job.cost, pool.only(keep), pools[1], job.subset, job.body, job.tokens, job.trace)
        if isinstance(placed, Refused) or placed.decision.prefill is None:
            if isinstance(placed, Placement):
                placed.lease.release()
            return None
        return placed

    def served_by(self, lease: Lease, address: str) -> None:
        """Record which decode served the request ``lease`` charges, moving the charge if it changed.

        The data plane reports that ``address`` served it: when that is another decode than the one
        charged (Envoy's retry walked the fallback list), move the decode charge there. Counted by
        outcome in ``pd_extproc_served_endpoint_total``."""
        charged = lease.decode
        if charged is None or charged.address == address:
            self.metrics.served("chosen")
            return
        served = self.registry.decode(address)
        if served is None:
            self.metrics.served("unknown")
            log.warning(
                "the data plane reports %s served a request routed to %s, and it is no known decode: "
                "the charge stays on %s",
                address,
                charged.address,
                charged.address,
            )
            return
        self.metrics.served("moved")
        log.info(
            "a retry moved a request from decode %s to %s: its charge moves too", charged.address, address
        )
        lease.move_decode(served)

    def leg_failed(self, address: str, outcome: str) -> None:
        """Eject a prefill whose leg failed or whose KV cache a decode could not pull.

        A prefill leg to ``address`` failed with ``outcome`` (not a 4xx), or a decode could not pull the
        KV cache it computed: eject that prefill."""
        self.ejections.eject(address, outcome)

    def decode_failed(self, address: str, outcome: str) -> None:
        """Eject the decode at ``address``, failed with ``outcome`` (its engine core died)."""
        self.decode_ejections.eject(address, outcome)

    def _cost(
        self, request: BodyRequest, tokens: Sequence[int] | None, pool: Pool[EndpointState]
    ) -> tuple[Cost, Pool[EndpointState]]:
        """What ``request`` charges (its prompt at the count of ``tokens`` when known) and its prefill
        candidates of ``pool`` (those serving its model): none unless its path is disaggregated and its
        prompt reaches the threshold."""
        info = request.info
        prompt = info.prompt_tokens if tokens is None else len(tokens)
        cost = Cost(prompt, prompt + info.output_budget)
        disaggregated = (
            prompt >= self._pd_threshold and urlsplit(request.meta.path).path in DISAGGREGATED_PATHS
        )
        prefills = self.ejections.keep(pool) if disaggregated else self._no_prefills
        return cost, prefills

    def _lookup(
        self,
        body: dict[str, object] | None,
        tokens: Sequence[int] | None,
        prefills: Pool[EndpointState],
        decodes: Pool[EndpointState],
        prompt: int,
    ) -> Lookup | None:
        """What the candidates hold of the prompt of ``body`` (``tokens``: its ids); ``None`` without a
        prefix source, a body or a block to look up."""
        prefix = self.live.prefix
        if prefix is None or body is None:
            return None
        adapter = self.registry.is_adapter(_model_of(body))
        return prefix.lookup_prompt(body, tokens, prefills, decodes, prompt, self.handoff.pins_ranks, adapter)

    def _count_lora(self, adapter: str, result: Decision[EndpointState]) -> None:
        """Count where a request for ``adapter`` went: to endpoints holding it, lacking it, or unknown."""
        for role, state in (("prefill", result.prefill), ("decode", result.decode)):
            if state is not None:
                held = state.lora_adapters
                self.metrics.lora_placed(
                    role, "unknown" if held is None else "held" if adapter in held else "lacking"
                )

    def _place(
        self,
        cost: Cost,
        prefills: Pool[EndpointState],
        decodes: Pool[EndpointState],
        subset: frozenset[str] | None,
        body: dict[str, object] | None = None,
        tokens: Sequence[int] | None = None,
        trace: Trace | None = None,
    ) -> Placement | Refused:
        """Decide and charge: the prompt of ``body`` (``tokens``: its ids) looked up in the prefix
        source, if any, then the decision, then the placement recorded there and told the peers.
        ``prefills`` and ``decodes``: the candidates (those serving the request's model)."""
        if subset is not None:
            decodes = decodes.only(subset)
            if not decodes.size:
                message = (
                    f"none of the {len(subset)} endpoints in the data plane's subset hint is a healthy decode"
                )
                return refuse(self.metrics, 503, message, "no_endpoint_in_subset")
        decodes = self.decode_ejections.keep(decodes)
        prompt = cost.prefill_tokens
        prefix = self.live.prefix
        lookup = self._lookup(body, tokens, prefills, decodes, prompt)
        self._ticket += 1
        started = time.perf_counter()
        hits = None if lookup is None else lookup.hits
        model = None if body is None else _model_of(body)
        lacks = self.registry.lacks(model, prefills, decodes)
        result = choose(cost, prefills, decodes, self.policy, self._ticket, hits, lacks)
        seconds = time.perf_counter() - started  # the decision alone (decision_seconds)
        if isinstance(result, NoPair):
            return refuse(self.metrics, 503, result.message, result.reason.value)
        hit = None
        if prefix is not None and lookup is not None:
            placed = prefix.placed(lookup, result, prompt)
            self.live.shared.placed(lookup.hashes, placed.holders)
            prompt -= placed.prefill_hit  # the prefill computes only what it does not hold
            hit = None if result.prefill is None else placed.prefill_hit
        if trace is not None:
            trace.decided(self._mode, result, hit)
        if lacks is not None and model is not None:
            self._count_lora(model, result)
        lease = Lease(result.prefill, prompt, result.decode, cost.decode_tokens)
        locality = result.locality.value
        self.metrics.decided(self._mode, locality, seconds)
        if result.estimate is not None:
            self.metrics.estimated(locality, result.estimate)
        if lookup is None or not lookup.ranks:
            return Placement(result, lease)
        prefill = None if result.prefill is None else lookup.ranks.get(result.prefill.address)
        return Placement(result, lease, Ranks(prefill, lookup.ranks.get(result.decode.address)))


def _model_of(body: dict[str, object]) -> str | None:
    """The body's ``model`` (the one routed by: a rewrite is in it), ``None`` when it names none."""
    model = body.get("model")
    return model if isinstance(model, str) else None
