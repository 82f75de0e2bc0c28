"""The tracing shell (ext_proc/tracing.py): its configuration's checks, the caller's trace context read
from Envoy's headers, and a span's hooks (in the SDK's own in-memory exporter; the OTLP export itself is
tests/e2e/test_e2e_tracing.py's, through the real Envoy to a real collector)."""

from __future__ import annotations

import sys

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.checks import ConfigError
from ext_proc.envoy_messages import HeadersMeta
from ext_proc.outcome import Refused, RequestMeta
from ext_proc.tracing import SPAN_NAME, Tracing
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
    assert Tracing.of(TracingConfig()) is None
    with pytest.raises(ConfigError, match=r"pip install --force-reinstall --no-deps opentelemetry-proto"):
        Tracing.of(TracingConfig("http://127.0.0.1:4317"))
