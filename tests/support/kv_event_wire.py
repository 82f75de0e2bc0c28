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


class Publisher:
    """An engine's KV-event publisher on loopback: a PUB socket and a replay ROUTER over a buffer.

    ``publish`` numbers batches from 0 as vLLM does (``restart`` starts again at 0); ``skip`` numbers a
    batch without sending it live (a gap the replay can fill); the replay socket answers
    ``[b"", start]`` with every buffered batch from ``start`` on and the end marker, like vLLM 0.32's
    (topic frame included)."""

    def __init__(self, encoding: Encoding = "array", replay: bool = True) -> None:
        import zmq
        import zmq.asyncio

        self._zmq = zmq
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = self.context.socket(zmq.ROUTER) if replay else None
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1") if self.replay else 0
        self.encoding = encoding
        self.sequence = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []

    async def publish(self, *events: Event, send: bool = True) -> int:
        """Send one batch of ``events`` (``send=False``: only buffer it); its sequence."""
        sequence = self.sequence
        self.sequence += 1
        body = payload(list(events), self.encoding)
        self.buffer.append((sequence, body))
        if send:
            await self.pub.send_multipart([b"", sequence.to_bytes(8, "big"), body])
        return sequence

    def restart(self) -> None:
        """The engine restarted: sequence 0, an empty buffer."""
        self.sequence = 0
        self.buffer.clear()

    async def serve_replays(self) -> None:
        """Answer replay requests until cancelled."""
        assert self.replay is not None
        while True:
            client, _, start = await self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for sequence, body in self.buffer:
                if sequence >= first:
                    await self.replay.send_multipart([client, b"", b"", sequence.to_bytes(8, "big"), body])
            await self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.context.destroy(linger=0)
