"""A model's tokenizer folder loaded into the prompt tokenizer, with the fastest encoder that agrees.

- :func:`load_prompt_tokenizer` reads a folder as transformers saves a tokenizer: ``tokenizer.json``;
  ``tokenizer_config.json`` with the chat template and the special tokens; ``chat_template.jinja``
  (newer transformers write it instead; it wins).
- It builds the pure :class:`~ext_proc.tokenize.prompt.PromptTokenizer` with one of three encoders
  (:data:`ENCODERS`): the first fast one (:data:`FAST_ENCODERS`:
  :mod:`~ext_proc.tokenize.fastokens_encoder`, then :mod:`~ext_proc.tokenize.tiktoken_encoder`) that
  gives the ``tokenizers`` library's ids on the check corpus (:mod:`ext_proc.tokenize.check`), else
  ``tokenizers`` itself. Every encoder releases the GIL while it encodes.
- Errors raise :class:`TokenizerLoadError` naming the file; :func:`load_folder` returns it instead
  (for a worker thread), :func:`check_folder` is ``pd-extproc check-config``'s check.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jinja2
from tokenizers import Tokenizer

from ext_proc.tokenize.base import TextEncoder
from ext_proc.tokenize.cache import PrefixTokenCache
from ext_proc.tokenize.check import NotRepresentable
from ext_proc.tokenize.fastokens_encoder import fastokens_encoder
from ext_proc.tokenize.prompt import PromptTokenizer
from ext_proc.tokenize.template import ChatTemplate
from ext_proc.tokenize.tiktoken_encoder import tiktoken_encoder

FastEncoderName = Literal["fastokens", "tiktoken"]
EncoderName = Literal["fastokens", "tiktoken", "tokenizers"]
FAST_ENCODERS: tuple[FastEncoderName, ...] = ("fastokens", "tiktoken")
"""The fast encoders, in the order they are tried (each checked equal to ``tokenizers``)."""
ENCODERS: tuple[EncoderName, ...] = (*FAST_ENCODERS, "tokenizers")
"""The encoders a folder may load with (a metric label): the first fast one checked equal, else
``tokenizers``."""
_SAMPLE_CHAT = (
    {"role": "system", "content": "You are a helpful assistant.\n\nAnswer briefly."},
    {"role": "user", "content": "What is 12 345 + 6 789? Explain   step by step:\n1. add\n2. carry"},
    {"role": "assistant", "content": " The sum is 19134.\n\n```python\nprint(12345 + 6789)\n```"},
    {"role": "user", "content": "Merci ! Et en 日本語? 🤖\t(tabs)  \n"},
)
"""A conversation rendered by each chat template into the encoder check corpus."""
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers hands a chat template (its ``special_tokens_map``)."""


@dataclass(frozen=True, slots=True)
class TokenizerSettings:
    """The gateway tokenizer's settings.

    ``folder``: the model's tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``); the prefix
    cache holds at most ``cache_entries`` rendered-text prefixes and ``cache_tokens`` token ids in all
    (4 bytes each: 16 MB by default, and the prefixes' text, about as much again for English text), an
    entry unused for ``cache_ttl_s`` seconds is dropped;
    ``fast_encoders``: the fast encoders tried (and checked), in order, before the ``tokenizers``
    encoder."""

    folder: str
    cache_entries: int = 1024
    cache_tokens: int = 4_000_000
    cache_ttl_s: float = 60.0
    fast_encoders: tuple[FastEncoderName, ...] = FAST_ENCODERS


class TokenizerLoadError(Exception):
    """A tokenizer folder that cannot be used: missing, unreadable, or not a tokenizer."""


class TokenizersEncoder:
    """The ``tokenizers`` library's tokenizer as a :class:`~ext_proc.tokenize.base.TextEncoder`.

    Without truncation or padding; ``encode_batch_fast`` (no offsets) releases the GIL while it encodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids, with the post-processor's special tokens when ``add_special_tokens``."""
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


@dataclass(frozen=True, slots=True)
class LoadedTokenizer:
    """A folder's :class:`~ext_proc.tokenize.prompt.PromptTokenizer` and which encoder it runs, and why."""

    tokenizer: PromptTokenizer
    encoder: EncoderName
    why: str


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


def _fast_encoder(
    settings: TokenizerSettings,
    spec_text: str,
    spec: object,
    reference: TextEncoder,
    templates: Mapping[str, ChatTemplate],
    specials: Mapping[str, object],
) -> tuple[TextEncoder, EncoderName, str]:
    """The first of ``settings.fast_encoders`` that gives ``reference``'s ids on the check corpus, else
    ``reference``; and why."""
    if not settings.fast_encoders:
        return reference, "tokenizers", "no fast encoder tried"
    if not isinstance(spec, dict):
        return reference, "tokenizers", "tokenizer.json is not an object"
    rendered: list[str] = []
    for template in templates.values():
        try:
            rendered.append(
                template.render({**specials, "messages": list(_SAMPLE_CHAT), "add_generation_prompt": True})
            )
        except Exception:  # a template may raise anything; it is checked again on real requests
            continue
    refused: list[str] = []
    for name in settings.fast_encoders:
        try:
            fast = (
                fastokens_encoder(spec_text, spec, reference, rendered)
                if name == "fastokens"
                else tiktoken_encoder(spec, reference, rendered)
            )
        except NotRepresentable as exc:
            refused.append(f"{name}: {exc}")
            continue
        except Exception as exc:  # either library failing on the check corpus: the next encoder
            refused.append(f"{name}: the check failed: {exc!r}")
            continue
        return fast, name, "its ids equal the tokenizer's on the check corpus"
    return reference, "tokenizers", "; ".join(refused)


def load_prompt_tokenizer(settings: TokenizerSettings) -> LoadedTokenizer:
    """The folder's tokenizer and chat template, with an empty prefix cache sized by ``settings``.

    The encoder is the first fast one that stands in exactly for the folder's tokenizer (see the module
    docstring), else ``tokenizers``. Raises :class:`TokenizerLoadError` naming the file and what is
    wrong with it. A folder without a chat template loads (chats are then not tokenized)."""
    folder = Path(settings.folder)
    spec_file = folder / "tokenizer.json"
    if not folder.is_dir():
        raise TokenizerLoadError(
            f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder"
        )
    if not spec_file.exists():
        raise TokenizerLoadError(
            f"{folder}: no tokenizer.json in it (a model's tokenizer as transformers saves it)"
        )
    try:
        spec_text = spec_file.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise TokenizerLoadError(f"{spec_file}: cannot read: {exc}") from exc
    try:
        tokenizer = Tokenizer.from_str(spec_text)
        spec = json.loads(spec_text)
    except Exception as exc:  # ValueError, or the Rust side's Exception for a file that is not a tokenizer
        raise TokenizerLoadError(f"{spec_file}: not a tokenizer: {exc}") from exc
    config_file = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        sources = _template_sources(folder, config if isinstance(config, dict) else {})
        templates = {name: ChatTemplate(source) for name, source in sources.items()}
    except (OSError, ValueError, jinja2.TemplateError) as exc:  # ValueError: JSON and Unicode errors
        raise TokenizerLoadError(f"{folder}: {exc}") from exc
    specials = _special_tokens(config if isinstance(config, dict) else {})
    reference = TokenizersEncoder(tokenizer)
    encoder, name, why = _fast_encoder(settings, spec_text, spec, reference, templates, specials)
    prompt_tokenizer = PromptTokenizer(
        encoder,
        templates.get("default"),
        templates.get("tool_use"),
        specials,
        PrefixTokenCache(settings.cache_entries, settings.cache_tokens, settings.cache_ttl_s),
    )
    return LoadedTokenizer(prompt_tokenizer, name, why)


def check_folder(folder: str) -> None:
    """Raise :class:`TokenizerLoadError` when ``folder`` does not load (``pd-extproc check-config``).

    Its files are read and parsed as :func:`load_prompt_tokenizer` reads them; no fast encoder is
    checked (a folder that loads always has an encoder: ``tokenizers``)."""
    load_prompt_tokenizer(TokenizerSettings(folder, cache_entries=0, fast_encoders=()))


def load_folder(settings: TokenizerSettings) -> LoadedTokenizer | TokenizerLoadError:
    """:func:`load_prompt_tokenizer`, its error returned rather than raised (for a worker thread)."""
    try:
        return load_prompt_tokenizer(settings)
    except TokenizerLoadError as exc:
        return exc
