"""What routing one request produces: the outcome vocabulary the router, the handoffs and the shell share.

The router parses a request (:class:`HandoffJob`) and decides where it runs; the decision and the
charges it holds are a :class:`Placement`. The handoff turns the placement into an outcome:
:class:`Routed` (instructions for Envoy), :class:`Refused` (an error answer), :class:`Answered` (the
gateway's own answer), or a
:class:`PendingAnswer` that needs I/O with an engine first and then completes into one of the two.
A routed request's :class:`ResponseWatcher`, when its handoff attached one, sees the upstream's answer.

A leaf module: value types only (no gRPC, HTTP client, metrics or handoff module). The records built
for every request (:class:`HandoffJob`, :class:`Placement`, :class:`Routed`) are never modified once
built, but not frozen: a frozen dataclass costs ~0.3 µs more to build, paid two to three times over
in a running server, and none of them is hashed (the others, hashed or not per request, are frozen).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ext_proc.affinity import Cost, Decision
from ext_proc.load import Lease
from ext_proc.registry import EndpointState


@dataclass(frozen=True, slots=True)
class RoutingInstructions:
    """What to tell Envoy for one request.

    ``set_headers`` overwrite (or add) request headers; ``remove_headers`` are dropped;
    ``lb_metadata`` goes into dynamic metadata namespace ``envoy.lb``, which Envoy's
    ``override_host`` load balancing policy reads; ``body``, when not ``None``, replaces the
    request body (``content-length`` is set to match).
    """

    set_headers: tuple[tuple[str, str], ...]
    remove_headers: tuple[str, ...]
    lb_metadata: tuple[tuple[str, str], ...]
    body: bytes | None = None


MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"
"""The Gateway API Inference Extension's header naming the model to serve a request with instead of
its body's ``model``: routed by, and written into the body the engines get."""


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """What the request-headers phase tells about a request.

    ``path`` is the HTTP ``:path`` (query included); ``client_request_id`` the incoming
    ``x-request-id`` (kept for logs only); ``authorization`` is forwarded to prefill legs;
    ``traceparent`` and ``tracestate`` the caller's W3C trace context, read by tracing alone
    (:mod:`ext_proc.tracing`: the request's span continues that trace), never by routing.
    ``objective`` and ``fairness_id``: the ``x-gateway-inference-objective`` and
    ``x-gateway-inference-fairness-id`` headers, for flow control (``None``: absent).
    ``model_rewrite`` the :data:`MODEL_REWRITE_HEADER`, if any.
    """

    path: str = ""
    client_request_id: str | None = None
    authorization: str | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    objective: str | None = None
    fairness_id: str | None = None
    model_rewrite: str | None = None


@dataclass(slots=True)
class HandoffJob:
    """One parsed request on its way to the engines.

    ``raw`` is the client's body as received and ``body`` its parsed JSON object; ``cost`` is what
    the request charges (tokens); ``subset`` the data plane's endpoint-subset hint, if any;
    ``tokens`` the prompt in the engine's token ids when the gateway tokenized it (``None``: unknown);
    ``trace`` the request's span when tracing is on (its W3C context goes on the prefill leg).
    ``rewritten``: the gateway changed the client's body (its ``model``, :data:`MODEL_REWRITE_HEADER`; its
    ``priority``, ``flow_control.engine_priority``),
    so ``raw`` is sent even where a handoff adds nothing.
    """

    raw: bytes
    body: dict[str, object]
    meta: RequestMeta
    cost: Cost
    subset: frozenset[str] | None
    tokens: Sequence[int] | None = None
    trace: Trace | None = None
    rewritten: bool = False


class Trace(Protocol):
    """What routing tells a request's span (:class:`ext_proc.tracing.RequestSpan`).

    ``headers``: the W3C trace context (``traceparent``, maybe ``tracestate``) the engines are sent."""

    headers: tuple[tuple[str, str], ...]

    def decided(self, mode: str, decision: Decision[EndpointState], hit_tokens: int | None) -> None:
        """Record the decision of ``mode`` and the prompt tokens the prefill is estimated to hold.

        ``hit_tokens`` ``None``: no prefix index, or no prefill."""
        ...


class Ranks(NamedTuple):
    """The data-parallel rank the chosen prefill's and decode's engine requests are pinned to.

    ``None``: not pinned (the engine's own balancer picks; :mod:`ext_proc.prefix.ranks`)."""

    prefill: int | None = None
    decode: int | None = None


NO_RANKS = Ranks()
"""Neither engine request pinned."""


@dataclass(slots=True)
class Placement:
    """A routing decision, the charges it holds (released through ``lease``) and the ranks it pins."""

    decision: Decision[EndpointState]
    lease: Lease
    ranks: Ranks = NO_RANKS


class Watch(enum.Enum):
    """What of an answer's body a :class:`ResponseWatcher` sees."""

    NONE = enum.auto()
    """Nothing: the answer passes."""
    CHUNKS = enum.auto()
    """Its chunks, one by one, while :meth:`ResponseWatcher.chunk` says so."""
    BODY = enum.auto()
    """All of it, in one piece (:meth:`ResponseWatcher.body`), before anything is answered."""


class ResponseWatcher(Protocol):
    """Sees the upstream's answer to a routed request and may answer otherwise.

    Attached by the handoff that needs it: the engine handoffs watch a decode's answer for a failed
    KV pull or a dead engine."""

    def headers(self, status: int, content_type: str, chunks_sent: bool) -> Watch:
        """Judge the answer's headers: what of its body to see before it is let through.

        Called when the answer's ``status`` and ``content-type`` arrived. ``chunks_sent``: the body's
        chunks come anyway (otherwise Envoy is asked to send what the watcher sees)."""
        ...

    def body(self, body: bytes) -> Refused:
        """The whole body of an answer the watcher asked to see (:attr:`Watch.BODY`): the answer instead."""
        ...

    def chunk(self, chunk: bytes) -> tuple[bytes | None, bool]:
        """A watched body chunk: ``(replacement, keep_watching)``.

        ``replacement`` is what to send instead, ``None`` to pass the chunk as it came."""
        ...


@dataclass(slots=True)
class Routed:
    """The request goes ahead: instructions for Envoy, a lease to release, a leg to cancel.

    ``instructions`` for Envoy, ``lease`` to release when it ends, and ``background`` (a prefill leg
    still running) to cancel when the HTTP exchange ends."""

    instructions: RoutingInstructions
    lease: Lease
    background: asyncio.Task[None] | None = None
    watcher: ResponseWatcher | None = None
    """Sees the upstream's answer (the engine handoffs: a decode's failed KV pull), else ``None``."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The request is answered with an error. ``code`` is also the ``rejected_total`` reason.

    ``body``, when set, is the exact JSON error body to send (an engine's own error, passed through).
    ``retry_after``, when set, is sent as the ``retry-after`` header (seconds).
    """

    status: int
    message: str
    code: str
    param: str | None = None
    body: bytes | None = None
    retry_after: int | None = None


@dataclass(frozen=True, slots=True)
class Answered:
    """The gateway answers the request itself (``GET /v1/models``): ``status`` and a JSON ``body``."""

    status: int
    body: bytes


class PendingAnswer(Protocol):
    """A routing answer that needs I/O first.

    Such as the kv-transfer-params prefill leg, or the Mooncake bootstrap query.

    ``timeout`` (seconds) is how long Envoy must wait for the answer. ``lease`` holds the charges
    of the moment (a retry replaces it). :meth:`complete` returns the answer; whatever it returns
    or raises, every charge outside the returned :class:`Routed`'s lease has been released, except
    when it is cancelled: then the caller releases ``lease``.
    """

    timeout: float
    lease: Lease

    async def complete(self) -> Routed | Refused:
        """Run the I/O and produce the answer for Envoy."""
        ...
