"""A request for a LoRA adapter prefers the endpoints whose engines report holding it (docs/routing.md
"LoRA adapters"): the registry's masks, the router's use of them in route and explain, every mode."""

from __future__ import annotations

import json

import pytest
from builders import CHAT_META, DEST, PREFILL, endpoint, make_router, value

from ext_proc.affinity import Mode
from ext_proc.models import ServedModel
from ext_proc.outcome import RequestMeta, Routed
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kv_events import BlockStored, EventBatch
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.router import Router

P1, P2, D1, D2 = "10.0.0.1:1", "10.0.0.2:1", "10.0.1.1:1", "10.0.1.2:1"
COMPLETION_META = RequestMeta("/v1/completions")
LISTED = (ServedModel("base"), ServedModel("sql-lora", "base"))


def serving_lora(mode: Mode) -> Router:
    """Two idle prefills and two idle decodes, each engine listing the base model and sql-lora."""
    router = make_router([endpoint(P1), endpoint(P2)], [endpoint(D1), endpoint(D2)], mode, fallback_count=1)
    for address in (P1, P2, D1, D2):
        router.registry.set_engine_models(address, LISTED)
    return router


def hold(router: Router, held: dict[str, frozenset[str] | None]) -> None:
    """What each engine's fresh sample says it holds (as the engine-metrics scraper sets it)."""
    for state in router.registry.endpoints():
        state.lora_adapters = held[state.address]


def pairs(router: Router, model: str, n: int = 8) -> set[tuple[str, str]]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * 4000}]}).encode()
    seen = set()
    for _ in range(n):
        result = router.route_body(body, CHAT_META)
        assert isinstance(result, Routed), result
        sent = dict(result.instructions.set_headers)
        seen.add((sent[PREFILL], sent[DEST].split(",")[0]))
        result.lease.release()  # idle again: only the round robin moves
    return seen


@pytest.mark.parametrize("mode", list(Mode))
def test_an_adapter_goes_to_the_endpoints_holding_it(mode: Mode) -> None:
    router = serving_lora(mode)
    hold(router, {P1: frozenset(), P2: frozenset({"sql-lora"}), D1: frozenset({"sql-lora"}), D2: frozenset()})
    assert pairs(router, "sql-lora") == {(P2, D1)}
    for role in ("prefill", "decode"):
        assert value(router, "pd_extproc_lora_placements_total", role=role, held="held") == 8.0
        assert value(router, "pd_extproc_lora_placements_total", role=role, held="lacking") is None


@pytest.mark.parametrize("mode", list(Mode))
def test_unknown_holdings_and_base_models_spread_as_before(mode: Mode) -> None:
    router = serving_lora(mode)
    hold(router, dict.fromkeys((P1, P2, D1, D2)))  # no fresh sample anywhere: unknown
    assert {p for p, _ in pairs(router, "sql-lora")} == {P1, P2}
    assert value(router, "pd_extproc_lora_placements_total", role="decode", held="unknown") == 8.0
    hold(router, {P1: frozenset(), P2: frozenset({"sql-lora"}), D1: frozenset({"sql-lora"}), D2: frozenset()})
    assert {p for p, _ in pairs(router, "base")} == {P1, P2}  # a base model: no preference
    assert value(router, "pd_extproc_lora_placements_total", role="decode", held="held") is None


def test_the_registry_masks_only_adapters_and_only_known_lacks() -> None:
    router = serving_lora(Mode.PREFER)
    registry = router.registry
    hold(router, {P1: None, P2: frozenset({"other"}), D1: frozenset({"sql-lora"}), D2: frozenset()})
    lacks = registry.lacks("sql-lora", registry.prefill_pool, registry.decode_pool)
    assert lacks is not None
    assert (lacks.prefill.tolist(), lacks.decode.tolist()) == ([False, True], [False, True])
    assert registry.lacks("base", registry.prefill_pool, registry.decode_pool) is None
    assert registry.lacks(None, registry.prefill_pool, registry.decode_pool) is None


def test_explain_ranks_the_lacking_endpoints_one_tick_behind() -> None:
    router = serving_lora(Mode.OFF)
    hold(router, {P1: frozenset(), P2: frozenset({"sql-lora"}), D1: frozenset({"sql-lora"}), D2: frozenset()})
    body = json.dumps({"model": "sql-lora", "messages": [{"role": "user", "content": "x" * 4000}]}).encode()
    explained = router.explain(router.parse(body, CHAT_META)).explanation
    assert explained.prefill_keys[0] == explained.prefill_keys[1] + 1  # P1 lacks it, P2 holds it
    assert explained.decode_keys[1] == explained.decode_keys[0] + 1  # D2 lacks it, D1 holds it
    assert explained.chosen is not None and (explained.chosen.prefill, explained.chosen.decode) == (1, 0)


def test_kv_events_credit_a_base_models_blocks_to_its_requests_never_to_an_adapters() -> None:
    prefix = PrefixSettings(16, 100, source="kv-events")
    router = make_router([endpoint(P1), endpoint(P2)], [endpoint(D1)], prefix=prefix, prefix_weight=0.5)
    for address in (P1, P2, D1):
        router.registry.set_engine_models(address, LISTED)
    source = router.live.prefix
    assert isinstance(source, KvEventSource)
    source.clock = lambda: 1.0  # the index's sample is fresh
    ids = list(range(1, 65))  # four blocks of 16 tokens, held by P2 for the base model
    source.index.apply(
        P2, EventBatch(0, 0.0, None, (BlockStored((1, 2, 3, 4), None, tuple(ids), 16),)), 0.0, False
    )

    def hits(model: str) -> list[int] | None:
        body = json.dumps({"model": model, "prompt": [*ids, 99]}).encode()
        found = router.explain(router.parse(body, COMPLETION_META)).hits
        return None if found is None else found.prefill.tolist()

    assert hits("base") == [0, 64]
    assert hits("sql-lora") is None  # the same token ids under the adapter: nothing held


def test_an_adapter_placed_where_it_is_lacking_is_counted_so() -> None:
    router = serving_lora(Mode.PREFER)
    hold(router, {P1: frozenset(), P2: frozenset(), D1: frozenset({"sql-lora"}), D2: frozenset({"sql-lora"})})
    pairs(router, "sql-lora", n=3)
    assert value(router, "pd_extproc_lora_placements_total", role="prefill", held="lacking") == 3.0
    assert value(router, "pd_extproc_lora_placements_total", role="decode", held="held") == 3.0
