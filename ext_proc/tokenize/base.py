"""The tokenizer package's vocabulary: the encoder it is given, what it answers, why it fails.

Pure: what the prompt tokenizer and the shell around it share (:mod:`ext_proc.tokenize`).
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from typing import NamedTuple, NoReturn, Protocol


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
        """``text``'s token ids.

        A list, or an unsigned 32-bit array; with the post-processor's special tokens (e.g. BOS) when asked.

        May raise any exception for a text it cannot encode (e.g. a lone surrogate)."""
        ...


class Tokenized(NamedTuple):
    """A prompt's token ids, ``cached`` of them (the leading ones) taken from the prefix cache.

    ``ids`` are an unsigned 32-bit ``array.array`` (no Python int is made for them: the chain of blocks,
    :func:`ext_proc.prefix.blocks.block_hashes`, reads them in place), or, for a prompt given as token
    ids, a list of the body's ids."""

    ids: array[int] | list[int]
    cached: int


def unsupported(message: str) -> NoReturn:
    """Raise :class:`TokenizeFailure` for what the gateway cannot render as the engine would."""
    raise TokenizeFailure(UntokenizedReason.UNSUPPORTED, message)
