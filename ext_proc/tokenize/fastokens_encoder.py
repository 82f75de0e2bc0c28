"""The gateway's fastest encoder: fastokens, built from ``tokenizer.json``, checked against ``tokenizers``.

fastokens (Crusoe's BPE in Rust: PCRE2 JIT pre-tokenization, a per-word cache, no offsets) reads a
Hugging Face ``tokenizer.json`` as it is and encodes a 12k-token chat prompt about fifteen times
faster than tiktoken on this box, twenty times faster than ``tokenizers`` (`docs/benchmarks.md`
section 8). It is used only where it computes the ``tokenizers`` library's ids:
:func:`fastokens_encoder` builds it and encodes the check corpus of
:func:`ext_proc.tokenize.check.check_ids` with both, raising
:class:`~ext_proc.tokenize.check.NotRepresentable` when fastokens refuses the tokenizer or one id
differs. Its encoder threads are held to one (``FASTOKENS_BPE_THREADS``, unless set): the gateway
encodes one prompt at a time on its tokenizer thread, and the other cores serve the event loop.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Iterable, Mapping

import fastokens

from ext_proc.tokenize.base import TextEncoder
from ext_proc.tokenize.check import NotRepresentable, check_ids, vocabulary_bytes

BPE_THREADS = "1"
"""fastokens' encoder threads (its ``FASTOKENS_BPE_THREADS``) when the environment does not say."""


class FastokensEncoder:
    """A :class:`~ext_proc.tokenize.base.TextEncoder` on fastokens (releases the GIL while it encodes).

    Added tokens written in the text are encoded as themselves and the post-processor adds its special
    tokens, as in ``tokenizers``; a lone surrogate raises :class:`UnicodeEncodeError`. The ids come as
    an unsigned 32-bit array, copied from fastokens' buffer: no Python int is made for them."""

    def __init__(self, tokenizer: fastokens.Tokenizer) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> array[int]:
        """``text``'s token ids, with the post-processor's special tokens when ``add_special_tokens``."""
        flat, _ = self._tokenizer.encode_batch_flat([text], add_special_tokens=add_special_tokens)
        ids = array("I", flat)  # little-endian uint32
        if sys.byteorder == "big":
            ids.byteswap()
        return ids


def fastokens_encoder(
    spec_text: str, spec: Mapping[str, object], reference: TextEncoder, texts: Iterable[str]
) -> FastokensEncoder:
    """fastokens standing in for ``reference`` (the tokenizer ``spec_text``, parsed: ``spec``).

    Raises :class:`~ext_proc.tokenize.check.NotRepresentable` when fastokens refuses the tokenizer, or
    when an id differs from ``reference``'s on the check corpus of ``texts``, the added tokens and the
    vocabulary (:func:`ext_proc.tokenize.check.check_ids`)."""
    if array("I").itemsize != 4:
        raise NotRepresentable("this machine's unsigned int is not the 32 bits of fastokens' ids")
    os.environ.setdefault("FASTOKENS_BPE_THREADS", BPE_THREADS)
    try:
        encoder = FastokensEncoder(fastokens.Tokenizer.from_json_str(spec_text))
    except Exception as exc:  # the Rust side raises plain exceptions for what it does not support
        raise NotRepresentable(f"fastokens refused it: {exc}") from exc
    model = spec.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = spec.get("added_tokens")
    specials = [t["content"] for t in added if isinstance(t, dict)] if isinstance(added, list) else []
    check_ids(encoder, reference, texts, specials, vocabulary_bytes(vocab if isinstance(vocab, dict) else ()))
    return encoder
