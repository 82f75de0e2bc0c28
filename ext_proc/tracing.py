"""OpenTelemetry traces: one span per request, continuing the caller's W3C trace context.

With ``tracing.otlp_endpoint`` set, every ext_proc stream is one span (kind SERVER, named
:data:`SPAN_NAME`), from Envoy's request headers to the stream's end: the routing decision's attributes
(:data:`ATTRIBUTES`), and on a refusal the error's code and status. A caller's ``traceparent`` (and
``tracestate``) makes the span its child; the span's own W3C context is then sent on the prefill leg
and to the decode (a request header mutation), so engines that export their own spans (vLLM's
``--otlp-traces-endpoint``) join the same trace. The caller's context is read for that alone: nothing of
it reaches the decision.

Sampling is the SDK's ``ParentBased(TraceIdRatioBased(sampling_ratio))`` rule, with its ids
(``RandomIdGenerator``) and trace flags: a request without a sampled caller is kept at
``sampling_ratio``; a caller's sampled flag is honoured (docs/operations.md "Tracing"). An unsampled span
records nothing and still sends its context (flag ``00``), so the engines drop theirs too.

The cost per request is kept low (docs/benchmarks.md 13): a span is not the SDK's live ``Span`` (a lock,
attribute validation and limits on every write, a processor call at its start) but its start time, its
ids and a dict of the attributes already computed; at its end a sampled one becomes the SDK's
``ReadableSpan``, handed to the SDK's ``BatchSpanProcessor`` (the public span-processor API). The spans
leave in batches on the processor's exporter thread, OTLP over gRPC (:mod:`ext_proc.otlp`: the SDK's
exporter with a leaner encoding); a collector that is down costs the exporter's retries there, never a
request's time. The SDK's span limits (``OTEL_SPAN_ATTRIBUTE_*``) do not apply: a span holds at most the
nine attributes named here, each a short value.
"""

from __future__ import annotations

from time import time_ns

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ext_proc.affinity import Decision
from ext_proc.checks import ConfigError
from ext_proc.outcome import Refused, RequestMeta
from ext_proc.registry import EndpointState
from ext_proc.tracing_config import TracingConfig

SPAN_NAME = "pd_extproc.route"
"""The name of every request's span."""
SCOPE_NAME = "pd-extproc"
"""The instrumentation scope of every span."""
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
ATTRIBUTES = (
    "pd_extproc.mode",
    "pd_extproc.prefill",
    "pd_extproc.decode",
    "pd_extproc.group",
    "pd_extproc.cross_group",
    "pd_extproc.predicted_hit_tokens",
    "pd_extproc.queue_wait_s",
)
"""The decision's span attributes: the affinity mode; the prefill's and the decode's ``ip:port`` (no
prefill: decode-only); the pdGroupID of the prefill (decode-only: of the decode); whether the KV cache
crosses groups; the prompt tokens the prefill is estimated to hold (prefix index on, a prefill chosen);
and the seconds the request waited in a queue before it was routed (:meth:`RequestSpan.queued`)."""
_MODE, _PREFILL, _DECODE, _GROUP, _CROSS, _HITS, _QUEUE = ATTRIBUTES
_PROPAGATOR = TraceContextTextMapPropagator()
_ROOT = Context()
_UNSET = Status(StatusCode.UNSET)
_SAMPLED = TraceFlags.SAMPLED


class RequestSpan:
    """One request's span, and the W3C trace context (:attr:`headers`) the engines are sent.

    ``headers``: ``traceparent`` (and the caller's ``tracestate``, if any) naming this span as the
    parent. ``ids``: the span's trace id, span id and W3C trace flags; ``parent``: the caller's span
    (``None``: a root), ``state`` its ``tracestate``. A sampled span keeps its start time and its
    attributes in plain values until :meth:`end` hands the finished span (an SDK ``ReadableSpan``) to the
    batch processor; every method is a no-op on attributes when the span is not sampled."""

    __slots__ = ("_attributes", "_ids", "_parent", "_start", "_state", "_status", "_tracing", "headers")

    def __init__(
        self,
        tracing: Tracing,
        ids: tuple[int, int, int],
        parent: SpanContext | None,
        state: TraceState | None,
    ) -> None:
        self._tracing, self._ids, self._parent, self._state = tracing, ids, parent, state
        trace_id, span_id, flags = ids
        self._attributes: dict[str, str | bool | int | float] | None = {} if flags & _SAMPLED else None
        self._start = time_ns()
        self._status = _UNSET
        self.headers = ((TRACEPARENT, f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"),)
        if state:
            self.headers += ((TRACESTATE, state.to_header()),)

    def decided(self, mode: str, decision: Decision[EndpointState], hit_tokens: int | None) -> None:
        """Record the decision of ``mode``: the pair, its group and locality, its hit tokens.

        ``hit_tokens`` ``None``: no prefix index, or decode-only. A later decision (a retry after a
        failed prefill leg) replaces the attributes of an earlier one."""
        attributes = self._attributes
        if attributes is None:
            return
        prefill, decode = decision.prefill, decision.decode
        attributes[_MODE], attributes[_DECODE] = mode, decode.address
        if prefill is None:
            attributes[_GROUP], attributes[_CROSS] = decode.group, False
        else:
            attributes[_PREFILL], attributes[_GROUP] = prefill.address, prefill.group
            attributes[_CROSS] = prefill.group != decode.group
        if hit_tokens is not None:
            attributes[_HITS] = hit_tokens

    def queued(self, seconds: float) -> None:
        """Record the seconds the request waited in a queue before it was routed."""
        if self._attributes is not None:
            self._attributes[_QUEUE] = seconds

    def refused(self, refused: Refused) -> None:
        """The request was answered with ``refused``: the span's status is an error of its code."""
        attributes = self._attributes
        if attributes is not None:
            attributes["error.type"], attributes["http.response.status_code"] = refused.code, refused.status
            self._status = Status(StatusCode.ERROR, refused.message)

    def end(self) -> None:
        """The request is over: a sampled span leaves with the exporter's next batch."""
        if self._attributes is not None:
            trace_id, span_id, flags = self._ids
            context = SpanContext(trace_id, span_id, False, TraceFlags(flags), self._state)
            self._tracing.finished(
                context, self._parent, self._attributes, self._status, self._start, time_ns()
            )


def otlp_exporter(endpoint: str, resource: Resource, scope: InstrumentationScope) -> SpanExporter:
    """The OTLP gRPC span exporter to ``endpoint``, imported only when tracing is on.

    :class:`ext_proc.otlp.OtlpSpanExporter`: its spans are all of ``resource`` and ``scope``.

    Raises :class:`ConfigError` naming the repair when the OpenTelemetry protos on disk are not
    ``opentelemetry-proto``'s: ``xds-protos`` ships an older copy of the same files, and whichever of the
    two pip installs last wins (``make install`` and the image reinstall ``opentelemetry-proto`` last)."""
    try:
        from ext_proc.otlp import OtlpSpanExporter
    except ImportError as error:
        raise ConfigError(
            f"tracing.otlp_endpoint: the OTLP exporter cannot be loaded ({error}); the OpenTelemetry protos "
            "on disk are xds-protos' older copy: run `pip install --force-reinstall --no-deps "
            "opentelemetry-proto` in pd-extproc's environment"
        ) from error
    return OtlpSpanExporter(endpoint, resource, scope)


class Tracing:
    """The sampler, ids and batch export of :class:`TracingConfig`: starts each :class:`RequestSpan`.

    ``exporter``: where the batches go (default: OTLP over gRPC to ``otlp_endpoint``)."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self._bound = TraceIdRatioBased(config.sampling_ratio).bound
        self._ids = RandomIdGenerator()
        self._random = TraceFlags.RANDOM_TRACE_ID if self._ids.is_trace_id_random() else 0
        self._resource = Resource.create({SERVICE_NAME: config.service_name})
        self._scope = InstrumentationScope(SCOPE_NAME)
        if exporter is None:
            exporter = otlp_exporter(config.otlp_endpoint, self._resource, self._scope)
        self._processor = BatchSpanProcessor(exporter)

    @classmethod
    def of(cls, config: TracingConfig) -> Tracing | None:
        """The tracing of ``config``, or ``None`` when ``otlp_endpoint`` is empty (tracing off)."""
        return cls(config) if config.otlp_endpoint else None

    def start(self, meta: RequestMeta) -> RequestSpan:
        """Start the span of the request whose headers ``meta`` describes.

        A child of the caller's ``traceparent`` when it sent a valid one (sampled as the caller was),
        else a new trace's root (sampled at ``sampling_ratio`` by its trace id): the SDK's
        ``ParentBased(TraceIdRatioBased(sampling_ratio))`` decision and trace flags."""
        parent = _caller(meta) if meta.traceparent is not None else None
        span_id = self._ids.generate_span_id()
        if parent is None:
            trace_id = self._ids.generate_trace_id()
            sampled = (trace_id & TraceIdRatioBased.TRACE_ID_LIMIT) < self._bound
            return RequestSpan(self, (trace_id, span_id, self._random | sampled), None, None)
        flags = parent.trace_flags & (_SAMPLED | TraceFlags.RANDOM_TRACE_ID)
        return RequestSpan(self, (parent.trace_id, span_id, flags), parent, parent.trace_state)

    def finished(
        self,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: dict[str, str | bool | int | float],
        status: Status,
        start: int,
        end: int,
    ) -> None:
        """Hand a sampled span that ran from ``start`` to ``end`` (ns since the epoch) to the batch."""
        self._processor.on_end(
            ReadableSpan(
                SPAN_NAME,
                context,
                parent,
                self._resource,
                attributes,
                kind=SpanKind.SERVER,
                status=status,
                start_time=start,
                end_time=end,
                instrumentation_scope=self._scope,
            )
        )

    def shutdown(self) -> None:
        """Export the spans still batched and stop the exporter's thread (the server is stopping)."""
        self._processor.shutdown()


def _caller(meta: RequestMeta) -> SpanContext | None:
    """The caller's span context of ``meta``'s ``traceparent`` (and ``tracestate``), or ``None`` when
    it is not a valid W3C context (the SDK's propagator reads it)."""
    carrier = {TRACEPARENT: meta.traceparent}
    if meta.tracestate is not None:
        carrier[TRACESTATE] = meta.tracestate
    context = trace.get_current_span(_PROPAGATOR.extract(carrier, context=_ROOT)).get_span_context()
    return context if context.is_valid else None
