"""The shared-state wire format: what is written reads back the same; nothing else is applied, and
whatever the bytes, decoding raises nothing but :class:`WireError` with a reason."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.shared import wire
from ext_proc.shared.wire import Batch, IndexPart, Load, Placed, SyncRequest, WireError, decode

CHAIN = np.array([1, -2, 3, (1 << 63) - 1, -(1 << 63)], dtype=np.int64)


def _batch(**changes: object) -> Batch:
    fields: dict[str, object] = {
        "replica": "gw-1",
        "seq": 7,
        "sent": 1.5e9,
        "full": False,
        "fingerprint": 42,
        "loads": (Load("prefill", "10.0.0.1:8000", 300, 2), Load("decode", "[fd00::1]:80", 0, 0)),
        "placements": (Placed((("10.0.0.1:8000", 1e5), ("10.0.1.1:8000@dp1", 2e5)), CHAIN),),
    }
    return Batch(**(fields | changes))  # type: ignore[arg-type]


def test_a_batch_reads_back_as_written() -> None:
    batch = _batch()
    read = decode(wire.encode_batch(batch))
    assert isinstance(read, Batch)
    assert read.loads == batch.loads and read.seq == 7 and read.fingerprint == 42 and not read.full
    assert read.placements[0].holders == batch.placements[0].holders
    assert read.placements[0].chain.tolist() == CHAIN.tolist()
    assert read.placements[0].chain.flags.writeable  # the index's kernels take it as it is


def test_a_sync_request_and_an_index_part_read_back() -> None:
    assert decode(wire.encode_sync_request(SyncRequest("gw-2"))) == SyncRequest("gw-2")
    part = decode(wire.encode_index_part(IndexPart("gw-2", 9, "10.0.0.1:8000", 5e4, CHAIN)))
    assert (
        isinstance(part, IndexPart) and part.name == "10.0.0.1:8000" and part.chain.tolist() == CHAIN.tolist()
    )


def _raw(kind: int, body: object, version: int = wire.VERSION) -> bytes:
    return wire.MAGIC + bytes((version, kind)) + msgspec.msgpack.encode(body)


GOOD_LOAD = [0, "10.0.0.1:8000", 1, 1]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "garbled"),
        (b"hello world", "garbled"),
        (wire.encode_batch(_batch())[:-3], "malformed"),  # truncated
        (_raw(1, ["gw", 0, 0.0, True, 0, [GOOD_LOAD], []], version=2), "version"),
        (_raw(9, ["gw"]), "malformed"),
        (_raw(1, ["gw", -1, 0.0, True, 0, [], []]), "negative"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [[0, "10.0.0.1:8000", -5, 1]], []]), "negative"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [[0, "10.0.0.1:8000", 1 << 41, 1]], []]), "absurd"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [[0, "10.0.0.1:8000", 1, 1 << 25]], []]), "absurd"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [[2, "10.0.0.1:8000", 1, 1]], []]), "malformed"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [[0, "no-port", 1, 1]], []]), "malformed"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [[0, "10.0.0.1:0", 1, 1]], []]), "malformed"),
        (_raw(1, ["gw", 0, float("nan"), True, 0, [], []]), "malformed"),
        (_raw(1, ["", 0, 0.0, True, 0, [], []]), "malformed"),
        (_raw(1, ["x" * 65, 0, 0.0, True, 0, [], []]), "malformed"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [], [[[["10.0.0.1:8000", 1e5]], b"1234567"]]]), "malformed"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [], [[[["10.0.0.1:8000", -1.0]], b""]]]), "negative"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [], [[[["10.0.0.1:8000", 1e300]], b""]]]), "absurd"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [], [[[], b""]]]), "malformed"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [], [[[["10.0.0.1:8000@dpx", 1e5]], b""]]]), "malformed"),
        (_raw(3, ["gw", 0, "10.0.0.1:8000", 1e5, b"\0" * 8 * (wire.MAX_CHAIN_BLOCKS + 1)]), "absurd"),
        (wire.MAGIC + bytes((1, 1)) + b"\0" * wire.MAX_MESSAGE_BYTES, "too_large"),
        (_raw(1, ["gw", 0, 0.0, True, 0, [GOOD_LOAD] * (wire.MAX_ENTRIES + 1), []]), "absurd"),
        (_raw(1, {"replica": "gw"}), "malformed"),
    ],
)
def test_a_message_not_to_apply_says_why(payload: bytes, reason: str) -> None:
    with pytest.raises(WireError) as raised:
        decode(payload)
    assert raised.value.reason == reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_a_wire_error(payload: bytes) -> None:
    for data in (payload, wire.MAGIC + bytes((1, 1)) + payload, wire.MAGIC + bytes((1, 3)) + payload):
        try:
            decode(data)
        except WireError as exc:
            assert exc.reason in {"garbled", "version", "malformed", "negative", "absurd", "too_large"}


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(wire.encode_batch(_batch())) - 1))
def test_every_truncation_of_a_batch_is_refused(cut: int) -> None:
    with pytest.raises(WireError):
        decode(wire.encode_batch(_batch())[:cut])


def test_fingerprints_differ_by_hashing_and_are_stable() -> None:
    assert wire.fingerprint("approximate", 16, 2048) == wire.fingerprint("approximate", 16, 2048)
    assert wire.fingerprint("approximate", 16, 2048) != wire.fingerprint("approximate", 128, 2048)
    assert wire.fingerprint("approximate", 16, 2048) != wire.fingerprint("kv-events", 16, 2048)
    assert 0 < wire.fingerprint("approximate", 16, 2048) < 1 << 63
