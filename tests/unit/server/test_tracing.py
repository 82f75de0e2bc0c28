"""The tracing shell (ext_proc/tracing.py): its configuration's checks, the caller's trace context read
from Envoy's headers, and a span's hooks (in the SDK's own in-memory exporter; the OTLP export itself is
tests/e2e/test_e2e_tracing.py's, through the real Envoy to a real collector)."""

from __future__ import annotations

import sys

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, StatusCode

from ext_proc.checks import ConfigError
from ext_proc.envoy_messages import HeadersMeta
from ext_proc.otlp import OtlpSpanExporter, SpanEncoder
from ext_proc.outcome import Refused, RequestMeta
from ext_proc.tracing import SCOPE_NAME, SPAN_NAME, Tracing
from ext_proc.tracing_config import TracingConfig

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _headers(*pairs: tuple[str, str]) -> HeadersMeta:
    message = pb.HttpHeaders()
    for key, value in ((":path", "/v1/completions"), *pairs):
        message.headers.headers.add(key=key, raw_value=value.encode())
    return HeadersMeta(message)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            TracingConfig("otel:4317"),
            "tracing.otlp_endpoint: 'otel:4317' is not allowed; use http://host:port",
        ),
        (TracingConfig("grpc://otel:4317"), "use http://host:port (https:// for TLS)"),
        (TracingConfig("http://otel:99999"), "its port is not a number in 1..65535"),
        (TracingConfig("http://otel:4317", 1.5), "tracing.sampling_ratio: must be a number in [0, 1]"),
        (TracingConfig("http://otel:4317", service_name=""), "tracing.service_name: must not be empty"),
    ],
)
def test_out_of_range_keys_are_named(config: TracingConfig, message: str) -> None:
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        config.check()


def test_off_and_valid_settings_pass() -> None:
    TracingConfig().check()
    TracingConfig("https://otel.example:4317", 0.0, "gw").check()
    assert Tracing.of(TracingConfig()) is None


def test_the_callers_context_is_read_only_when_a_header_is_named_so() -> None:
    assert _headers(("x-request-id", "r"), ("authorization", "traceparent")).traceparent is None
    meta = _headers(("x-request-id", "r"), ("traceparent", CALLER), ("tracestate", "k=v"))
    assert (meta.traceparent, meta.tracestate, meta.client_request_id) == (CALLER, "k=v", "r")
    # A value that holds the name's bytes only makes the headers be read in full: still no header so named.
    assert _headers(("x-note", "\x0a\x0btraceparent")).traceparent is None


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def test_a_span_continues_the_caller_and_records_the_hooks(spans: InMemorySpanExporter) -> None:
    tracing = Tracing(TracingConfig("http://127.0.0.1:4317", 0.0), spans)
    span = tracing.start(RequestMeta("/v1/completions", traceparent=CALLER, tracestate="k=v"))
    (name, value), (state_name, state) = span.headers
    assert (name, state_name, state) == ("traceparent", "tracestate", "k=v")
    assert value.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-") and value.endswith("-01")
    span.queued(0.25)
    span.refused(Refused(429, "the gateway is overloaded", "overloaded"))
    span.end()
    tracing.shutdown()
    (finished,) = spans.get_finished_spans()
    assert finished.name == SPAN_NAME and finished.parent.span_id == 0x00F067AA0BA902B7
    assert dict(finished.attributes) == {
        "pd_extproc.queue_wait_s": 0.25,
        "error.type": "overloaded",
        "http.response.status_code": 429,
    }


def test_an_unsampled_span_records_nothing_and_still_passes_its_context(spans: InMemorySpanExporter) -> None:
    tracing = Tracing(TracingConfig("http://127.0.0.1:4317", 0.0), spans)
    span = tracing.start(RequestMeta("/v1/completions"))
    ((name, value),) = span.headers
    assert name == "traceparent" and int(value.rsplit("-", 1)[1], 16) & 1 == 0
    span.queued(1.0)
    span.end()
    tracing.shutdown()
    assert spans.get_finished_spans() == ()


def test_an_exporter_that_cannot_load_is_a_config_error_naming_the_repair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What an environment where xds-protos' older OpenTelemetry protos won the install looks like: the
    # exporter's import fails. Tracing off never imports it.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    monkeypatch.delitem(sys.modules, "ext_proc.otlp")  # imported above: loaded again, from that exporter
    assert Tracing.of(TracingConfig()) is None
    with pytest.raises(ConfigError, match=r"pip install --force-reinstall --no-deps opentelemetry-proto"):
        Tracing.of(TracingConfig("http://127.0.0.1:4317"))


def _finished(tracing: Tracing, spans: InMemorySpanExporter, *metas: RequestMeta) -> tuple[ReadableSpan, ...]:
    """The spans of ``metas``' requests, each given every attribute type and the first refused."""
    for n, meta in enumerate(metas):
        span = tracing.start(meta)
        span.queued(0.125 * n)
        if n == 0:
            span.refused(Refused(400, "the body is not JSON", "invalid_request"))
        span.end()
    tracing.shutdown()
    return spans.get_finished_spans()


def test_the_lean_encoding_is_the_sdks_byte_for_byte(spans: InMemorySpanExporter) -> None:
    tracing = Tracing(TracingConfig("http://127.0.0.1:4317", 1.0, "gw"), spans)
    metas = (
        RequestMeta("/v1/completions", traceparent=CALLER, tracestate="k=v,l=w"),  # a remote parent
        RequestMeta("/v1/completions"),  # a root
    )
    finished = _finished(tracing, spans, *metas)
    assert [span.status.status_code for span in finished] == [StatusCode.ERROR, StatusCode.UNSET]
    ours = SpanEncoder(finished[0].resource, finished[0].instrumentation_scope).encode(finished)
    assert ours.SerializeToString(deterministic=True) == encode_spans(finished).SerializeToString(
        deterministic=True
    )


def test_the_exporter_encodes_with_the_lean_encoder(spans: InMemorySpanExporter) -> None:
    # The one difference the SDK's encoder does not share: a value this server never records fails.
    resource, scope = Resource.create({}), InstrumentationScope(SCOPE_NAME)
    exporter = OtlpSpanExporter("http://127.0.0.1:4317", resource, scope)
    span = ReadableSpan(SPAN_NAME, SpanContext(1, 1, False), attributes={"list": ("a",)}, resource=resource)
    assert encode_spans([span]).resource_spans  # the SDK's would encode it
    with pytest.raises(TypeError, match="'list': tuple is not encoded"):
        exporter.export([span])
    exporter.shutdown()


@pytest.mark.parametrize(
    ("traceparent", "flags", "recorded"),
    [
        (None, "03", True),  # a root at ratio 1: sampled, and the SDK's random-trace-id flag
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", "00", False),  # the caller's "no"
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03", "03", True),  # its flags carried
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", "03", True),  # invalid: a new root
    ],
)
def test_the_sdks_sampling_rule_and_flags(
    spans: InMemorySpanExporter, traceparent: str | None, flags: str, recorded: bool
) -> None:
    tracing = Tracing(TracingConfig("http://127.0.0.1:4317", 1.0), spans)
    span = tracing.start(RequestMeta("/v1/completions", traceparent=traceparent))
    ((_, value),) = span.headers
    version, trace_id, span_id, sent_flags = value.split("-")
    assert (version, sent_flags) == ("00", flags)
    span.end()
    tracing.shutdown()
    finished = spans.get_finished_spans()
    assert len(finished) == recorded
    if traceparent is not None and "4bf92f" in traceparent:
        assert trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    for span_data in finished:
        assert (f"{span_data.context.trace_id:032x}", f"{span_data.context.span_id:016x}") == (
            trace_id,
            span_id,
        )
