"""The ext_proc message choreography of each body mode: which answers go out for which message.

Envoy states the stream's body modes in its first ``ProcessingRequest`` (``protocol_config``); the
server picks the matching :class:`Choreography` once per stream (:func:`choreography_for`) and routes
the same way in every mode. Only the translation between Envoy's messages and the router's
``(raw body, meta, subset) → outcome`` differs:

- :data:`BUFFERED` (the shipped ``envoy/envoy.yaml``): the request headers are answered at once
  (client routing headers stripped; with a handoff that hands KV, the answer also asks for the
  response headers), the whole body comes in one message and its answer carries the routing
  (headers, ``envoy.lb`` metadata, a rewritten body). Response messages, where Envoy sends them,
  are passed through unchanged (the server inspects a KV handoff's answer first).
- :data:`FULL_DUPLEX` (``FULL_DUPLEX_STREAMED``, what the Gateway API Inference Extension gateways
  configure): Envoy sends the headers and every body chunk without waiting. The headers answer is
  held until the body's ``end_of_stream`` (or the request trailers); then it goes out with the
  routing headers, ``envoy.lb`` metadata, ``clear_route_cache`` and the body's ``content-length``,
  followed by the body (the client's, or the handoff's rewrite) as ``streamed_response`` chunks of at
  most :data:`STREAMED_CHUNK_BYTES`, ``end_of_stream`` on the last. Response body chunks are echoed
  unchanged as they come (tokens stream through), response headers and trailers passed through.

A choreography answers only the messages Envoy sends; it never answers a phase Envoy did not send.
"""

from __future__ import annotations

from dataclasses import dataclass

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc import envoy_messages as msg
from ext_proc.outcome import RoutingInstructions

BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode
_BUFFERED = BodySendMode.BUFFERED  # the enum's values bound once: each attribute access costs ~0.8 µs
_FULL_DUPLEX = BodySendMode.FULL_DUPLEX_STREAMED
STREAMED_CHUNK_BYTES = 62_000
"""The largest body chunk sent in one ``streamed_response`` (the Gateway API Inference Extension
endpoint picker's ``BodyByteLimit``), in bytes."""
BODY_LIMIT_BYTES = 16 * 1024 * 1024
"""The largest request body routed, in bytes: in BUFFERED mode the shipped Envoy's
``per_connection_buffer_limit_bytes`` refuses a larger one itself (a test keeps the two equal); in
FULL_DUPLEX_STREAMED mode Envoy buffers nothing and pd-extproc refuses it (413 ``request_too_large``)."""

ROUTING_ANSWERS_KEPT = 4096
"""The most BUFFERED routing answers :class:`RoutingAnswers` keeps for reuse."""

Answers = tuple[pb.ProcessingResponse, ...]
_TRAILERS = msg.passthrough("request_trailers")
"""Built once, never modified: the answer that passes request trailers through."""


class RoutingAnswers:
    """The BUFFERED answers of routings that keep the client's body, each built once and reused.

    Such an answer depends on its routing alone (the decode, its fallbacks, the prefill), and few
    routings recur, so building one per request is wasted work. Like the constant answers, one is
    never modified after it is built, only serialized. At most :data:`ROUTING_ANSWERS_KEPT` are kept;
    when full, all are forgotten and built again as they recur."""

    __slots__ = ("_answers",)

    def __init__(self) -> None:
        self._answers: dict[RoutingInstructions, Answers] = {}

    def of(self, routing: RoutingInstructions) -> Answers:
        """The answer to a ``request_body`` message that routes with ``routing`` (``routing.body`` None)."""
        answers = self._answers.get(routing)
        if answers is None:
            if len(self._answers) >= ROUTING_ANSWERS_KEPT:
                self._answers.clear()
            answers = self._answers[routing] = (msg.route_on_body(routing),)
        return answers


@dataclass(frozen=True, slots=True)
class Choreography:
    """How one body mode's messages are answered.

    Stateless and shared by every stream of that mode; a stream keeps its own collected body
    (:class:`BodyCollector`)."""

    name: str
    """The request body mode, as the metric label ``body_mode`` names it."""
    full_duplex: bool
    """Request body chunks are collected and the headers answer held until the body is complete."""
    header_hold: Answers
    """What answers request headers that a body follows: the strip answer (BUFFERED) or nothing."""
    streams_response_body: bool
    """Response body chunks are answered with the same bytes as ``streamed_response`` (FDS)."""
    strip: tuple[str, ...]
    """The routing headers a client may not send; a held headers answer removes those it does not set."""
    reused: RoutingAnswers
    """The BUFFERED routing answers built so far (shared by the server's choreographies)."""

    def route_body(self, routing: RoutingInstructions, body: bytes, trailers: bool = False) -> Answers:
        """The answers that route a request whose complete body is ``body``.

        ``routing.body``, when set, replaces it; ``trailers``: the request trailers ended the body (FDS
        only), and are answered last, unchanged."""
        if not self.full_duplex:
            return self.reused.of(routing) if routing.body is None else (msg.route_on_body(routing),)
        sent = body if routing.body is None else routing.body
        headers = msg.route_on_headers(
            routing, strip=self.strip, content_length=len(sent), clear_route_cache=True
        )
        if trailers:
            return (headers, *streamed_body(sent, end_of_stream=False), _TRAILERS)
        return (headers, *streamed_body(sent))

    def route_bodiless(self, routing: RoutingInstructions) -> Answers:
        """The answer that routes a request without a body, at its headers."""
        if not self.full_duplex:
            return (msg.route_on_headers(routing),)
        return (msg.route_on_headers(routing, strip=self.strip, clear_route_cache=True),)

    def response_body(self, body: pb.HttpBody, passthrough: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """The answer to one response body message: its bytes echoed (FDS), else ``passthrough``."""
        if self.streams_response_body:
            return msg.streamed_chunk("response_body", body.body, body.end_of_stream)
        return passthrough


def streamed_body(body: bytes, end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
    """``body`` as request-body ``streamed_response`` answers, the last with ``end_of_stream``.

    Each answer carries at most :data:`STREAMED_CHUNK_BYTES` (one empty chunk for an empty body)."""
    size = len(body)
    starts = range(0, size, STREAMED_CHUNK_BYTES) if size else (0,)
    last = starts[-1]
    return [
        msg.streamed_chunk("request_body", body[i : i + STREAMED_CHUNK_BYTES], end_of_stream and i == last)
        for i in starts
    ]


class BodyCollector:
    """A FULL_DUPLEX_STREAMED request body, chunk by chunk, up to :data:`BODY_LIMIT_BYTES`."""

    __slots__ = ("_chunks", "size")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> bool:
        """Append ``chunk``; ``False`` once the body exceeds :data:`BODY_LIMIT_BYTES` (nothing kept)."""
        self.size += len(chunk)
        if self.size > BODY_LIMIT_BYTES:
            self._chunks.clear()
            return False
        self._chunks.append(chunk)
        return True

    def body(self) -> bytes:
        """The body collected so far, in one piece."""
        chunks = self._chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Choreographies:
    """The choreographies of a server, built once: one per body mode and response handling.

    The server's handoff owns ``routing_headers`` (a client may not send them). There is one
    choreography per request body mode (BUFFERED, FULL_DUPLEX_STREAMED) and response body handling
    (echoed in FULL_DUPLEX_STREAMED, else passed through). ``response_headers``: the BUFFERED strip
    answer also asks for the response headers (the shipped phases skip them), which the KV handoffs
    read to tell a decode's failed pull."""

    def __init__(self, routing_headers: tuple[str, ...], response_headers: bool = False) -> None:
        hold = (msg.strip_on_headers(routing_headers, response_headers),)
        reused = RoutingAnswers()
        self.buffered = Choreography("buffered", False, hold, False, routing_headers, reused)
        self._by_modes = {
            (False, False): self.buffered,
            (False, True): Choreography("buffered", False, hold, True, routing_headers, reused),
            (True, False): Choreography("full_duplex_streamed", True, (), False, routing_headers, reused),
            (True, True): Choreography("full_duplex_streamed", True, (), True, routing_headers, reused),
        }

    def choreography_for(self, request: pb.ProcessingRequest) -> Choreography | str:
        """The choreography of the stream whose first message is ``request``, or why none fits.

        Why none fits is the message of a 500 ``ext_proc_misconfigured`` answer. No ``protocol_config``
        (an Envoy older than 1.33) means BUFFERED, as the shipped bootstrap configures."""
        if not request.HasField("protocol_config"):
            return self.buffered
        config = request.protocol_config
        request_mode = config.request_body_mode
        if request_mode != _BUFFERED and request_mode != _FULL_DUPLEX:
            return (
                f"ext_proc request_body_mode is {BodySendMode.Name(request_mode)}: pd-extproc routes by "
                "the whole request body, so use BUFFERED or FULL_DUPLEX_STREAMED"
            )
        return self._by_modes[(request_mode == _FULL_DUPLEX, config.response_body_mode == _FULL_DUPLEX)]
