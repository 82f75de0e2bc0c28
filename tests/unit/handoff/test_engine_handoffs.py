"""The engine handoffs' prefill legs with a fake prefill client (no HTTP): a leg that succeeds, the retry
on the next-ranked prefill, decode-only or an error answer when both fail, an engine's 4xx passed
through, the ejection of a failed prefill, and every charge released (``kv-transfer-params``,
``vllm-mooncake``, ``sglang-bootstrap``)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from builders import endpoint, registry_of

from ext_proc.affinity import Mode, Policy
from ext_proc.handoff.base import DecodeRoute, FailurePolicy
from ext_proc.handoff.config import HandoffConfig
from ext_proc.handoff.kinds import Handoff
from ext_proc.handoff.kv_failure import KvPullWatcher
from ext_proc.handoff.kv_transfer import KvTransferParamsHandoff
from ext_proc.handoff.leg import LegError, LegOutcome, LegReply
from ext_proc.handoff.mooncake import VllmMooncakeHandoff
from ext_proc.handoff.sglang import SglangBootstrapHandoff
from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused, RequestMeta, Routed
from ext_proc.router import Router, RouterSettings

DEST = "x-gateway-destination-endpoint"
PREFILL = "x-prefiller-host-port"
KV_HANDOFF = "x-gateway-kv-handoff"
P_FIRST = "10.0.0.1:8000"  # ranked first: far more capacity than P_NEXT
P_NEXT = "10.0.0.2:8000"
DECODE = "10.0.1.1:8000"
CLIENT_BODY = {"model": "m", "prompt": "tell me about KV caches", "max_tokens": 4}
INJECTED_PARAMS = {"do_remote_prefill": True, "remote_host": "10.9.9.9"}
"""``kv_transfer_params`` a client sends itself: never reaches an engine."""
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1]]}
LEG_ANSWER = LegReply(
    200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}).encode(), None, 0.01
)
ENGINE_400 = json.dumps({"error": {"message": "max_tokens is too large", "code": 400}}).encode()
BOOTSTRAP_ANSWER = LegReply(
    200,
    json.dumps({"0": {"engine_id": "e0", "worker_addr": {"0": {"0": "10.0.0.1:7000"}}}}).encode(),
    None,
    0.01,
)


def status(code: int) -> LegReply:
    return LegReply(code, b"engine trouble", None, 0.01)


CONNECT_ERROR = LegError(LegOutcome.CONNECT_ERROR, "ClientConnectorError: refused")
TIMEOUT = LegError(LegOutcome.TIMEOUT, "no answer within 1 s")


class FakePrefillClient:
    """A :class:`~ext_proc.handoff.leg.PrefillClient` without HTTP: each ``send`` (prefill leg) and ``get``
    (bootstrap query) takes the next scripted answer, a :class:`LegReply` or a :class:`LegError` to
    raise; ``legs`` records each leg as ``(address, path, body, headers)``, ``queries`` each URL."""

    def __init__(self, *answers: LegReply | LegError) -> None:
        self.answers = list(answers)
        self.legs: list[tuple[str, str, dict[str, object], dict[str, str]]] = []
        self.queries: list[str] = []

    async def send(self, address: str, path: str, body: bytes, headers: dict[str, str]) -> LegReply:
        self.legs.append((address, path, json.loads(body), dict(headers)))
        return self._next()

    async def get(self, url: str, timeout_seconds: float) -> LegReply:
        self.queries.append(url)
        return self._next()

    def _next(self) -> LegReply:
        answer = self.answers.pop(0)
        if isinstance(answer, LegError):
            raise answer
        return answer

    async def close(self) -> None:
        pass


HandoffFactory = Callable[[DecodeRoute, FakePrefillClient, Metrics, FailurePolicy], Handoff]


def kv_transfer(route, client, metrics, policy) -> Handoff:
    settings = HandoffConfig(prefill_timeout_seconds=1.0, on_prefill_failure=policy)
    return KvTransferParamsHandoff(settings, route=route, client=client, metrics=metrics)


def mooncake(route, client, metrics, policy) -> Handoff:
    settings = HandoffConfig(on_prefill_failure=policy, default_bootstrap_port=8998)
    return VllmMooncakeHandoff(settings, route=route, client=client, metrics=metrics)


def sglang(route, client, metrics, policy) -> Handoff:
    settings = HandoffConfig(default_bootstrap_port=8998)
    return SglangBootstrapHandoff(settings, route=route, client=client, metrics=metrics)


def router_with(factory: HandoffFactory, client: FakePrefillClient, policy: FailurePolicy) -> Router:
    """Two prefills (``P_FIRST`` ranked first) and one decode; a failed prefill is ejected for 60 s."""
    prefills = [endpoint(P_FIRST, capacity=1e12), endpoint(P_NEXT, capacity=1e6)]
    registry = registry_of(prefills, [endpoint(DECODE)], 10_000.0)
    metrics = Metrics(registry.endpoints)
    handoff = factory(DecodeRoute(DEST, PREFILL), client, metrics, policy)
    settings = RouterSettings(16, eject_seconds=60.0)
    return Router(
        settings, registry=registry, policy=Policy(Mode.PREFER, 0.3, 1), handoff=handoff, metrics=metrics
    )


async def answer(router: Router, body: dict[str, object]) -> Routed | Refused:
    """Route ``body`` and complete the prefill I/O the handoff needs before it answers."""
    result = router.route_body(json.dumps(body).encode(), RequestMeta("/v1/completions"))
    if isinstance(result, Routed | Refused):
        return result
    return await result.complete()


def charges(router: Router) -> dict[str, tuple[int, int]]:
    """Every endpoint's (active tokens, active requests)."""
    return {s.address: (s.active_tokens, s.active_requests) for s in router.registry.endpoints()}


def body_of(result: Routed | Refused) -> dict[str, object]:
    assert isinstance(result, Routed), result
    assert result.instructions.body is not None
    return json.loads(result.instructions.body)


def kv_handoff_marked(result: Routed) -> bool:
    return (KV_HANDOFF, "1") in result.instructions.set_headers


def kv_source(result: Routed) -> str | None:
    """The prefill whose KV the decode is told to pull (its failed pull is watched), else ``None``."""
    watcher = result.watcher
    return watcher.prefill if isinstance(watcher, KvPullWatcher) else None


IDLE = {P_FIRST: (0, 0), P_NEXT: (0, 0), DECODE: (0, 0)}


# --- kv-transfer-params: the prefill leg first ----------------------------------------------------------


async def test_kv_transfer_a_leg_that_succeeds_gives_the_decode_the_prefills_params_verbatim():
    client = FakePrefillClient(LEG_ANSWER)
    router = router_with(kv_transfer, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, {**CLIENT_BODY, "kv_transfer_params": INJECTED_PARAMS})
    assert [leg[0] for leg in client.legs] == [P_FIRST]
    assert client.legs[0][2]["kv_transfer_params"]["do_remote_decode"] is True  # the leg asks, never injected
    assert body_of(result) == {**CLIENT_BODY, "kv_transfer_params": PARAMS}
    assert kv_source(result) == P_FIRST and kv_handoff_marked(result)
    assert router.ejections.ejected() == frozenset()
    assert charges(router)[P_FIRST] == (0, 0) and charges(router)[DECODE][1] == 1  # prefill released
    result.lease.release()
    assert charges(router) == IDLE


@pytest.mark.parametrize("failure", [status(503), CONNECT_ERROR, TIMEOUT, status(429)], ids=str)
async def test_kv_transfer_a_failed_leg_is_retried_on_the_next_prefill_and_the_failed_one_ejected(failure):
    client = FakePrefillClient(failure, LEG_ANSWER)
    router = router_with(kv_transfer, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, CLIENT_BODY)
    assert [leg[0] for leg in client.legs] == [P_FIRST, P_NEXT]
    assert client.legs[0][3]["x-request-id"] == client.legs[1][3]["x-request-id"]  # one request
    assert body_of(result) == {**CLIENT_BODY, "kv_transfer_params": PARAMS}
    assert kv_source(result) == P_NEXT and kv_handoff_marked(result)
    assert router.ejections.ejected() == {P_FIRST}
    assert charges(router)[P_FIRST] == charges(router)[P_NEXT] == (0, 0)
    result.lease.release()
    assert charges(router) == IDLE


async def test_kv_transfer_both_legs_failed_decode_only_sends_the_clients_body_without_handoff_fields():
    client = FakePrefillClient(status(500), CONNECT_ERROR)
    router = router_with(kv_transfer, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, {**CLIENT_BODY, "kv_transfer_params": INJECTED_PARAMS})
    assert [leg[0] for leg in client.legs] == [P_FIRST, P_NEXT]
    assert body_of(result) == CLIENT_BODY
    assert kv_source(result) is None and not kv_handoff_marked(result)
    assert dict(result.instructions.set_headers)[DEST] == DECODE
    assert router.ejections.ejected() == {P_FIRST, P_NEXT}
    result.lease.release()
    assert charges(router) == IDLE


@pytest.mark.parametrize(
    ("last_failure", "code", "status_code"),
    [
        (status(502), "prefill_failed", 502),
        (CONNECT_ERROR, "prefill_failed", 502),
        (TIMEOUT, "prefill_timeout", 504),
    ],
)
async def test_kv_transfer_both_legs_failed_policy_error_answers_an_error(last_failure, code, status_code):
    client = FakePrefillClient(status(500), last_failure)
    router = router_with(kv_transfer, client, FailurePolicy.ERROR)
    result = await answer(router, CLIENT_BODY)
    assert isinstance(result, Refused), result
    assert (result.status, result.code) == (status_code, code)
    assert P_NEXT in result.message
    assert router.ejections.ejected() == {P_FIRST, P_NEXT}
    assert charges(router) == IDLE


async def test_kv_transfer_an_engines_4xx_goes_back_to_the_client_without_retry_or_ejection():
    client = FakePrefillClient(LegReply(400, ENGINE_400, None, 0.01))
    router = router_with(kv_transfer, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, CLIENT_BODY)
    assert isinstance(result, Refused), result
    assert (result.status, result.code, result.body) == (400, "prefill_rejected", ENGINE_400)
    assert [leg[0] for leg in client.legs] == [P_FIRST]
    assert router.ejections.ejected() == frozenset()
    assert charges(router) == IDLE


# --- vllm-mooncake: the bootstrap query first, then both legs at once ---------------------------------


async def test_mooncake_a_bootstrap_answer_routes_both_legs_and_the_leg_releases_the_prefill():
    client = FakePrefillClient(BOOTSTRAP_ANSWER, LEG_ANSWER)
    router = router_with(mooncake, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, {**CLIENT_BODY, "kv_transfer_params": INJECTED_PARAMS})
    assert client.queries == ["http://10.0.0.1:8998/query"]
    params = body_of(result)["kv_transfer_params"]
    assert params["remote_engine_id"] == "e0" and params["remote_bootstrap_addr"] == "http://10.0.0.1:8998"
    assert kv_source(result) == P_FIRST and kv_handoff_marked(result)
    assert result.background is not None
    await result.background
    ((address, _, leg_body, headers),) = client.legs
    assert address == P_FIRST and headers["x-data-parallel-rank"] == "0"
    assert leg_body["kv_transfer_params"]["transfer_id"] == params["transfer_id"]
    assert router.ejections.ejected() == frozenset()
    assert charges(router)[P_FIRST] == (0, 0)
    result.lease.release()
    assert charges(router) == IDLE


@pytest.mark.parametrize("failure", [status(503), CONNECT_ERROR], ids=str)
async def test_mooncake_a_failed_bootstrap_query_is_retried_on_the_next_prefill(failure):
    client = FakePrefillClient(failure, BOOTSTRAP_ANSWER, LEG_ANSWER)
    router = router_with(mooncake, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, CLIENT_BODY)
    assert client.queries == ["http://10.0.0.1:8998/query", "http://10.0.0.2:8998/query"]
    assert isinstance(result, Routed) and kv_source(result) == P_NEXT
    assert result.background is not None
    await result.background
    assert [leg[0] for leg in client.legs] == [P_NEXT]
    assert router.ejections.ejected() == {P_FIRST}
    result.lease.release()
    assert charges(router) == IDLE


async def test_mooncake_both_queries_failed_decode_only_sends_the_clients_body_without_handoff_fields():
    client = FakePrefillClient(CONNECT_ERROR, status(500))
    router = router_with(mooncake, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, {**CLIENT_BODY, "kv_transfer_params": INJECTED_PARAMS})
    assert body_of(result) == CLIENT_BODY
    assert kv_source(result) is None and not kv_handoff_marked(result) and result.background is None
    assert client.legs == []
    assert router.ejections.ejected() == {P_FIRST, P_NEXT}
    result.lease.release()
    assert charges(router) == IDLE


async def test_mooncake_both_queries_failed_policy_error_answers_502():
    client = FakePrefillClient(CONNECT_ERROR, status(500))
    router = router_with(mooncake, client, FailurePolicy.ERROR)
    result = await answer(router, CLIENT_BODY)
    assert isinstance(result, Refused), result
    assert (result.status, result.code) == (502, "prefill_failed")
    assert charges(router) == IDLE


@pytest.mark.parametrize(
    ("leg_answer", "ejected"),
    [(status(503), {P_FIRST}), (CONNECT_ERROR, {P_FIRST}), (LegReply(400, ENGINE_400, None, 0.01), set())],
    ids=["5xx", "connect-error", "4xx"],
)
async def test_mooncake_a_failed_background_leg_ejects_its_prefill_and_forgets_its_engine_ids_but_a_4xx(
    leg_answer, ejected
):
    client = FakePrefillClient(BOOTSTRAP_ANSWER, leg_answer)
    router = router_with(mooncake, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, CLIENT_BODY)
    assert isinstance(result, Routed) and result.background is not None
    await result.background
    assert router.ejections.ejected() == ejected
    assert (router.handoff.known(P_FIRST) is None) is bool(ejected)
    assert charges(router)[P_FIRST] == (0, 0)
    result.lease.release()
    assert charges(router) == IDLE


# --- sglang-bootstrap: both legs at once, the prefill leg in the background ----------------------------


async def test_sglang_the_decode_and_the_prefill_leg_get_one_bootstrap_room():
    client = FakePrefillClient(LegReply(200, b"{}", None, 0.01))
    router = router_with(sglang, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, {**CLIENT_BODY, "bootstrap_room": 42, "bootstrap_host": "10.9.9.9"})
    decode_body = body_of(result)
    assert decode_body["bootstrap_host"] == "10.0.0.1" and decode_body["bootstrap_port"] == 8998
    assert decode_body["bootstrap_room"] != 42
    assert kv_source(result) == P_FIRST and kv_handoff_marked(result)
    assert result.background is not None
    await result.background
    ((address, _, leg_body, _),) = client.legs
    assert address == P_FIRST and leg_body == decode_body
    assert router.ejections.ejected() == frozenset()
    assert charges(router)[P_FIRST] == (0, 0)
    result.lease.release()
    assert charges(router) == IDLE


@pytest.mark.parametrize(
    ("leg_answer", "ejected"),
    [(status(500), {P_FIRST}), (CONNECT_ERROR, {P_FIRST}), (TIMEOUT, {P_FIRST}), (status(400), set())],
    ids=["5xx", "connect-error", "timeout", "4xx"],
)
async def test_sglang_a_failed_prefill_leg_ejects_its_prefill_but_a_4xx(leg_answer, ejected):
    client = FakePrefillClient(leg_answer)
    router = router_with(sglang, client, FailurePolicy.DECODE_ONLY)
    result = await answer(router, CLIENT_BODY)
    assert isinstance(result, Routed) and result.background is not None
    await result.background
    assert router.ejections.ejected() == ejected
    assert charges(router)[P_FIRST] == (0, 0)
    result.lease.release()
    assert charges(router) == IDLE
