"""vLLM's KV-event wire format for tests: batches of :mod:`ext_proc.prefix.kv_events` events as frames.

``encoding="array"``: a batch ``[ts, events, dp_rank]`` of tagged arrays, as ``msgspec`` writes
vLLM's ``array_like`` structs; ``"map"``: maps with a ``type`` key inside a map batch, as newer vLLM
writes them; ``"mixed"``: map events inside an array batch, as vLLM 0.32 for CPU was seen to send.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event

Encoding = Literal["array", "map", "mixed"]


def event_value(event: Event, as_map: bool) -> object:
    """One event as the engine encodes it (a tagged array, or a map with ``type``)."""
    if isinstance(event, BlockStored):
        tag, fields = (
            "BlockStored",
            {
                "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash,
                "token_ids": list(event.token_ids),
                "block_size": event.block_size,
                "lora_id": event.lora_id,
                "medium": event.medium,
            },
        )
    elif isinstance(event, BlockRemoved):
        tag, fields = "BlockRemoved", {"block_hashes": list(event.block_hashes), "medium": event.medium}
    else:
        assert isinstance(event, AllBlocksCleared)
        tag, fields = "AllBlocksCleared", {}
    return {"type": tag, **fields} if as_map else [tag, *fields.values()]


def payload(events: list[Event], encoding: Encoding = "array", ts: float = 1.0, dp_rank: int = 0) -> bytes:
    """The msgpack batch of ``events``."""
    values = [event_value(e, encoding != "array") for e in events]
    batch: object = (
        {"ts": ts, "events": values, "data_parallel_rank": dp_rank}
        if encoding == "map"
        else [ts, values, dp_rank]
    )
    return msgspec.msgpack.encode(batch)


def frames(
    sequence: int, events: list[Event], encoding: Encoding = "array", topic: bytes = b""
) -> list[bytes]:
    """One published message ``[topic, sequence, payload]``."""
    return [topic, sequence.to_bytes(8, "big"), payload(events, encoding)]
