"""Engine requests pinned to the data-parallel rank whose cache the ``kv-events`` index credited.

The prefill leg the gateway sends and the decode request Envoy forwards carry ``x-data-parallel-rank``
(``kv-transfer-params``, ``vllm-mooncake``); the handoffs that cannot pin (``sidecar``,
``sglang-bootstrap``) credit an engine of several ranks nothing. A fake prefill client (no HTTP)."""

from __future__ import annotations

import json

import pytest
from builders import endpoint, registry_of
from test_engine_handoffs import BOOTSTRAP_ANSWER, LEG_ANSWER, FakePrefillClient, body_of

from ext_proc.affinity import Mode, Policy
from ext_proc.handoff.base import DecodeRoute
from ext_proc.handoff.config import HandoffConfig
from ext_proc.handoff.kinds import Handoff
from ext_proc.handoff.kv_transfer import KvTransferParamsHandoff
from ext_proc.handoff.leg import LegReply
from ext_proc.handoff.mooncake import VllmMooncakeHandoff
from ext_proc.handoff.sglang import SglangBootstrapHandoff
from ext_proc.handoff.sidecar import SidecarHandoff
from ext_proc.live import LiveParts
from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused, RequestMeta, Routed
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.event_index import ROOT
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kv_events import BlockStored, EventBatch
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.router import Router, RouterSettings

B = 16
PREFILL = "10.0.0.1:8000"  # 2 data-parallel ranks
DECODE = "10.0.1.1:8000"  # 4
RANK = "x-data-parallel-rank"
PROMPT = list(range(1, 4 * B + 1))
TWO_RANKS = json.dumps(
    {str(r): {"engine_id": f"e{r}", "worker_addr": {"0": {"0": "10.0.0.1:7000"}}} for r in range(2)}
).encode()


def handoff_of(mode: str, client: FakePrefillClient, metrics: Metrics) -> Handoff:
    route, settings = DecodeRoute("x-dest", "x-prefill"), HandoffConfig(default_bootstrap_port=8998)
    if mode == "kv-transfer-params":
        return KvTransferParamsHandoff(settings, route=route, client=client, metrics=metrics)
    if mode == "vllm-mooncake":
        return VllmMooncakeHandoff(settings, route=route, client=client, metrics=metrics)
    if mode == "sglang-bootstrap":
        return SglangBootstrapHandoff(settings, route=route, client=client, metrics=metrics)
    return SidecarHandoff("x-dest", "x-prefill")


def router_of(mode: str, client: FakePrefillClient) -> Router:
    """One prefill of 2 ranks whose rank 1 holds the prompt, one decode of 4 whose rank 3 holds it."""
    prefill = endpoint(PREFILL, kv_events_port=6000, data_parallel_size=2)
    decode = endpoint(DECODE, kv_events_port=6000, data_parallel_size=4)
    registry = registry_of([prefill], [decode], 10_000.0)
    metrics = Metrics(registry.endpoints)
    router = Router(
        RouterSettings(16),
        registry=registry,
        policy=Policy(Mode.PREFER, 0.3, 0, prefix_weight=0.5),
        handoff=handoff_of(mode, client, metrics),
        metrics=metrics,
        live=LiveParts(PrefixSettings(B, 100, source="kv-events"), metrics),
    )
    source = router.live.prefix
    assert isinstance(source, KvEventSource)
    stored = BlockStored(tuple(range(101, 105)), None, tuple(PROMPT), B)
    for name in (f"{PREFILL}@dp1", f"{DECODE}@dp3"):
        source.index.apply(name, EventBatch(0, 0.0, None, (stored,)), source.clock(), replayable=False)
    return router


async def answer(router: Router) -> Routed:
    body = {"model": "m", "prompt": [*PROMPT, 7], "max_tokens": 2, "kv_transfer_params": {}}
    result = router.route_body(json.dumps(body).encode(), RequestMeta("/v1/completions"))
    if not isinstance(result, Routed | Refused):
        result = await result.complete()
    assert isinstance(result, Routed), result
    return result


def predicted(router: Router, role: str) -> float:
    labels = {"role": role}
    return router.metrics.registry.get_sample_value("pd_extproc_prefix_predicted_hit_tokens_sum", labels) or 0


async def test_kv_transfer_pins_the_prefill_leg_and_the_decode_to_the_ranks_holding_the_prompt() -> None:
    client = FakePrefillClient(LEG_ANSWER)
    router = router_of("kv-transfer-params", client)
    result = await answer(router)
    ((_, _, _, headers),) = client.legs
    assert headers[RANK] == "1"
    assert dict(result.instructions.set_headers)[RANK] == "3"
    assert predicted(router, "prefill") == predicted(router, "decode") == 4 * B
    source = router.live.prefix
    assert isinstance(source, KvEventSource)  # the placements are recent on the pinned ranks
    recent = source.recent.match(block_hashes([*PROMPT, 7], B, 100, ROOT), source.clock())
    assert recent == {f"{PREFILL}@dp1": 4, f"{DECODE}@dp3": 4}


async def test_mooncake_takes_the_pinned_rank_of_the_prefill_when_its_bootstrap_lists_it() -> None:
    client = FakePrefillClient(LegReply(200, TWO_RANKS, None, 0.01), LEG_ANSWER)
    router = router_of("vllm-mooncake", client)
    result = await answer(router)
    assert body_of(result)["kv_transfer_params"]["remote_engine_id"] == "e1"
    assert dict(result.instructions.set_headers)[RANK] == "3"
    assert result.background is not None
    await result.background
    ((_, _, _, headers),) = client.legs
    assert headers[RANK] == "1"


async def test_mooncake_picks_a_listed_rank_when_the_bootstrap_lacks_the_pinned_one() -> None:
    client = FakePrefillClient(BOOTSTRAP_ANSWER, LEG_ANSWER)  # lists rank 0 only
    result = await answer(router_of("vllm-mooncake", client))
    assert body_of(result)["kv_transfer_params"]["remote_engine_id"] == "e0"
    assert result.background is not None
    await result.background
    assert client.legs[0][3][RANK] == "0"


@pytest.mark.parametrize("mode", ["sidecar", "sglang-bootstrap"])
async def test_a_handoff_that_cannot_pin_credits_an_engine_of_several_ranks_nothing(mode: str) -> None:
    client = FakePrefillClient(LEG_ANSWER)
    router = router_of(mode, client)
    result = await answer(router)
    assert RANK not in dict(result.instructions.set_headers)
    assert all(RANK not in headers for *_, headers in client.legs)
    assert predicted(router, "prefill") == predicted(router, "decode") == 0
