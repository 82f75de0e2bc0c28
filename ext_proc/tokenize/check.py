"""The check that a fast encoder stands in exactly for a tokenizer: a corpus both encode, every id compared.

A faster encoder (:mod:`~ext_proc.tokenize.fastokens_encoder`, :mod:`~ext_proc.tokenize.tiktoken_encoder`)
is used by the gateway only where it computes the ``tokenizers`` library's ids. :func:`check_ids` makes
sure of it, raising :class:`NotRepresentable` at the first text whose ids differ. The check corpus:

- the chat templates rendered over sample messages;
- Unicode, whitespace and digit edge cases, the special tokens inside text;
- random strings from a seeded generator;
- all these with and without the post-processor's special tokens;
- every vocabulary token's bytes once, in a seeded random order (a few hundred kB for a 32k vocabulary).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from ext_proc.tokenize.base import TextEncoder

CHECK_SEED = 26
CHECK_RANDOM_TEXTS = 400
"""Random strings in the check corpus (each up to :data:`_RANDOM_CHARS` characters)."""
_RANDOM_CHARS = 400
_VOCAB_CHUNK_BYTES = 4096
"""The vocabulary's bytes are checked in texts of about this size (a difference names a short one)."""
_EDGE_CASES = (
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    " \n \n",
    "\r\n",
    "\t\t x",
    "a  b   c    d",
    "trailing   ",
    "   leading",
    "1234567890 12 345 6789 0.5 -3e10 1,000,000",
    "٣٤٥ ١٢ 一二三 ①②③ ½",
    "don't I'LL we've You'RE it's HE'D",
    "naïve café Straße İstanbul ǅ ﬁ",
    "日本語のテキストと中文文本 한국어",
    "emoji 👩‍👩‍👧‍👦 🇫🇷 ✔️ 🤖🤖🤖",
    "combining é ñ a\u0301\u0302",
    "zero\u200bwidth\u00a0nbsp\u3000ideographic",
    "<tag attr='x'>&amp;</tag> {\"json\": [1, 2]} $x_{i}^2",
    "def f(x):\n    return x ** 2  # comment\n\n\n",
    "\u0000\u0001\u001f\u007f\u0085",
)
"""Texts where pre-tokenizers and byte-level alphabets tend to differ."""
_ALPHABETS = (
    " \n\t\r",
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "àéîõüçñßøåæœÀÉÎÕÜ",
    "абвгдежзийклмнопрстуфхцчшщъыьэюя",
    "的一是不了人我在有他这为之大来以个中上们",
    "😀😁😂🤣😃🚀🌍👍",
    "\u0301\u200b\u00a0\u3000\u2028",
)


class NotRepresentable(Exception):
    """A fast encoder cannot stand in for this tokenizer; the message says why."""


def byte_alphabet() -> dict[str, int]:
    """The byte-level alphabet read back: each of its 256 characters to the byte it stands for (GPT-2's)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + extra)
    return {c: b for b, c in chars.items()}


def check_corpus(texts: Iterable[str], specials: Iterable[str], seed: int = CHECK_SEED) -> list[str]:
    """The texts every fast encoder must encode as ``tokenizers`` does.

    ``texts`` (e.g. rendered chat templates), the edge cases, ``specials`` written into text, and
    :data:`CHECK_RANDOM_TEXTS` random strings mixing scripts, digits, punctuation and whitespace."""
    rng = random.Random(seed)
    corpus = [*texts, *_EDGE_CASES]
    corpus += [f"x{token} {token}\n{token}{token}y" for token in specials]
    for _ in range(CHECK_RANDOM_TEXTS):
        alphabets = rng.sample(_ALPHABETS, rng.randint(1, 4))
        pool = "".join(alphabets)
        corpus.append("".join(rng.choice(pool) for _ in range(rng.randint(1, _RANDOM_CHARS))))
    return corpus


def vocabulary_corpus(vocabulary: Iterable[bytes], seed: int = CHECK_SEED) -> list[str]:
    """Every vocabulary token's bytes, in texts of a few kB.

    The tokens' bytes one after another in a random order, in texts of about :data:`_VOCAB_CHUNK_BYTES`
    (invalid UTF-8 replaced): every token's bytes, next to others."""
    tokens = sorted(vocabulary)
    random.Random(seed).shuffle(tokens)
    joined = b"".join(tokens)
    step = _VOCAB_CHUNK_BYTES
    return [joined[start : start + step].decode("utf-8", "replace") for start in range(0, len(joined), step)]


def check_ids(
    candidate: TextEncoder,
    reference: TextEncoder,
    texts: Iterable[str],
    specials: Iterable[str],
    vocabulary: Iterable[bytes],
) -> None:
    """Raise :class:`NotRepresentable` unless ``candidate`` gives ``reference``'s ids on the check corpus.

    :func:`check_corpus` of ``texts`` and ``specials``, encoded with and without special tokens, then
    :func:`vocabulary_corpus` of ``vocabulary`` (without)."""
    checks = [(text, special) for text in check_corpus(texts, sorted(specials)) for special in (False, True)]
    checks += [(text, False) for text in vocabulary_corpus(vocabulary)]
    for text, add_special in checks:
        if list(candidate.encode(text, add_special)) != list(reference.encode(text, add_special)):
            raise NotRepresentable(f"its ids differ from the tokenizer's on {text[:80]!r}")


def vocabulary_bytes(tokens: Iterable[str]) -> list[bytes]:
    """The bytes the vocabulary's ``tokens`` stand for, for :func:`vocabulary_corpus`.

    A token of the byte-level alphabet is read back through it (GPT-2's); any other is its own UTF-8,
    SentencePiece's ``▁`` read as a space."""
    alphabet = byte_alphabet()
    return [
        bytes(alphabet[c] for c in token)
        if all(c in alphabet for c in token)
        else token.replace("\u2581", " ").encode("utf-8", "replace")
        for token in tokens
    ]
