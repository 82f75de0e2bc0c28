"""The shared-state wire format, version 1: what gateway replicas tell each other (pure).

Every message is ``b"PDXS"``, one version byte (:data:`VERSION`), one kind byte, then a msgpack array:

* kind 1, :class:`Batch` — ``[replica, seq, sent, full, fingerprint, loads, placements]``: a replica's
  own in-flight load and the prompts it placed since its last batch. ``replica`` names the sending
  process (1-64 characters, new at every start), ``seq`` counts its batches from 0, ``sent`` is its wall
  clock (seconds since the epoch; only the sync lag is read from it). ``loads`` are
  ``[role, address, tokens, requests]`` (role 0 prefill, 1 decode; ``address`` ``host:port``): the
  replica's *own* charges on that endpoint, absolute values, not increments, so a lost or repeated
  batch never leaks load. ``full`` true: ``loads`` lists every endpoint the sender charges (an endpoint
  it leaves out holds nothing of it); false: only the endpoints that changed. ``placements`` are
  ``[[[name, capacity_tokens], ...], chain]``: the prompt whose chained block hashes ``chain`` holds
  (little-endian int64, 8 bytes a block) was placed on each ``name`` (an endpoint's address, or
  ``address@dp<rank>`` for one data-parallel rank of it), whose KV cache holds ``capacity_tokens``.
  ``fingerprint`` names the sender's prompt hashing (:func:`fingerprint`): chains of another hashing
  are not applied.
* kind 2, :class:`SyncRequest` — ``[replica]``: a replica that starts asks its peers for their state;
  each answers on the request's reply subject with a full batch and its index (kind 3).
* kind 3, :class:`IndexPart` — ``[replica, fingerprint, name, capacity_tokens, chain]``: blocks an
  endpoint is estimated to hold in the sender's index, most recently used first.

:func:`decode` accepts nothing else: a message that is too large, garbled, of another version or kind,
malformed, negative or absurd raises :class:`WireError` with a short ``reason`` (a metric label), and
nothing else is raised, whatever the bytes. Bounds: :data:`MAX_MESSAGE_BYTES` a message,
:data:`MAX_TOKENS` tokens and :data:`MAX_REQUESTS` requests an entry.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import msgspec
import numpy as np

from ext_proc.prefix.blocks import Chain
from ext_proc.prefix.ranks import RANK_MARK

MAGIC = b"PDXS"
VERSION = 1
BATCH, SYNC_REQUEST, INDEX_PART = 1, 2, 3
MAX_MESSAGE_BYTES = 512 * 1024
"""The largest message accepted (a NATS server's default ``max_payload`` is 1 MiB)."""
MAX_CHAIN_BLOCKS = 16_384
"""The most blocks of one chain in a message (128 KiB); an index part holds at most this many."""
MAX_TOKENS = 1 << 40
"""More tokens than this in flight on one endpoint is absurd."""
MAX_REQUESTS = 1 << 24
MAX_CAPACITY_TOKENS = float(1 << 50)
MAX_ENTRIES = 16_384
"""The most load entries, or placements, in one batch."""
MAX_HOLDERS = 64
ROLES = ("prefill", "decode")
_HEADER = len(MAGIC) + 2


class WireError(ValueError):
    """A message that is not applied: ``reason`` is the metric label, the text says what is wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Load:
    """A replica's own charges on one endpoint: ``tokens`` in flight, ``requests`` in flight."""

    role: str
    address: str
    tokens: int
    requests: int


@dataclass(frozen=True, slots=True)
class Placed:
    """A prompt's chain placed on ``holders``: (name, KV capacity in tokens) each."""

    holders: tuple[tuple[str, float], ...]
    chain: Chain


@dataclass(frozen=True, slots=True)
class Batch:
    """Kind 1: a replica's own loads (all of them when ``full``) and its placements since the last."""

    replica: str
    seq: int
    sent: float
    full: bool
    fingerprint: int
    loads: tuple[Load, ...]
    placements: tuple[Placed, ...]


@dataclass(frozen=True, slots=True)
class SyncRequest:
    """Kind 2: ``replica`` started and asks for its peers' state."""

    replica: str


@dataclass(frozen=True, slots=True)
class IndexPart:
    """Kind 3: ``chain`` (most recently used first) is estimated held at ``name`` of ``capacity`` tokens."""

    replica: str
    fingerprint: int
    name: str
    capacity: float
    chain: Chain


Message = Batch | SyncRequest | IndexPart

_ENCODER = msgspec.msgpack.Encoder()
_BATCH = msgspec.msgpack.Decoder(
    tuple[
        str,
        int,
        float,
        bool,
        int,
        list[tuple[int, str, int, int]],
        list[tuple[list[tuple[str, float]], bytes]],
    ]
)
_SYNC = msgspec.msgpack.Decoder(tuple[str])
_INDEX = msgspec.msgpack.Decoder(tuple[str, int, str, float, bytes])


def fingerprint(source: str, block_tokens: int, max_blocks: int) -> int:
    """A stable 63-bit number naming a prompt hashing: chains of equal fingerprints compare."""
    digest = hashlib.blake2b(f"{source}/{block_tokens}/{max_blocks}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def encode_batch(batch: Batch) -> bytes:
    """``batch`` on the wire."""
    loads = [(ROLES.index(x.role), x.address, x.tokens, x.requests) for x in batch.loads]
    placements = [([list(h) for h in p.holders], p.chain.astype("<i8").tobytes()) for p in batch.placements]
    body = (batch.replica, batch.seq, batch.sent, batch.full, batch.fingerprint, loads, placements)
    return _header(BATCH) + _ENCODER.encode(body)


def encode_sync_request(request: SyncRequest) -> bytes:
    """``request`` on the wire."""
    return _header(SYNC_REQUEST) + _ENCODER.encode((request.replica,))


def encode_index_part(part: IndexPart) -> bytes:
    """``part`` on the wire."""
    body = (part.replica, part.fingerprint, part.name, part.capacity, part.chain.astype("<i8").tobytes())
    return _header(INDEX_PART) + _ENCODER.encode(body)


def _header(kind: int) -> bytes:
    return MAGIC + bytes((VERSION, kind))


def decode(payload: bytes) -> Message:
    """The message ``payload`` holds; :class:`WireError` when it is not one to apply (module docstring)."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise WireError("too_large", f"{len(payload)} bytes, more than {MAX_MESSAGE_BYTES}")
    if len(payload) < _HEADER or payload[: len(MAGIC)] != MAGIC:
        raise WireError("garbled", "no shared-state message (it does not start with PDXS)")
    version, kind = payload[len(MAGIC)], payload[len(MAGIC) + 1]
    if version != VERSION:
        raise WireError("version", f"version {version}; this replica reads version {VERSION}")
    body = memoryview(payload)[_HEADER:]
    try:
        if kind == BATCH:
            return _batch(_BATCH.decode(body))
        if kind == SYNC_REQUEST:
            (replica,) = _SYNC.decode(body)
            return SyncRequest(_replica(replica))
        if kind == INDEX_PART:
            replica, print_, name, capacity, chain = _INDEX.decode(body)
            return IndexPart(_replica(replica), print_, _name(name), _capacity(capacity), _chain(chain))
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError("malformed", f"kind {kind}: {exc}") from None
    raise WireError("malformed", f"unknown kind {kind}")


def _batch(fields: tuple) -> Batch:
    replica, seq, sent, full, print_, loads, placements = fields
    if seq < 0:
        raise WireError("negative", f"sequence {seq}")
    if not math.isfinite(sent):
        raise WireError("malformed", f"sent {sent}")
    if len(loads) > MAX_ENTRIES or len(placements) > MAX_ENTRIES:
        raise WireError("absurd", f"{len(loads)} loads and {len(placements)} placements in one batch")
    return Batch(
        _replica(replica),
        seq,
        sent,
        full,
        print_,
        tuple(_load(*entry) for entry in loads),
        tuple(_placed(holders, chain) for holders, chain in placements),
    )


def _load(role: int, address: str, tokens: int, requests: int) -> Load:
    if role not in (0, 1):
        raise WireError("malformed", f"role {role}")
    if tokens < 0 or requests < 0:
        raise WireError("negative", f"{tokens} tokens, {requests} requests on {address!r}")
    if tokens > MAX_TOKENS or requests > MAX_REQUESTS:
        raise WireError("absurd", f"{tokens} tokens, {requests} requests on {address!r}")
    return Load(ROLES[role], _address(address), tokens, requests)


def _placed(holders: list[tuple[str, float]], chain: bytes) -> Placed:
    if not 0 < len(holders) <= MAX_HOLDERS:
        raise WireError("malformed", f"a placement on {len(holders)} endpoints")
    return Placed(tuple((_name(n), _capacity(c)) for n, c in holders), _chain(chain))


def _replica(replica: str) -> str:
    if not 0 < len(replica) <= 64 or not replica.isprintable():
        raise WireError("malformed", f"replica name {replica[:80]!r}")
    return replica


def _address(address: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or len(address) > 256 or not port.isdigit() or not 0 < int(port) < 65536:
        raise WireError("malformed", f"endpoint address {address[:80]!r}")
    return address


def _name(name: str) -> str:
    """An address, or an address and a data-parallel rank (``host:port@dp<rank>``)."""
    address, _, rank = name.partition(RANK_MARK)
    if rank and not rank.isdigit():
        raise WireError("malformed", f"endpoint name {name[:80]!r}")
    _address(address)
    return name


def _capacity(capacity: float) -> float:
    if not 0 < capacity <= MAX_CAPACITY_TOKENS:  # NaN fails too
        raise WireError("absurd" if capacity > 0 else "negative", f"KV capacity {capacity} tokens")
    return capacity


def _chain(raw: bytes) -> Chain:
    if len(raw) % 8:
        raise WireError("malformed", f"a chain of {len(raw)} bytes, not whole 8-byte blocks")
    if len(raw) > 8 * MAX_CHAIN_BLOCKS:
        raise WireError("absurd", f"a chain of {len(raw) // 8} blocks")
    return np.frombuffer(raw, "<i8").astype(np.int64)
