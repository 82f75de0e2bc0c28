"""The sglang-bootstrap handoff: SGLang's PD disaggregation, prefill and decode at the same time.

The body gets ``bootstrap_host`` (the prefill's IP), ``bootstrap_port`` (its ``bootstrap_port``
endpoint metadata, else the configured default) and ``bootstrap_room`` (a random 63-bit integer, the
rendezvous key: no client can choose or predict it); for a batched completions prompt, a list of each
with one room per prompt. Envoy forwards it to the decode while the same
body goes to the prefill through the prefill-leg listener, concurrently: the prefill waits for the
decode to connect before it sends the KV cache, so waiting for the prefill first would deadlock.
The prefill leg is drained in the background (:mod:`ext_proc.handoff.background`): a failed one is
logged, counted and (unless a 4xx) ejects that prefill; the decode engine then fails the request itself
once its bootstrap wait times out (docs/handoffs.md "Handoff modes").
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from ext_proc.handoff.background import BackgroundLegs
from ext_proc.handoff.base import DecodeRoute, Rerouter, leg_headers, new_request_id
from ext_proc.handoff.body import HANDOFF_FIELDS, with_fields
from ext_proc.handoff.kv_failure import KvPullWatcher
from ext_proc.handoff.leg import PrefillClient
from ext_proc.metrics import Metrics
from ext_proc.outcome import HandoffJob, Placement, Routed

if TYPE_CHECKING:
    from ext_proc.handoff.config import HandoffConfig
    from ext_proc.handoff.routing import RoutingConfig


def prompt_count(body: dict[str, object]) -> int:
    """How many requests SGLang makes of a body.

    A completions ``prompt`` that is a list of strings or of token-id lists is a batch of that many;
    anything else (a string, one token-id list, chat) is one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt):
        return len(prompt)
    return 1


def bootstrap_fields(host: str, port: int, count: int) -> dict[str, object]:
    """The bootstrap fields of ``count`` requests.

    Scalars for one; for a batch, lists of ``count`` (SGLang's ``GenerateReqInput`` indexes them per
    prompt), one random room per prompt."""
    if count == 1:
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": secrets.randbits(63)}
    rooms = [secrets.randbits(63) for _ in range(count)]
    return {"bootstrap_host": [host] * count, "bootstrap_port": [port] * count, "bootstrap_room": rooms}


def bootstrap_host(address: str) -> str:
    """The IP of an ``"ip:port"`` / ``"[ipv6]:port"`` address, as SGLang expects ``bootstrap_host``."""
    return address.rpartition(":")[0].strip("[]")


def build(routing: RoutingConfig, settings: HandoffConfig, metrics: Metrics) -> SglangBootstrapHandoff:
    """The sglang-bootstrap handoff of ``routing`` and ``settings`` (the ``handoff`` section)."""
    route, client = DecodeRoute.of(routing), PrefillClient.of(routing, settings)
    return SglangBootstrapHandoff(settings, route=route, client=client, metrics=metrics)


class SglangBootstrapHandoff:
    """The concurrent handoff; see the module docstring.

    Of ``settings`` it reads ``default_bootstrap_port`` and ``watch_streamed_answers``."""

    hands_kv = True
    pins_ranks = False  # SGLang engines read no X-data-parallel-rank

    def __init__(
        self, settings: HandoffConfig, *, route: DecodeRoute, client: PrefillClient, metrics: Metrics
    ) -> None:
        self.route = route
        self.metrics = metrics
        self.watch_streams = settings.watch_streamed_answers
        self.legs = BackgroundLegs(client, metrics, "its decode fails once its bootstrap wait ends")
        self.default_bootstrap_port = settings.default_bootstrap_port
        self.routing_headers = route.routing_headers

    def hand_off(self, job: HandoffJob, placement: Placement, router: Rerouter) -> Routed:
        """Answer at once: the decode gets the bootstrap fields, the prefill leg starts alongside."""
        decision, lease = placement.decision, placement.lease
        prefill = decision.prefill
        if prefill is None:
            return self.route.decode_only(job, placement, None)
        port = prefill.bootstrap_port or self.default_bootstrap_port
        fields = bootstrap_fields(bootstrap_host(prefill.address), port, prompt_count(job.body))
        body = with_fields(job.raw, job.body, fields, HANDOFF_FIELDS)
        request_id = new_request_id()
        headers = leg_headers(request_id, job)
        leg = self.legs.start(prefill, job.meta.path, body, headers, lease, router)
        watcher = KvPullWatcher(prefill.address, lease, self.metrics, router, self.watch_streams)
        return self.route.routed(placement, request_id, body, watcher=watcher, background=leg)

    async def close(self) -> None:
        """Cancel the prefill legs still running and close their connections."""
        await self.legs.close()
