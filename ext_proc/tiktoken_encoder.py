"""A faster encoder for byte-level BPE tokenizers: tiktoken, built from ``tokenizer.json``, checked first.

The Hugging Face ``tokenizers`` library spends about 3 µs a pre-token on its offset bookkeeping; tiktoken
(a Rust BPE without offsets) encodes the same text about ten times faster. It can stand in only where it
computes the same ids, which :func:`tiktoken_encoder` makes sure of, raising :class:`NotRepresentable`
(its message says why) otherwise:

- Structure: a ``BPE`` model without dropout, unknown token, subword prefix or suffix, byte fallback; no
  normalizer; the pre-tokenizer a ``Split`` on a regex (``Isolated``, not inverted) then ``ByteLevel``
  without its own regex (Llama 3's shape); added tokens without ``lstrip``/``rstrip``/``single_word``.
  The vocabulary, read back through the byte-level alphabet, gives tiktoken's ranks (rank = id), the
  ``Split`` regex its pattern, the added tokens its special tokens.
- Merge order: tiktoken merges the adjacent pair whose concatenation ranks lowest, ``tokenizers`` the
  pair whose merge rule ranks lowest; they agree when the merge rules, in order, make tokens of
  non-decreasing id (vocabularies trained the usual way, Llama 3's among them). Checked on every rule.
- Ids: both encode a check corpus (the chat template rendered over sample messages, Unicode, whitespace
  and digit edge cases, the special tokens inside text, random strings from a seeded generator, all
  these with and without the post-processor's special tokens; then every vocabulary token's bytes
  once, in a seeded random order: a few hundred kB for a 32k vocabulary); every id must agree. 0.35 s
  for a 32k vocabulary on a two-vCPU box, about a second when it is busy.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

import tiktoken

from ext_proc.prefix.tokens import TextEncoder, added_specials

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
    """tiktoken cannot stand in for this tokenizer; the message says why."""


class TiktokenEncoder:
    """A :class:`~ext_proc.prefix.tokens.TextEncoder` on tiktoken (releases the GIL while it encodes).

    ``head`` and ``tail`` are the ids the post-processor adds around a prompt (``add_special_tokens``).
    Added tokens written in the text are encoded as themselves, as ``tokenizers`` encodes them. A lone
    surrogate raises :class:`UnicodeEncodeError`, as ``tokenizers`` refuses one (tiktoken alone would
    replace it)."""

    def __init__(self, encoding: tiktoken.Encoding, head: list[int], tail: list[int]) -> None:
        self.encoding = encoding
        self._head = head
        self._tail = tail
        self._specials = encoding.special_tokens_set

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids, with ``head`` and ``tail`` around them when ``add_special_tokens``."""
        text.encode("utf-8")  # raises on a lone surrogate
        ids = self.encoding.encode(text, allowed_special=self._specials, disallowed_special=())
        return self._head + ids + self._tail if add_special_tokens else ids


def _byte_alphabet() -> dict[str, int]:
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


def _pattern(pre_tokenizer: object) -> str:
    """The ``Split`` regex of a ``Sequence[Split(regex, Isolated), ByteLevel(use_regex=False)]``."""
    steps = pre_tokenizer.get("pretokenizers") if isinstance(pre_tokenizer, dict) else None
    if not isinstance(steps, list) or pre_tokenizer.get("type") != "Sequence":  # type: ignore[union-attr]
        raise NotRepresentable("the pre-tokenizer is not a Sequence of a Split and a ByteLevel")
    if [s.get("type") if isinstance(s, dict) else None for s in steps] != ["Split", "ByteLevel"]:
        raise NotRepresentable("the pre-tokenizer is not a Split then a ByteLevel")
    split, byte_level = steps
    pattern = split.get("pattern")
    if not isinstance(pattern, dict) or not isinstance(pattern.get("Regex"), str):
        raise NotRepresentable("the Split pattern is not a regex")
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise NotRepresentable("the Split does not isolate its matches")
    if byte_level.get("use_regex") or byte_level.get("add_prefix_space"):
        raise NotRepresentable("the ByteLevel pre-tokenizer splits or adds a space of its own")
    return pattern["Regex"]


def _check_model(model: object) -> tuple[dict[str, int], list[object]]:
    """The model's vocabulary and merge rules, when it is a plain byte-level BPE."""
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise NotRepresentable("the model is not a BPE")
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotRepresentable(f"the BPE has {key}")
    if model.get("byte_fallback"):
        raise NotRepresentable("the BPE has byte_fallback")
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise NotRepresentable("the BPE has no vocab or merges")
    return vocab, merges


def _check_merge_order(vocab: Mapping[str, int], merges: Iterable[object]) -> None:
    """Raise unless the merge rules, in order, make tokens of non-decreasing id (tiktoken's order)."""
    last = -1
    for rank, rule in enumerate(merges):
        left, right = rule.split(" ", 1) if isinstance(rule, str) else rule  # type: ignore[misc]
        merged = vocab.get(left + right)
        if merged is None:
            raise NotRepresentable(f"merge rule {rank} makes a token not in the vocabulary")
        if merged < last:
            raise NotRepresentable(
                f"merge rule {rank} makes token {merged} after token {last}: merges are not in id order"
            )
        last = merged


def tiktoken_encoding(spec: Mapping[str, object]) -> tiktoken.Encoding:
    """tiktoken's encoding of the tokenizer ``spec`` (``tokenizer.json`` parsed), checked for its structure.

    Raises :class:`NotRepresentable` when the structure or the merge order is not one tiktoken computes."""
    if spec.get("normalizer") is not None:
        raise NotRepresentable("the tokenizer has a normalizer")
    pattern = _pattern(spec.get("pre_tokenizer"))
    vocab, merges = _check_model(spec.get("model"))
    added = spec.get("added_tokens") or []
    specials: dict[str, int] = {}
    for token in added if isinstance(added, list) else []:
        if any(token.get(key) for key in ("lstrip", "rstrip", "single_word")):
            raise NotRepresentable(f"added token {token.get('content')!r} strips or matches single words")
        specials[token["content"]] = token["id"]
    alphabet = _byte_alphabet()
    special_ids = set(specials.values())
    try:
        ranks = {
            bytes(alphabet[c] for c in token): rank
            for token, rank in vocab.items()
            if rank not in special_ids
        }
    except KeyError as exc:
        raise NotRepresentable(
            f"a vocabulary token has a character outside the byte alphabet: {exc}"
        ) from exc
    if len(ranks) + len(special_ids) != len(vocab.keys() | specials.keys()):
        raise NotRepresentable("two vocabulary tokens stand for the same bytes")
    _check_merge_order(vocab, merges)
    try:
        return tiktoken.Encoding(
            "tokenizer.json", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
    except Exception as exc:  # the Rust side raises plain exceptions (e.g. a regex it cannot compile)
        raise NotRepresentable(f"tiktoken refused it: {exc}") from exc


def check_corpus(texts: Iterable[str], specials: Iterable[str], seed: int = CHECK_SEED) -> list[str]:
    """``texts`` (e.g. rendered chat templates), the edge cases, ``specials`` written into text, and
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
    """The ``vocabulary`` tokens' bytes one after another in a random order, in texts of about
    :data:`_VOCAB_CHUNK_BYTES` (invalid UTF-8 replaced): every token's bytes, next to others."""
    tokens = sorted(vocabulary)
    random.Random(seed).shuffle(tokens)
    joined = b"".join(tokens)
    step = _VOCAB_CHUNK_BYTES
    return [joined[start : start + step].decode("utf-8", "replace") for start in range(0, len(joined), step)]


def tiktoken_encoder(
    spec: Mapping[str, object], reference: TextEncoder, texts: Iterable[str]
) -> TiktokenEncoder:
    """tiktoken standing in for ``reference`` (the tokenizer ``spec`` loaded by ``tokenizers``).

    Raises :class:`NotRepresentable` when :func:`tiktoken_encoding` does, or when an id differs from
    ``reference``'s on :func:`check_corpus` of ``texts`` and the added tokens (encoded with and without
    special tokens) or on :func:`vocabulary_corpus` (without)."""
    encoding = tiktoken_encoding(spec)
    added = added_specials(reference)
    if added is None:
        raise NotRepresentable("the post-processor does not add a plain head and tail around a prompt")
    encoder = TiktokenEncoder(encoding, *added)
    checks = [
        (text, special)
        for text in check_corpus(texts, sorted(encoding.special_tokens_set))
        for special in (False, True)
    ]
    checks += [(text, False) for text in vocabulary_corpus(encoding.token_byte_values())]
    for text, add_special in checks:
        if encoder.encode(text, add_special) != reference.encode(text, add_special):
            raise NotRepresentable(f"tiktoken's ids differ from the tokenizer's on {text[:80]!r}")
    return encoder
