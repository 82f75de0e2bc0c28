"""The ``kv-events`` prefix source in virtual time: the simulated engines' KV-cache events fed in process.

:class:`KvEventFeed` hooks every simulated engine's prefix cache (:attr:`sim.prefix.BlockCache.events`):
each batch an engine reports is encoded on vLLM's wire (:func:`sim.kv_events.frames`, in the feed's
encoding) and decoded by the gateway's own decoder (:func:`ext_proc.prefix.kv_events.decode_message`),
then applied, at the engines' virtual time, to the index of every subscribed router, as
:mod:`ext_proc.kv_subscribers` applies what its ZMQ sockets receive: every gateway replica subscribed
to every engine. Only the sockets, and the milliseconds an event takes to arrive, are left out.

:class:`EventReplica` is one gateway replica on that source: pd-extproc's own
:class:`~ext_proc.router.Router` (``affinity.prefix.source: kv-events``, its clock the engines' virtual
one), given each chat request's prompt as the engines' token ids (:func:`sim.prefix.token_ids`, the
simulator's tokenizer: what the gateway tokenizer does for a real model), so the request's chain and
the events' chains meet. It routes as the gateway does with a tokenizer (``affinity.prefix.tokenizer``):
it reads the chat body and routes it on the ids, which it is handed in an array; the tokenizer's own
work, on the gateway's worker thread, is timed apart from the router's (its cost with a real model's
tokenizer: ``bench/tokenize_cost.py``). Replicas share nothing but the engines' events.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from itertools import count

from bench.prefix_peers import CHAT_PATH, COMPLETIONS_PATH, Endpoint, PdExtproc, Placed
from ext_proc.affinity import Policy
from ext_proc.prefix.blocks import prompt_content
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kv_events import Event, decode_message
from ext_proc.prefix.settings import PrefixSettings, PrefixSourceKind
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


def prompt_ids(body: dict[str, object]) -> array:
    """The engines' token ids of ``body``'s prompt, as an array of unsigned 64-bit ints.

    The simulator's tokenizer makes them; the gateway tokenizer hands the router its ids in an array too
    (unsigned 32-bit)."""
    content = prompt_content(body)
    assert content, "every benchmark request has a prompt"
    return array("Q", token_ids(content))


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
        source = self.live.prefix
        assert isinstance(source, KvEventSource)
        feed.subscribe(source)

    def place(self, body: dict[str, object]) -> Placed:
        """Route ``body`` on its prompt's token ids, as the gateway does with its tokenizer.

        The prompt is put in the engines' token ids first (timed apart: :attr:`Placed.tokenize_s`), the body
        read, and routed on those ids."""
        started = time.perf_counter()
        ids = prompt_ids(body)
        tokenize_s = time.perf_counter() - started
        path = CHAT_PATH if "messages" in body else COMPLETIONS_PATH
        return self.place_raw(json.dumps(body).encode(), path, ids)._replace(tokenize_s=tokenize_s)
