"""Routing by model: each request only on endpoints serving its model, in every mode; 404, 400, the
rewrite header, the gateway's own ``GET /v1/models``, the engines' lists and the bounded metric labels."""

from __future__ import annotations

import json

import pytest
from builders import CHAT_META, DEST, PREFILL, endpoint, make_router, refused, value

from ext_proc.affinity import Mode
from ext_proc.handoff.body import prefill_leg_body
from ext_proc.models import MAX_MODEL_NAME_CHARS, ServedModel
from ext_proc.outcome import Answered, RequestMeta, Routed
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.router import BodyRequest, Router

# Group g1 serves model "a" (two prefills, two decodes), g2 model "b"; X serves both, in g3.
PA1, PA2, PB1, PX = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.9:1"
DA1, DA2, DB1, DB2, DX = "10.0.1.1:1", "10.0.1.2:1", "10.0.1.3:1", "10.0.1.4:1", "10.0.1.9:1"
SERVES = {"a": {PA1, PA2, DA1, DA2, PX, DX}, "b": {PB1, DB1, DB2, PX, DX}}


def two_models(mode: Mode, fallback_count: int = 4, prefix: PrefixSettings | None = None) -> Router:
    a, b, both = ("a",), ("b",), ("a", "b")
    prefills = [endpoint(PA1, "g1", models=a), endpoint(PA2, "g1", models=a), endpoint(PB1, "g2", models=b)]
    prefills.append(endpoint(PX, "g3", models=both))
    decodes = [endpoint(DA1, "g1", models=a), endpoint(DA2, "g1", models=a), endpoint(DB1, "g2", models=b)]
    decodes += [endpoint(DB2, "g2", models=b), endpoint(DX, "g3", models=both)]
    return make_router(prefills, decodes, mode, fallback_count=fallback_count, prefix=prefix)


def chat(model: object = "a", content: str = "x" * 4000) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}]}).encode()


def headers(result: object) -> dict[str, str]:
    assert isinstance(result, Routed), result
    return dict(result.instructions.set_headers)


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("model", ["a", "b"])
def test_every_mode_routes_prefill_decode_and_fallbacks_only_to_endpoints_serving_the_model(
    mode: Mode, model: str
) -> None:
    router = two_models(mode)
    for busy in (PA1, DA1, PB1, DB1, PX, DX):  # load moves the choice around; the model never
        for _ in range(20):
            sent = headers(router.route_body(chat(model), CHAT_META))
            assert sent[PREFILL] in SERVES[model]
            assert set(sent[DEST].split(",")) <= SERVES[model]
        for state in router.registry.endpoints():
            if state.address == busy:
                state.active_tokens += 5_000


def test_a_model_only_the_shared_endpoints_serve_leaves_them_the_only_candidates() -> None:
    router = make_router(
        [endpoint(PA1, models=("a",)), endpoint(PX)], [endpoint(DA1, models=("a",)), endpoint(DX)]
    )
    for _ in range(5):
        sent = headers(router.route_body(chat("unlisted"), CHAT_META))
        assert (sent[PREFILL], sent[DEST]) == (PX, DX)  # the endpoints serving every model
    seen = {headers(router.route_body(chat("a"), CHAT_META))[DEST].split(",")[0] for _ in range(6)}
    assert seen == {DA1, DX}


def test_a_model_no_decode_serves_is_404_model_not_found_naming_it() -> None:
    router = two_models(Mode.PREFER)
    answer = refused(router.route_body(chat("gpt-9"), CHAT_META))
    assert (answer.status, answer.code, answer.param) == (404, "model_not_found", "model")
    assert "'gpt-9'" in answer.message
    assert value(router, "pd_extproc_rejected_total", reason="model_not_found") == 1.0
    only_prefills = make_router([endpoint(PA1, models=("p",))], [endpoint(DA1, models=("a",))])
    assert refused(only_prefills.route_body(chat("p"), CHAT_META)).code == "model_not_found"


def test_a_served_model_whose_decodes_are_unhealthy_is_503_not_404() -> None:
    router = make_router([endpoint(PA1, models=("a",))], [endpoint(DA1, models=("a",), health="UNHEALTHY")])
    assert refused(router.route_body(chat("a"), CHAT_META)).status == 503


def test_a_request_without_a_model_may_go_anywhere() -> None:
    router = two_models(Mode.PREFER)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 4000}]}).encode()
    assert isinstance(router.route_body(body, CHAT_META), Routed)


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        (7, "must be a string"),
        (["a"], "must be a string"),
        ("m" * 10_000, "10000 characters long"),
    ],
)
def test_a_bad_model_name_is_a_clear_400(model: object, says: str) -> None:
    answer = refused(two_models(Mode.PREFER).route_body(chat(model), CHAT_META))
    assert (answer.status, answer.code, answer.param) == (400, "invalid_request", "model")
    assert says in answer.message


def test_the_longest_name_allowed_is_routed_when_served() -> None:
    name = "n" * MAX_MODEL_NAME_CHARS
    router = make_router([endpoint(PA1, models=(name,))], [endpoint(DA1, models=(name,))])
    assert headers(router.route_body(chat(name), CHAT_META))[DEST] == DA1


def test_the_rewrite_header_routes_by_its_model_and_rewrites_the_body() -> None:
    router = two_models(Mode.PREFER)
    meta = RequestMeta("/v1/chat/completions", model_rewrite="b")
    result = router.route_body(chat("a"), meta)
    sent = headers(result)
    assert sent[PREFILL] in SERVES["b"] and set(sent[DEST].split(",")) <= SERVES["b"]
    assert isinstance(result, Routed) and result.instructions.body is not None
    assert json.loads(result.instructions.body)["model"] == "b"
    assert json.loads(result.instructions.body)["messages"] == json.loads(chat("a"))["messages"]
    same = router.route_body(chat("b"), meta)  # the model already: the body goes unchanged
    assert isinstance(same, Routed) and same.instructions.body is None
    unknown = refused(router.route_body(chat("a"), RequestMeta("/v1/chat/completions", model_rewrite="zz")))
    assert (unknown.status, unknown.code) == (404, "model_not_found")


@pytest.mark.parametrize("rewrite", ["", "r" * 10_000])
def test_a_bad_rewrite_header_is_a_clear_400(rewrite: str) -> None:
    answer = refused(
        two_models(Mode.PREFER).route_body(chat("a"), RequestMeta("/v1/completions", model_rewrite=rewrite))
    )
    assert (answer.status, answer.code) == (400, "invalid_request")
    assert "x-gateway-model-name-rewrite" in answer.message


def test_get_models_answers_the_union_of_the_decodes_models_in_openais_shape() -> None:
    router = two_models(Mode.PREFER)
    answer = router.answer_bodiless(RequestMeta("/v1/models?x=1"))
    assert isinstance(answer, Answered) and answer.status == 200
    listed = json.loads(answer.body)
    assert listed["object"] == "list"
    assert [(m["id"], m["object"], m["parent"]) for m in listed["data"]] == [
        ("a", "model", None),
        ("b", "model", None),
    ]
    assert router.answer_bodiless(RequestMeta("/v1/other")) is None  # routed: route_bodiless
    assert isinstance(router.route_bodiless(), Routed)


def test_get_models_goes_to_a_decode_while_no_endpoint_names_its_models() -> None:
    router = make_router([endpoint(PA1)], [endpoint(DA1)])
    assert router.answer_bodiless(RequestMeta("/v1/models")) is None
    assert headers(router.route_bodiless())[DEST] == DA1


def test_an_engines_list_applies_where_nothing_is_declared_and_a_declaration_wins() -> None:
    router = make_router([endpoint(PA1), endpoint(PB1)], [endpoint(DA1), endpoint(DB1, models=("b",))])
    registry = router.registry
    registry.set_engine_models(DA1, (ServedModel("base"), ServedModel("sql-lora", "base")))
    registry.set_engine_models(DB1, (ServedModel("base"),))  # declared "b" wins
    registry.set_engine_models(PA1, (ServedModel("base"), ServedModel("sql-lora", "base")))
    for _ in range(4):
        sent = headers(router.route_body(chat("sql-lora"), CHAT_META))
        assert (sent[DEST], sent[PREFILL] in {PA1, PB1}) == (DA1, True)
    assert headers(router.route_body(chat("b"), CHAT_META))[DEST] == DB1
    assert refused(router.route_body(chat("other"), CHAT_META)).code == "model_not_found"
    answer = router.answer_bodiless(RequestMeta("/v1/models"))
    assert isinstance(answer, Answered)
    assert [(m["id"], m["parent"]) for m in json.loads(answer.body)["data"]] == [
        ("b", None),
        ("base", None),
        ("sql-lora", "base"),
    ]
    registry.set_engine_models(DA1, (ServedModel("base"),))  # the adapter unloaded
    assert refused(router.route_body(chat("sql-lora"), CHAT_META)).code == "model_not_found"


def test_a_model_pool_reads_the_live_load_on_every_request() -> None:
    router = two_models(Mode.OFF, fallback_count=0)
    first = headers(router.route_body(chat("b"), CHAT_META))[DEST]
    assert first in {DB1, DB2, DX}
    for state in router.registry.endpoints():
        if state.role.value == "decode" and state.address in SERVES["b"] - {DB2}:
            state.active_tokens += 50_000
    assert headers(router.route_body(chat("b"), CHAT_META))[DEST] == DB2
    pools = router.registry.pools_for("b")
    assert pools is not None
    assert sorted(pools[1].tokens.tolist()) == sorted(s.blended_tokens for s in pools[1].endpoints)


def held(lookup: object) -> int:
    """The most prompt tokens any endpoint holds in a prefix lookup (0: none matched)."""
    hits = getattr(lookup, "hits", None)
    return 0 if hits is None else max(int(hits.prefill.max(initial=0)), int(hits.decode.max(initial=0)))


def test_two_models_never_share_prefix_credit_on_an_endpoint_serving_both() -> None:
    settings = PrefixSettings(block_tokens=16)
    router = make_router([endpoint(PX)], [endpoint(DX), endpoint(DA1, models=("zz",))], prefix=settings)
    prefix = router.live.prefix
    assert prefix is not None
    prompt = "the same long shared system prompt " * 200
    routed_a = router.route_body(chat("a", prompt), CHAT_META)
    assert isinstance(routed_a, Routed)
    routed_a.lease.release()
    prefills, decodes = router.registry.pools_for("a") or ()
    again = prefix.lookup_prompt(json.loads(chat("a", prompt)), None, prefills, decodes, 2000)
    other = prefix.lookup_prompt(json.loads(chat("b", prompt)), None, prefills, decodes, 2000)
    assert held(again) > 0
    assert held(other) == 0  # the same prompt, another model: no credit on the endpoints serving both


def test_metrics_label_only_the_models_endpoints_name() -> None:
    router = make_router([endpoint(PA1)], [endpoint(DA1), endpoint(DB1, models=("b",))])
    for model in ("b", "client-chosen-1", "client-chosen-2"):
        headers(router.route_body(chat(model), CHAT_META))
    assert value(router, "pd_extproc_model_requests_total", model="b") == 1.0
    assert value(router, "pd_extproc_model_requests_total", model="") == 2.0
    assert value(router, "pd_extproc_model_requests_total", model="client-chosen-1") is None
    info = {"role": "decode", "group": "g1", "endpoint": DB1, "model": "b", "parent": ""}
    assert value(router, "pd_extproc_endpoint_model_info", **info) == 1.0


def test_the_engines_priority_replaces_the_clients_on_both_legs_and_is_left_alone_without_one() -> None:
    router = two_models(Mode.PREFER)
    sent = json.loads(chat("a"))
    sent["priority"] = -99  # a client's own: never the engines' word once the gateway sets one
    raw = json.dumps(sent).encode()
    request = router.read(raw, CHAT_META, -10)
    assert isinstance(request, BodyRequest) and request.rewritten and request.body["priority"] == -10
    assert json.loads(prefill_leg_body(request.body))["priority"] == -10  # the prefill leg's body
    result = router.route(request)
    assert isinstance(result, Routed) and result.instructions.body is not None  # the decode's body
    assert json.loads(result.instructions.body)["priority"] == -10
    assert json.loads(result.instructions.body)["messages"] == sent["messages"]
    untouched = router.route_body(raw, CHAT_META)  # engine priorities off: the body goes as it came
    assert isinstance(untouched, Routed) and untouched.instructions.body is None
    same = router.read(json.dumps({**sent, "priority": 3}).encode(), CHAT_META, 3)
    assert isinstance(same, BodyRequest) and not same.rewritten  # the value already: the body unchanged


def test_a_mixed_pool_lists_the_declared_models_and_an_all_serving_decodes_once_its_engine_says() -> None:
    router = make_router([endpoint(PA1)], [endpoint(DA1, models=("a",)), endpoint(DX)])

    def listed() -> list[str]:
        answer = router.answer_bodiless(RequestMeta("/v1/models"))
        assert isinstance(answer, Answered)
        return [m["id"] for m in json.loads(answer.body)["data"]]

    assert listed() == ["a"]  # DX serves every model, but which ones is not known yet: it adds nothing
    assert headers(router.route_body(chat("zz"), CHAT_META))[DEST] == DX  # though it takes any name
    router.registry.set_engine_models(DX, (ServedModel("base"), ServedModel("lora-1", "base")))
    assert listed() == ["a", "base", "lora-1"]
    router.registry.set_engine_models(PA1, (ServedModel("prefill-only"),))  # prefills are not listed
    assert listed() == ["a", "base", "lora-1"]
