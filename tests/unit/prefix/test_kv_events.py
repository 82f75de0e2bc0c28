"""The KV-event decoder: both encodings, both hash forms, unknown fields, and one error type for garbage."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.prefix.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    decode_batch,
    decode_message,
    decode_replay,
)
from sim.kv_events import frames, payload

STORED = BlockStored((11, 12), None, tuple(range(32)), 16, None, "GPU")
STORED_BYTES = BlockStored((b"\x01" * 32,), b"\x02" * 32, tuple(range(16)), 16, 3, None)
REMOVED = BlockRemoved((2**64 - 1,), "CPU")
EVENTS = [STORED, STORED_BYTES, REMOVED, AllBlocksCleared()]


@pytest.mark.parametrize("encoding", ["array", "map", "mixed"])
def test_every_encoding_decodes_to_the_same_batch(encoding: str) -> None:
    batch = decode_message(frames(7, EVENTS, encoding, topic=b"kv"))  # type: ignore[arg-type]
    assert batch == EventBatch(7, 1.0, 0, tuple(EVENTS))


def test_the_sequence_is_eight_bytes_big_endian() -> None:
    assert decode_message(frames(2**40 + 5, [])).sequence == 2**40 + 5
    with pytest.raises(DecodeError, match="has 4 bytes, not 8"):
        decode_message([b"", b"\0\0\0\1", payload([])])
    with pytest.raises(DecodeError, match="3 frames"):
        decode_message([b"", payload([])])


def test_a_batch_without_a_rank_and_trailing_fields_omitted_take_defaults() -> None:
    raw = msgspec.msgpack.encode([2.5, [["BlockStored", [1], 9, [5] * 4, 4], ["BlockRemoved", [1]]]])
    batch = decode_batch(3, raw)
    assert batch == EventBatch(3, 2.5, None, (BlockStored((1,), 9, (5,) * 4, 4), BlockRemoved((1,))))


def test_unknown_fields_are_ignored() -> None:
    stored = [
        "BlockStored",
        [1],
        None,
        [0] * 16,
        16,
        None,
        "GPU",
        "lora-name",
        [None],
        0,
        "full",
        None,
    ]
    removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": None, "group_idx": 2}
    raw = msgspec.msgpack.encode({"ts": 1, "events": [stored, removed], "extra": {"a": 1}})
    batch = decode_batch(0, raw)
    assert batch.events == (BlockStored((1,), None, (0,) * 16, 16, None, "GPU"), BlockRemoved((1,)))
    assert batch.ts == 1.0 and batch.dp_rank is None


def test_events_of_types_not_known_are_skipped_and_named() -> None:
    raw = msgspec.msgpack.encode([1, [["BlockPinned", [1]], {"type": "Other"}, ["BlockRemoved", [1]]]])
    assert decode_batch(0, raw) == EventBatch(0, 1.0, None, (BlockRemoved((1,)),), ("BlockPinned", "Other"))


def test_the_replay_answers_and_their_end_marker_with_or_without_a_topic_frame() -> None:
    end = (-1).to_bytes(8, "big", signed=True)
    answer = [b"", (4).to_bytes(8, "big"), payload([REMOVED])]
    assert decode_replay(answer) == EventBatch(4, 1.0, 0, (REMOVED,))
    assert decode_replay([b"", b"kv", *answer[1:]]) == EventBatch(4, 1.0, 0, (REMOVED,))  # vLLM 0.32
    assert decode_replay([b"", end, b""]) is None
    assert decode_replay([b"", b"", end, b""]) is None
    assert int.from_bytes(end, "big") == END_OF_REPLAY
    with pytest.raises(DecodeError, match="replay answer"):
        decode_replay([b"x", (4).to_bytes(8, "big"), b""])
    with pytest.raises(DecodeError, match="replay answer"):
        decode_replay([b"", b"", b"", (4).to_bytes(8, "big"), b""])


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (b"\xc1", "no msgpack"),
        (msgspec.msgpack.encode(5), "a batch is a map or an array"),
        (msgspec.msgpack.encode(["x", []]), "ts is str, not a number"),
        (msgspec.msgpack.encode([1, {}]), "events are dict, not an array"),
        (msgspec.msgpack.encode([1, [], "r"]), "data_parallel_rank is str"),
        (msgspec.msgpack.encode([1, [7]]), "event 0 is int"),
        (msgspec.msgpack.encode([1, [[3]]]), "event 0 has no type: its tag is int"),
        (msgspec.msgpack.encode([1, [{"block_hashes": []}]]), "event 0 has no type: its tag is nil"),
        (msgspec.msgpack.encode([1, [["BlockStored", [1], None]]]), "lacks token_ids, block_size"),
        (
            msgspec.msgpack.encode([1, [["BlockStored", [1], None, [1] * 16, 0]]]),
            "block_size is 0, not a positive",
        ),
        (
            msgspec.msgpack.encode([1, [["BlockStored", [1], None, [], -16]]]),
            "block_size is -16, not a positive",
        ),
        (
            msgspec.msgpack.encode([1, [["BlockStored", [1], None, [], "16"]]]),
            "block_size is str, not an int",
        ),
        (msgspec.msgpack.encode([1, [["BlockStored", [1], None, [1] * 15, 16]]]), "15 token_ids for 1"),
        (msgspec.msgpack.encode([1, [["BlockStored", [1], None, [-1], 1]]]), "no array of token ids"),
        (msgspec.msgpack.encode([1, [["BlockStored", [1.5], None, [1], 1]]]), "a block hash is float"),
        (msgspec.msgpack.encode([1, [["BlockStored", [b""], None, [1], 1]]]), "a block hash is 0 bytes"),
        (msgspec.msgpack.encode([1, [["BlockStored", [1], None, [1], 1, "x"]]]), "lora_id is str"),
        (msgspec.msgpack.encode([1, [["BlockRemoved", 1]]]), "block_hashes is int"),
        (
            msgspec.msgpack.encode([1, [["BlockRemoved", [1], 3]]]),
            "event 0 \\(BlockRemoved\\): medium is int",
        ),
    ],
)
def test_a_garbled_batch_says_what_is_wrong(batch: bytes, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        decode_batch(0, batch)


_INTEGERS = st.integers(-(2**63), 2**64 - 1)  # what msgpack holds
_MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | _INTEGERS
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8) | _INTEGERS, inner, max_size=6)
    ),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_nothing_but_decode_error(raw: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_batch(0, raw)


@settings(max_examples=400, deadline=None)
@given(_MSGPACK_VALUES)
def test_random_msgpack_raises_nothing_but_decode_error(value: object) -> None:
    with contextlib.suppress(DecodeError):
        decode_batch(0, msgspec.msgpack.encode(value))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=12), max_size=4))
def test_random_frames_raise_nothing_but_decode_error(parts: list[bytes]) -> None:
    for decode in (decode_message, decode_replay):
        with contextlib.suppress(DecodeError):
            decode(parts)


_TAGGED = st.tuples(
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
    st.lists(_MSGPACK_VALUES, max_size=8),
)


@pytest.mark.slow  # 400 random events: `make test-fast` leaves it out
@settings(max_examples=400, deadline=None)
@given(st.lists(_TAGGED, max_size=3), st.booleans())
def test_tagged_events_with_random_fields_raise_nothing_but_decode_error(
    events: list[tuple[str, list[object]]], as_map: bool
) -> None:
    names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "x", "y"]
    values = [
        {"type": tag, **dict(zip(names, fields, strict=False))} if as_map else [tag, *fields]
        for tag, fields in events
    ]
    with contextlib.suppress(DecodeError):
        decode_batch(0, msgspec.msgpack.encode([0.0, values, 0]))
