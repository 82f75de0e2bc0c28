"""Parse an OpenAI-compatible request body into the few numbers routing needs.

One parse per request and a walk over the prompt: no schema library on the hot path. The body is
parsed by ``msgspec`` (C, several times faster than ``json`` on long prompts); a body it refuses is
parsed again by Python's ``json``, which decides, so what is accepted, its values and the error
messages are exactly ``json``'s (``msgspec`` accepts a subset of what the hooks below let through,
with the same values: it refuses lone surrogates, non-UTF-8 encodings and out-of-range numbers that
``json`` may take).
Token counts are estimates the load accounting can trust to be monotone in request size:
exact for token-id prompts, ``ceil(chars / 4)`` for text. Nothing here recurses with the body's
nesting (the prompt walk reads a fixed few levels); Python's ``json`` does, so bodies nesting
deeper than :data:`MAX_JSON_DEPTH` are refused as bad input.

The body must be strict JSON (RFC 8259): ``NaN``, ``Infinity`` and ``-Infinity``, which Python's
``json`` accepts by default, are refused, and so is a number beyond a 64-bit float (``1e400``, which
would become infinity) or an integer of more than 4,300 digits (Python's conversion limit): engines
would refuse them or read something else, and a re-serialised body would carry them on as invalid
JSON. Duplicate keys are accepted, the last one wins, as in the engines' own (Python) parsers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import msgspec

from ext_proc.models import ModelNameError, check_model_name

MAX_OUTPUT_BUDGET = 2**40
"""The most output tokens one request may reserve, all sequences together: far beyond any model's
context, and small enough that the in-flight token sums (int64 load arrays) cannot overflow."""
MAX_JSON_DEPTH = 128
"""The deepest a request body may nest arrays and objects, in levels (the body itself is level 1): far
beyond any OpenAI request (a tool's JSON schema nests a few dozen levels), and far within what
Python's recursive ``json`` parses and the handoffs re-serialise (about 1,000 levels)."""
_TOO_DEEP = f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
_CONTAINERS = frozenset({dict, list})  # the only container types json.loads makes
_DECODER = msgspec.json.Decoder()
_WALK_BUDGET = 4096  # values a depth walk looks at before the brackets are counted instead


class RequestError(ValueError):
    """The body cannot be routed. ``param`` names the offending field (``None`` for the body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What routing knows about one request.

    ``prompt_tokens`` and ``output_budget`` are in tokens; ``output_budget`` is the most the
    request may generate: per sequence ``max_completion_tokens``, else ``max_tokens``, else the
    default, times the number of sequences (``n``, or ``best_of`` when larger).
    """

    model: str | None
    stream: bool
    prompt_tokens: int
    output_budget: int


def _ceil_quarter(chars: int) -> int:
    return -(-chars // 4)


def _prompt_tokens(prompt: object, field: str) -> int:
    """Tokens of a completions ``prompt`` / embeddings ``input``: str, [str], [int] or [[int]]."""
    if isinstance(prompt, str):
        return _ceil_quarter(len(prompt))
    if not isinstance(prompt, list):
        raise RequestError(f"'{field}' must be a string, a list of strings or a list of token ids", field)
    if not prompt:
        return 0
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise RequestError(f"'{field}' mixes strings with other types", field)
        return _ceil_quarter(sum(map(len, prompt)))
    if isinstance(first, int) and not isinstance(first, bool):
        if not all(type(p) is int for p in prompt):
            raise RequestError(f"'{field}' token ids must all be integers", field)
        return len(prompt)
    if isinstance(first, dict):  # Responses API: input items shaped like chat messages
        return _messages_tokens(prompt, field)
    if isinstance(first, list):
        total = 0
        for row in prompt:
            if not isinstance(row, list) or not all(type(p) is int for p in row):
                raise RequestError(f"'{field}' must be a list of token-id lists", field)
            total += len(row)
        return total
    raise RequestError(f"'{field}' must be a string, a list of strings or a list of token ids", field)


def _content_chars(content: object, field: str) -> int:
    """Characters of one chat message's ``content``: str, null, or a list of parts."""
    if isinstance(content, str):
        return len(content)
    if content is None:
        return 0
    if not isinstance(content, list):
        raise RequestError(f"'{field}' must be a string, null or a list of content parts", field)
    chars = 0
    for part in content:
        if not isinstance(part, dict):
            raise RequestError(f"'{field}' parts must be objects", field)
        text = part.get("text")
        if text is not None:
            if not isinstance(text, str):
                raise RequestError(f"'{field}' part text must be a string", field)
            chars += len(text)
    return chars


def _messages_tokens(messages: object, field: str = "messages") -> int:
    if not isinstance(messages, list):
        raise RequestError(f"'{field}' must be a list of message objects", field)
    chars = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"'{field}[{index}]' must be an object", f"{field}[{index}]")
        chars += _content_chars(message.get("content"), f"{field}[{index}].content")
    return _ceil_quarter(chars)


def _optional_count(body: dict, field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise RequestError(f"'{field}' must be a non-negative integer", field)
    return value


def _sequences(body: dict, field: str) -> int:
    """``n`` / ``best_of``: how many sequences are generated (default 1)."""
    value = body.get(field)
    if value is None:
        return 1
    if type(value) is not int or value < 1:
        raise RequestError(f"'{field}' must be a positive integer", field)
    return value


def _nests_deeper(body: dict[str, object], limit: int, budget: int | None = None) -> bool | None:
    """Whether ``body`` nests arrays and objects more than ``limit`` levels deep (``body`` is level 1).

    Iterative, one level at a time: any depth is measured without recursion, in about 60 ns per value.
    With ``budget``: ``None`` (undecided) once more than ``budget`` values would be looked at.
    """
    level: list[dict[str, object] | list[object]] = [body]
    for _ in range(limit):
        if budget is not None:
            budget -= sum(map(len, level))
            if budget < 0:
                return None
        level = [
            child
            for value in level
            for child in (value.values() if type(value) is dict else value)
            if type(child) in _CONTAINERS
        ]
        if not level:
            return False
    return True


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise ValueError(f"the number {literal[:40]} is beyond the range of a 64-bit float")
    return value


def parse_body(raw: bytes) -> dict[str, object]:
    """The request's strict JSON object (see the module docstring), parsed once.

    Raises :class:`RequestError` when it is not one, or when it nests arrays and objects deeper than
    :data:`MAX_JSON_DEPTH` levels."""
    try:
        body = _DECODER.decode(raw)
    except (msgspec.MsgspecError, RecursionError):  # json decides: see the module docstring
        body = _parse_strictly(raw)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    # A body of few values (a chat request, however long its text) is walked; one of many (token ids)
    # has its bracket bytes counted first: each level opens with one (in any JSON encoding), so a body
    # with few of them is shallow. Either way, linear in the body.
    deep = _nests_deeper(body, MAX_JSON_DEPTH, _WALK_BUDGET)
    if deep is None:
        deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nests_deeper(body, MAX_JSON_DEPTH)
    if deep:
        raise RequestError(_TOO_DEEP)
    return body


def _parse_strictly(raw: bytes) -> object:
    """``raw`` parsed by Python's ``json`` with the strict-JSON hooks; :class:`RequestError` if invalid."""
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the hooks', too many digits
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the interpreter's recursion limit (about 1,000 levels)
        raise RequestError(_TOO_DEEP) from None


def parse_request(raw: bytes, default_max_tokens: int) -> RequestInfo:
    """Parse a JSON request body; raise :class:`RequestError` naming the field that is wrong."""
    return describe(parse_body(raw), default_max_tokens)


def describe(body: dict[str, object], default_max_tokens: int) -> RequestInfo:
    """What routing needs from a parsed body; raise :class:`RequestError` naming the field that is wrong.

    The prompt comes from ``messages`` (chat), else ``prompt`` (completions), else ``input``
    (embeddings/responses); a body with none of them has zero prompt tokens. A ``model``, when given,
    is a name :func:`~ext_proc.models.check_model_name` accepts.
    """
    model = body.get("model")
    if model is not None:
        try:
            check_model_name(model, "'model'")
        except ModelNameError as exc:
            raise RequestError(str(exc), "model") from None
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    if "messages" in body:
        prompt_tokens = _messages_tokens(body["messages"])
    elif "prompt" in body:
        prompt_tokens = _prompt_tokens(body["prompt"], "prompt")
    elif "input" in body:
        prompt_tokens = _prompt_tokens(body["input"], "input")
    else:
        prompt_tokens = 0
    completion_budget = _optional_count(body, "max_completion_tokens")
    max_tokens = _optional_count(body, "max_tokens")
    budget = completion_budget if completion_budget is not None else max_tokens
    n, best_of = _sequences(body, "n"), _sequences(body, "best_of")
    output_budget = (default_max_tokens if budget is None else budget) * max(n, best_of)
    if output_budget > MAX_OUTPUT_BUDGET:
        if budget is not None:
            field = "max_completion_tokens" if completion_budget is not None else "max_tokens"
        else:
            field = "n" if n >= best_of else "best_of"
        raise RequestError(
            f"'{field}' is too large: the request may generate more than the {MAX_OUTPUT_BUDGET} "
            "tokens one request may reserve (max_tokens or max_completion_tokens, times n or best_of)",
            field,
        )
    return RequestInfo(model, stream, prompt_tokens, output_budget)
