"""The ``kv-events`` prefix source in virtual time: the simulated engines' KV-cache events fed in process.

:class:`KvEventFeed` hooks every simulated engine's prefix cache (:attr:`sim.prefix.BlockCache.events`):
each batch an engine reports is encoded on vLLM's wire (:func:`sim.kv_events.frames`, in the feed's
encoding) and decoded by the gateway's own decoder (:func:`ext_proc.prefix.kv_events.decode_message`),
then applied, at the engines' virtual time, to the index of every subscribed router, as
:mod:`ext_proc.kv_subscribers` applies what its ZMQ sockets receive: every gateway replica subscribed
to every engine. Only the sockets, and the milliseconds an event takes to arrive, are left out.

:class:`EventReplica` is one gateway replica on that source: pd-extproc's own
:class:`~ext_proc.router.Router` (``affinity.prefix.source: kv-events``, its clock the engines' virtual
one), given each request's prompt as the engines' token ids (:func:`sim.prefix.token_ids`, the
simulator's tokenizer: what the gateway tokenizer does for a real model), so the request's chain and
the events' chains meet. Replicas share nothing but the engines' events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from itertools import count

from prefix_peers import Endpoint, PdExtproc, Placed

from ext_proc.affinity import Policy
from ext_proc.prefix import PrefixSettings, prompt_content
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kinds import PrefixSourceKind
from ext_proc.prefix.kv_events import Event, decode_message
from sim.config import KvEventEncoding
from sim.engine import Engine
from sim.kv_events import frames
from sim.prefix import token_ids

EVENTS = PrefixSettings(source=PrefixSourceKind.KV_EVENTS.value)
"""``affinity.prefix`` with the ``kv-events`` source, every other key its default."""


class KvEventFeed:
    """The KV-cache events of ``engines`` (by address), fed to the subscribed sources' indexes."""

    def __init__(self, engines: Mapping[str, Engine], encoding: KvEventEncoding = "array") -> None:
        self.encoding = encoding
        self.batches = 0
        self._sources: list[KvEventSource] = []
        self._clock: Callable[[], float] = next(iter(engines.values())).clock.now
        for address, engine in engines.items():
            engine.scheduler.cache.events = partial(self._publish, address, count())

    def subscribe(self, source: KvEventSource) -> None:
        """Feed ``source``'s index from now on (and read its time from the engines' clock)."""
        source.clock = self._clock
        self._sources.append(source)

    def _publish(self, address: str, sequence: Iterator[int], events: list[Event]) -> None:
        batch = decode_message(frames(next(sequence), events, self.encoding))
        self.batches += 1
        now = self._clock()
        for source in self._sources:
            source.index.apply(address, batch, now, replayable=False)


def tokenized(body: dict[str, object]) -> dict[str, object]:
    """``body`` as a completions request whose prompt is the engines' token ids of its prompt."""
    content = prompt_content(body)
    assert content, "every benchmark request has a prompt"
    return {"model": body["model"], "prompt": token_ids(content), "max_tokens": body["max_tokens"]}


class EventReplica(PdExtproc):
    """One gateway replica on the ``kv-events`` source, subscribed to ``feed`` (module docstring).

    ``prefix``: its ``affinity.prefix`` (its ``source`` ``kv-events``)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        policy: Policy,
        feed: KvEventFeed,
        prefix: PrefixSettings = EVENTS,
    ) -> None:
        super().__init__(endpoints, policy, prefix)
        source = self.router.prefix
        assert isinstance(source, KvEventSource)
        feed.subscribe(source)

    def place(self, body: dict[str, object]) -> Placed:
        return super().place(tokenized(body))
