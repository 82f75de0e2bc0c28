"""KV-cache events on vLLM's wire: the encoder, and the ZMQ publisher of a simulated engine.

What a vLLM engine started with ``--kv-events-config`` sends (the decoder is
:mod:`ext_proc.prefix.kv_events`): one multipart message ``[topic, sequence, payload]`` per batch on a
PUB socket, ``sequence`` 8 bytes big-endian from 0 when the engine starts, ``payload`` a msgpack batch
of :data:`~ext_proc.prefix.kv_events.Event` values; a replay ROUTER socket that answers a DEALER's
``[b"", start]`` with ``[b"", topic, sequence, payload]`` for every buffered batch from ``start`` on, then
``[b"", b"", -1 (8 signed bytes), b""]`` (vLLM 0.32's replay answers carry the topic frame).

Encodings (:data:`~sim.config.KvEventEncoding`): ``"array"``, a batch ``[ts, events, dp_rank]`` of
tagged arrays (``["BlockStored", block_hashes, …]``), as ``msgspec`` writes vLLM's ``array_like``
structs; ``"map"``, maps with a ``type`` key inside a map batch, as newer vLLM writes them;
``"mixed"``, map events inside an array batch, as vLLM 0.32 for CPU was seen to send. Hash forms
(:data:`~sim.config.KvEventHashForm`): ``"int"``, a 64-bit unsigned integer (a negative hash is sent
as its two's complement), or ``"bytes"``, 32 raw bytes big-endian, as vLLM's sha256 block hashes; a
hash already in bytes is sent as it is. A simulated engine publishes what its prefix cache reports
(:mod:`sim.prefix`): one batch per change.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event
from sim.config import KvEventEncoding, KvEventHashForm

REPLAY_BUFFER_BATCHES = 10_000
"""Batches the replay socket can answer from (vLLM's ``buffer_steps`` default)."""

_MASK = (1 << 64) - 1
_END = (-1).to_bytes(8, "big", signed=True)


def wire_hash(block_hash: EngineHash, form: KvEventHashForm = "int") -> EngineHash:
    """``block_hash`` as the wire carries it in ``form``."""
    if isinstance(block_hash, bytes):
        return block_hash
    unsigned = block_hash & _MASK
    return unsigned if form == "int" else unsigned.to_bytes(32, "big")


def event_value(event: Event, as_map: bool, hashes: KvEventHashForm = "int") -> object:
    """One event as the engine encodes it (a tagged array, or a map with ``type``)."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        tag, fields = (
            "BlockStored",
            {
                "block_hashes": [wire_hash(h, hashes) for h in event.block_hashes],
                "parent_block_hash": None if parent is None else wire_hash(parent, hashes),
                "token_ids": list(event.token_ids),
                "block_size": event.block_size,
                "lora_id": event.lora_id,
                "medium": event.medium,
            },
        )
    elif isinstance(event, BlockRemoved):
        tag, fields = (
            "BlockRemoved",
            {"block_hashes": [wire_hash(h, hashes) for h in event.block_hashes], "medium": event.medium},
        )
    else:
        assert isinstance(event, AllBlocksCleared)
        tag, fields = "AllBlocksCleared", {}
    return {"type": tag, **fields} if as_map else [tag, *fields.values()]


def payload(
    events: list[Event],
    encoding: KvEventEncoding = "array",
    ts: float = 1.0,
    dp_rank: int = 0,
    hashes: KvEventHashForm = "int",
) -> bytes:
    """The msgpack batch of ``events`` (``ts``: seconds since the epoch)."""
    values = [event_value(e, encoding != "array", hashes) for e in events]
    batch: object = (
        {"ts": ts, "events": values, "data_parallel_rank": dp_rank}
        if encoding == "map"
        else [ts, values, dp_rank]
    )
    return msgspec.msgpack.encode(batch)


def frames(
    sequence: int,
    events: list[Event],
    encoding: KvEventEncoding = "array",
    topic: bytes = b"",
    hashes: KvEventHashForm = "int",
) -> list[bytes]:
    """One published message ``[topic, sequence, payload]``."""
    return [topic, sequence.to_bytes(8, "big"), payload(events, encoding, hashes=hashes)]


class Publisher:
    """An engine's KV-event publisher: a PUB socket and a replay ROUTER over the last batches.

    Binds ``host`` on ``port`` and ``replay_port`` (0: an ephemeral port; ``replay=False``: no replay
    socket, ``replay_port`` is then 0). :meth:`publish` numbers batches from 0 as vLLM does
    (:meth:`restart` starts again at 0, empty); ``send=False`` numbers and buffers a batch without
    sending it live (a gap the replay can fill). :meth:`serve_replays` answers replay requests until
    cancelled; ``replays`` lists the start sequences asked. Publishing never blocks: past the PUB
    socket's high-water mark ZeroMQ drops messages, as it does for vLLM."""

    def __init__(
        self,
        encoding: KvEventEncoding = "array",
        replay: bool = True,
        hashes: KvEventHashForm = "int",
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int = 0,
        topic: bytes = b"",
        buffer_batches: int = REPLAY_BUFFER_BATCHES,
    ) -> None:
        self.context = zmq.asyncio.Context()
        self.pub = zmq.Context.shadow(self.context.underlying).socket(zmq.PUB)  # sends from sync code
        self.port = _bind(self.pub, host, port)
        self.replay = self.context.socket(zmq.ROUTER) if replay else None
        self.replay_port = _bind(self.replay, host, replay_port) if self.replay is not None else 0
        self.encoding = encoding
        self.hashes = hashes
        self.topic = topic
        self.sequence = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.replays: list[int] = []

    def publish(self, *events: Event, send: bool = True) -> int:
        """Send one batch of ``events`` (``send=False``: only buffer it); its sequence."""
        sequence = self.sequence
        self.sequence += 1
        body = payload(list(events), self.encoding, time.time(), hashes=self.hashes)
        self.buffer.append((sequence, body))
        if send:
            self.pub.send_multipart([self.topic, sequence.to_bytes(8, "big"), body], zmq.NOBLOCK)
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
            for sequence, body in list(self.buffer):
                if sequence >= first:
                    await self.replay.send_multipart(
                        [client, b"", self.topic, sequence.to_bytes(8, "big"), body]
                    )
            await self.replay.send_multipart([client, b"", b"", _END, b""])

    def start(self) -> asyncio.Task[None] | None:
        """Serve replays in a task of the running loop (``None`` without a replay socket)."""
        if self.replay is None:
            return None
        return asyncio.get_running_loop().create_task(self.serve_replays(), name="kv-events replay")

    def close(self) -> None:
        """Close both sockets."""
        self.pub.close(linger=0)
        self.context.destroy(linger=0)


def _bind(socket: zmq.Socket, host: str, port: int) -> int:
    if port:
        socket.bind(f"tcp://{host}:{port}")
        return port
    return socket.bind_to_random_port(f"tcp://{host}")
