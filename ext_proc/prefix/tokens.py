"""A request's prompt in the engine's own token ids: the chat template, the tokenizer, a prefix cache.

What vLLM's OpenAI server does before it schedules a request, redone in the gateway so the prefix index
can key blocks by the token ids the engine caches (``affinity.prefix.source: kv-events``):

- ``/v1/chat/completions``: ``messages`` normalised as vLLM's ``parse_chat_messages`` does (text parts
  joined with newlines, or kept as ``{"type": "text"}`` parts when the template loops over a message's
  content; assistant ``tool_calls`` arguments parsed from JSON; ``tools`` as vLLM's request model dumps
  them), rendered by the model's chat template (``tool_use`` when tools are given and it has one) as
  transformers' ``apply_chat_template`` renders (sandboxed jinja2, ``trim_blocks``, ``lstrip_blocks``,
  ``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now``, the special tokens of
  ``tokenizer_config.json``, ``add_generation_prompt`` true unless the body says otherwise), then
  tokenized with ``add_special_tokens=False`` (vLLM's chat default: the template writes its own BOS).
- ``/v1/completions`` (``prompt``) and ``/v1/embeddings`` (``input``): text tokenized with
  ``add_special_tokens=True`` (vLLM's completions default); token ids are used as given. Several prompts
  are concatenated in order, as :func:`ext_proc.prefix.blocks.prompt_content` concatenates them.
- A body's own ``add_special_tokens``, ``add_generation_prompt``, ``documents`` and
  ``chat_template_kwargs`` are honoured, as vLLM honours them.

What cannot be matched exactly raises :class:`TokenizeFailure` with an :class:`UntokenizedReason`
(the caller routes such a request on the ``approximate`` index): images and other non-text parts, a
per-request ``chat_template``, ``continue_final_message``, a template that raises or fails to render.

**The prefix cache.** A conversation's next turn renders to a text that extends the previous turn's
(the messages so far, then the new ones), and a shared system prompt renders to the same leading text
in every conversation. :class:`PromptTokenizer` keeps the token ids of recent rendered texts up to a
message boundary (:class:`PrefixTokenCache`: bounded in entries and tokens, each entry kept ``ttl_s``
after its last use; looked up by the prefix's length and its last :data:`KEY_CHARS` characters, a hit
then compared whole with the text, a memory compare), and tokenizes only what follows the longest
cached prefix found at any message's content start or end. Each request adds at most three prefixes:
to the end of its first message (a shared system prompt), to the end of its last, and its whole text
(which the conversation's next turn extends); a prefix per message would hold a conversation's tokens
once per turn. The text after the cached prefix is encoded in pieces cut at those three points, so each
stored prefix's ids are known without token offsets. Joining two separately encoded pieces is exact only
where the cut is a token boundary in the whole text; it is checked at every join by encoding the
:data:`SEAM_CHARS` characters on each side of the cut together and apart and comparing; a join at the
cached prefix that differs drops the prefix, one further on falls back to encoding the whole text.
Cuts sit at the end of a message's content, where templates write an end-of-turn special token, which
the tokenizer always splits at.

The encoder is injected (:class:`TextEncoder`: text to ids, nothing else), so the shell can give the
model's own ``tokenizers`` tokenizer or a faster equivalent it has checked against it.

Pure apart from the encoder's own state: the clock is an argument (``now``, seconds), and no file
is read (:mod:`ext_proc.tokenizer` loads a tokenizer folder and runs this off the event loop). Not
thread-safe: one thread at a time per :class:`PromptTokenizer`.
"""

from __future__ import annotations

import enum
import json
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, NamedTuple, NoReturn, Protocol
from urllib.parse import urlsplit

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SEAM_CHARS = 64
"""Characters on each side of a join between two separately encoded pieces that are encoded again."""
KEY_CHARS = 64
"""The last characters of a prefix that, with its length, look it up in the :class:`PrefixTokenCache`."""
_PROBE_CHARS = 32
"""The leading characters of a message's content searched for before the whole content is compared."""
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""vLLM's text-like content part types and the field that holds each one's text."""
_PROBE = "probe"
"""Text tokenized once to learn the special tokens the tokenizer's post-processor adds around a prompt."""

ContentFormat = Literal["string", "openai"]
"""How a template reads a message's content (vLLM's ``--chat-template-content-format auto``): as one
string, or as a list of ``{"type": "text", "text": ...}`` parts."""


class UntokenizedReason(enum.StrEnum):
    """Why a request's prompt is not in the engine's tokens (a metric label)."""

    NO_TOKENIZER = "no_tokenizer"
    """No tokenizer: the folder is missing, unreadable or not a tokenizer."""
    NO_PROMPT = "no_prompt"
    """The body has no prompt for its path."""
    UNSUPPORTED = "unsupported"
    """The path, or a part of the body, that the gateway cannot render as the engine would."""
    TEMPLATE = "template"
    """No chat template, or it raised while rendering."""
    TOKENIZER = "tokenizer"
    """The tokenizer raised."""


class TokenizeFailure(Exception):
    """A prompt the gateway cannot put in the engine's tokens; ``reason`` says why, the message what."""

    def __init__(self, reason: UntokenizedReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TextEncoder(Protocol):
    """A tokenizer's text-to-ids step: what :class:`PromptTokenizer` needs of a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool) -> Sequence[int]:
        """``text``'s token ids (a list, or an unsigned 32-bit array); with the post-processor's special
        tokens (e.g. BOS) when asked.

        May raise any exception for a text it cannot encode (e.g. a lone surrogate)."""
        ...


class Tokenized(NamedTuple):
    """A prompt's token ids, ``cached`` of them (the leading ones) taken from the prefix cache.

    ``ids`` are an unsigned 32-bit ``array.array`` (no Python int is made for them: the chain of blocks,
    :func:`ext_proc.prefix.blocks.block_hashes`, reads them in place), or, for a prompt given as token
    ids, a list of the body's ids."""

    ids: array[int] | list[int]
    cached: int


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


def _unsupported(message: str) -> NoReturn:
    raise TokenizeFailure(UntokenizedReason.UNSUPPORTED, message)


def _content_texts(content: object) -> list[str]:
    """The texts of one message's ``content`` (a string, null or a list of parts), as vLLM reads them."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        _unsupported("a message's content is neither a string, null nor a list of parts")
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        field = _TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
        if field is None:
            _unsupported("a message has a content part that is not text (an image, audio, ...)")
        text = part.get(field)
        if isinstance(text, str):
            texts.append(text)
        elif text is not None:
            _unsupported(f"a content part's {field!r} is not a string")
    return texts


def _tool_calls(calls: object) -> list[object]:
    """Assistant ``tool_calls``, ``arguments`` parsed from JSON (vLLM's ``_postprocess_messages``)."""
    if not isinstance(calls, list):
        _unsupported("'tool_calls' is not a list")
    parsed: list[object] = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            _unsupported("a tool call has no 'function' object")
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif not isinstance(arguments, dict | list):
            try:
                arguments = json.loads(arguments)
            except (TypeError, ValueError):
                _unsupported("a tool call's arguments are not JSON")
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
        _unsupported("'tools' is not a list")
    schemas: list[dict[str, object]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            _unsupported("a tool is not a function with a name")
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
            _unsupported("a message is not an object with a string 'role'")
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


@dataclass(slots=True)
class _Prefix:
    """A rendered text up to a boundary, its token ids, and when the entry is dropped unless used again.

    ``ids`` are unsigned 32-bit (4 bytes a token id, a tenth of a Python list's); ``expires`` in seconds."""

    text: str
    ids: array[int]
    expires: float


class PrefixTokenCache:
    """Recent rendered-text prefixes and their token ids, least recently used first.

    At most ``max_entries`` entries and ``max_tokens`` token ids in all (4 bytes each, and the prefix's
    text: about as much again for English text); an entry unused for ``ttl_s`` seconds is dropped. An
    entry is found by its text's length and last :data:`KEY_CHARS` characters, and answers only when
    its whole text is the one asked for."""

    def __init__(self, max_entries: int, max_tokens: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[int, str], _Prefix] = OrderedDict()
        self.tokens = 0
        """Token ids held, all entries together."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str, end: int, now: float) -> array[int] | None:
        """The ids of ``text[:end]`` (made most recent, kept ``ttl_s`` more); ``None`` when not held.

        The caller leaves them unchanged. O(``end``) at most (one compare), O(:data:`KEY_CHARS`) on a miss."""
        key = _key(text, end)
        entry = self._entries.get(key)
        if entry is None or not text.startswith(entry.text):
            return None
        if entry.expires <= now:
            self._drop(key)
            return None
        entry.expires = now + self.ttl_s
        self._entries.move_to_end(key)
        return entry.ids

    def put(self, text: str, end: int, ids: array[int], now: float) -> None:
        """Hold ``ids`` (kept, not copied: the caller leaves it unchanged) as those of ``text[:end]``,
        replacing what was held for a text of that length and ending, then evict to the bounds."""
        key = _key(text, end)
        if key in self._entries:
            self._drop(key)
        if len(ids) > self.max_tokens or self.max_entries < 1:
            return
        self._entries[key] = _Prefix(text[:end], ids, now + self.ttl_s)
        self.tokens += len(ids)
        while self._entries and (
            len(self._entries) > self.max_entries
            or self.tokens > self.max_tokens
            or next(iter(self._entries.values())).expires <= now
        ):
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, str]) -> None:
        self.tokens -= len(self._entries.pop(key).ids)


def _key(text: str, end: int) -> tuple[int, str]:
    """The cache key of ``text[:end]``: its length and its last :data:`KEY_CHARS` characters."""
    return end, text[max(0, end - KEY_CHARS) : end]


def _find_part(text: str, part: str, position: int) -> int:
    """``text.find(part, position)``, found faster for a long ``part``: its first :data:`_PROBE_CHARS`
    characters searched for, then the whole compared where they occur."""
    probe = part[:_PROBE_CHARS]
    at = text.find(probe, position)
    while at >= 0 and not text.startswith(part, at):
        at = text.find(probe, at + 1)
    return at


def _find(text: str, parts: list[str], position: int) -> tuple[int, int] | None:
    """Where ``parts`` occur one after another in ``text`` from ``position`` (empty parts skipped).

    From the start of the first to the end of the last; ``None`` when one is missing or all are empty."""
    span: tuple[int, int] | None = None
    for part in filter(None, parts):
        at = _find_part(text, part, position)
        if at < 0:
            return None
        position = at + len(part)
        span = (span[0] if span else at, position)
    return span


def _message_spans(text: str, messages: list[dict[str, object]]) -> tuple[list[int], list[int]]:
    """Where each message's content starts and ends in the rendered ``text`` (those found, in order).

    Content is looked for as rendered: a string whole (or stripped, as templates often trim it), a list
    of text parts one after another."""
    starts: list[int] = []
    ends: list[int] = []
    position = 0
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            span = _find(text, [content], position) or _find(text, [content.strip()], position)
        else:
            span = _find(text, [part["text"] for part in content], position)  # type: ignore[attr-defined]
        if span is not None:
            starts.append(span[0])
            ends.append(span[1])
            position = span[1]
    return starts, ends


class PromptTokenizer:
    """A model's encoder and chat template, with a cache of recent prefixes (see the module docstring).

    ``template`` renders chats (``None``: the folder has none, chats are not tokenized); ``tool_template``
    renders chats with ``tools`` when the folder names one (``tool_use``); ``special_tokens`` are the
    template's ``bos_token``, ``eos_token``, … strings."""

    def __init__(
        self,
        encoder: TextEncoder,
        template: ChatTemplate | None,
        tool_template: ChatTemplate | None,
        special_tokens: Mapping[str, str],
        cache: PrefixTokenCache,
    ) -> None:
        self._encoder = encoder
        self._template = template
        self._tool_template = tool_template
        self._special_tokens = dict(special_tokens)
        self.cache = cache
        self._added = added_specials(encoder)

    def tokens(self, body: Mapping[str, object], path: str, now: float) -> Tokenized:
        """The token ids the engine would compute for ``body`` sent to ``path`` (``now`` in seconds).

        Raises :class:`TokenizeFailure`."""
        endpoint = urlsplit(path).path
        if endpoint.endswith("/chat/completions"):
            return self._chat(body, now)
        if endpoint.endswith("/completions"):
            field = "prompt"
        elif endpoint.endswith("/embeddings") and "messages" not in body:
            field = "input"
        else:
            _unsupported(f"no tokenization for the path {endpoint!r}")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            _unsupported("'add_special_tokens' is not a boolean")
        return self._prompt(body.get(field), add_special, now)

    def _prompt(self, prompt: object, add_special: bool, now: float) -> Tokenized:
        if isinstance(prompt, str):
            return self._encode(prompt, [], [len(prompt)], add_special, now)
        if not isinstance(prompt, list) or not prompt:
            raise TokenizeFailure(UntokenizedReason.NO_PROMPT, "no prompt in the body")
        if all(type(p) is int for p in prompt):
            return Tokenized(list(prompt), 0)  # type: ignore[arg-type]
        if all(isinstance(row, list) and all(type(t) is int for t in row) for row in prompt):
            return Tokenized([t for row in prompt for t in row], 0)  # type: ignore[attr-defined]
        if all(isinstance(p, str) for p in prompt):
            parts = [self._encode(p, [], [len(p)], add_special, now) for p in prompt]  # type: ignore[arg-type]
            ids = array("I")
            for part in parts:
                ids.extend(part.ids)
            return Tokenized(ids, parts[0].cached)
        _unsupported("the prompt is neither text, a list of texts nor token ids")

    def _chat(self, body: Mapping[str, object], now: float) -> Tokenized:
        if body.get("chat_template") is not None or body.get("continue_final_message"):
            _unsupported("a per-request chat_template or continue_final_message")
        tools = body.get("tools")
        template = self._tool_template if tools and self._tool_template is not None else self._template
        if template is None:
            raise TokenizeFailure(UntokenizedReason.TEMPLATE, "the tokenizer folder has no chat template")
        messages = conversation(body.get("messages"), template.content_format)
        variables = self._variables(body, messages, tools)
        try:
            text = template.render(variables)
        except Exception as exc:  # a template may raise anything: raise_exception, TypeError, SecurityError
            raise TokenizeFailure(UntokenizedReason.TEMPLATE, f"the chat template failed: {exc}") from exc
        starts, ends = _message_spans(text, messages)
        stores = sorted({ends[0], ends[-1], len(text)} if ends else {len(text)})
        add_special = body.get("add_special_tokens", False)
        if not isinstance(add_special, bool):
            _unsupported("'add_special_tokens' is not a boolean")
        return self._encode(text, starts + ends, stores, add_special, now)

    def _variables(
        self, body: Mapping[str, object], messages: list[dict[str, object]], tools: object
    ) -> dict[str, object]:
        """What the template is rendered with: vLLM's ``chat_template_kwargs``, then the request's own."""
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict) or {"chat_template", "tokenize"} & extra.keys():
            _unsupported("'chat_template_kwargs' is not an object vLLM accepts")
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            _unsupported("'add_generation_prompt' is not a boolean")
        return {
            **self._special_tokens,
            **extra,
            "messages": messages,
            "tools": tool_schemas(tools),
            "documents": body.get("documents"),
            "add_generation_prompt": add_generation_prompt,
        }

    def _encode(
        self, text: str, lookups: list[int], stores: list[int], add_special: bool, now: float
    ) -> Tokenized:
        """``text``'s ids: the longest cached prefix whose join agrees, then the rest encoded in pieces.

        Prefixes are looked up at ``lookups`` and ``stores`` (character offsets); the rest is cut at the
        ``stores`` past the prefix, and the ids up to each of them are cached for later texts."""
        if add_special and self._added is None:
            return Tokenized(array("I", self._encode_piece(text, True)), 0)
        positions = sorted({p for p in (*lookups, *stores) if 0 < p <= len(text)})
        base, known = 0, array("I")  # the ids of text[:base], as the cache holds them
        for position in reversed(positions):
            prefix = self.cache.get(text, position, now)
            if prefix is not None:
                if self._seam_agrees(text, position):
                    base, known = position, prefix[:]  # copied: extended below
                break
        cached, start = len(known), base
        for end in sorted({s for s in stores if base < s < len(text)} | {len(text)}):
            if start > base and not self._seam_agrees(text, start):
                known, cached = array("I", self._encode_piece(text, False)), 0
                break
            known.extend(self._encode_piece(text[start:end], False))
            if end in stores:
                self.cache.put(text, end, known[:], now)  # a copy: extended after
            start = end
        if add_special and self._added is not None:
            head, tail = self._added
            known = array("I", head) + known
            known.extend(tail)
        return Tokenized(known, cached)

    def _encode_piece(self, text: str, add_special: bool) -> Sequence[int]:
        try:
            return self._encoder.encode(text, add_special)
        except Exception as exc:  # an encoder may raise anything (the Rust side's plain Exception)
            raise TokenizeFailure(UntokenizedReason.TOKENIZER, f"the tokenizer failed: {exc}") from exc

    def _seam_agrees(self, text: str, position: int) -> bool:
        """Whether ``text`` encodes across ``position`` as its two sides do apart.

        Tested on the :data:`SEAM_CHARS` characters on each side of ``position``."""
        left = text[max(0, position - SEAM_CHARS) : position]
        right = text[position : position + SEAM_CHARS]
        encode = self._encode_piece
        return encode(left + right, False) == encode(left, False) + encode(right, False)


def added_specials(encoder: TextEncoder) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor adds before and after a prompt (e.g. ``[BOS]``, ``[]``).

    ``None`` when they are not a plain head and tail around the prompt's own ids."""
    plain = encoder.encode(_PROBE, False)
    full = encoder.encode(_PROBE, True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain) :])
    return None
