"""A request's prompt in the engine's own token ids: the body rendered and encoded as vLLM does.

Redone in the gateway so the prefix index can key blocks by the token ids the engine caches
(``affinity.prefix.source: kv-events``). Rules, as vLLM's OpenAI server:

- ``/v1/chat/completions``: ``messages`` rendered by the model's chat template
  (:mod:`ext_proc.tokenize.template`; ``tool_use`` when tools are given and it has one), then encoded
  with ``add_special_tokens=False`` (the template writes its own BOS).
- ``/v1/completions`` (``prompt``) and ``/v1/embeddings`` (``input``): text encoded with
  ``add_special_tokens=True``; token ids used as given; several prompts concatenated in order, as
  :func:`ext_proc.prefix.blocks.prompt_content` concatenates them.
- A body's own ``add_special_tokens``, ``add_generation_prompt``, ``documents`` and
  ``chat_template_kwargs`` are honoured.
- What cannot be matched exactly raises :class:`~ext_proc.tokenize.base.TokenizeFailure` (the caller
  routes on the ``approximate`` index): non-text parts, a per-request ``chat_template``,
  ``continue_final_message``, a template that raises.

The prefix cache (:class:`~ext_proc.tokenize.cache.PrefixTokenCache`):

- A conversation's next turn extends the previous turn's text, and a shared system prompt is the same
  leading text everywhere: only what follows the longest cached prefix, found at a message's content
  start or end, is encoded.
- Each request stores at most three prefixes: to the end of its first message, to the end of its last,
  and its whole text (a prefix per message would hold a conversation once per turn).
- The rest is encoded in pieces cut at those points. Each join is checked by encoding the
  :data:`SEAM_CHARS` characters on each side together and apart: a join at the cached prefix that
  differs drops the prefix, one further on falls back to encoding the whole text.

Pure apart from the encoder's own state (:class:`~ext_proc.tokenize.base.TextEncoder`, injected): the
clock is an argument (``now``, seconds), no file is read (:mod:`ext_proc.tokenize.folder` loads a
folder, :mod:`ext_proc.tokenize.gateway` runs this off the event loop). Not thread-safe: one thread at
a time per :class:`PromptTokenizer`.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from ext_proc.tokenize.base import TextEncoder, Tokenized, TokenizeFailure, UntokenizedReason, unsupported
from ext_proc.tokenize.cache import PrefixTokenCache
from ext_proc.tokenize.template import ChatTemplate, conversation, tool_schemas

SEAM_CHARS = 64
"""Characters on each side of a join between two separately encoded pieces that are encoded again."""
_PROBE_CHARS = 32
"""The leading characters of a message's content searched for before the whole content is compared."""
_PROBE = "probe"
"""Text tokenized once to learn the special tokens the tokenizer's post-processor adds around a prompt."""


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
            unsupported(f"no tokenization for the path {endpoint!r}")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            unsupported("'add_special_tokens' is not a boolean")
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
        unsupported("the prompt is neither text, a list of texts nor token ids")

    def _chat(self, body: Mapping[str, object], now: float) -> Tokenized:
        if body.get("chat_template") is not None or body.get("continue_final_message"):
            unsupported("a per-request chat_template or continue_final_message")
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
            unsupported("'add_special_tokens' is not a boolean")
        return self._encode(text, starts + ends, stores, add_special, now)

    def _variables(
        self, body: Mapping[str, object], messages: list[dict[str, object]], tools: object
    ) -> dict[str, object]:
        """What the template is rendered with: vLLM's ``chat_template_kwargs``, then the request's own."""
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict) or {"chat_template", "tokenize"} & extra.keys():
            unsupported("'chat_template_kwargs' is not an object vLLM accepts")
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            unsupported("'add_generation_prompt' is not a boolean")
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
