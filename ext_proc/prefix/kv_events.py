"""vLLM's KV-cache events off the wire: one ZMQ message's frames as a typed :class:`EventBatch` (pure).

An engine started with ``--kv-events-config`` publishes on a ZMQ PUB socket one multipart message per
batch of cache changes: ``[topic, sequence, payload]``, ``sequence`` 8 bytes big-endian (0 when the
engine starts, one more each batch), ``payload`` a msgpack batch. Its replay socket (ROUTER) answers a
DEALER's ``[b"", start sequence]`` with ``[b"", topic, sequence, payload]`` per buffered batch from there
on, then ``[b"", b"", -1 (8 bytes, signed), b""]`` (vLLM 0.32; earlier engines sent no topic frame:
``[b"", sequence, payload]`` and ``[b"", -1, b""]``; both are read).

Both encodings the engines use are accepted: a batch is ``[ts, events]``, ``[ts, events, dp_rank]``
or a map ``{ts, events, data_parallel_rank}``; an event is an array tagged by its first element
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, …]``) or a
map with a ``type`` key; trailing array fields the engine omits take their defaults, fields and event
types this module does not know are skipped (a batch says which types it skipped). A block hash is an
integer (msgpack holds 64 bits) or raw bytes (1 to 64 of them; vLLM sends 32). Anything else raises
:class:`DecodeError`, and nothing else is raised, whatever the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

EngineHash = int | bytes
"""A block hash as the engine reports it: only compared for equality (removals name blocks by it)."""

END_OF_REPLAY = (1 << 64) - 1
"""The sequence of the replay socket's end marker (-1 as 8 signed bytes, read unsigned)."""

_MAX_HASH_BYTES = 64
_DECODER = msgspec.msgpack.Decoder()
_TOKEN_IDS = tuple[Annotated[int, msgspec.Meta(ge=0)], ...]


class DecodeError(ValueError):
    """A message that is no KV-event batch; the text says what is wrong with it."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The engine cached ``len(block_hashes)`` full blocks of ``block_size`` tokens, in chain order.

    ``token_ids`` are their tokens (``len(block_hashes) * block_size`` of them); ``parent_block_hash``
    the engine hash of the block before the first (``None``: the first is a prompt's first block);
    ``medium`` the tier holding them (``None``: the engine's default, its GPU memory)."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine evicted the blocks ``block_hashes`` from ``medium`` (``None``: its GPU memory)."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine emptied its cache (a prefix-cache reset)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch of KV-cache events.

    Its ``sequence``, the engine's timestamp ``ts`` (seconds since the epoch), its data-parallel rank
    (``None`` when not sent), its events in order, and the types of those skipped (a newer engine's
    kinds this module does not know)."""

    sequence: int
    ts: float
    dp_rank: int | None
    events: tuple[Event, ...]
    skipped: tuple[str, ...] = ()


def decode_message(frames: list[bytes]) -> EventBatch:
    """The batch of one published message ``[topic, sequence, payload]``."""
    if len(frames) != 3:
        raise DecodeError(f"a KV-event message has 3 frames (topic, sequence, payload), not {len(frames)}")
    return decode_batch(_sequence(frames[1]), frames[2])


def decode_replay(frames: list[bytes]) -> EventBatch | None:
    """Decode one replay answer into its batch (``None``: the end marker).

    The answer is ``[b"", topic, sequence, payload]`` or ``[b"", sequence, payload]``."""
    if len(frames) not in (3, 4) or frames[0]:
        raise DecodeError("a replay answer has 3 or 4 frames (empty, [topic,] sequence, payload)")
    sequence = _sequence(frames[-2])
    if sequence == END_OF_REPLAY:
        return None
    return decode_batch(sequence, frames[-1])


def _sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError(f"the sequence frame has {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big")


def decode_batch(sequence: int, payload: bytes) -> EventBatch:
    """The batch numbered ``sequence`` from its msgpack ``payload``."""
    try:
        raw = _DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError, ValueError) as exc:
        raise DecodeError(f"the payload is no msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise DecodeError("a batch is a map or an array [ts, events, dp_rank]")
    if not _number(ts):
        raise DecodeError(f"the batch's ts is {_kind(ts)}, not a number")
    if not isinstance(events, list):
        raise DecodeError(f"the batch's events are {_kind(events)}, not an array")
    if rank is not None and not _integer(rank):
        raise DecodeError(f"the batch's data_parallel_rank is {_kind(rank)}, not an integer")
    decoded: list[Event] = []
    skipped: list[str] = []
    for index, raw_event in enumerate(events):
        event = _event(index, raw_event)
        if isinstance(event, str):
            skipped.append(event)
        else:
            decoded.append(event)
    return EventBatch(sequence, float(ts), rank, tuple(decoded), tuple(skipped))


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _event(index: int, raw: object) -> Event | str:
    """The event ``raw``, or the type it names when that is a type this module does not know."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        fields = dict(zip(_FIELDS.get(tag, ()) if isinstance(tag, str) else (), raw[1:], strict=False))
    else:
        raise DecodeError(f"event {index} is {_kind(raw)}, not a tagged array or a map")
    if not isinstance(tag, str):
        raise DecodeError(f"event {index} has no type: its tag is {_kind(tag)}")
    names = _FIELDS.get(tag)
    if names is None:
        return tag
    missing = [n for n in names[: _REQUIRED[tag]] if n not in fields]
    if missing:
        raise DecodeError(f"event {index} ({tag}) lacks {', '.join(missing)}")
    try:
        if tag == "BlockStored":
            return _stored(fields)
        if tag == "BlockRemoved":
            return BlockRemoved(_hashes(fields["block_hashes"]), _medium(fields.get("medium")))
        return AllBlocksCleared()
    except DecodeError as exc:
        raise DecodeError(f"event {index} ({tag}): {exc}") from None


def _stored(fields: dict[object, object]) -> BlockStored:
    hashes = _hashes(fields["block_hashes"])
    parent = fields["parent_block_hash"]
    if parent is not None:
        parent = _hash(parent)
    size = fields["block_size"]
    if not _integer(size):
        raise DecodeError(f"block_size is {_kind(size)}, not an integer")
    if size < 1:
        raise DecodeError(f"block_size is {size}, not a positive number of tokens")
    try:
        tokens = msgspec.convert(fields["token_ids"], _TOKEN_IDS)  # in C: a prompt has thousands
    except msgspec.ValidationError:
        raise DecodeError("token_ids is no array of token ids") from None
    if len(tokens) != len(hashes) * size:
        raise DecodeError(f"{len(tokens)} token_ids for {len(hashes)} blocks of {size}")
    lora = fields.get("lora_id")
    if lora is not None and not _integer(lora):
        raise DecodeError(f"lora_id is {_kind(lora)}, not an integer")
    return BlockStored(hashes, parent, tokens, size, lora, _medium(fields.get("medium")))


def _hashes(raw: object) -> tuple[EngineHash, ...]:
    if not isinstance(raw, list):
        raise DecodeError(f"block_hashes is {_kind(raw)}, not an array")
    return tuple(_hash(h) for h in raw)


def _hash(raw: object) -> EngineHash:
    if _integer(raw):
        return raw
    if isinstance(raw, bytes) and 0 < len(raw) <= _MAX_HASH_BYTES:
        return raw
    raise DecodeError(f"a block hash is {_kind(raw)}, not an integer or 1 to {_MAX_HASH_BYTES} bytes")


def _medium(raw: object) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    raise DecodeError(f"medium is {_kind(raw)}, not a string")


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(value: object) -> str:
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    return "nil" if value is None else type(value).__name__
