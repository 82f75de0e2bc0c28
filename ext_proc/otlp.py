"""The OTLP export of pd-extproc's spans: the SDK's gRPC exporter with a leaner encoding of a batch.

:class:`SpanEncoder` turns a batch of :mod:`ext_proc.tracing`'s spans (SDK ``ReadableSpan``) into the
``ExportTraceServiceRequest`` the SDK's own ``encode_spans`` builds from them, field for field and byte
for byte (tests/unit/server/test_tracing.py compares the two), at about a fifth of its CPU: the resource
and the instrumentation scope, the same for every span, are encoded once, and each span's fields and
attributes are written into the request's messages in place instead of through the SDK's generic
per-value encoder. The values it writes are the ones this server records: ``str``, ``bool``, ``int``,
``float`` attributes; no events, no links.

:class:`OtlpSpanExporter` is the SDK's ``OTLPSpanExporter`` (its gRPC channel, TLS, retries and
``OTEL_EXPORTER_OTLP_*`` settings) with that encoding as its request-building step (``_translate_data``,
the hook its base class leaves to each signal's exporter). Imported only when tracing is on
(:func:`ext_proc.tracing.otlp_exporter`).
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope as ScopeMessage
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceMessage
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.util.types import Attributes

_LOCAL_PARENT = SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_REMOTE_PARENT = _LOCAL_PARENT | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


def _write_attributes(target: object, attributes: Attributes) -> None:
    """Append ``attributes`` (``str``, ``bool``, ``int`` or ``float`` values) to the repeated
    ``KeyValue`` field ``target``, as the SDK's encoder does (``bool`` before ``int``: a subclass).

    Raises :class:`TypeError` on any other value (this server records none)."""
    for key, value in (attributes or {}).items():
        pair: KeyValue = target.add(key=key)  # type: ignore[attr-defined]
        if isinstance(value, str):
            pair.value.string_value = value
        elif isinstance(value, bool):
            pair.value.bool_value = value
        elif isinstance(value, int):
            pair.value.int_value = value
        elif isinstance(value, float):
            pair.value.double_value = value
        else:
            raise TypeError(f"span attribute {key!r}: {type(value).__name__} is not encoded")


class SpanEncoder:
    """Encodes batches of spans that all share ``resource`` and ``scope`` (their messages built once)."""

    __slots__ = ("_resource", "_resource_schema", "_scope", "_scope_schema")

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        self._resource = ResourceMessage()
        _write_attributes(self._resource.attributes, resource.attributes)
        self._resource_schema = resource.schema_url
        self._scope = ScopeMessage(name=scope.name, version=scope.version)
        _write_attributes(self._scope.attributes, scope.attributes)
        self._scope_schema = scope.schema_url

    def encode(self, spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        """The export request of ``spans``: one resource, one scope, the spans in their order."""
        request = ExportTraceServiceRequest()
        resource_spans = request.resource_spans.add(schema_url=self._resource_schema)
        resource_spans.resource.CopyFrom(self._resource)
        scope_spans = resource_spans.scope_spans.add(schema_url=self._scope_schema)
        scope_spans.scope.CopyFrom(self._scope)
        add = scope_spans.spans.add
        for span in spans:
            context, parent = span.context, span.parent
            assert context is not None  # an ended span of this server always has its context
            message = add(
                trace_id=context.trace_id.to_bytes(16, "big"),
                span_id=context.span_id.to_bytes(8, "big"),
                trace_state=context.trace_state.to_header(),
                name=span.name,
                kind=span.kind.value + 1,  # the SDK's SpanKind counts from 0, OTLP's from 1 (unspecified)
                start_time_unix_nano=span.start_time,
                end_time_unix_nano=span.end_time,
                flags=_LOCAL_PARENT,
            )
            if parent is not None:
                message.parent_span_id = parent.span_id.to_bytes(8, "big")
                if parent.is_remote:
                    message.flags = _REMOTE_PARENT
            _write_attributes(message.attributes, span.attributes)
            status = span.status
            message.status.code = status.status_code.value
            if status.description:
                message.status.message = status.description
        return request


class OtlpSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP gRPC span exporter to ``endpoint``, encoding with :class:`SpanEncoder`."""

    def __init__(self, endpoint: str, resource: Resource, scope: InstrumentationScope) -> None:
        super().__init__(endpoint=endpoint)
        self._encoder = SpanEncoder(resource, scope)

    def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        """The request the base class sends (and re-sends on a retry): :meth:`SpanEncoder.encode`."""
        return self._encoder.encode(data)
