"""ext_proc ProcessingResponse builders: routing mutations, error answers, passthrough."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.choreography import STREAMED_CHUNK_BYTES, streamed_body
from ext_proc.envoy_messages import (
    LB_NAMESPACE,
    PHASES,
    SERVED_KEY,
    HeadersMeta,
    error_body,
    immediate_error,
    passthrough,
    route_on_body,
    route_on_headers,
    served_endpoint,
    strip_on_headers,
)
from ext_proc.outcome import RequestMeta, RoutingInstructions

OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
DEST = "x-gateway-destination-endpoint"
PREFILL = "x-prefiller-host-port"


def instructions(
    destination: str = "10.0.1.1:8000,10.0.1.2:8000", prefill: str | None = "10.0.0.1:8000"
) -> RoutingInstructions:
    if prefill is None:
        return RoutingInstructions(((DEST, destination),), (PREFILL,), ((DEST, destination),))
    return RoutingInstructions(((DEST, destination), (PREFILL, prefill)), (), ((DEST, destination),))


def round_trip(message: pb.ProcessingResponse) -> pb.ProcessingResponse:
    copy = pb.ProcessingResponse.FromString(message.SerializeToString())
    assert copy == message
    return copy


def set_headers(mutation) -> list[tuple[str, bytes, str, int]]:
    return [(o.header.key, o.header.raw_value, o.header.value, o.append_action) for o in mutation.set_headers]


def lb_metadata(response: pb.ProcessingResponse) -> dict[str, str]:
    fields = response.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    return {key: value.string_value for key, value in fields.items()}


# --- routing answers ---------------------------------------------------------------------------


def test_route_on_body_sets_headers_as_raw_bytes_with_overwrite() -> None:
    response = round_trip(route_on_body(instructions()))
    assert response.WhichOneof("response") == "request_body"
    mutation = response.request_body.response.header_mutation
    assert set_headers(mutation) == [
        (DEST, b"10.0.1.1:8000,10.0.1.2:8000", "", OVERWRITE),
        (PREFILL, b"10.0.0.1:8000", "", OVERWRITE),
    ]
    assert list(mutation.remove_headers) == []


def test_route_on_body_puts_destination_into_envoy_lb_dynamic_metadata() -> None:
    response = round_trip(route_on_body(instructions()))
    assert list(response.dynamic_metadata.fields) == [LB_NAMESPACE]
    assert LB_NAMESPACE == "envoy.lb"
    assert lb_metadata(response) == {DEST: "10.0.1.1:8000,10.0.1.2:8000"}


def test_route_on_body_without_prefill_removes_the_prefill_header() -> None:
    response = round_trip(route_on_body(instructions("10.0.1.1:8000", prefill=None)))
    mutation = response.request_body.response.header_mutation
    assert set_headers(mutation) == [(DEST, b"10.0.1.1:8000", "", OVERWRITE)]
    assert list(mutation.remove_headers) == [PREFILL]


def test_route_on_body_leaves_the_body_and_status_alone() -> None:
    common = route_on_body(instructions()).request_body.response
    assert common.status == pb.CommonResponse.ResponseStatus.CONTINUE
    assert not common.HasField("body_mutation")


def test_route_on_body_encodes_non_ascii_values_as_utf8() -> None:
    response = route_on_body(RoutingInstructions((("x-note", "café"),), (), ()))
    assert response.request_body.response.header_mutation.set_headers[0].header.raw_value == "café".encode()


def test_route_on_headers_answers_the_request_headers_phase() -> None:
    response = round_trip(route_on_headers(instructions("10.0.1.1:8000", prefill=None)))
    assert response.WhichOneof("response") == "request_headers"
    mutation = response.request_headers.response.header_mutation
    assert set_headers(mutation) == [(DEST, b"10.0.1.1:8000", "", OVERWRITE)]
    assert list(mutation.remove_headers) == [PREFILL]
    assert lb_metadata(response) == {DEST: "10.0.1.1:8000"}


def test_a_held_headers_answer_strips_the_routing_headers_it_does_not_set() -> None:
    routing = RoutingInstructions(((DEST, "10.0.1.1:8000"),), (PREFILL,), ((DEST, "10.0.1.1:8000"),))
    strip = (DEST, PREFILL, "x-data-parallel-host-port")
    response = route_on_headers(routing, strip=strip, content_length=123, clear_route_cache=True)
    common = response.request_headers.response
    assert list(common.header_mutation.remove_headers) == [PREFILL, "x-data-parallel-host-port"]
    set_headers = {o.header.key: o.header.raw_value for o in common.header_mutation.set_headers}
    assert set_headers == {DEST: b"10.0.1.1:8000", "content-length": b"123"}
    assert common.clear_route_cache and not common.HasField("body_mutation")


def test_a_plain_headers_answer_sets_no_length_and_keeps_the_route_cache() -> None:
    common = route_on_headers(instructions()).request_headers.response
    assert not common.clear_route_cache
    assert "content-length" not in {o.header.key for o in common.header_mutation.set_headers}


@pytest.mark.parametrize(
    ("size", "chunks"),
    [(0, [0]), (1, [1]), (STREAMED_CHUNK_BYTES, [STREAMED_CHUNK_BYTES]), (150_000, [62_000, 62_000, 26_000])],
)
def test_a_streamed_body_is_cut_in_chunks_of_at_most_62000_bytes(size: int, chunks: list[int]) -> None:
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    answers = streamed_body(body)
    streamed = [a.request_body.response.body_mutation.streamed_response for a in answers]
    assert [len(s.body) for s in streamed] == chunks
    assert b"".join(s.body for s in streamed) == body
    assert [s.end_of_stream for s in streamed] == [False] * (len(chunks) - 1) + [True]
    assert not streamed_body(body, end_of_stream=False)[
        -1
    ].request_body.response.body_mutation.streamed_response.end_of_stream


@pytest.mark.parametrize(
    ("value", "expected"),
    [("10.0.0.3:8000", "10.0.0.3:8000"), ("", None), (5.0, None), (None, None)],
    ids=["address", "empty", "number", "absent"],
)
def test_the_served_endpoint_is_read_from_envoy_lb(value: object, expected: str | None) -> None:
    request = pb.ProcessingRequest()
    request.response_headers.SetInParent()
    if value is not None:
        field = request.metadata_context.filter_metadata[LB_NAMESPACE].fields[SERVED_KEY]
        if isinstance(value, str):
            field.string_value = value
        else:
            field.number_value = value
    assert served_endpoint(request) == expected


def test_strip_on_headers_only_removes_headers() -> None:
    response = round_trip(strip_on_headers((DEST, PREFILL)))
    assert response.WhichOneof("response") == "request_headers"
    mutation = response.request_headers.response.header_mutation
    assert list(mutation.remove_headers) == [DEST, PREFILL]
    assert list(mutation.set_headers) == []
    assert not response.HasField("dynamic_metadata")


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (500, "internal_error"),
        (503, "service_unavailable"),
        (429, "rate_limit_error"),
        (502, "bad_gateway"),
        (504, "gateway_timeout"),
        (422, "invalid_request_error"),  # any other 4xx: the request was refused
        (507, "error"),  # any other status
    ],
)
def test_immediate_error_carries_status_and_openai_error_body(status: int, error_type: str) -> None:
    response = round_trip(immediate_error(status, "it broke", "some_code", "messages[0]"))
    assert response.WhichOneof("response") == "immediate_response"
    immediate = response.immediate_response
    assert immediate.status.code == status
    assert json.loads(immediate.body) == {
        "error": {"message": "it broke", "type": error_type, "code": "some_code", "param": "messages[0]"}
    }
    assert immediate.details == "pd_extproc_some_code"


def test_immediate_error_without_param_has_null_param() -> None:
    body = json.loads(immediate_error(503, "no decode", "no_healthy_decode_endpoint").immediate_response.body)
    assert body["error"]["param"] is None
    assert body["error"]["code"] == "no_healthy_decode_endpoint"


def test_immediate_error_sets_json_content_type() -> None:
    immediate = immediate_error(400, "bad", "invalid_request").immediate_response
    assert set_headers(immediate.headers) == [("content-type", b"application/json", "", OVERWRITE)]


def test_error_body_escapes_the_message_as_json() -> None:
    message = 'quote " and newline \n and unicode é'
    assert json.loads(error_body(400, message, "c"))["error"]["message"] == message


# --- passthrough -------------------------------------------------------------------------------


def test_phases_are_every_processing_phase() -> None:
    oneof = pb.ProcessingResponse.DESCRIPTOR.oneofs_by_name["response"]
    assert set(PHASES) == {f.name for f in oneof.fields} - {"immediate_response"}


@pytest.mark.parametrize("phase", PHASES)
def test_passthrough_answers_exactly_the_given_phase_with_no_changes(phase: str) -> None:
    response = round_trip(passthrough(phase))
    assert response.WhichOneof("response") == phase
    assert getattr(response, phase).ByteSize() == 0
    assert not response.HasField("dynamic_metadata")
    assert response.SerializeToString() != b""


def test_passthrough_of_an_unknown_phase_fails_loudly() -> None:
    with pytest.raises(AttributeError):
        passthrough("request_bodyy")


def test_each_builder_returns_a_fresh_message() -> None:
    first = passthrough("request_headers")
    first.request_headers.response.header_mutation.remove_headers.append("x-leak")
    assert passthrough("request_headers").request_headers.ByteSize() == 0
    second = immediate_error(400, "a", "b")
    second.immediate_response.body = b"changed"
    assert immediate_error(400, "a", "b").immediate_response.body != b"changed"


def http_headers(*pairs: tuple[str, str], raw: bool = True) -> pb.HttpHeaders:
    headers = pb.HttpHeaders()
    for key, value in pairs:
        header = headers.headers.headers.add()
        header.key = key
        if raw:
            header.raw_value = value.encode()
        else:
            header.value = value
    return headers


@pytest.mark.parametrize("raw", [True, False], ids=["raw_value", "value"])
def test_the_request_meta_is_the_path_request_id_and_authorization(raw: bool) -> None:
    meta = HeadersMeta(
        http_headers(
            (":authority", "gw"),
            (":path", "/v1/chat/completions?x=1"),
            ("authorization", "Bearer a"),
            ("x-request-id", "first"),
            ("x-request-id", "last"),
            raw=raw,
        )
    )
    assert (meta.path, meta.client_request_id, meta.authorization) == (
        "/v1/chat/completions?x=1",
        "last",
        "Bearer a",
    )
    assert meta == HeadersMeta(
        http_headers(
            (":path", "/v1/chat/completions?x=1"), ("x-request-id", "last"), ("authorization", "Bearer a")
        )
    )
    assert isinstance(meta, RequestMeta)


def test_headers_without_them_give_an_empty_path_and_no_id_or_authorization() -> None:
    meta = HeadersMeta(http_headers((":method", "GET")))
    assert (meta.path, meta.client_request_id, meta.authorization) == ("", None, None)


def test_the_request_meta_reads_the_headers_past_the_path_only_when_asked() -> None:
    headers = http_headers((":path", "/v1/completions"), ("x-request-id", "id"))
    meta = HeadersMeta(headers)
    headers.headers.headers[1].raw_value = b"changed"  # what is read after: proves it was not read before
    assert meta.path == "/v1/completions"
    assert meta.client_request_id == "changed"
    headers.headers.headers[1].raw_value = b"again"
    assert meta.client_request_id == "changed"  # read once
