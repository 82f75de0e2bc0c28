"""OpenTelemetry traces: one span per request, continuing the caller's W3C trace context.

With ``tracing.otlp_endpoint`` set, every ext_proc stream is one span (kind SERVER, named
:data:`SPAN_NAME`), from Envoy's request headers to the stream's end: the routing decision's attributes
(:data:`ATTRIBUTES`), and on a refusal the error's code and status. A caller's ``traceparent`` (and
``tracestate``) makes the span its child; the span's own W3C context is then sent on the prefill leg
and to the decode (a request header mutation), so engines that export their own spans (vLLM's
``--otlp-traces-endpoint``) join the same trace. The caller's context is read for that alone: nothing of
it reaches the decision.

Sampling is the SDK's ``ParentBased(TraceIdRatioBased(sampling_ratio))``: a request without a sampled
caller is kept at ``sampling_ratio``; a caller's sampled flag is honoured (docs/operations.md
"Tracing"). An unsampled span records nothing and still sends its context (flag ``00``), so the engines
drop theirs too. Spans leave in batches on the SDK's exporter thread (OTLP over gRPC); a collector that is
down costs the exporter's retries there, never a request's time.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ext_proc.affinity import Decision
from ext_proc.checks import ConfigError
from ext_proc.outcome import Refused, RequestMeta
from ext_proc.registry import EndpointState
from ext_proc.tracing_config import TracingConfig

SPAN_NAME = "pd_extproc.route"
"""The name of every request's span."""
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


class RequestSpan:
    """One request's span, and the W3C trace context (:attr:`headers`) the engines are sent.

    ``headers``: ``traceparent`` (and the caller's ``tracestate``, if any) naming this span as the
    parent. Every method is a no-op on attributes when the span is not sampled."""

    __slots__ = ("_recording", "_span", "headers")

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self._recording = span.is_recording()
        context = span.get_span_context()
        parent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        state = context.trace_state
        self.headers = ((TRACEPARENT, parent),)
        if state:
            self.headers += ((TRACESTATE, state.to_header()),)

    def decided(self, mode: str, decision: Decision[EndpointState], hit_tokens: int | None) -> None:
        """Record the decision of ``mode``: the pair, its group and locality, its hit tokens.

        ``hit_tokens`` ``None``: no prefix index, or decode-only. A later decision (a retry after a
        failed prefill leg) replaces the attributes of an earlier one."""
        if not self._recording:
            return
        prefill, decode = decision.prefill, decision.decode
        attributes: dict[str, str | bool | int] = {_MODE: mode, _DECODE: decode.address}
        if prefill is None:
            attributes[_GROUP], attributes[_CROSS] = decode.group, False
        else:
            attributes[_PREFILL], attributes[_GROUP] = prefill.address, prefill.group
            attributes[_CROSS] = prefill.group != decode.group
        if hit_tokens is not None:
            attributes[_HITS] = hit_tokens
        self._span.set_attributes(attributes)

    def queued(self, seconds: float) -> None:
        """Record the seconds the request waited in a queue before it was routed."""
        if self._recording:
            self._span.set_attribute(_QUEUE, seconds)

    def refused(self, refused: Refused) -> None:
        """The request was answered with ``refused``: the span's status is an error of its code."""
        if self._recording:
            status = refused.status
            self._span.set_attributes({"error.type": refused.code, "http.response.status_code": status})
            self._span.set_status(Status(StatusCode.ERROR, refused.message))

    def end(self) -> None:
        """The request is over: end the span (it leaves with the exporter's next batch)."""
        self._span.end()


def otlp_exporter(endpoint: str) -> SpanExporter:
    """The OTLP gRPC span exporter to ``endpoint``, imported only when tracing is on.

    Raises :class:`ConfigError` naming the repair when the OpenTelemetry protos on disk are not
    ``opentelemetry-proto``'s: ``xds-protos`` ships an older copy of the same files, and whichever of the
    two pip installs last wins (``make install`` and the image reinstall ``opentelemetry-proto`` last)."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as error:
        raise ConfigError(
            f"tracing.otlp_endpoint: the OTLP exporter cannot be loaded ({error}); the OpenTelemetry protos "
            "on disk are xds-protos' older copy: run `pip install --force-reinstall --no-deps "
            "opentelemetry-proto` in pd-extproc's environment"
        ) from error
    return OTLPSpanExporter(endpoint=endpoint)


class Tracing:
    """The tracer provider of :class:`TracingConfig`: starts each request's :class:`RequestSpan`.

    ``exporter``: where the batches go (default: OTLP over gRPC to ``otlp_endpoint``)."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        sampler = ParentBased(TraceIdRatioBased(config.sampling_ratio))
        resource = Resource.create({SERVICE_NAME: config.service_name})
        self._provider = TracerProvider(sampler=sampler, resource=resource)
        if exporter is None:
            exporter = otlp_exporter(config.otlp_endpoint)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pd-extproc")
        self._root = Context()

    @classmethod
    def of(cls, config: TracingConfig) -> Tracing | None:
        """The tracing of ``config``, or ``None`` when ``otlp_endpoint`` is empty (tracing off)."""
        return cls(config) if config.otlp_endpoint else None

    def start(self, meta: RequestMeta) -> RequestSpan:
        """Start the span of the request whose headers ``meta`` describes.

        A child of the caller's ``traceparent`` when it sent a valid one, else a new trace's root."""
        parent = self._root
        traceparent = meta.traceparent
        if traceparent is not None:
            carrier = {TRACEPARENT: traceparent}
            if meta.tracestate is not None:
                carrier[TRACESTATE] = meta.tracestate
            parent = _PROPAGATOR.extract(carrier, context=self._root)
        return RequestSpan(self._tracer.start_span(SPAN_NAME, parent, SpanKind.SERVER))

    def shutdown(self) -> None:
        """Export the spans still batched and stop the exporter's thread (the server is stopping)."""
        self._provider.shutdown()
