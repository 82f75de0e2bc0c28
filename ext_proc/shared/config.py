"""The ``shared_state`` section: whether and how gateway replicas share their bookings.

See docs/operations.md "Running active-active". Read at start only: a reload that changes it is
logged and waits for a restart.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ext_proc.checks import ConfigError, check_url_port, in_range

DEFAULT_PREFIX = "pd-extproc"


class SharedStateKind(enum.StrEnum):
    """``local``: this process alone (no sharing); ``nats``: replicas share over a NATS server."""

    LOCAL = "local"
    NATS = "nats"


def redacted(url: str) -> str:
    """``url`` without its credentials: what a log line or an error message may show.

    ``url`` may be several, comma-separated; each loses the user, password or token before its ``@``."""
    shown = []
    for one in url.split(","):
        scheme, sep, rest = one.strip().partition("://")
        host = rest.rpartition("@")[2]
        shown.append(f"{scheme}{sep}{'***@' if '@' in rest else ''}{host}" if sep else one.strip())
    return ",".join(shown)


@dataclass(frozen=True)
class NatsTls:
    """``shared_state.nats.tls``: the CA of the server and this client's certificate.

    ``ca``: the CA that signs the server; ``cert`` and ``key``: this client's certificate and key,
    for a server that asks for one. Files in PEM; ``""``: none."""

    ca: str = ""
    cert: str = ""
    key: str = ""


@dataclass(frozen=True)
class NatsConfig:
    """``shared_state.nats``: the server and the subjects.

    ``url``: ``nats://[user:password@]host:port`` (``tls://`` for TLS; several comma-separated for a
    cluster); ``""`` with ``serve --workers``: a private server on loopback, started by ``serve``.
    ``creds_file``: a NATS credentials file (JWT and NKey), ``token``: an authorization token (or in
    the URL as ``nats://token@host:port``). ``subject_prefix``: the replicas of one pool share it (another
    prefix is another pool, on the same server). ``hash_key``: the secret the replicas hash prompts with
    (their placements compare only when it is the same); ``""``: derived from the subject prefix and the
    credentials, which every replica of a pool shares and no client sees."""

    url: str = ""
    creds_file: str = ""
    token: str = ""
    subject_prefix: str = DEFAULT_PREFIX
    hash_key: str = ""
    tls: NatsTls = field(default_factory=NatsTls)

    def key(self) -> bytes:
        """The key the replicas hash prompts with (:func:`ext_proc.prefix.blocks.use_key`)."""
        if self.hash_key:
            return self.hash_key.encode()
        creds = Path(self.creds_file).read_bytes() if self.creds_file else b""
        secret = f"{self.subject_prefix}\n{self.token}\n{urlsplit(self.url.split(',')[0]).password or ''}"
        return hashlib.blake2b(secret.encode() + creds, person=b"pd-extproc-key").digest()


@dataclass(frozen=True)
class SharedStateConfig:
    """The ``shared_state`` section.

    ``kind``: ``local`` (default: nothing shared) or ``nats``. ``heartbeat_seconds``: how often a replica
    sends all its bookings (and checks its peers); ``peer_timeout_seconds``: a peer silent this long has
    its bookings dropped; ``batch_seconds``: how long a booking waits to travel with the next ones (0:
    the next turn of the event loop), hence at most ``1 / batch_seconds`` messages a second from a replica
    besides its heartbeats; ``sync_wait_seconds``: how long a starting replica waits for its
    peers' state before it answers requests (it answers anyway after that); ``sync_answer_seconds``: a
    replica answers its peers' sync requests at most once per this long, the ones arriving meanwhile
    together (a flood of them costs one answer built per window), so a starting replica's answer comes
    within it; ``sync_max_waiting``: the sync requests waiting for that next answer at most (more are
    refused, unanswered: as many as the replicas of a pool is enough). ``decision_slot_ms``: the replicas
    take turns to decide, each in slots of this many milliseconds (:mod:`ext_proc.shared.slots`; 0: off,
    every replica decides at once); half a slot must exceed ``batch_seconds`` (checked) plus the bus's
    delay and the wall clocks' skew (NTP)."""

    kind: SharedStateKind = SharedStateKind.LOCAL
    nats: NatsConfig = field(default_factory=NatsConfig)
    heartbeat_seconds: float = 1.0
    peer_timeout_seconds: float = 5.0
    batch_seconds: float = 0.02
    sync_wait_seconds: float = 1.0
    sync_answer_seconds: float = 0.25
    sync_max_waiting: int = 64
    decision_slot_ms: float = 0.0

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first key out of range."""
        key = "shared_state"
        in_range(f"{key}.heartbeat_seconds", self.heartbeat_seconds, 0.01, 60, low_open=False)
        in_range(
            f"{key}.peer_timeout_seconds",
            self.peer_timeout_seconds,
            self.heartbeat_seconds,
            600,
            low_open=True,
            note="more than heartbeat_seconds",
        )
        in_range(f"{key}.batch_seconds", self.batch_seconds, 0, 1)
        in_range(f"{key}.sync_wait_seconds", self.sync_wait_seconds, 0, 60)
        in_range(f"{key}.sync_answer_seconds", self.sync_answer_seconds, 0.01, 10)
        if 0 < self.sync_wait_seconds < self.sync_answer_seconds:
            raise ConfigError(
                f"{key}.sync_answer_seconds: {self.sync_answer_seconds:g} is more than sync_wait_seconds "
                f"({self.sync_wait_seconds:g}): a starting replica would stop waiting before its peers' "
                "answer may come; make it at most sync_wait_seconds (or sync_wait_seconds 0: no wait)"
            )
        in_range(f"{key}.sync_max_waiting", self.sync_max_waiting, 1, 10_000, kind="an integer")
        in_range(f"{key}.decision_slot_ms", self.decision_slot_ms, 0, 50)
        if self.decision_slot_ms and self.decision_slot_ms / 2000 <= self.batch_seconds:
            raise ConfigError(
                f"{key}.decision_slot_ms: half a slot ({self.decision_slot_ms / 2:g} ms) must exceed "
                f"batch_seconds ({self.batch_seconds * 1000:g} ms), or a replica's bookings leave after the "
                "next replica's slot began; lengthen the slot or shorten batch_seconds (0.001 with slots)"
            )
        nats = self.nats
        prefix = nats.subject_prefix
        if not prefix or any(c in prefix for c in " \t*>") or prefix.startswith(".") or prefix.endswith("."):
            raise ConfigError(
                f"{key}.nats.subject_prefix: {prefix!r} is not allowed; use NATS subject tokens such as "
                "pd-extproc or team.pool-a (no spaces, * or >)"
            )
        if self.kind is SharedStateKind.NATS and not nats.url.strip():
            raise ConfigError(
                f"{key}.nats.url: required with kind nats (or run `pd-extproc serve --workers N`, which "
                "starts a private server)"
            )
        for url in filter(None, nats.url.split(",")):
            shown = redacted(url.strip())  # an error message must not carry the password
            if urlsplit(url.strip()).scheme not in ("nats", "tls"):
                raise ConfigError(
                    f"{key}.nats.url: {shown!r} is not allowed; use nats://host:port or tls://host:port"
                )
            try:
                check_url_port(f"{key}.nats.url", url.strip())
            except ConfigError:
                raise ConfigError(
                    f"{key}.nats.url: {shown!r} is not allowed: its port is not a number in 1..65535"
                ) from None
        if bool(nats.tls.cert) != bool(nats.tls.key):
            raise ConfigError(f"{key}.nats.tls: cert and key go together")
