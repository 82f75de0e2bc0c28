"""The prefill leg: an HTTP POST to the chosen prefill engine, through Envoy or directly.

Through Envoy (``via`` set, e.g. ``http://127.0.0.1:10001``: the shipped bootstrap's prefill-leg
listener), the request goes to ``via`` + the client's path with the destination header naming the
prefill, so Envoy's override_host policy forwards it there; directly (``via`` empty), to
``http://<prefill address><path>``. :meth:`PrefillClient.send` returns what came back or raises
:class:`LegError` saying how it failed; it never retries.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from ext_proc.handoff.config import HandoffConfig
    from ext_proc.handoff.routing import RoutingConfig

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Largest prefill answer read (a one-token completion, unless the client asked for prompt logprobs)."""
UPSTREAM_HEADER = "x-gateway-prefill-upstream"
"""Response header the shipped prefill-leg listener sets to the address that served."""
IDLE_CONNECTION_SECONDS = 3.0
"""A pooled connection idle this long is closed: below the engines' HTTP keep-alive (vLLM's and
SGLang's uvicorn end an idle connection after 5 s), so a leg is never written on a connection the
engine is closing at that moment. The shipped Envoy clusters use the same ``idle_timeout``."""


class LegOutcome(enum.StrEnum):
    """How one prefill leg ended: the ``outcome`` label of ``pd_extproc_prefill_leg_total``."""

    OK = "ok"
    NO_KV_TRANSFER_PARAMS = "no_kv_transfer_params"
    CONNECT_ERROR = "connect_error"
    SERVER_ERROR = "server_error"
    TIMEOUT = "timeout"
    BAD_RESPONSE = "bad_response"
    CLIENT_ERROR = "client_error"
    CANCELLED = "cancelled"


class LegError(Exception):
    """A prefill leg that produced no HTTP answer: ``outcome`` is CONNECT_ERROR or TIMEOUT."""

    def __init__(self, outcome: LegOutcome, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


@dataclass(frozen=True, slots=True)
class LegReply:
    """An HTTP answer from (or, through Envoy, on behalf of) the prefill.

    ``upstream`` is the address Envoy reports having used (``None`` when sent directly or not said);
    ``seconds`` the leg's wall time.
    """

    status: int
    body: bytes
    upstream: str | None
    seconds: float


class PrefillClient:
    """Sends prefill legs over one pooled HTTP client session (created on first use, in the loop)."""

    def __init__(self, via: str, destination_header: str, timeout_seconds: float) -> None:
        self._via = via.rstrip("/")
        self._destination_header = destination_header
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def of(cls, routing: RoutingConfig, settings: HandoffConfig) -> PrefillClient:
        """The client of ``settings.prefill_via``, naming the prefill in ``routing.destination_header``.

        Each leg is bounded by ``prefill_timeout_seconds``."""
        return cls(settings.prefill_via, routing.destination_header, settings.prefill_timeout_seconds)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, use_dns_cache=True, keepalive_timeout=IDLE_CONNECTION_SECONDS
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False
            )
        return self._session

    async def send(self, address: str, path: str, body: bytes, headers: Mapping[str, str]) -> LegReply:
        """POST ``body`` (JSON) to the prefill at ``address`` on ``path``; raise :class:`LegError`."""
        sent = {**headers, "content-type": "application/json"}
        if self._via:
            url = self._via + path
            sent[self._destination_header] = address
        else:
            url = f"http://{address}{path}"
        return await self._exchange(self._client().post(url, data=body, headers=sent), self._timeout.total)

    async def get(self, url: str, timeout_seconds: float) -> LegReply:
        """GET ``url`` directly (not through Envoy) within ``timeout_seconds``; raise :class:`LegError`."""
        request = self._client().get(url, timeout=aiohttp.ClientTimeout(total=timeout_seconds))
        return await self._exchange(request, timeout_seconds)

    @staticmethod
    async def _exchange(request: Any, timeout_seconds: float | None) -> LegReply:
        """Run ``request`` (an aiohttp request context manager) and read the whole answer."""
        started = time.perf_counter()
        try:
            async with request as response:
                data = await _read_capped(response)
                upstream = response.headers.get(UPSTREAM_HEADER)
                return LegReply(response.status, data, upstream, time.perf_counter() - started)
        except TimeoutError:
            raise LegError(LegOutcome.TIMEOUT, f"no answer within {timeout_seconds:g} s") from None
        except aiohttp.ClientError as exc:
            raise LegError(LegOutcome.CONNECT_ERROR, f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        """Close the pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_capped(response: aiohttp.ClientResponse) -> bytes:
    """The whole response body, or a :class:`LegError` (BAD_RESPONSE) beyond MAX_RESPONSE_BYTES."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise LegError(LegOutcome.BAD_RESPONSE, f"answer larger than {MAX_RESPONSE_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
