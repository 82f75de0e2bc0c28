"""A prompt as a chain of block hashes: what a prefix cache can hold of it.

Engines cache a prompt's KV in fixed-size blocks keyed by a hash chained over the blocks before it
(vLLM: 16 tokens a block; block ``i``'s hash covers the tokens of blocks ``0..i``), so two prompts
share cache exactly as far as their leading blocks agree. The gateway hashes token ids when it has
them (the body's ``prompt`` / ``input`` as ids, or the gateway tokenizer's, :mod:`ext_proc.tokenizer`)
and otherwise the prompt text in chunks of ``CHARS_PER_TOKEN * block_tokens`` characters — the same 4
characters a token the load accounting estimates (:mod:`ext_proc.request`). Text chunks do not line up
with an engine's token blocks, but both chains stop agreeing where the prompts stop agreeing, so the
length of the common prefix they measure is the same within a block.

Pure: no I/O. One pass, no Python loop per block or per token id: the prompt becomes a sequence of
64-bit values ``v`` (text: its UTF-32 code points two to a value; token ids: each id a value; each value
keyed and mixed with a per-process secret, one secret for text and another for ids), the chain value
``c_w = c_{w-1} * M + v_w`` modulo 2**64 (``c_{-1}`` the seed, ``M`` odd) runs over all of them, and
block ``i``'s hash is ``c`` at the block's last value: it stands for every character (id) before it,
and a chain continues from any block's hash (the seed of the blocks after it). Written out,
``c_w = M**w * (seed * M + sum over u <= w of v_u * M**-u)``: one cumulative sum (numpy). Token ids
may come as a list or tuple of Python ints or as an ``array.array`` of machine integers (the gateway
tokenizer's unsigned 32-bit ids, read in place); the same ids give the same chain in any of these. An
id outside ``0..2**64-1`` (a malformed request's) counts modulo 2**64. Values are equal within one
process only (the secrets are per process, so each gateway replica keeps its own index).
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Sequence

import numpy as np

CHARS_PER_TOKEN = 4
"""Characters of prompt text per estimated token (:func:`ext_proc.request.describe` counts so)."""


def prompt_content(body: dict[str, object]) -> str | list[int] | None:
    """The prompt of a parsed request body as the engines' caches see it; ``None`` without a prompt.

    Its text (chat message contents and text parts, or completions / responses prompt strings,
    concatenated in order) or its token ids (``prompt`` / ``input`` as ids, several rows concatenated).
    The body was already validated by :func:`ext_proc.request.describe`; parts of other types
    (images, say) are skipped, as the token estimate skips them.
    """
    if "messages" in body:
        return _chat_text(body["messages"])
    for field in ("prompt", "input"):
        if field in body:
            return _prompt(body[field])
    return None


def _chat_text(messages: object) -> str:
    texts: list[str] = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "".join(texts)


def _prompt(prompt: object) -> str | list[int] | None:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        return None
    first = prompt[0]
    if isinstance(first, str):
        return "".join(p for p in prompt if isinstance(p, str))
    if isinstance(first, int):
        return [p for p in prompt if isinstance(p, int)]
    if isinstance(first, dict):  # Responses API input items shaped like chat messages
        return _chat_text(prompt)
    if isinstance(first, list):
        return [t for row in prompt if isinstance(row, list) for t in row if isinstance(t, int)]
    return None


def block_hashes(
    content: str | Sequence[int], block_tokens: int, max_blocks: int, seed: int = 0
) -> list[int]:
    """The chained hashes of the full blocks of ``content``, at most ``max_blocks`` of them.

    A block is ``block_tokens`` ids for token ids (a list, tuple or ``array.array``), else
    ``CHARS_PER_TOKEN * block_tokens`` characters; a partial last block is not cached (as in vLLM).
    ``seed`` starts the chain (e.g. the model name's hash: different models share no cache; or the hash
    of the block before ``content``, continuing its chain). O(blocks hashed), whatever the length of
    ``content``."""
    text = isinstance(content, str)
    size = CHARS_PER_TOKEN * block_tokens if text else block_tokens
    count = min(len(content) // size, max_blocks)
    per_block = size // 2 if text else size  # text: two code points a value; ids: one
    powers, inverses = _powers(count * per_block)
    step = max(1, _CHUNK_VALUES // per_block)  # blocks a chunk
    carry = np.uint64((seed * _MULTIPLIER) & _MASK)
    hashes: list[int] = []
    for first in range(0, count, step):
        last = min(first + step, count)
        values = _text_values(content, size, first, last) if text else _id_values(content, size, first, last)
        offset = first * per_block
        np.multiply(values, inverses[offset : offset + len(values)], out=values)
        sums = np.cumsum(values, dtype=np.uint64)
        np.add(sums, carry, out=sums)
        carry = sums[-1]
        ends = np.multiply(
            sums[per_block - 1 :: per_block],
            powers[offset + per_block - 1 : offset + len(values) : per_block],
        )
        hashes += ends.view(np.int64).tolist()
    return hashes


def _text_values(text: str, size: int, first: int, last: int) -> np.ndarray:
    """The chain's values of blocks ``first..last-1`` of ``text``: code points two a value, keyed."""
    points = np.frombuffer(text[first * size : last * size].encode("utf-32-le", "surrogatepass"), np.uint64)
    return _keyed(points, _TEXT_SECRET)


def _id_values(ids: Sequence[int], size: int, first: int, last: int) -> np.ndarray:
    """The chain's values of blocks ``first..last-1`` of ``ids``: each id a value, keyed.

    An ``array.array`` is read in place; Python ints are copied into a 64-bit array in C (an id outside
    ``0..2**64-1`` taken modulo 2**64)."""
    if isinstance(ids, array):
        raw = np.frombuffer(ids, ids.typecode)[first * size : last * size]
    else:
        block = ids[first * size : last * size]
        try:
            raw = np.frombuffer(array("Q", block), np.uint64)
        except OverflowError:  # a negative or huge id: only in a malformed request
            raw = np.frombuffer(array("Q", [i & _MASK for i in block]), np.uint64)
    return _keyed(raw.astype(np.uint64, copy=False), _ID_SECRET)


_MASK = (1 << 64) - 1
_CHUNK_VALUES = 8192  # values hashed at a time: 64 KiB arrays, below the allocator's fresh-pages threshold
_MULTIPLIER = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_TEXT_SECRET = np.uint64(secrets.randbits(64))
_ID_SECRET = np.uint64(secrets.randbits(64))
_POWERS: list[np.ndarray] = [np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)]


def _powers(count: int) -> list[np.ndarray]:
    """``M**i`` and ``M**-i`` modulo 2**64 for ``i`` in ``0..count-1`` (at least), computed once."""
    if len(_POWERS[0]) < count:
        size = max(count, 2 * len(_POWERS[0]))
        for k, base in enumerate((_MULTIPLIER, pow(_MULTIPLIER, -1, 1 << 64))):
            steps = np.full(size, base, dtype=np.uint64)
            steps[0] = 1
            _POWERS[k] = np.cumprod(steps, dtype=np.uint64)
    return _POWERS


def _keyed(values: np.ndarray, secret: np.uint64) -> np.ndarray:
    """Each value keyed with ``secret`` and mixed (one multiply, one xor-shift): the sums of the chain
    cannot be steered by chosen text or ids without the secret. A new array.

    Numpy's functions rather than operators: an operator on arrays of 256 KiB and more looks for a
    temporary to reuse by walking the C stack, which costs more than the arithmetic."""
    mixed = np.bitwise_xor(values, secret)
    np.multiply(mixed, np.uint64(0xBF58476D1CE4E5B9), out=mixed)
    return np.bitwise_xor(mixed, np.right_shift(mixed, np.uint64(31)), out=mixed)
