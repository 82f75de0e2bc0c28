"""Router: parse, decide, charge and describe the answer; the metrics it records."""

from __future__ import annotations

import json
import time

import pytest
from builders import (
    CHAT_META,
    D_SAME_IDLE,
    DEFAULT_MAX_TOKENS,
    DEST,
    P1,
    PREFILL,
    endpoint,
    make_router,
    refused,
    samples,
    value,
)

from ext_proc.affinity import Mode
from ext_proc.load import Lease
from ext_proc.outcome import Refused, RequestMeta, Routed, RoutingInstructions
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kinds import KINDS as PREFIX_SOURCES
from ext_proc.prefix.settings import KvEventsSettings, PrefixSettings, PrefixSourceKind
from ext_proc.prefix.tracker import PrefixTracker
from ext_proc.registry import EndpointState
from ext_proc.router import Router

D_SAME_BUSY = "10.0.1.2:8000"
D_OTHER = "10.0.2.1:8000"


def state(router: Router, address: str, role: str = "decode") -> EndpointState:
    return next(s for s in router.registry.endpoints() if s.address == address and s.role.value == role)


def chat(content: str = "x" * 40, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra}).encode()


def routed(result: Routed | Refused) -> Routed:
    assert isinstance(result, Routed), result
    return result


@pytest.fixture
def prefer_router() -> Router:
    router = make_router(
        [endpoint(P1, "g1")],
        [endpoint(D_OTHER, "g2"), endpoint(D_SAME_BUSY, "g1"), endpoint(D_SAME_IDLE, "g1")],
    )
    state(router, D_SAME_BUSY).active_tokens = 1_000  # u = 0.1 more than the idle one
    return router


# --- route_body --------------------------------------------------------------------------------


def test_chat_body_goes_to_same_group_decode_with_both_headers_and_lb_metadata(prefer_router: Router) -> None:
    result = routed(prefer_router.route_body(meta=CHAT_META, raw=chat()))
    destination = f"{D_SAME_IDLE},{D_SAME_BUSY},{D_OTHER}"
    assert result.instructions == RoutingInstructions(
        set_headers=((DEST, destination), (PREFILL, P1)),
        remove_headers=(),
        lb_metadata=((DEST, destination),),
    )


def test_route_body_charges_prompt_to_prefill_and_prompt_plus_budget_to_decode(prefer_router: Router) -> None:
    result = routed(
        prefer_router.route_body(meta=CHAT_META, raw=chat("x" * 40, max_tokens=50))
    )  # 10 prompt tokens
    prefill, decode = state(prefer_router, P1, "prefill"), state(prefer_router, D_SAME_IDLE)
    assert (prefill.active_tokens, prefill.active_requests) == (10, 1)
    assert (decode.active_tokens, decode.active_requests) == (60, 1)
    result.lease.release()
    assert (prefill.active_tokens, prefill.active_requests, decode.active_tokens, decode.active_requests) == (
        0,
        0,
        0,
        0,
    )


def test_route_body_uses_default_budget_when_body_sets_none(prefer_router: Router) -> None:
    routed(prefer_router.route_body(meta=CHAT_META, raw=chat("x" * 8)))
    assert state(prefer_router, D_SAME_IDLE).active_tokens == 2 + DEFAULT_MAX_TOKENS


def test_fallback_count_limits_the_destination_list() -> None:
    router = make_router(
        [endpoint(P1, "g1")], [endpoint(D_SAME_IDLE, "g1"), endpoint(D_SAME_BUSY, "g1")], fallback_count=0
    )
    state(router, D_SAME_BUSY).active_tokens = 1_000
    result = routed(router.route_body(meta=CHAT_META, raw=chat()))
    assert result.instructions.lb_metadata == ((DEST, D_SAME_IDLE),)


def test_unhealthy_decode_is_never_chosen() -> None:
    router = make_router(
        [endpoint(P1, "g1")], [endpoint(D_SAME_IDLE, "g1", health="UNHEALTHY"), endpoint(D_OTHER, "g2")]
    )
    result = routed(router.route_body(meta=CHAT_META, raw=chat()))
    assert result.instructions.lb_metadata == ((DEST, D_OTHER),)


def test_decode_only_routing_removes_the_prefill_header() -> None:
    router = make_router([], [endpoint(D_SAME_IDLE, "g1")])
    result = routed(router.route_body(meta=CHAT_META, raw=chat()))
    assert result.instructions == RoutingInstructions(
        set_headers=((DEST, D_SAME_IDLE),), remove_headers=(PREFILL,), lb_metadata=((DEST, D_SAME_IDLE),)
    )
    decode = state(router, D_SAME_IDLE)
    assert (decode.active_tokens, decode.active_requests) == (10 + DEFAULT_MAX_TOKENS, 1)


def test_invalid_json_is_refused_with_400_and_no_param(prefer_router: Router) -> None:
    result = refused(prefer_router.route_body(meta=CHAT_META, raw=b"{oops"))
    assert (result.status, result.code, result.param) == (400, "invalid_request", None)
    assert result.message.startswith("request body is not valid JSON")


def test_invalid_field_is_refused_with_400_naming_the_param(prefer_router: Router) -> None:
    result = refused(prefer_router.route_body(meta=CHAT_META, raw=chat(max_tokens=-1)))
    assert result == Refused(
        400, "'max_tokens' must be a non-negative integer", "invalid_request", "max_tokens"
    )


def test_refused_request_charges_nothing(prefer_router: Router) -> None:
    refused(prefer_router.route_body(meta=CHAT_META, raw=b"[]"))
    assert all(s.active_requests == 0 for s in prefer_router.registry.endpoints())


@pytest.mark.parametrize("max_tokens", [2**40 + 1, 10**30])
def test_an_output_budget_beyond_the_load_arrays_is_400_and_charges_nothing(
    prefer_router: Router, max_tokens: int
) -> None:
    result = refused(prefer_router.route_body(meta=CHAT_META, raw=chat(max_tokens=max_tokens)))
    assert (result.status, result.code, result.param) == (400, "invalid_request", "max_tokens")
    assert "'max_tokens' is too large" in result.message
    assert all(s.active_requests == 0 for s in prefer_router.registry.endpoints())
    routed(prefer_router.route_body(meta=CHAT_META, raw=chat(max_tokens=2**40)))  # the limit itself is routed


def test_strict_mode_without_same_group_decode_is_503() -> None:
    router = make_router([endpoint(P1, "g1")], [endpoint(D_OTHER, "g2")], mode=Mode.STRICT)
    result = refused(router.route_body(meta=CHAT_META, raw=chat()))
    assert (result.status, result.code, result.param) == (503, "no_same_group_decode_endpoint", None)
    assert "strict pdGroupID affinity" in result.message
    assert all(s.active_requests == 0 for s in router.registry.endpoints())


def test_strict_mode_keeps_the_decode_and_fallbacks_in_the_group() -> None:
    router = make_router(
        [endpoint(P1, "g1")], [endpoint(D_OTHER, "g2"), endpoint(D_SAME_IDLE, "g1")], mode=Mode.STRICT
    )
    result = routed(router.route_body(meta=CHAT_META, raw=chat()))
    assert result.instructions.lb_metadata == ((DEST, D_SAME_IDLE),)


def test_no_healthy_decode_is_503() -> None:
    router = make_router([endpoint(P1, "g1")], [endpoint(D_SAME_IDLE, "g1", health="DRAINING")])
    result = refused(router.route_body(meta=CHAT_META, raw=chat()))
    assert (result.status, result.code) == (503, "no_healthy_decode_endpoint")
    assert "no healthy decode endpoint" in result.message


# --- route_bodiless ----------------------------------------------------------------------------


def test_bodiless_request_goes_to_least_loaded_decode_and_charges_one_request(prefer_router: Router) -> None:
    state(prefer_router, D_SAME_IDLE).active_tokens = 5_000
    result = routed(prefer_router.route_bodiless())
    assert result.instructions.set_headers[0] == (DEST, f"{D_OTHER},{D_SAME_BUSY},{D_SAME_IDLE}")
    assert result.instructions.remove_headers == (PREFILL,)
    chosen, prefill = state(prefer_router, D_OTHER), state(prefer_router, P1, "prefill")
    assert (chosen.active_tokens, chosen.active_requests) == (0, 1)
    assert (prefill.active_tokens, prefill.active_requests) == (0, 0)
    result.lease.release()
    assert chosen.active_requests == 0


def test_bodiless_request_without_decodes_is_503() -> None:
    result = refused(make_router([endpoint(P1, "g1")], []).route_bodiless())
    assert (result.status, result.code) == (503, "no_healthy_decode_endpoint")


def test_ties_rotate_between_equally_loaded_decodes() -> None:
    router = make_router([], [endpoint(D_SAME_IDLE, "g1"), endpoint(D_SAME_BUSY, "g1")], fallback_count=0)
    chosen = []
    for _ in range(4):
        result = routed(router.route_bodiless())
        chosen.append(result.instructions.lb_metadata[0][1])
        result.lease.release()
    assert sorted(set(chosen)) == sorted([D_SAME_IDLE, D_SAME_BUSY])
    assert chosen[0] != chosen[1]


# --- metrics -----------------------------------------------------------------------------------


def test_decisions_are_counted_by_mode_and_locality(prefer_router: Router) -> None:
    routed(prefer_router.route_body(meta=CHAT_META, raw=chat()))
    routed(prefer_router.route_body(meta=CHAT_META, raw=chat()))
    routed(prefer_router.route_bodiless())
    name = "pd_extproc_route_decisions_total"
    assert value(prefer_router, name, mode="prefer", locality="same_group") == 2.0
    assert value(prefer_router, name, mode="prefer", locality="decode_only") == 1.0
    assert value(prefer_router, name, mode="prefer", locality="cross_group") is None
    assert value(prefer_router, "pd_extproc_decision_seconds_count") == 3.0


def test_cross_group_decision_is_counted_as_such() -> None:
    router = make_router([endpoint(P1, "g1")], [endpoint(D_OTHER, "g2")], mode=Mode.OFF)
    routed(router.route_body(meta=CHAT_META, raw=chat()))
    assert value(router, "pd_extproc_route_decisions_total", mode="off", locality="cross_group") == 1.0


def test_rejections_are_counted_by_reason_and_are_not_decisions() -> None:
    router = make_router([endpoint(P1, "g1")], [endpoint(D_OTHER, "g2")], mode=Mode.STRICT)
    refused(router.route_body(meta=CHAT_META, raw=b"nope"))
    refused(router.route_body(meta=CHAT_META, raw=chat(stream="yes")))
    refused(router.route_body(meta=CHAT_META, raw=chat()))
    name = "pd_extproc_rejected_total"
    assert value(router, name, reason="invalid_request") == 2.0
    assert value(router, name, reason="no_same_group_decode_endpoint") == 1.0
    assert value(router, "pd_extproc_decision_seconds_count") == 0.0
    assert not any(key[0] == "pd_extproc_route_decisions_total" for key in samples(router))


def test_endpoint_gauges_follow_live_load(prefer_router: Router) -> None:
    result = routed(prefer_router.route_body(meta=CHAT_META, raw=chat("x" * 40, max_tokens=50)))
    labels = {"role": "decode", "group": "g1", "endpoint": D_SAME_IDLE}
    assert value(prefer_router, "pd_extproc_endpoint_active_tokens", **labels) == 60.0
    assert value(prefer_router, "pd_extproc_endpoint_active_requests", **labels) == 1.0
    prefill_labels = {"role": "prefill", "group": "g1", "endpoint": P1}
    assert value(prefer_router, "pd_extproc_endpoint_active_tokens", **prefill_labels) == 10.0
    busy = {"role": "decode", "group": "g1", "endpoint": D_SAME_BUSY}
    assert value(prefer_router, "pd_extproc_endpoint_active_tokens", **busy) == 1000.0
    assert value(prefer_router, "pd_extproc_endpoint_active_requests", **busy) == 0.0
    result.lease.release()
    assert value(prefer_router, "pd_extproc_endpoint_active_tokens", **labels) == 0.0
    assert value(prefer_router, "pd_extproc_endpoint_active_requests", **labels) == 0.0


def test_endpoint_gauges_include_unhealthy_endpoints() -> None:
    router = make_router([], [endpoint(D_SAME_IDLE, "g1"), endpoint(D_OTHER, "g2", health="DRAINING")])
    labels = {"role": "decode", "group": "g2", "endpoint": D_OTHER}
    assert value(router, "pd_extproc_endpoint_active_requests", **labels) == 0.0


def test_decision_seconds_times_the_choice_alone(
    prefer_router: Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Charging the endpoints (like building the answer) follows the choice and is not timed."""
    pause = 0.2

    def slow_lease(*args: object) -> Lease:
        time.sleep(pause)
        return Lease(*args)  # type: ignore[arg-type]

    monkeypatch.setattr("ext_proc.router.Lease", slow_lease)
    routed(prefer_router.route_bodiless())
    assert value(prefer_router, "pd_extproc_decision_seconds_count") == 1.0
    assert value(prefer_router, "pd_extproc_decision_seconds_sum") < pause


# ---------------------------------------------------------------- the prefix index


TENANT = "t" * 4000  # 1,000 tokens: 62 blocks of 16, plus a partial one


def test_with_the_prefix_index_a_repeated_prompt_goes_back_and_charges_only_its_uncached_tokens() -> None:
    prefills = [endpoint(f"10.0.0.{i}:8000", "a") for i in (1, 2, 3)]
    router = make_router(
        prefills, [endpoint("10.0.1.1:8000", "a")], prefix=PrefixSettings(), prefix_weight=0.1
    )

    def prefill_of(result: Routed) -> str:
        return dict(result.instructions.set_headers)[PREFILL]

    holder = prefill_of(routed(router.route_body(chat(TENANT + "q1"), CHAT_META)))
    assert state(router, holder, "prefill").active_tokens == 1001
    again = routed(router.route_body(chat(TENANT + "q2"), CHAT_META))
    assert prefill_of(again) == holder  # although it is the busiest prefill
    assert state(router, holder, "prefill").active_tokens == 1001 + (1001 - 62 * 16)
    assert value(router, "pd_extproc_prefix_predicted_hit_tokens_sum", role="prefill") == 62 * 16


def test_set_prefix_keeps_the_index_while_its_hashing_stays_and_drops_it_when_off() -> None:
    router = make_router(
        [endpoint("10.0.0.1:8000", "a")], [endpoint("10.0.1.1:8000", "a")], prefix=PrefixSettings()
    )
    tracker = router.live.prefix
    router.live.set_prefix(PrefixSettings(self_correct=False))
    assert router.live.prefix is tracker and tracker is not None and not tracker.settings.self_correct
    router.live.set_prefix(PrefixSettings(block_tokens=32))
    assert router.live.prefix is not tracker and router.live.prefix is not None
    router.live.set_prefix(None)
    assert router.live.prefix is None
    routed(router.route_body(chat(TENANT), CHAT_META))  # routes without an index


def test_the_kernels_are_compiled_before_a_prefix_source_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr("ext_proc.prefix.blocks.warm", lambda: built.append("warm"))
    monkeypatch.setattr("ext_proc.prefix.index.warm", lambda: built.append("lru"))
    for kind in ("approximate", "kv-events"):
        monkeypatch.setitem(PREFIX_SOURCES, PrefixSourceKind(kind), lambda *_, kind=kind: built.append(kind))
    router = make_router([endpoint("10.0.0.1:8000", "a")], [endpoint("10.0.1.1:8000", "a")])
    assert built == []  # no index: nothing to compile
    router.live.set_prefix(PrefixSettings())
    router.live.set_prefix(PrefixSettings(source="kv-events"))
    assert built == ["warm", "lru", "approximate", "warm", "kv-events"]  # the LRU: placements only


def test_set_prefix_builds_the_kind_the_settings_name() -> None:
    prefills = [endpoint(f"10.0.0.{i}:8000", "a") for i in (1, 2, 3)]
    router = make_router(
        prefills, [endpoint("10.0.1.1:8000", "a")], prefix=PrefixSettings(), prefix_weight=0.1
    )
    assert isinstance(router.live.prefix, PrefixTracker)
    router.live.set_prefix(PrefixSettings(source="kv-events"))
    events = router.live.prefix
    assert isinstance(events, KvEventSource)
    router.live.set_prefix(PrefixSettings(source="kv-events", self_correct=False))
    assert router.live.prefix is events
    stale = KvEventsSettings(stale_after_seconds=1)
    router.live.set_prefix(PrefixSettings(source="kv-events", kv_events=stale))
    assert router.live.prefix is not events and isinstance(router.live.prefix, KvEventSource)
    prompt = json.dumps({"model": "m", "prompt": list(range(1000))}).encode()
    meta = RequestMeta("/v1/completions")
    first = routed(router.route_body(prompt, meta))
    again = routed(router.route_body(prompt, meta))  # met by the recent placement, before any event
    assert dict(first.instructions.set_headers)[PREFILL] == dict(again.instructions.set_headers)[PREFILL]
