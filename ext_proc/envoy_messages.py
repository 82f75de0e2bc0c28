"""Build ext_proc ``ProcessingResponse`` messages: the only module that knows their shape.

Every call returns a new upb-backed protobuf. Constant answers (``strip_on_headers``,
``passthrough``) are built once by the server and shared by all its streams: immutable by
convention, they are only ever serialized, never modified after they are built.
Error answers are ``ImmediateResponse`` messages with an OpenAI-style JSON body
``{"error": {"message", "type", "code", "param"}}``.
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.outcome import MODEL_REWRITE_HEADER, RequestMeta, RoutingInstructions

LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
_HeaderSendMode = processing_mode_pb2.ProcessingMode.HeaderSendMode
_BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}

PHASES = (
    "request_headers",
    "response_headers",
    "request_body",
    "response_body",
    "request_trailers",
    "response_trailers",
)

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse
HttpBody = pb.HttpBody
HttpHeaders = pb.HttpHeaders


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoint subset the data plane allows (endpoint-picker protocol), or ``None`` if not set.

    ``filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`` is a list of
    ``"ip:port"`` strings (a comma-separated string is accepted too); set but empty means no endpoint
    may be picked.
    """
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "list_value":
        return frozenset(
            v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"
        )
    if value.WhichOneof("kind") == "string_value":
        return frozenset(a.strip() for a in value.string_value.split(",") if a.strip())
    return frozenset()


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The ``"ip:port"`` of the endpoint that served the request, as the data plane reports it, or ``None``.

    Read at the response phase (endpoint-picker protocol:
    ``filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"]``, which Envoy's
    override_host ``selected_host_key`` writes)."""
    namespaces = request.metadata_context.filter_metadata
    if LB_NAMESPACE not in namespaces:
        return None
    value = namespaces[LB_NAMESPACE].fields.get(SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value or None


def _header_value(header: base_pb2.HeaderValue) -> str:
    raw = header.raw_value
    return raw.decode(errors="replace") if raw else header.value


class HeadersMeta(RequestMeta):
    """The :class:`RequestMeta` of a ``request_headers`` message, each part read when first needed.

    ``path`` is read at once, from the first ``:path`` header (Envoy sends the pseudo-headers first:
    a few headers are looked at); ``client_request_id``, ``authorization``, ``traceparent``,
    ``tracestate`` and ``model_rewrite``, which only the engine handoffs' prefill legs, their logs,
    tracing and a rewrite read (the last two first look for their header's bytes), on first use of any,
    in one pass over all the headers (the last of each name wins; ``None`` when absent).
    Each header looked at costs a protobuf wrapper, and Envoy sends about a dozen: a request routed
    without a prefill leg reads two or three. ``objective`` and ``fairness_id`` (flow control's
    headers) are read, on first use of either, in a pass of their own. Equal to (and hashed as) another
    ``HeadersMeta`` of the same values."""

    __slots__ = ("_flow", "_headers", "_rest")

    def __init__(self, headers: pb.HttpHeaders) -> None:
        path = ""
        for header in headers.headers.headers:
            if header.key == ":path":
                path = _header_value(header)
                break
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "_headers", headers)
        object.__setattr__(self, "_rest", None)
        object.__setattr__(self, "_flow", None)

    @property  # type: ignore[override]
    def client_request_id(self) -> str | None:
        """The incoming ``x-request-id``, or ``None``."""
        return self._read()[0]

    @property  # type: ignore[override]
    def authorization(self) -> str | None:
        """The incoming ``authorization``, or ``None``."""
        return self._read()[1]

    @property  # type: ignore[override]
    def traceparent(self) -> str | None:
        """The incoming ``traceparent``, or ``None``.

        Tracing reads it for every request, and most send none: their headers, serialised (one call),
        are first searched for the bytes that start a ``traceparent`` header's name (``None`` at once
        when absent), which costs a sixth of the wrapper per header the full read takes."""
        if self._rest is None and _TRACEPARENT_KEY not in self._headers.headers.SerializeToString():
            return None
        return self._read()[2]

    @property  # type: ignore[override]
    def tracestate(self) -> str | None:
        """The incoming ``tracestate``, or ``None``."""
        return self._read()[3]

    @property  # type: ignore[override]
    def model_rewrite(self) -> str | None:
        """The incoming :data:`~ext_proc.outcome.MODEL_REWRITE_HEADER`, or ``None``.

        Read for every request with a body, and most send none: looked for as ``traceparent`` is."""
        if self._rest is None and _REWRITE_KEY not in self._headers.headers.SerializeToString():
            return None
        return self._read()[4]

    @property  # type: ignore[override]
    def objective(self) -> str | None:
        """The incoming ``x-gateway-inference-objective``, or ``None``."""
        return self._read_flow()[0]

    @property  # type: ignore[override]
    def fairness_id(self) -> str | None:
        """The incoming ``x-gateway-inference-fairness-id``, or ``None``."""
        return self._read_flow()[1]

    def _read_flow(self) -> tuple[str | None, str | None]:
        flow = self._flow
        if flow is None:
            objective, fairness_id = None, None
            for header in self._headers.headers.headers:
                key = header.key
                if key == "x-gateway-inference-objective":
                    objective = _header_value(header)
                elif key == "x-gateway-inference-fairness-id":
                    fairness_id = _header_value(header)
            flow = (objective, fairness_id)
            object.__setattr__(self, "_flow", flow)
        return flow

    def _read(self) -> tuple[str | None, ...]:
        rest = self._rest
        if rest is None:
            found: dict[str, str] = {}
            for header in self._headers.headers.headers:
                key = header.key
                if key in _LAZY_HEADERS:
                    found[key] = _header_value(header)
            rest = tuple(found.get(name) for name in _LAZY_HEADERS)
            object.__setattr__(self, "_rest", rest)
        return rest


_LAZY_HEADERS = ("x-request-id", "authorization", "traceparent", "tracestate", MODEL_REWRITE_HEADER)
"""The headers :class:`HeadersMeta` reads on first use, in the order of its ``_read``."""
_TRACEPARENT_KEY = b"\x0a\x0btraceparent"
_REWRITE_KEY = b"\x0a" + bytes([len(MODEL_REWRITE_HEADER)]) + MODEL_REWRITE_HEADER.encode()
"""The bytes that start a :data:`~ext_proc.outcome.MODEL_REWRITE_HEADER` header, as ``_TRACEPARENT_KEY``."""
"""A ``HeaderValue`` whose ``key`` (field 1, length-delimited: tag 0x0a) is the 11 bytes ``traceparent``,
as serialised: absent from a header map's bytes, no header is named so (present, the map is read)."""


def response_status(headers: pb.HttpHeaders) -> tuple[int, str]:
    """The ``:status`` and ``content-type`` of a ``response_headers`` message.

    The status is 0 when missing or not a number."""
    status, content_type = 0, ""
    for header in headers.headers.headers:
        key = header.key
        if key == ":status":
            value = _header_value(header)
            status = int(value) if value.isdigit() else 0
        elif key == "content-type":
            content_type = _header_value(header)
    return status, content_type


def _set_header(mutation: pb.HeaderMutation, name: str, value: bytes) -> None:
    option = mutation.set_headers.add()
    option.header.key = name
    option.header.raw_value = value
    option.append_action = _OVERWRITE


def _fill_headers(mutation: pb.HeaderMutation, routing: RoutingInstructions, strip: tuple[str, ...]) -> None:
    for name, value in routing.set_headers:
        _set_header(mutation, name, value.encode())
    mutation.remove_headers.extend(routing.remove_headers)
    if strip:
        owned = {name for name, _ in routing.set_headers} | set(routing.remove_headers)
        mutation.remove_headers.extend(name for name in strip if name not in owned)


def _fill_common(common: pb.CommonResponse, routing: RoutingInstructions) -> None:
    _fill_headers(common.header_mutation, routing, ())
    if routing.body is not None:
        # Envoy 1.40 answers 500 for a mutated body unless content-length matches it in the same answer.
        _set_header(common.header_mutation, "content-length", str(len(routing.body)).encode())
        common.body_mutation.body = routing.body


def _fill_metadata(response: pb.ProcessingResponse, routing: RoutingInstructions) -> None:
    fields = response.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    for key, value in routing.lb_metadata:
        fields[key].string_value = value


def route_on_body(routing: RoutingInstructions) -> pb.ProcessingResponse:
    """Answer a ``request_body`` message with the routing headers, metadata and any new body.

    The metadata is ``envoy.lb``; the body is included when the handoff rewrote it."""
    response = pb.ProcessingResponse()
    _fill_common(response.request_body.response, routing)
    _fill_metadata(response, routing)
    return response


def with_headers(
    answer: pb.ProcessingResponse, headers: tuple[tuple[str, str], ...]
) -> pb.ProcessingResponse:
    """A copy of the routing ``answer`` that also sets ``headers`` on the request.

    ``answer`` answers ``request_headers`` or ``request_body``; a client's header of the same name is
    replaced. A copy: a BUFFERED routing answer is shared by every request of its routing (never modified)."""
    copy = pb.ProcessingResponse()
    copy.CopyFrom(answer)
    mutation = getattr(copy, copy.WhichOneof("response")).response.header_mutation
    for name, value in headers:
        _set_header(mutation, name, value.encode())
    return copy


def route_on_headers(
    routing: RoutingInstructions,
    *,
    strip: tuple[str, ...] = (),
    content_length: int | None = None,
    clear_route_cache: bool = False,
) -> pb.ProcessingResponse:
    """Answer a ``request_headers`` message with the routing headers and ``envoy.lb`` metadata.

    Never a body: a request without one, or a FULL_DUPLEX_STREAMED body, which follows in its own answers.

    ``strip``: routing headers a client may not send, removed unless ``routing`` sets them;
    ``content_length``: the length of the body that will follow, in bytes; ``clear_route_cache``: have
    Envoy match the route again (for filters configured without ``route_cache_action: CLEAR``).
    """
    response = pb.ProcessingResponse()
    common = response.request_headers.response
    _fill_headers(common.header_mutation, routing, strip)
    if content_length is not None:
        _set_header(common.header_mutation, "content-length", str(content_length).encode())
    if clear_route_cache:
        common.clear_route_cache = True
    _fill_metadata(response, routing)
    return response


def streamed_chunk(kind: str, body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """Answer a FULL_DUPLEX_STREAMED body message of ``kind`` with ``body``.

    ``kind`` is ``request_body`` / ``response_body``; ``body`` is its ``streamed_response``
    (``end_of_stream`` on the body's last chunk)."""
    response = pb.ProcessingResponse()
    streamed = getattr(response, kind).response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end_of_stream
    return response


def ask_response_body(streamed: bool) -> pb.ProcessingResponse:
    """Answer a ``response_headers`` message unchanged, asking for the body.

    Envoy is asked to send this response's body chunk by chunk (``streamed``) or whole, in one
    message (``mode_override``: ``response_body_mode: STREAMED`` / ``BUFFERED``; the filter must
    allow mode overrides, ``allow_mode_override``)."""
    response = pb.ProcessingResponse()
    response.response_headers.SetInParent()
    response.mode_override.response_body_mode = _BodySendMode.STREAMED if streamed else _BodySendMode.BUFFERED
    return response


def replace_body(body: bytes) -> pb.ProcessingResponse:
    """Answer a (BUFFERED or STREAMED) ``response_body`` message by sending ``body`` in its place."""
    response = pb.ProcessingResponse()
    response.response_body.response.body_mutation.body = body
    return response


def strip_on_headers(headers: tuple[str, ...], response_headers: bool = False) -> pb.ProcessingResponse:
    """Answer a ``request_headers`` message by removing client-supplied routing headers.

    With ``response_headers``, also ask Envoy to send this request's response headers
    (``mode_override`` of the shipped BUFFERED phases with response headers ``SEND``; needs
    ``allow_mode_override``)."""
    response = pb.ProcessingResponse()
    response.request_headers.response.header_mutation.remove_headers.extend(headers)
    if response_headers:
        mode = response.mode_override
        mode.request_header_mode = _HeaderSendMode.SEND
        mode.request_body_mode = _BodySendMode.BUFFERED
        mode.response_header_mode = _HeaderSendMode.SEND
        mode.response_body_mode = _BodySendMode.NONE
        mode.request_trailer_mode = _HeaderSendMode.SKIP
        mode.response_trailer_mode = _HeaderSendMode.SKIP
    return response


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    """The OpenAI-style JSON error body."""
    kind = _ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "error")
    error = {"message": message, "type": kind, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


def immediate_error(
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    body: bytes | None = None,
    retry_after: int | None = None,
) -> pb.ProcessingResponse:
    """Answer any message by ending the HTTP exchange with ``status`` and a JSON error body.

    The body is ``body`` when given (e.g. an engine's own error), else built from the other
    arguments; a ``retry-after`` header of ``retry_after`` seconds is added when given."""
    response = pb.ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = status  # type: ignore[assignment]
    immediate.body = body if body is not None else error_body(status, message, code, param)
    immediate.details = f"pd_extproc_{code}"
    _set_header(immediate.headers, "content-type", b"application/json")
    if retry_after is not None:
        _set_header(immediate.headers, "retry-after", str(retry_after).encode())
    return response


def immediate_answer(status: int, body: bytes) -> pb.ProcessingResponse:
    """Answer any message by ending the HTTP exchange with ``status`` and the JSON ``body``.

    Its details, ``pd_extproc_answer``, tell the shipped Envoy's local-reply mappers to leave it as it is."""
    response = pb.ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = status  # type: ignore[assignment]
    immediate.body = body
    immediate.details = "pd_extproc_answer"
    _set_header(immediate.headers, "content-type", b"application/json")
    return response


def extend_timeout(seconds: float) -> pb.ProcessingResponse:
    """Ask Envoy to wait up to ``seconds`` for the answer to the current message.

    This is ``override_message_timeout``; Envoy caps it at the filter's ``max_message_timeout``."""
    response = pb.ProcessingResponse()
    whole = int(seconds)
    response.override_message_timeout.seconds = whole
    response.override_message_timeout.nanos = int((seconds - whole) * 1e9)
    return response


def passthrough(kind: str) -> pb.ProcessingResponse:
    """The 'carry on unchanged' answer for a message of the given ``WhichOneof`` kind."""
    response = pb.ProcessingResponse()
    getattr(response, kind).SetInParent()
    return response
