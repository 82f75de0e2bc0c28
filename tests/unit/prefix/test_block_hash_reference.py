"""The compiled block hashes are the documented chain, computed here in plain Python ints."""

from __future__ import annotations

from array import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.prefix import blocks
from ext_proc.prefix.blocks import CHARS_PER_TOKEN, block_hashes

MASK = (1 << 64) - 1
M = 0x9E3779B97F4A7C15  # the chain's multiplier
MIX = 0xBF58476D1CE4E5B9  # the values' mixing multiplier


def reference(content: str | list[int], block_tokens: int, max_blocks: int, seed: int) -> list[int]:
    """``blocks``' module docstring, one value at a time: keyed, mixed, ``c = c * M + v`` modulo 2**64."""
    if isinstance(content, str):
        size = CHARS_PER_TOKEN * block_tokens
        count = min(len(content) // size, max_blocks)
        points = [ord(c) for c in content[: count * size]]
        values = [low | high << 32 for low, high in zip(points[::2], points[1::2], strict=True)]
        secret, per_block = int(blocks._TEXT_SECRET), size // 2
    else:
        count = min(len(content) // block_tokens, max_blocks)
        values = [i & MASK for i in content[: count * block_tokens]]
        secret, per_block = int(blocks._ID_SECRET), block_tokens
    chain, hashes = seed & MASK, []
    for w, value in enumerate(values, 1):
        mixed = (value ^ secret) * MIX & MASK
        chain = (chain * M + (mixed ^ mixed >> 31)) & MASK
        if w % per_block == 0:
            hashes.append(chain - (1 << 64) if chain >> 63 else chain)  # as a signed 64-bit value
    return hashes


seeds = st.integers(-(2**70), 2**70)
block_sizes = st.integers(1, 5)
max_blocks = st.integers(0, 40)
texts = st.text(st.characters(exclude_categories=()), max_size=300)  # lone surrogates too
ids = st.lists(
    st.one_of(st.integers(0, 2**32 - 1), st.integers(2**63, 2**64 - 1), st.integers(-(2**70), 2**70)),
    max_size=120,
)
TYPECODES = {"b": 8, "h": 16, "i": 32, "q": 64, "B": 8, "H": 16, "I": 32, "Q": 64}


@settings(deadline=None, max_examples=200)
@given(texts, block_sizes, max_blocks, seeds)
def test_text_chains_are_the_reference(text: str, size: int, most: int, seed: int) -> None:
    hashes = block_hashes(text, size, most, seed)
    assert hashes.dtype == np.int64 and hashes.ndim == 1
    assert hashes.tolist() == reference(text, size, most, seed)


@settings(deadline=None, max_examples=200)
@given(ids, block_sizes, max_blocks, seeds)
def test_id_chains_are_the_reference_whatever_the_ids_range(
    token_ids: list[int], size: int, most: int, seed: int
) -> None:
    expected = reference(token_ids, size, most, seed)
    assert block_hashes(token_ids, size, most, seed).tolist() == expected
    assert block_hashes(tuple(token_ids), size, most, seed).tolist() == expected


@settings(deadline=None, max_examples=200)
@given(st.sampled_from(sorted(TYPECODES)), st.data(), block_sizes, seeds)
def test_id_arrays_of_any_width_and_sign_are_the_reference(
    typecode: str, data: st.DataObject, size: int, seed: int
) -> None:
    bits = TYPECODES[typecode]
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if typecode.islower() else (0, 2**bits - 1)
    token_ids = data.draw(st.lists(st.integers(low, high), max_size=60))
    assert block_hashes(array(typecode, token_ids), size, 100, seed).tolist() == reference(
        token_ids, size, 100, seed
    )


@settings(deadline=None, max_examples=100)
@given(st.one_of(texts, ids), block_sizes, seeds, st.integers(0, 10))
def test_a_chain_continued_from_a_blocks_hash_is_the_reference(
    content: str | list[int], size: int, seed: int, head: int
) -> None:
    whole = block_hashes(content, size, 1000, seed)
    head = min(head, len(whole))
    start = whole[head - 1] if head else seed  # a block's hash as the array holds it: a numpy int64
    tail = content[head * size * (CHARS_PER_TOKEN if isinstance(content, str) else 1) :]
    assert block_hashes(tail, size, 1000, start).tolist() == reference(tail, size, 1000, int(start))
    assert block_hashes(tail, size, 1000, start).tolist() == whole[head:].tolist()


def test_warm_compiles_every_kind_of_content_the_gateway_hashes() -> None:
    blocks.warm()
    compiled = len(blocks._chain.signatures)
    for content in ("x" * 64, [1, 2**64 - 1], (3, -4), array("I", [5, 6])):
        block_hashes(content, 1, 10)
    assert len(blocks._chain.signatures) == compiled
