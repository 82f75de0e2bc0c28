"""OpenAI-compatible request parsing and response shapes, as vLLM's server produces them.

Prompt tokens and the output budget come from :func:`ext_proc.request.parse_request`, the very
rule the gateway uses (exact for token ids, ``ceil(chars / 4)`` over all prompt strings or chat
text parts), so gateway and engines agree on sizes. Generated text is a fixed cycle of
four-character tokens, so ``ceil(len(text) / 4)`` equals the completion token count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ext_proc.request import RequestError, parse_request
from sim.config import TimingConfig

__all__ = ["Bootstrap", "GenerateRequest", "RequestError", "parse_generate"]

_WORDS = (" the", " sim", " kv.", " pd!", " and", " of.", " to,", " llm")


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """SGLang's PD handoff fields.

    The prefill's bootstrap server ``host:port`` and the ``room`` (a 63-bit id shared by the prefill and
    the decode request of one client request)."""

    host: str
    port: int
    room: int


BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` body; counts in tokens.

    ``output_tokens`` (<= ``max_tokens``) is how many tokens the engine will generate: the budget,
    or the simulator extension ``sim_output_tokens`` (the model ends after that many tokens).
    ``stops`` is true when the model ends by itself within the budget (``sim_output_tokens`` <=
    ``max_tokens``): the finish reason is then ``"stop"``, else ``"length"``. ``bootstrap`` holds
    SGLang's handoff fields when the body has any of them. ``priority``: vLLM's (lower is scheduled
    earlier under ``--scheduling-policy priority``; ignored otherwise), 0 when absent.
    """

    body: dict[str, Any]
    chat: bool
    model: str | None
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    stops: bool
    kv_transfer_params: dict[str, Any] | None
    bootstrap: Bootstrap | None
    priority: int = 0

    @property
    def remote_decode(self) -> bool:
        """``kv_transfer_params.do_remote_decode``: the prefill leg of a vLLM handoff."""
        return bool((self.kv_transfer_params or {}).get("do_remote_decode"))

    @property
    def remote_prefill(self) -> bool:
        """``kv_transfer_params.do_remote_prefill``: the decode leg of a vLLM handoff."""
        return bool((self.kv_transfer_params or {}).get("do_remote_prefill"))


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise RequestError(f"'{name}' must be an integer >= 1", name)
    return value


def _bootstrap(body: dict[str, Any]) -> Bootstrap | None:
    """SGLang's fields, all three required once any is set (``None`` counts as unset)."""
    if all(body.get(name) is None for name in BOOTSTRAP_FIELDS):
        return None
    host, port, room = (body.get(name) for name in BOOTSTRAP_FIELDS)
    if not isinstance(host, str) or not host:
        raise RequestError("'bootstrap_host' must be a non-empty string", "bootstrap_host")
    if type(port) is not int or not 0 < port <= 65535:
        raise RequestError("'bootstrap_port' must be an integer port in 1..65535", "bootstrap_port")
    if type(room) is not int or not 0 <= room < 2**63:
        raise RequestError("'bootstrap_room' must be an integer in 0..2**63-1", "bootstrap_room")
    return Bootstrap(host, port, room)


def parse_generate(raw: bytes, chat: bool, timing: TimingConfig) -> GenerateRequest:
    """Parse and validate a request body; raise :class:`RequestError` (HTTP 400) when invalid."""
    info = parse_request(raw, timing.default_max_tokens)
    body: dict[str, Any] = json.loads(raw)
    field = "messages" if chat else "prompt"
    if field not in body:
        raise RequestError(f"'{field}' is required", field)
    if chat and not body["messages"]:
        raise RequestError("'messages' must not be empty", "messages")
    if not chat and info.prompt_tokens == 0:
        raise RequestError("'prompt' must not be empty", "prompt")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        _positive_int(body, name)
    if body.get("n", 1) != 1:
        raise RequestError("the simulator supports only n=1", "n")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(
            "'stream_options' must be an object with a boolean include_usage", "stream_options"
        )
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise RequestError("'kv_transfer_params' must be an object", "kv_transfer_params")
    budget = info.output_budget
    if info.prompt_tokens + budget > timing.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {timing.max_model_len} tokens; the request has "
            f"{info.prompt_tokens} prompt tokens and asks for {budget} output tokens",
            "max_tokens",
        )
    priority = body.get("priority", 0)
    if type(priority) is not int:
        raise RequestError("'priority' must be an integer", "priority")
    early = _positive_int(body, "sim_output_tokens")
    return GenerateRequest(
        body=body,
        chat=chat,
        model=info.model,
        stream=info.stream,
        include_usage=info.stream and bool(options.get("include_usage", False)),
        prompt_tokens=info.prompt_tokens,
        max_tokens=budget,
        output_tokens=min(budget, early) if early else budget,
        stops=early is not None and early <= budget,
        kv_transfer_params=kv_params,
        bootstrap=_bootstrap(body),
        priority=priority,
    )


def token_text(start: int, end: int) -> str:
    """Text of generated tokens ``start`` (inclusive) to ``end`` (exclusive)."""
    return "".join(_WORDS[i % len(_WORDS)] for i in range(start, end))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(
    message: str, code: int = 400, err_type: str = "BadRequestError", param: str | None = None
) -> dict:
    """vLLM/OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError"}


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None
) -> web.Response:
    """An HTTP ``status`` response carrying :func:`error_body`.

    An HTTP ``status`` response carrying :func:`error_body` (type ``InternalServerError`` unless
    400 or 404)."""
    err_type = _ERROR_TYPES.get(status, "InternalServerError")
    return web.json_response(error_body(message, status, err_type, param), status=status, headers=headers)


@dataclass(frozen=True, slots=True)
class Shaper:
    """Builds the response objects of one request (fixed id, creation time and model name)."""

    chat: bool
    request_id: str
    model: str
    created: int

    @classmethod
    def new(cls, chat: bool, request_id: str, model: str) -> Shaper:
        """A shaper with an OpenAI-style id (``chatcmpl-`` / ``cmpl-`` prefix) created now."""
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, prefix + request_id, model, int(time.time()))

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, text: str, finish_reason: str | None, use: dict[str, int]) -> dict[str, Any]:
        """Non-streaming response body."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
            obj = "chat.completion"
        else:
            choice, obj = {"index": 0, "text": text}, "text_completion"
        choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=None)
        body = self._envelope(obj, [choice])
        body["usage"] = use
        return body

    def chunk(
        self, text: str | None, finish_reason: str | None, with_usage: bool, role: bool = False
    ) -> dict[str, Any]:
        """One streaming chunk; ``role`` makes the initial chat chunk ``{"role": "assistant"}``."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text or ""}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": text or ""}, "text_completion"
        choice.update(logprobs=None, finish_reason=finish_reason)
        body = self._envelope(obj, [choice])
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        """The final ``include_usage`` chunk: no choices, the request's usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = use
        return body


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``) and a blank line."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
