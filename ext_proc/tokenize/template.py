"""A chat rendered as vLLM renders it: the model's chat template and vLLM's message normalisation.

- ``messages`` are normalised as vLLM's ``parse_chat_messages`` does: text parts joined with newlines,
  or kept as ``{"type": "text"}`` parts when the template loops over a message's content; assistant
  ``tool_calls`` arguments parsed from JSON; ``tools`` as vLLM's request model dumps them.
- The template renders as transformers' ``apply_chat_template``: sandboxed jinja2, ``trim_blocks``,
  ``lstrip_blocks``, ``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now``.
- What vLLM would render otherwise (images and other non-text parts) raises
  :class:`~ext_proc.tokenize.base.TokenizeFailure`.

Pure (``strftime_now`` reads the clock, as transformers' does).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Literal, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ext_proc.tokenize.base import TokenizeFailure, UntokenizedReason, unsupported

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""vLLM's text-like content part types and the field that holds each one's text."""

ContentFormat = Literal["string", "openai"]
"""How a template reads a message's content (vLLM's ``--chat-template-content-format auto``): as one
string, or as a list of ``{"type": "text", "text": ...}`` parts."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}…{% endgeneration %}`` (it marks assistant text): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


_ENVIRONMENT = _environment()


class ChatTemplate:
    """A compiled chat template and how it reads message content.

    Raises :class:`jinja2.TemplateSyntaxError` when ``source`` does not parse."""

    def __init__(self, source: str) -> None:
        self._template = _ENVIRONMENT.from_string(source)
        self.content_format = _content_format(_ENVIRONMENT.parse(source))

    def render(self, variables: Mapping[str, object]) -> str:
        """The template rendered with ``variables`` (``messages``, ``add_generation_prompt``, …)."""
        return self._template.render(**variables)


def _is_loop_over(node: jinja2.nodes.Node, names: Iterable[str]) -> bool:
    """Whether ``node`` is one of ``names``, or a slice or filter of one (``messages[1:]``)."""
    while isinstance(node, jinja2.nodes.Getitem | jinja2.nodes.Filter):
        if isinstance(node, jinja2.nodes.Getitem) and not isinstance(node.arg, jinja2.nodes.Slice):
            return False
        node = node.node
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _is_content_of(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """Whether ``node`` is ``message['content']`` or ``message.content`` for a message loop variable."""
    while isinstance(node, jinja2.nodes.Filter):
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        key, of = node.arg, node.node
        is_content = isinstance(key, jinja2.nodes.Const) and key.value == "content"
    elif isinstance(node, jinja2.nodes.Getattr):
        is_content, of = node.attr == "content", node.node
    else:
        return False
    return is_content and isinstance(of, jinja2.nodes.Name) and of.name in names


def _content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """``openai`` when the template loops over a message's content, else ``string`` (as vLLM detects)."""
    loops = list(ast.find_all(jinja2.nodes.For))
    messages = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name) and _is_loop_over(loop.iter, ("messages",))
    }
    return "openai" if any(_is_content_of(loop.iter, messages) for loop in loops) else "string"


def _content_texts(content: object) -> list[str]:
    """The texts of one message's ``content`` (a string, null or a list of parts), as vLLM reads them."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        unsupported("a message's content is neither a string, null nor a list of parts")
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        field = _TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
        if field is None:
            unsupported("a message has a content part that is not text (an image, audio, ...)")
        text = part.get(field)
        if isinstance(text, str):
            texts.append(text)
        elif text is not None:
            unsupported(f"a content part's {field!r} is not a string")
    return texts


def _tool_calls(calls: object) -> list[object]:
    """Assistant ``tool_calls``, ``arguments`` parsed from JSON (vLLM's ``_postprocess_messages``)."""
    if not isinstance(calls, list):
        unsupported("'tool_calls' is not a list")
    parsed: list[object] = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            unsupported("a tool call has no 'function' object")
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif not isinstance(arguments, dict | list):
            try:
                arguments = json.loads(arguments)
            except (TypeError, ValueError):
                unsupported("a tool call's arguments are not JSON")
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


def tool_schemas(tools: object) -> list[dict[str, object]] | None:
    """``tools`` as vLLM hands them to the chat template: each as its request model dumps it.

    ``{"type", "function": {"name", "description", "parameters", …}}``, the function's declared fields
    first (``null`` when absent), then its other keys in order. ``None`` without tools; raises
    :class:`TokenizeFailure` for a tool that is not a function with a name."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        unsupported("'tools' is not a list")
    schemas: list[dict[str, object]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            unsupported("a tool is not a function with a name")
        declared = {key: function.get(key) for key in ("name", "description", "parameters")}
        schemas.append({"type": tool.get("type", "function"), "function": {**declared, **function}})
    return schemas


def conversation(messages: object, content_format: ContentFormat) -> list[dict[str, object]]:
    """``messages`` as vLLM hands them to the chat template.

    Each message keeps its ``role``, its content (text parts joined with ``"\\n"`` in the ``string``
    format; a list of text parts in the ``openai`` format), ``name``, an assistant's ``tool_calls``
    (arguments parsed) and ``reasoning`` (also as ``reasoning_content``), a tool message's
    ``tool_call_id``. Raises :class:`TokenizeFailure` for what vLLM would render otherwise or refuse."""
    if not isinstance(messages, list) or not messages:
        raise TokenizeFailure(UntokenizedReason.NO_PROMPT, "'messages' is not a non-empty list")
    rendered: list[dict[str, object]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            unsupported("a message is not an object with a string 'role'")
        role = message["role"]
        texts = _content_texts(message.get("content"))
        content: object = (
            [{"type": "text", "text": t} for t in texts] if content_format == "openai" else "\n".join(texts)
        )
        item: dict[str, object] = {"role": role, "content": content}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                item["tool_calls"] = _tool_calls(message["tool_calls"])
            reasoning = message.get("reasoning") or message.get("reasoning_content")
            if reasoning is not None:
                item["reasoning"] = item["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        rendered.append(item)
    return rendered
