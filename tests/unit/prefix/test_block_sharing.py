"""Block hashes share exactly as far as prompts agree: the common prefix's full blocks, no more, no less."""

from __future__ import annotations

from array import array

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.index import PrefixIndex

BLOCK_TOKENS = 4  # 16 characters a text block: short prompts span many blocks
TEXT = 4 * BLOCK_TOKENS
letters = st.text(alphabet="ab\u00e9\u4e2d\U0001f600\ud800", min_size=0, max_size=200)


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(deadline=None)
@given(letters, letters, letters)
@example("x" * 64, "y" * 64, "z" * 64)
def test_text_prompts_share_exactly_the_full_blocks_of_their_common_prefix(common, a, b) -> None:
    first, second = common + a, common + b
    agree = _leading_equal(list(first), list(second))  # characters in common
    one, two = block_hashes(first, BLOCK_TOKENS, 1000), block_hashes(second, BLOCK_TOKENS, 1000)
    assert _leading_equal(one, two) == min(agree // TEXT, len(one), len(two))
    index = PrefixIndex(BLOCK_TOKENS)
    index.record(one.tolist(), "p", 1e9)
    assert index.match(two.tolist()).get("p", 0) == min(agree // TEXT, len(one), len(two))


@settings(deadline=None)
@given(st.lists(st.integers(0, 50), max_size=60), st.lists(st.integers(0, 50), max_size=60))
def test_token_id_prompts_share_exactly_the_full_blocks_of_their_common_prefix(a, b) -> None:
    agree = _leading_equal(a, b)
    one, two = block_hashes(a, BLOCK_TOKENS, 1000), block_hashes(b, BLOCK_TOKENS, 1000)
    assert _leading_equal(one, two) == min(agree // BLOCK_TOKENS, len(one), len(two))


def test_a_block_equal_to_another_prompts_block_after_a_different_head_hashes_differently() -> None:
    one, two = (
        block_hashes("a" * TEXT + "b" * TEXT, BLOCK_TOKENS, 10),
        block_hashes("c" * TEXT + "b" * TEXT, 4, 10),
    )
    assert one[1] != two[1]
    assert (
        block_hashes("b" * 2 * TEXT, BLOCK_TOKENS, 10, seed=1).tolist()
        != block_hashes("b" * 2 * TEXT, BLOCK_TOKENS, 10).tolist()
    )


def test_at_most_max_blocks_are_hashed_whatever_the_length() -> None:
    long = "q" * (TEXT * 10_000)
    assert (
        block_hashes(long, BLOCK_TOKENS, 7).tolist()
        == block_hashes(long[: TEXT * 7], BLOCK_TOKENS, 1000).tolist()
    )


@settings(deadline=None)
@given(st.integers(0, 6), st.integers(0, 6), st.integers(-(2**63), 2**63 - 1))
def test_a_chain_continues_from_any_blocks_hash(head: int, tail: int, seed: int) -> None:
    ids = list(range(100, 100 + (head + tail) * BLOCK_TOKENS))
    text = "".join(chr(0x61 + i % 7) for i in range((head + tail) * TEXT))
    for content, size in ((ids, BLOCK_TOKENS), (text, TEXT)):
        whole = block_hashes(content, BLOCK_TOKENS, 1000, seed)
        start = whole[head - 1] if head else seed
        assert (
            block_hashes(content[head * size :], BLOCK_TOKENS, 1000, start).tolist() == whole[head:].tolist()
        )


def test_long_chains_continue_from_any_block_far_in() -> None:
    ids = [i * 7919 % 1000 for i in range(20_000)]  # 20k one-id blocks
    whole = block_hashes(ids, 1, 20_000)
    for head in (8191, 8192, 8193, 16_385):
        assert block_hashes(ids[head:], 1, 20_000, whole[head - 1]).tolist() == whole[head:].tolist()
    text = "".join(chr(0x61 + i * 31 % 26) for i in range(80_000))  # 2,500 blocks of 16 values
    whole = block_hashes(text, 8, 10_000)
    assert block_hashes(text[256 * 32 :], 8, 10_000, whole[255]).tolist() == whole[256:].tolist()


@settings(deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=60), st.integers(-(2**63), 2**63 - 1))
def test_token_ids_chain_alike_as_a_list_a_tuple_or_an_array(ids: list[int], seed: int) -> None:
    whole = block_hashes(ids, BLOCK_TOKENS, 1000, seed).tolist()
    assert block_hashes(tuple(ids), BLOCK_TOKENS, 1000, seed).tolist() == whole
    tokenizer_ids = array("I", ids)  # the gateway tokenizer's
    assert block_hashes(tokenizer_ids, BLOCK_TOKENS, 1000, seed).tolist() == whole
    assert block_hashes(array("Q", ids), BLOCK_TOKENS, 1000, seed).tolist() == whole


def test_ids_outside_64_bits_count_modulo_2_to_the_64() -> None:
    assert block_hashes([-1, 2**64 + 5], 1, 10).tolist() == block_hashes([2**64 - 1, 5], 1, 10).tolist()
    assert block_hashes([-1, 5], 1, 10).tolist() != block_hashes([1, 5], 1, 10).tolist()


def test_a_token_id_prompt_hashes_apart_from_text_of_the_same_values() -> None:
    text = "ab" * (2 * BLOCK_TOKENS)  # one text block: 2 * BLOCK_TOKENS values of two code points each
    ids = [ord("a") | ord("b") << 32] * (2 * BLOCK_TOKENS)  # the same values: two blocks of ids
    assert block_hashes(text, BLOCK_TOKENS, 10)[0] != block_hashes(ids, BLOCK_TOKENS, 10)[1]
