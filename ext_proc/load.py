"""Local in-flight load accounting and the admission limit on the requests in flight.

What each routed request charges, and its release (:class:`Lease`); how many requests may be in
flight at once (:class:`Admission`).

The load signal is the in-flight token sum per endpoint, charged when a request is routed and
released when Envoy is done with it, through :class:`~ext_proc.registry.EndpointState` (which writes
the endpoint's slot of the registry's load arrays). A :class:`Lease` releases each charge at most once, so a
``finally`` may call :meth:`Lease.release` whatever already happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ext_proc.checks import ConfigError, in_range
from ext_proc.registry import EndpointState
from ext_proc.request import MAX_OUTPUT_BUDGET

MAX_RETRY_AFTER = 3600
"""Upper bound of ``limits.retry_after_seconds`` (seconds)."""


class Lease:
    """The charges of one routed request: prefill (prompt tokens) and decode (prompt + output budget)."""

    __slots__ = ("_decode", "_decode_tokens", "_prefill", "_prefill_tokens")

    def __init__(
        self, prefill: EndpointState | None, prefill_tokens: int, decode: EndpointState, decode_tokens: int
    ) -> None:
        self._prefill = prefill
        self._prefill_tokens = prefill_tokens
        self._decode: EndpointState | None = decode
        self._decode_tokens = decode_tokens
        if prefill is not None:
            prefill.charge(prefill_tokens)
        decode.charge(decode_tokens)

    def release_prefill(self) -> None:
        """Release the prefill charge (the prompt has been processed); idempotent."""
        prefill = self._prefill
        if prefill is not None:
            self._prefill = None
            prefill.release(self._prefill_tokens)

    @property
    def decode(self) -> EndpointState | None:
        """The decode endpoint charged, ``None`` once released."""
        return self._decode

    def move_decode(self, served: EndpointState) -> None:
        """Move the decode charge to ``served``, the endpoint that serves the request instead.

        Nothing moves once the charge has been released."""
        decode = self._decode
        if decode is not None and decode is not served:
            decode.release(self._decode_tokens)
            served.charge(self._decode_tokens)
            self._decode = served

    def release(self) -> None:
        """Release everything still charged; idempotent."""
        self.release_prefill()
        decode = self._decode
        if decode is not None:
            self._decode = None
            decode.release(self._decode_tokens)


class Admission:
    """Admission control: the count of requests in flight against ``limit`` (0 = unlimited).

    A request takes a slot (:meth:`admit`) when it is about to be routed and gives it back
    (:meth:`release`) when its ext_proc stream ends or it is refused; the caller holds at most one
    slot per request and releases each once. O(1); the asyncio loop is the only caller, so no lock.
    ``retry_after_seconds`` is what a refused client is told to wait (``Retry-After``, seconds).
    ``on_release``, when set, is called after each slot given back (flow control hands it on).
    """

    __slots__ = ("inflight", "limit", "on_release", "retry_after_seconds")

    def __init__(self, limit: int = 0, retry_after_seconds: int = 1) -> None:
        self.limit = limit
        self.retry_after_seconds = retry_after_seconds
        self.inflight = 0
        self.on_release: Callable[[], None] | None = None

    def admit(self) -> bool:
        """Take a slot and return ``True``; ``False`` (nothing taken) when all ``limit`` are taken."""
        if self.limit and self.inflight >= self.limit:
            return False
        self.inflight += 1
        return True

    def release(self) -> None:
        """Give back one slot taken by :meth:`admit`."""
        self.inflight -= 1
        if self.on_release is not None:
            self.on_release()


@dataclass(frozen=True)
class LoadConfig:
    """Defaults for load accounting, in tokens."""

    default_max_tokens: int = 256
    default_token_capacity: float = 100_000.0

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first key out of range."""
        if self.default_max_tokens < 0:
            raise ConfigError("load.default_max_tokens: must be an integer >= 0")
        if self.default_max_tokens > MAX_OUTPUT_BUDGET:
            raise ConfigError(f"load.default_max_tokens: must be at most {MAX_OUTPUT_BUDGET}")
        if not self.default_token_capacity > 0:
            raise ConfigError("load.default_token_capacity: must be a number > 0")


@dataclass(frozen=True)
class LimitsConfig:
    """Admission control (docs/operations.md "Overload"), the :class:`Admission` limit.

    ``max_inflight_requests``: the most requests this server has routed and not yet seen end (their
    ext_proc stream open) at once; beyond it a request is answered 429 ``overloaded`` at once. 0 (the
    default) = unlimited, as before the key existed: the right limit depends on the cluster's
    capacity, so it is the operator's to set. ``retry_after_seconds``: the ``Retry-After`` of that 429.
    """

    max_inflight_requests: int = 0
    retry_after_seconds: int = 1

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first key out of range."""
        if self.max_inflight_requests < 0:
            raise ConfigError("limits.max_inflight_requests: must be an integer >= 0 (0 = unlimited)")
        in_range(
            "limits.retry_after_seconds", self.retry_after_seconds, 1, MAX_RETRY_AFTER, kind="an integer"
        )
