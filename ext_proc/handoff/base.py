"""What a handoff may ask of the router, and the decode routing and headers the handoffs share.

The router parses and decides (:class:`~ext_proc.outcome.Placement`: a decision and its charges) and
hands the request to a :class:`~ext_proc.handoff.kinds.Handoff`, which answers at once
(:class:`~ext_proc.outcome.Routed` or :class:`~ext_proc.outcome.Refused`) or, when it must first talk to
an engine, with a :class:`~ext_proc.outcome.PendingAnswer` that the server completes after asking Envoy
for more time. The outcome types live in :mod:`ext_proc.outcome`.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ext_proc.affinity import Decision
from ext_proc.handoff.body import HANDOFF_FIELDS, without_fields
from ext_proc.outcome import (
    HandoffJob,
    Placement,
    ResponseWatcher,
    Routed,
    RoutingInstructions,
)
from ext_proc.registry import EndpointState

if TYPE_CHECKING:
    from ext_proc.handoff.routing import RoutingConfig


class HandoffMode(enum.StrEnum):
    """How the engines receive a disaggregated request (config ``handoff.mode``)."""

    SIDECAR = "sidecar"
    KV_TRANSFER_PARAMS = "kv-transfer-params"
    SGLANG_BOOTSTRAP = "sglang-bootstrap"
    VLLM_MOONCAKE = "vllm-mooncake"


UNSUPPORTED_HANDOFFS = {
    "mooncake-layerwise": (
        "vllm-ascend's MooncakeLayerwiseConnector is decode-first: the decode posts its KV addresses to a "
        "metaserver, which only then sends the prefill its request with them (remote_cached_tokens "
        "included). pd-extproc serves no metaserver, and a prefill-first leg lacks remote_cached_tokens, "
        "which crashes that prefill's scheduler (KeyError). Run the engines with vllm-ascend's "
        "MooncakeConnector and handoff.mode kv-transfer-params, or behind vllm-ascend's layerwise proxy "
        "(examples/disaggregated_prefill_v1/load_balance_proxy_layerwise_server_example.py)"
    ),
}
"""``handoff.mode`` values of engine protocols pd-extproc refuses, and why (docs/handoffs.md "Engine
protocols")."""


class FailurePolicy(enum.StrEnum):
    """What a failed prefill leg leads to, once the retry failed too (``handoff.on_prefill_failure``)."""

    DECODE_ONLY = "decode-only"
    ERROR = "error"


class Rerouter(Protocol):
    """What a handoff may ask of the router after a prefill leg failed, a decode's KV pull, or a decode."""

    def retry(
        self, job: HandoffJob, failed: Decision[EndpointState], exclude: frozenset[str]
    ) -> Placement | None:
        """A new, charged placement on the next-ranked prefill; ``None`` when there is none.

        The prefill is not in ``exclude``, and in ``strict`` mode it is in the failed prefill's group."""
        ...

    def leg_failed(self, address: str, outcome: str) -> None:
        """Report a failed prefill leg or KV pull: the router leaves that prefill out for a while.

        A prefill leg to ``address`` failed with ``outcome`` (a connect error, 5xx, timeout or unusable
        answer; not a 4xx), or a decode could not pull the KV cache it computed (``kv_transfer_failed``)."""
        ...

    def decode_failed(self, address: str, outcome: str) -> None:
        """Report a failed decode: the router leaves it out for a while.

        The decode at ``address`` failed with ``outcome`` (``decode_engine_dead``: its engine core died)."""
        ...


REQUEST_ID_HEADER = "x-request-id"
KV_HANDOFF_HEADER = "x-gateway-kv-handoff"
"""Set (to ``1``) on a decode request whose body carries a KV handoff (``kv_transfer_params``,
SGLang's bootstrap fields): the shipped Envoy routes it with a retry policy that never sends it to a
second decode once the first may have pulled the KV, and removes the header before forwarding."""
DP_RANK_HEADER = "x-data-parallel-rank"
"""Pins a request to one data-parallel rank of a vLLM engine (read by vLLM's OpenAI server, set by
llm-d's sidecar, and by the ``kv-transfer-params`` and ``vllm-mooncake`` handoffs on the prefill leg and
the decode request to the ranks of the :class:`~ext_proc.outcome.Placement`)."""
STEERING_HEADERS = (
    "x-encoder-hosts-ports",
    "x-kv-cache-source-host-port",
    "x-data-parallel-host-port",
    DP_RANK_HEADER,
    "prefer",
)
"""Request headers that point llm-d's decode sidecar or a vLLM engine at another host, rank or
behaviour (llm-d-router ``pkg/common/routing/common.go`` and ``pkg/sidecar/proxy/proxy.go`` at
ebab687: encoder hosts, the peer to pull cached prefix KV from, the data-parallel pod, the
data-parallel rank, ``Prefer: if-available`` conditional decode). The prefill header is the
configured ``routing.prefill_header``. Every handoff removes all of them from a client's request.
"""


def new_request_id() -> str:
    """A request id for both legs of a handoff that no client can predict or reuse (random UUID)."""
    return str(uuid.uuid4())


def leg_headers(request_id: str, job: HandoffJob) -> dict[str, str]:
    """The headers of a prefill leg.

    The gateway's request id, the client's ``authorization`` and, when tracing, the request span's W3C
    trace context."""
    headers = {REQUEST_ID_HEADER: request_id}
    authorization = job.meta.authorization
    if authorization is not None:
        headers["authorization"] = authorization
    if job.trace is not None:
        headers.update(job.trace.headers)
    return headers


@dataclass(frozen=True, slots=True)
class DecodeRoute:
    """The decode routing of the engine handoffs, whose body carries the handoff.

    It writes the destination list (header and ``envoy.lb`` metadata) and no prefill header (a
    client's is removed)."""

    destination_header: str
    prefill_header: str

    @classmethod
    def of(cls, routing: RoutingConfig) -> DecodeRoute:
        """The decode routing with ``routing``'s header names."""
        return cls(routing.destination_header, routing.prefill_header)

    @property
    def routing_headers(self) -> tuple[str, ...]:
        """The headers this routing owns (clients may not supply them)."""
        return owned_headers(self.destination_header, self.prefill_header)

    def routed(
        self,
        placement: Placement,
        request_id: str | None,
        body: bytes | None,
        *,
        watcher: ResponseWatcher | None,
        background: asyncio.Task[None] | None = None,
    ) -> Routed:
        """Route to the placement's decode (and fallbacks), with or without a KV cache to pull.

        ``request_id`` and ``body`` replace the client's. ``watcher``: the body tells the decode to pull a
        KV cache and the watcher sees its answer (the request is then marked with
        :data:`KV_HANDOFF_HEADER`), ``None`` when the decode computes the prompt itself. A decode rank
        in ``placement.ranks`` pins the request to it (:data:`DP_RANK_HEADER`)."""
        destination = destination_list(placement.decision)
        headers = ((self.destination_header, destination),)
        if request_id is not None:
            headers += ((REQUEST_ID_HEADER, request_id),)
        if watcher is not None:
            headers += ((KV_HANDOFF_HEADER, "1"),)
        if placement.ranks.decode is not None:
            headers += ((DP_RANK_HEADER, str(placement.ranks.decode)),)
        metadata = ((self.destination_header, destination),)
        instructions = RoutingInstructions(headers, (self.prefill_header,), metadata, body)
        return Routed(instructions, placement.lease, background, watcher)

    def decode_only(self, job: HandoffJob, placement: Placement, request_id: str | None) -> Routed:
        """The client's body, without its handoff fields, to the decode already chosen."""
        plain = without_fields(job.raw, job.body, HANDOFF_FIELDS, job.rewritten)
        return self.routed(placement, request_id, plain, watcher=None)


def prefill_leg_headers(request_id: str, job: HandoffJob, placement: Placement) -> dict[str, str]:
    """:func:`leg_headers`, and :data:`DP_RANK_HEADER` when ``placement`` pins the prefill to a rank."""
    headers = leg_headers(request_id, job)
    if placement.ranks.prefill is not None:
        headers[DP_RANK_HEADER] = str(placement.ranks.prefill)
    return headers


def owned_headers(destination_header: str, prefill_header: str) -> tuple[str, ...]:
    """Every header a handoff owns.

    The two routing headers, :data:`KV_HANDOFF_HEADER` and :data:`STEERING_HEADERS`."""
    return (destination_header, prefill_header, KV_HANDOFF_HEADER, *STEERING_HEADERS)


def destination_list(decision: Decision[EndpointState]) -> str:
    """The decode endpoint then its fallbacks, ``"ip:port[,ip:port...]"`` (endpoint-picker protocol)."""
    if not decision.fallbacks:
        return decision.decode.address
    return ",".join([decision.decode.address, *(f.address for f in decision.fallbacks)])
