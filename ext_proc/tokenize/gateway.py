"""The gateway tokenizer: a loaded tokenizer folder run off the event loop, its failures counted.

- :class:`GatewayTokenizer` is what the router awaits: :meth:`GatewayTokenizer.prompt_tokens` runs the
  prompt tokenizer (:mod:`ext_proc.tokenize.prompt`) on a thread of its own; the encoders release the
  GIL while they encode, so the event loop keeps serving.
- It answers ``None`` instead of raising: a folder that did not load, a template that fails, a body it
  cannot render are logged (once per reason) and counted, and the caller routes that request on the
  ``approximate`` index.
- The folder is loaded by :mod:`ext_proc.tokenize.folder`, on the calling thread
  (:meth:`GatewayTokenizer.open`) or a worker thread (:meth:`GatewayTokenizer.open_off_loop`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from ext_proc.tokenize.base import Tokenized, TokenizeFailure, UntokenizedReason
from ext_proc.tokenize.folder import LoadedTokenizer, TokenizerLoadError, TokenizerSettings, load_folder
from ext_proc.tokenize.prompt import PromptTokenizer

log = logging.getLogger(__name__)


class TokenizeSink(Protocol):
    """Where the gateway tokenizer reports (:class:`ext_proc.metrics.Metrics` is one)."""

    def tokenized(self, seconds: float, tokens: int, cached: int) -> None:
        """One prompt tokenized: ``seconds`` waited, ``tokens`` ids, ``cached`` of them reused."""
        ...

    def untokenized(self, reason: str) -> None:
        """One prompt not tokenized, for ``reason`` (an ``UntokenizedReason`` value)."""
        ...

    def tokenizer_encoder(self, encoder: str | None) -> None:
        """The encoder now in use (``fastokens``, ``tiktoken``, ``tokenizers``); ``None``: no tokenizer."""
        ...


class GatewayTokenizer:
    """Tokenizes requests' prompts off the event loop; ``None`` (counted, logged) where it cannot.

    ``tokenizer`` is ``None`` when the folder did not load (every prompt is then ``None``, counted as
    ``no_tokenizer``). One worker thread: requests are tokenized one at a time, in arrival order, and the
    prefix cache is touched by that thread alone. ``clock`` gives the cache's time (seconds)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer | None,
        sink: TokenizeSink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self._sink = sink
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._warned: set[UntokenizedReason] = set()

    @classmethod
    def open(cls, settings: TokenizerSettings, sink: TokenizeSink) -> GatewayTokenizer:
        """A gateway tokenizer for ``settings.folder``; one that answers ``None`` when it does not load.

        Loads on the calling thread (:meth:`open_off_loop` does not), logs which encoder it runs and why,
        and tells ``sink`` (``None``: no tokenizer)."""
        return cls.opened(settings, load_folder(settings), sink)

    @classmethod
    async def open_off_loop(cls, settings: TokenizerSettings, sink: TokenizeSink) -> GatewayTokenizer:
        """:meth:`open`, the folder loaded (and its fast encoder checked) on a worker thread."""
        return cls.opened(settings, await asyncio.to_thread(load_folder, settings), sink)

    @classmethod
    def opened(
        cls, settings: TokenizerSettings, loaded: LoadedTokenizer | TokenizerLoadError, sink: TokenizeSink
    ) -> GatewayTokenizer:
        """The gateway tokenizer of ``loaded`` (what :func:`load_folder` gave); logged, ``sink`` told."""
        if isinstance(loaded, TokenizerLoadError):
            log.error("tokenizer folder unusable, prompts are routed on the approximate index: %s", loaded)
            sink.tokenizer_encoder(None)
            return cls(None, sink)
        log.info("tokenizer %s encodes with %s: %s", settings.folder, loaded.encoder, loaded.why)
        sink.tokenizer_encoder(loaded.encoder)
        return cls(loaded.tokenizer, sink)

    async def prompt_tokens(self, body: Mapping[str, object], path: str) -> Sequence[int] | None:
        """The engine's token ids for ``body`` sent to ``path``; ``None`` when they cannot be known.

        ``body`` must not change until this returns (the worker thread reads it)."""
        if self.tokenizer is None:
            self._failed(UntokenizedReason.NO_TOKENIZER, "no tokenizer loaded")
            return None
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor, self._tokens, self.tokenizer, body, path)
        except TokenizeFailure as failure:
            self._failed(failure.reason, str(failure))
            return None
        self._sink.tokenized(time.perf_counter() - started, len(result.ids), result.cached)
        return result.ids

    def _tokens(self, tokenizer: PromptTokenizer, body: Mapping[str, object], path: str) -> Tokenized:
        return tokenizer.tokens(body, path, self._clock())

    def _failed(self, reason: UntokenizedReason, message: str) -> None:
        self._sink.untokenized(reason.value)
        if reason in self._warned:
            log.debug("prompt not tokenized (%s): %s", reason.value, message)
        else:
            self._warned.add(reason)
            log.warning("prompt not tokenized (%s, logged once; counted after): %s", reason.value, message)

    def close(self) -> None:
        """Stop the worker thread once the prompts already asked for are tokenized (without waiting)."""
        self._executor.shutdown(wait=False)
