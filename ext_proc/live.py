"""The live parts: the prefix source, gateway tokenizer and shared state in force, and their lifecycles.

The router only reads them, per request (:mod:`ext_proc.router`: read → place → hand off). Everything
else that happens to them happens here, and each part of the shell that drives it receives the holder
or the one method it uses, never the router:

- the reloader (:mod:`ext_proc.reload`) swaps them (:meth:`LiveParts.set_prefix`): the prefix source is
  kept while its hashing stays, else built anew, its kernels compiled first; the tokenizer folder is
  opened on a worker thread, the previous tokenizer serving meanwhile;
- discovery (:class:`ext_proc.app.Readiness`) tells the prefix source which endpoints are left
  (:meth:`LiveParts.retain`), the engine scraper hands it the engines' counters
  (:meth:`LiveParts.engine_sampled`);
- the KV-event subscribers (:mod:`ext_proc.kv_subscribers`) write into the feed of the ``kv-events``
  source in force (:meth:`LiveParts.events`);
- the server starts and stops them (:meth:`LiveParts.start`, :meth:`LiveParts.stop`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ext_proc.metrics import Metrics
from ext_proc.prefix import kinds
from ext_proc.prefix.event_sink import EventFeed
from ext_proc.prefix.kinds import PrefixSource
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.shared.kinds import LocalState, SharedState
from ext_proc.tokenize.folder import TokenizerSettings
from ext_proc.tokenize.gateway import GatewayTokenizer


class LiveParts:
    """The swappable parts of one server, built from ``settings`` (``None``: no prefix source).

    ``prefix``: the prefix source (``None``: off); ``tokenizer``: the gateway tokenizer of
    ``settings.tokenizer`` (``None``: none configured); ``shared``: where placements are told to the
    peer replicas (``shared_state``; :class:`~ext_proc.shared.kinds.LocalState` until the server
    sets it). ``metrics`` counts what they report.
    """

    def __init__(self, settings: PrefixSettings | None, metrics: Metrics) -> None:
        self._metrics = metrics
        self.prefix: PrefixSource | None = None
        folder = "" if settings is None else settings.tokenizer
        self.tokenizer: GatewayTokenizer | None = (
            GatewayTokenizer.open(TokenizerSettings(folder), metrics) if folder else None
        )
        self._tokenizer_folder = folder
        self.tokenizer_opening: asyncio.Task[None] | None = None
        """The load of a tokenizer folder a reload named, while it runs (:meth:`set_prefix`)."""
        self.shared: SharedState = LocalState()
        self.set_prefix(settings)

    def set_prefix(self, settings: PrefixSettings | None) -> None:
        """Route every later request with the prefix source of ``settings`` (``None``: without one).

        The source is of the kind ``settings.source`` names. It is kept while its kind and hashing (and,
        for ``kv-events``, its own settings) stay the same (:func:`~ext_proc.prefix.kinds.keeps_state`),
        and starts empty when they change, its kernels compiled first (:func:`~ext_proc.prefix.kinds.build`).
        The tokenizer folder ``settings.tokenizer`` is opened when it changes: on a worker thread when
        the event loop runs (:attr:`tokenizer_opening`; a second or so with its fast encoder's check),
        the previous tokenizer (or none: prompts routed on their text) serving meanwhile; a folder that
        does not load is logged, and its prompts are counted and routed untokenized."""
        self._set_tokenizer("" if settings is None else settings.tokenizer)
        if settings is None:
            self.prefix = None
        elif self.prefix is not None and kinds.keeps_state(self.prefix.settings, settings):
            self.prefix.settings = settings
        else:
            self.prefix = kinds.build(settings, self._metrics)

    def _set_tokenizer(self, folder: str) -> None:
        """Tokenize with the folder ``folder`` (``""``: none) from now on, or once it is loaded."""
        if folder == self._tokenizer_folder:
            return
        self._tokenizer_folder = folder
        if self.tokenizer_opening is not None:
            self.tokenizer_opening.cancel()  # superseded: its folder is no longer the configured one
            self.tokenizer_opening = None
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # no event loop to keep serving: load here
            loop = None
        if not folder:
            self._use_tokenizer(None)
        elif loop is None:
            self._use_tokenizer(GatewayTokenizer.open(TokenizerSettings(folder), self._metrics))
        else:
            self.tokenizer_opening = loop.create_task(self._open_tokenizer(folder))

    async def _open_tokenizer(self, folder: str) -> None:
        """Load ``folder`` on a worker thread, then tokenize with it (a later change cancels this first)."""
        opened = await GatewayTokenizer.open_off_loop(TokenizerSettings(folder), self._metrics)
        self.tokenizer_opening = None
        self._use_tokenizer(opened)

    def _use_tokenizer(self, tokenizer: GatewayTokenizer | None) -> None:
        """Tokenize later prompts with ``tokenizer`` (``None``: none), the previous one closed."""
        if self.tokenizer is not None:
            self.tokenizer.close()
        self.tokenizer = tokenizer
        if tokenizer is None:
            self._metrics.tokenizer_encoder(None)

    def events(self) -> EventFeed | None:
        """What the KV-event subscribers feed now: the ``kv-events`` source's (``None``: another, or none)."""
        prefix = self.prefix
        return None if prefix is None else prefix.events()

    def retain(self, addresses: Iterable[str]) -> None:
        """Discovery's endpoints are now ``addresses``: the prefix source forgets every other endpoint."""
        if self.prefix is not None:
            self.prefix.retain(set(addresses))

    def engine_sampled(self, address: str, queries: float | None, hits: float | None) -> None:
        """An engine's prefix-cache counters (tokens, since it started) arrived with its load sample."""
        if self.prefix is not None:
            self.prefix.observe(address, queries, hits)

    async def start(self) -> None:
        """Start the shared state: it learns the peers' state before the first request (bounded wait)."""
        await self.shared.start()

    async def stop(self) -> None:
        """Stop the shared state (what is pending is sent), then :meth:`close` the tokenizer."""
        await self.shared.stop()
        self.close()

    def close(self) -> None:
        """Stop the gateway tokenizer's thread, if any, and a tokenizer load (the server is stopping)."""
        if self.tokenizer_opening is not None:
            self.tokenizer_opening.cancel()
        if self.tokenizer is not None:
            self.tokenizer.close()
