"""Where the KV-event subscribers write: the ``kv-events`` source's index, behind a small protocol.

The subscribers (:mod:`ext_proc.kv_subscribers`, the shell) never see a prefix source: they ask the
live parts (:mod:`ext_proc.live`) for the :class:`EventFeed` of the source in force, which only the
``kv-events`` kind has (:meth:`~ext_proc.prefix.kinds.PrefixSource.events`), and apply the engines'
batches to its :class:`EventSink` (:class:`~ext_proc.prefix.event_index.EventIndex` is one). Times
are seconds of the subscribers' monotonic clock.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from ext_proc.prefix.block_sizes import BlockSizes
from ext_proc.prefix.event_index import Applied, ReplayFrom
from ext_proc.prefix.kv_events import EventBatch
from ext_proc.prefix.settings import KvEventsSettings


class EventSink(Protocol):
    """What the subscribers do to the index: follow publishers, apply their batches, report on them."""

    @property
    def sizes(self) -> BlockSizes:
        """Each publisher's block size and the pool's (learned from the events)."""
        ...

    def watch(self, address: str, now: float) -> None:
        """Listening to the publisher ``address`` starts: its staleness bound runs from ``now``."""
        ...

    def forget(self, address: str) -> None:
        """Forget the publisher ``address`` (no longer subscribed to)."""
        ...

    def expected(self, address: str) -> int | None:
        """The next sequence expected from ``address`` (``None``: none yet, or since a reset)."""
        ...

    def apply(self, address: str, batch: EventBatch, now: float, replayable: bool) -> Applied | ReplayFrom:
        """Take ``batch`` from ``address``, or ask for a replay (``replayable``: its socket may be asked)."""
        ...

    def is_stale(self, address: str, now: float) -> bool:
        """``address`` has not published for too long (or is not watched)."""
        ...

    def blocks(self) -> dict[str, dict[str, int]]:
        """Blocks held per publisher and tier."""
        ...


class EventFeed(NamedTuple):
    """The ``kv-events`` source in force as its subscribers see it: its settings (ports, queue) and sink."""

    settings: KvEventsSettings
    sink: EventSink
