"""The vllm-mooncake handoff: vLLM's upstream ``MooncakeConnector``, prefill and decode at the same time.

As vLLM's connector expects (``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/`` in vLLM 0.32:
``mooncake_connector.py``, ``mooncake_utils.py``; llm-d's sidecar ``connector_mooncake.go`` speaks the
same): every prefill engine runs a bootstrap server (``VLLM_MOONCAKE_BOOTSTRAP_PORT``, 8998) whose
``GET /query`` answers ``{"<dp_rank>": {"engine_id": str, "worker_addr": {...}}, ...}``. Per request:

1. the prefill's engine ids come from that ``/query`` (``http://<prefill ip>:<bootstrap_port
   metadata, else handoff.default_bootstrap_port>``), cached per prefill for
   :data:`ENGINE_IDS_MAX_AGE_SECONDS` and dropped after a failed leg; the data-parallel rank is the
   one the placement pins (:mod:`ext_proc.prefix.ranks`) when listed, else one picked at random;
2. the decode gets the client's body plus ``kv_transfer_params = {do_remote_prefill: true,
   do_remote_decode: false, transfer_id, remote_bootstrap_addr, remote_engine_id}`` (that rank's
   engine id) and is answered at once;
3. alongside, the prefill leg (:func:`~ext_proc.handoff.body.prefill_leg_body` with ``{do_remote_decode:
   true, do_remote_prefill: false, transfer_id}``, ``X-data-parallel-rank`` = the rank, the same
   gateway-made ``X-Request-Id``) runs in the background (:mod:`ext_proc.handoff.background`).

``transfer_id`` (``xfer-<uuid>``) is made by the gateway: both legs carry it, no client can choose it.
The prefill's answer carries no ``kv_transfer_params`` (its connector returns none), so it is only
drained. A ``/query`` that fails (connect error, timeout, non-2xx, no engine id) is retried once on the
next-ranked prefill, then ``handoff.on_prefill_failure`` applies, as for a failed kv-transfer-params leg.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ext_proc.handoff.background import BackgroundLegs
from ext_proc.handoff.base import (
    DP_RANK_HEADER,
    DecodeRoute,
    Rerouter,
    leg_headers,
    new_request_id,
)
from ext_proc.handoff.body import HANDOFF_FIELDS, KV_TRANSFER_PARAMS, prefill_leg_body, with_fields
from ext_proc.handoff.fallback import Attempts, LegHandoff
from ext_proc.handoff.kv_failure import KvPullWatcher
from ext_proc.handoff.leg import LegError, LegOutcome, PrefillClient
from ext_proc.metrics import Metrics
from ext_proc.outcome import HandoffJob, Placement, Refused, Routed
from ext_proc.registry import EndpointState

if TYPE_CHECKING:
    from ext_proc.handoff.config import HandoffConfig
    from ext_proc.handoff.routing import RoutingConfig

log = logging.getLogger(__name__)

ENGINE_IDS_MAX_AGE_SECONDS = 30.0
"""How long a prefill's ``/query`` answer is reused (a restarted engine has new engine ids)."""
QUERY_TIMEOUT_SECONDS = 5.0
"""Bound of one ``/query`` (llm-d's sidecar uses the same)."""
TIMEOUT_MARGIN_SECONDS = 5.0
"""Added to two queries' worst case when asking Envoy to wait for the answer."""


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """A prefill's Mooncake bootstrap server: its ``url`` and engine id per data-parallel rank."""

    url: str
    engine_ids: dict[int, str]


def bootstrap_url(address: str, port: int) -> str:
    """``http://<host of address>:<port>`` (an IPv6 host keeps its brackets), as ``remote_bootstrap_addr``."""
    return f"http://{address.rpartition(':')[0]}:{port}"


def parse_query(data: bytes) -> dict[int, str]:
    """The engine id per data-parallel rank of a ``/query`` answer; ``ValueError`` says what is wrong.

    vLLM's ``MooncakeBootstrapServer.query`` answers ``{"<dp_rank>": {"engine_id": str, "worker_addr":
    {...}}}``; a rank without a string ``engine_id`` is left out, and at least one must remain.
    """
    try:
        answer = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(answer, dict):
        raise ValueError("not a JSON object")
    engine_ids: dict[int, str] = {}
    for rank, entry in answer.items():
        engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
        if isinstance(engine_id, str) and engine_id and rank.isdigit():
            engine_ids[int(rank)] = engine_id
    if not engine_ids:
        raise ValueError("no data-parallel rank with an engine_id (has the prefill registered its workers?)")
    return engine_ids


def decode_params(transfer_id: str, bootstrap: Bootstrap, rank: int) -> dict[str, object]:
    """The decode's ``kv_transfer_params``: pull ``transfer_id`` from ``rank``'s engine."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap.url,
        "remote_engine_id": bootstrap.engine_ids[rank],
    }


def prefill_params(transfer_id: str) -> dict[str, object]:
    """The prefill leg's ``kv_transfer_params``: keep ``transfer_id``'s KV for a remote decode."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def build(routing: RoutingConfig, settings: HandoffConfig, metrics: Metrics) -> VllmMooncakeHandoff:
    """The vllm-mooncake handoff of ``routing`` and ``settings`` (the ``handoff`` section)."""
    route, client = DecodeRoute.of(routing), PrefillClient.of(routing, settings)
    return VllmMooncakeHandoff(settings, route=route, client=client, metrics=metrics)


class VllmMooncakeHandoff(LegHandoff):
    """The concurrent Mooncake handoff; see the module docstring.

    Of ``settings`` it reads ``default_bootstrap_port`` besides what :class:`LegHandoff` reads."""

    def __init__(
        self, settings: HandoffConfig, *, route: DecodeRoute, client: PrefillClient, metrics: Metrics
    ) -> None:
        super().__init__(settings, route=route, client=client, metrics=metrics)
        self.default_bootstrap_port = settings.default_bootstrap_port
        self.legs = BackgroundLegs(
            client,
            metrics,
            "its decode fails once its KV pull times out (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s)",
        )
        self._bootstraps: dict[str, tuple[float, Bootstrap]] = {}

    def hand_off(self, job: HandoffJob, placement: Placement, router: Rerouter) -> Routed | BootstrapQuery:
        """Hand off at once when possible, else after querying the prefill's engine ids.

        Decode-only at once without a prefill; else at once when the prefill's engine ids are known, or
        after querying them."""
        prefill = placement.decision.prefill
        request_id = new_request_id()
        if prefill is None:
            return self.route.decode_only(job, placement, request_id)
        known = self.known(prefill.address)
        if known is not None:
            return self.route_both(job, placement, known, request_id, router)
        return BootstrapQuery(self, job, placement, router, request_id)

    def known(self, address: str) -> Bootstrap | None:
        """The cached bootstrap of the prefill at ``address``, unless older than the max age."""
        entry = self._bootstraps.get(address)
        if entry is None or time.monotonic() - entry[0] > ENGINE_IDS_MAX_AGE_SECONDS:
            return None
        return entry[1]

    def forget(self, address: str) -> None:
        """Drop the cached bootstrap of ``address`` (its leg failed: the engine may have restarted)."""
        self._bootstraps.pop(address, None)

    async def query(self, prefill: EndpointState) -> Bootstrap:
        """Ask ``prefill``'s bootstrap server for its engine ids, count the outcome and cache them.

        Raise :class:`LegError` (BAD_RESPONSE / SERVER_ERROR for an answer without them)."""
        try:
            bootstrap = await self._query(prefill)
        except LegError as exc:
            self.metrics.bootstrap_query(exc.outcome.value)
            raise
        self.metrics.bootstrap_query(LegOutcome.OK.value)
        self._bootstraps[prefill.address] = (time.monotonic(), bootstrap)
        return bootstrap

    async def _query(self, prefill: EndpointState) -> Bootstrap:
        url = bootstrap_url(prefill.address, prefill.bootstrap_port or self.default_bootstrap_port)
        reply = await self.client.get(url + "/query", QUERY_TIMEOUT_SECONDS)
        if not 200 <= reply.status < 300:
            text = reply.body[:300].decode(errors="replace")
            raise LegError(LegOutcome.SERVER_ERROR, f"{url}/query: HTTP {reply.status}: {text}")
        try:
            return Bootstrap(url, parse_query(reply.body))
        except ValueError as exc:
            raise LegError(LegOutcome.BAD_RESPONSE, f"{url}/query: {exc}") from None

    def route_both(
        self, job: HandoffJob, placement: Placement, bootstrap: Bootstrap, request_id: str, router: Rerouter
    ) -> Routed:
        """Start the prefill leg and answer with the decode's body.

        The prefill's data-parallel rank is the one the placement pins when the bootstrap lists it, else
        one at random."""
        decision, lease = placement.decision, placement.lease
        prefill = decision.prefill
        assert prefill is not None
        rank = placement.ranks.prefill
        if rank not in bootstrap.engine_ids:
            rank = secrets.choice(sorted(bootstrap.engine_ids))
        transfer_id = f"xfer-{uuid.uuid4()}"
        params = decode_params(transfer_id, bootstrap, rank)
        body = with_fields(job.raw, job.body, {KV_TRANSFER_PARAMS: params}, HANDOFF_FIELDS)
        headers = {**leg_headers(request_id, job), DP_RANK_HEADER: str(rank)}
        leg_body = prefill_leg_body(job.body, prefill_params(transfer_id))
        address = prefill.address
        leg = self.legs.start(
            prefill, job.meta.path, leg_body, headers, lease, router, lambda: self.forget(address)
        )
        watcher = KvPullWatcher(address, lease, self.metrics, router, self.watch_streams)
        return self.route.routed(placement, request_id, body, watcher=watcher, background=leg)

    async def close(self) -> None:
        """Cancel the prefill legs still running and close their connections."""
        await self.legs.close()


class BootstrapQuery(Attempts):
    """One request waiting for its prefill's engine ids (a :class:`~ext_proc.outcome.PendingAnswer`)."""

    timeout = 2 * QUERY_TIMEOUT_SECONDS + TIMEOUT_MARGIN_SECONDS

    def __init__(
        self,
        handoff: VllmMooncakeHandoff,
        job: HandoffJob,
        placement: Placement,
        router: Rerouter,
        request_id: str,
    ) -> None:
        super().__init__(handoff, job, placement, router, request_id)
        self._handoff = handoff

    async def complete(self) -> Routed | Refused:
        """Query the prefill's bootstrap server (and at most one other prefill's), then route."""
        handoff = self._handoff
        while True:
            prefill = self._placement.decision.prefill
            assert prefill is not None
            try:
                bootstrap = handoff.known(prefill.address) or await handoff.query(prefill)
            except LegError as exc:
                log.warning(
                    "Mooncake bootstrap query to prefill %s: %s (%s); request %s",
                    prefill.address,
                    exc.outcome.value,
                    exc,
                    self._request_id,
                )
                if not self.retry(prefill, exc.outcome):
                    self.lease.release_prefill()
                    failure = f"the Mooncake bootstrap server of prefill {prefill.address} failed: {exc}"
                    return self.give_up(exc.outcome, failure)
                continue
            return handoff.route_both(self._job, self._placement, bootstrap, self._request_id, self._router)
