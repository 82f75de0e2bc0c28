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

from ext_proc.request import RequestError, parse_request
from sim.config import TimingConfig

__all__ = ["GenerateRequest", "RequestError", "parse_generate"]

_WORDS = (" the", " sim", " kv.", " pd!", " and", " of.", " to,", " llm")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` body; counts in tokens.

    ``output_tokens`` (<= ``max_tokens``) is how many tokens the engine will generate: the budget,
    or the simulator extension ``sim_output_tokens`` to end early with ``finish_reason="stop"``.
    """

    body: dict[str, Any]
    chat: bool
    model: str | None
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    kv_transfer_params: dict[str, Any] | None


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise RequestError(f"'{name}' must be an integer >= 1", name)
    return value


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
        kv_transfer_params=kv_params,
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
