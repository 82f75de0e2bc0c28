"""The ext_proc messages Envoy sends for one request, built for tests that drive the gRPC server
with a real gRPC client (no Envoy needed)."""

from __future__ import annotations

import json

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode

BODY = json.dumps({"model": "m", "prompt": "x" * 40, "max_tokens": 10}).encode()
"""A completions body: 10 prompt tokens, a budget of 10 output tokens."""


def headers(
    end_of_stream: bool = False, extra: dict[str, bytes] | None = None, path: str = "/v1/completions"
) -> pb.ProcessingRequest:
    """Request headers of ``POST path`` (``end_of_stream``: a request without a body), and the ``extra``
    headers a client sent."""
    request = pb.ProcessingRequest()
    header = request.request_headers.headers.headers.add()
    header.key, header.raw_value = ":path", path.encode()
    for key, value in (extra or {}).items():
        request.request_headers.headers.headers.add(key=key, raw_value=value)
    request.request_headers.end_of_stream = end_of_stream
    return request


def with_modes(
    request: pb.ProcessingRequest,
    request_body: int = BodySendMode.FULL_DUPLEX_STREAMED,
    response_body: int = BodySendMode.FULL_DUPLEX_STREAMED,
) -> pb.ProcessingRequest:
    """``request`` as the first message of a stream: with the ``protocol_config`` stating the body modes
    (by default FULL_DUPLEX_STREAMED both ways, as the GIE gateways configure)."""
    request.protocol_config.request_body_mode = request_body
    request.protocol_config.response_body_mode = response_body
    return request


def body(raw: bytes = BODY, end_of_stream: bool = True) -> pb.ProcessingRequest:
    """The request body (BUFFERED: whole, in one message)."""
    request = pb.ProcessingRequest()
    request.request_body.body, request.request_body.end_of_stream = raw, end_of_stream
    return request


def response_body(raw: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    """One chunk of the upstream's response body."""
    request = pb.ProcessingRequest()
    request.response_body.body, request.response_body.end_of_stream = raw, end_of_stream
    return request


def trailers(kind: str = "request_trailers") -> pb.ProcessingRequest:
    """The request (or ``response_trailers``) trailers, one ``grpc-status: 0``."""
    request = pb.ProcessingRequest()
    getattr(request, kind).trailers.headers.add(key="grpc-status", raw_value=b"0")
    return request


def response_headers(status: int = 200, content_type: str | None = None) -> pb.ProcessingRequest:
    """The upstream's response headers: ``:status`` and, when given, ``content-type``."""
    request = pb.ProcessingRequest()
    request.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
    if content_type is not None:
        request.response_headers.headers.headers.add(key="content-type", raw_value=content_type.encode())
    return request


def destination(response: pb.ProcessingResponse) -> str:
    """The ``x-gateway-destination-endpoint`` list an answer puts in the ``envoy.lb`` metadata."""
    lb = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return lb["x-gateway-destination-endpoint"].string_value
