"""A prompt as a chain of block hashes: what a prefix cache can hold of it.

Engines cache a prompt's KV in fixed-size blocks keyed by a hash chained over the blocks before it
(vLLM: 16 tokens a block; block ``i``'s hash covers the tokens of blocks ``0..i``), so two prompts
share cache exactly as far as their leading blocks agree. The gateway hashes token ids when it has
them (the body's ``prompt`` / ``input`` as ids, or the gateway tokenizer's, :mod:`ext_proc.tokenize.gateway`)
and otherwise the prompt text in chunks of ``CHARS_PER_TOKEN * block_tokens`` characters — the same 4
characters a token the load accounting estimates (:mod:`ext_proc.request`). Text chunks do not line up
with an engine's token blocks, but both chains stop agreeing where the prompts stop agreeing, so the
length of the common prefix they measure is the same within a block.

Pure: no I/O. One pass, one compiled loop (numba; no Python step per block or per token id): the
prompt becomes a sequence of 64-bit values ``v`` (text: its UTF-32 code points two to a value; token
ids: each id a value; each value keyed and mixed with a per-process secret, one secret for text and
another for ids), the chain value ``c_w = c_{w-1} * M + v_w`` modulo 2**64 (``c_{-1}`` the seed, ``M``
odd) runs over all of them, and block ``i``'s hash is ``c`` at the block's last value: it stands for
every character (id) before it, and a chain continues from any block's hash (the seed of the blocks
after it). A chain is a 1-D int64 numpy array (``.tolist()`` gives its hashes as Python ints). Token ids
may come as a list or tuple of Python ints or as an ``array.array`` of machine integers of any width
(the gateway tokenizer's unsigned 32-bit ids, read in place); the same ids give the same chain in any
of these. An id outside ``0..2**64-1`` (a malformed request's, or a negative one in a signed array)
counts modulo 2**64. Values are equal within one process only (the secrets are random per process),
unless the process takes its secrets from a key (:func:`use_key`): replicas sharing their placements
(:mod:`ext_proc.shared`) use one key, so their chains compare. The loop compiles on its first call:
:func:`warm` compiles it ahead of requests.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections.abc import Sequence
from typing import TypeAlias

import numba
import numpy as np
import numpy.typing as npt

Chain: TypeAlias = npt.NDArray[np.int64]
"""A prompt's chained block hashes (:func:`block_hashes`): a 1-D int64 array, block by block."""
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


def block_hashes(content: str | Sequence[int], block_tokens: int, max_blocks: int, seed: int = 0) -> Chain:
    """The chained hashes of the full blocks of ``content``, at most ``max_blocks`` of them, in order.

    A block is ``block_tokens`` ids for token ids (a list, tuple or ``array.array``), else
    ``CHARS_PER_TOKEN * block_tokens`` characters; a partial last block is not cached (as in vLLM).
    ``seed`` starts the chain (e.g. the model name's hash: different models share no cache; or the hash
    of the block before ``content``, continuing its chain); any int, taken modulo 2**64. A new 1-D int64
    array (the 64-bit hashes as signed values), empty when no block is full. O(blocks hashed), whatever
    the length of ``content``."""
    text = isinstance(content, str)
    size = CHARS_PER_TOKEN * block_tokens if text else block_tokens
    count = min(len(content) // size, max_blocks)
    if text:
        values = np.frombuffer(content[: count * size].encode("utf-32-le", "surrogatepass"), np.uint64)
        per_block, secret = size // 2, _TEXT_SECRET  # two code points a value
    else:
        values, per_block, secret = _ids(content, count * size), size, _ID_SECRET
    return _chain(values, per_block, count, np.uint64(int(seed) & _MASK), secret).view(np.int64)


def _ids(ids: Sequence[int], count: int) -> npt.NDArray[np.integer]:
    """The first ``count`` of ``ids`` as an array of machine integers.

    An ``array.array`` is read in place (its own width and sign); Python ints are copied into a 64-bit
    array in C (an id outside ``0..2**64-1`` taken modulo 2**64)."""
    if isinstance(ids, array):
        return np.frombuffer(ids, ids.typecode)[:count]
    head = ids[:count]
    try:
        return np.frombuffer(array("Q", head), np.uint64)
    except OverflowError:  # a negative or huge id: only in a malformed request
        return np.frombuffer(array("Q", [i & _MASK for i in head]), np.uint64)


def use_key(key: bytes) -> None:
    """Take the secrets from ``key`` from now on: processes using one key hash alike.

    Chains computed before hash otherwise: call it before any index holds a chain."""
    global _TEXT_SECRET, _ID_SECRET
    digest = hashlib.blake2b(key, digest_size=16, person=b"pd-extproc-block").digest()
    _TEXT_SECRET = np.uint64(int.from_bytes(digest[:8], "little"))
    _ID_SECRET = np.uint64(int.from_bytes(digest[8:], "little"))


def model_seed(model: str) -> int:
    """The chain seed of the model named ``model``: the same in every process (unlike ``hash``)."""
    return int.from_bytes(
        hashlib.blake2b(model.encode(errors="surrogatepass"), digest_size=8).digest(), "little"
    )


def prompt_chain(
    body: dict[str, object], block_tokens: int, max_blocks: int, tokens: Sequence[int] | None = None
) -> Chain:
    """The chained block hashes of the request's prompt (``tokens`` when given); empty without a prompt.

    The chain is seeded with the request's ``model``: different models share no cache. Both prefix
    sources hash so a prompt they have no token ids of (:mod:`ext_proc.prefix.kinds`)."""
    content = prompt_content(body) if tokens is None else tokens
    if not content:
        return np.empty(0, np.int64)
    model = body.get("model")
    seed = model_seed(model) if isinstance(model, str) else 0
    return block_hashes(content, block_tokens, max_blocks, seed)


def warm() -> None:
    """Compile the hashing loop ahead of requests, for every kind of content the gateway hashes.

    Text and token ids as Python ints (64-bit values) and the gateway tokenizer's unsigned 32-bit ids;
    about 0.6 s once a process, then nothing. The loop compiles on its first call otherwise (numba, in
    memory: nothing is cached on disk)."""
    for content in ("ab" * CHARS_PER_TOKEN, [1, 2], array("I", [1, 2])):
        block_hashes(content, 1, 1)


_MASK = (1 << 64) - 1
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd
_MIX = np.uint64(0xBF58476D1CE4E5B9)  # odd: multiplying by it is a bijection modulo 2**64
_SHIFT = np.uint64(31)
_TEXT_SECRET = np.uint64(secrets.randbits(64))
_ID_SECRET = np.uint64(secrets.randbits(64))


@numba.njit(nogil=True)
def _chain(
    values: npt.NDArray[np.integer], per_block: int, count: int, seed: np.uint64, secret: np.uint64
) -> npt.NDArray[np.uint64]:
    """The chain ``c`` over ``values`` (machine integers, each taken modulo 2**64) at the end of each of
    its first ``count`` blocks of ``per_block`` values, compiled.

    Each value is keyed with ``secret`` and mixed (one xor, one multiply, one xor-shift), so the chain
    cannot be steered by chosen text or ids without the secret; ``c_w = c_{w-1} * M + v_w`` modulo
    2**64, ``c_{-1} = seed``."""
    hashes = np.empty(count, np.uint64)
    c = seed
    w = 0
    for block in range(count):
        for _ in range(per_block):
            v = (np.uint64(values[w]) ^ secret) * _MIX
            c = c * _MULTIPLIER + (v ^ (v >> _SHIFT))
            w += 1
        hashes[block] = c
    return hashes
