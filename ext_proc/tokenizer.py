"""The gateway's tokenizer: a model's tokenizer folder, run off the event loop, its failures counted.

:func:`load_prompt_tokenizer` reads a folder as transformers saves a tokenizer (``tokenizer.json``;
``tokenizer_config.json`` with the chat template and the special tokens; ``chat_template.jinja``, which
newer transformers write instead and which wins) into the pure
:class:`~ext_proc.prefix.tokens.PromptTokenizer`. :class:`GatewayTokenizer` is what the router awaits:
:meth:`GatewayTokenizer.prompt_tokens` runs the tokenizer on a thread of its own (the ``tokenizers``
library's ``encode_batch``, which the pure module calls, releases the GIL while it encodes; its
``encode`` does not), so the event loop keeps serving, and answers ``None``
instead of raising: a folder that is missing or unreadable, a template that fails, a body it cannot
render are logged and counted, and the caller routes that request on the ``approximate`` index.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import jinja2
from tokenizers import Tokenizer

from ext_proc.prefix.tokens import (
    ChatTemplate,
    PrefixTokenCache,
    PromptTokenizer,
    Tokenized,
    TokenizeFailure,
    UntokenizedReason,
)

log = logging.getLogger(__name__)

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers hands a chat template (its ``special_tokens_map``)."""


@dataclass(frozen=True, slots=True)
class TokenizerSettings:
    """The gateway tokenizer's settings.

    ``folder``: the model's tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``); the prefix
    cache holds at most ``cache_entries`` rendered-text prefixes and ``cache_tokens`` token ids in all
    (4 bytes each: 16 MB by default), an entry unused for ``cache_ttl_s`` seconds is dropped."""

    folder: str
    cache_entries: int = 1024
    cache_tokens: int = 4_000_000
    cache_ttl_s: float = 60.0


class TokenizerLoadError(Exception):
    """A tokenizer folder that cannot be used: missing, unreadable, or not a tokenizer."""


def _special_tokens(config: Mapping[str, object]) -> dict[str, object]:
    """The template's special-token variables from ``tokenizer_config.json``.

    Each is a string there, or an ``AddedToken`` object with its ``content``."""
    tokens: dict[str, object] = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str):
            tokens[name] = content
    additional = config.get("additional_special_tokens")
    if isinstance(additional, list):
        tokens["additional_special_tokens"] = [
            t.get("content") if isinstance(t, dict) else t for t in additional
        ]
    return tokens


def _template_sources(folder: Path, config: Mapping[str, object]) -> dict[str, str]:
    """The folder's chat templates by name (``default``, maybe ``tool_use``), as transformers finds them."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    templates = config.get("chat_template")
    if isinstance(templates, str):
        return {"default": templates}
    if isinstance(templates, list):
        return {
            t["name"]: t["template"]
            for t in templates
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        }
    return {}


def load_prompt_tokenizer(settings: TokenizerSettings) -> PromptTokenizer:
    """The folder's tokenizer and chat template, with an empty prefix cache sized by ``settings``.

    Raises :class:`TokenizerLoadError` naming the file and what is wrong with it. A folder without a
    chat template loads (chats are then not tokenized)."""
    folder = Path(settings.folder)
    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # OSError, or the Rust side's Exception for a file that is not a tokenizer
        raise TokenizerLoadError(f"{folder / 'tokenizer.json'}: {exc}") from exc
    config_file = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        sources = _template_sources(folder, config if isinstance(config, dict) else {})
        templates = {name: ChatTemplate(source) for name, source in sources.items()}
    except (OSError, ValueError, jinja2.TemplateError) as exc:  # ValueError: JSON and Unicode errors
        raise TokenizerLoadError(f"{folder}: {exc}") from exc
    return PromptTokenizer(
        tokenizer,
        templates.get("default"),
        templates.get("tool_use"),
        _special_tokens(config if isinstance(config, dict) else {}),
        PrefixTokenCache(settings.cache_entries, settings.cache_tokens, settings.cache_ttl_s),
    )


class TokenizeSink(Protocol):
    """Where the gateway tokenizer reports (:class:`ext_proc.metrics.Metrics` is one)."""

    def tokenized(self, seconds: float, tokens: int, cached: int) -> None: ...
    def untokenized(self, reason: str) -> None: ...


class GatewayTokenizer:
    """Tokenizes requests' prompts off the event loop; ``None`` (counted, logged) where it cannot.

    ``tokenizer`` is ``None`` when the folder did not load (every prompt is then ``None``, counted as
    ``no_tokenizer``). One worker thread: requests are tokenized one at a time, in arrival order, and the
    prefix cache is touched by that thread alone. ``clock`` gives the cache's time (seconds)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer | None,
        sink: TokenizeSink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self._sink = sink
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._warned: set[UntokenizedReason] = set()

    @classmethod
    def open(cls, settings: TokenizerSettings, sink: TokenizeSink) -> GatewayTokenizer:
        """A gateway tokenizer for ``settings.folder``; one that answers ``None`` when it does not load."""
        try:
            tokenizer = load_prompt_tokenizer(settings)
        except TokenizerLoadError as exc:
            log.error("tokenizer folder unusable, prompts are routed on the approximate index: %s", exc)
            tokenizer = None
        return cls(tokenizer, sink)

    async def prompt_tokens(self, body: Mapping[str, object], path: str) -> list[int] | None:
        """The engine's token ids for ``body`` sent to ``path``; ``None`` when they cannot be known.

        ``body`` must not change until this returns (the worker thread reads it)."""
        if self.tokenizer is None:
            self._failed(UntokenizedReason.NO_TOKENIZER, "no tokenizer loaded")
            return None
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor, self._tokens, self.tokenizer, body, path)
        except TokenizeFailure as failure:
            self._failed(failure.reason, str(failure))
            return None
        self._sink.tokenized(time.perf_counter() - started, len(result.ids), result.cached)
        return result.ids

    def _tokens(self, tokenizer: PromptTokenizer, body: Mapping[str, object], path: str) -> Tokenized:
        return tokenizer.tokens(body, path, self._clock())

    def _failed(self, reason: UntokenizedReason, message: str) -> None:
        self._sink.untokenized(reason.value)
        if reason in self._warned:
            log.debug("prompt not tokenized (%s): %s", reason.value, message)
        else:
            self._warned.add(reason)
            log.warning("prompt not tokenized (%s, logged once; counted after): %s", reason.value, message)

    def close(self) -> None:
        """Stop the worker thread (after the prompt it is tokenizing, if any)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
