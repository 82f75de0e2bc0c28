"""The router's side of the engine handoffs: which requests are disaggregated, and the retry placement."""

from __future__ import annotations

import json

import pytest
from builders import endpoint, registry_of

from ext_proc.affinity import Cost, Mode, Policy
from ext_proc.handoff.sidecar import SidecarHandoff
from ext_proc.metrics import Metrics
from ext_proc.outcome import HandoffJob, RequestMeta, Routed
from ext_proc.router import Router, RouterSettings

PREFILLS = {"10.0.0.1:1": "a", "10.0.0.2:1": "a", "10.0.0.3:1": "b"}
DECODES = {"10.0.1.1:1": "a", "10.0.1.2:1": "b"}
JOB = HandoffJob(b"", {}, RequestMeta("/v1/completions"), Cost(100, 104), None)


def router(mode: Mode = Mode.PREFER, threshold: int = 0) -> Router:
    prefills = [endpoint(a, g) for a, g in PREFILLS.items()]
    registry = registry_of(prefills, [endpoint(a, g) for a, g in DECODES.items()], 10_000.0)
    handoff = SidecarHandoff("x-gateway-destination-endpoint", "x-prefiller-host-port")
    return Router(
        RouterSettings(16, threshold),
        registry=registry,
        policy=Policy(mode, 0.3, 1),
        handoff=handoff,
        metrics=Metrics(registry.endpoints),
    )


def body(prompt_chars: int) -> bytes:
    return json.dumps({"model": "m", "prompt": "x" * prompt_chars, "max_tokens": 4}).encode()


def prefill_of(result: object) -> str | None:
    assert isinstance(result, Routed), result
    headers = dict(result.instructions.set_headers)
    return headers.get("x-prefiller-host-port")


@pytest.mark.parametrize(
    ("path", "disaggregated"),
    [
        ("/v1/completions", True),
        ("/v1/chat/completions?api-version=1", True),
        ("/v1/embeddings", False),
        ("/v1/responses", False),
        ("", False),
    ],
)
def test_only_completions_and_chat_get_a_prefill(path, disaggregated):
    result = router().route_body(body(400), RequestMeta(path))
    assert (prefill_of(result) is not None) is disaggregated


def test_prompts_below_the_threshold_go_decode_only():
    r = router(threshold=100)
    assert prefill_of(r.route_body(body(396), RequestMeta("/v1/completions"))) is None  # 99 tokens
    assert prefill_of(r.route_body(body(400), RequestMeta("/v1/completions"))) is not None  # 100 tokens


@pytest.mark.parametrize("mode", [Mode.OFF, Mode.PREFER])
def test_retry_takes_the_next_ranked_prefill_and_charges_it(mode):
    r = router(mode)
    first = r.route_body(body(400), JOB.meta)
    assert isinstance(first, Routed)
    failed = first.lease
    chosen = prefill_of(first)
    first_prefill = next(e for e in r.registry.prefills if e.address == chosen)
    retry = r.retry(JOB, _decision(r, chosen), frozenset({chosen}))
    assert retry is not None and retry.decision.prefill is not first_prefill
    assert retry.decision.prefill.active_requests == 1  # charged
    retry.lease.release()
    failed.release()
    assert r.retry(JOB, _decision(r, chosen), frozenset(PREFILLS)) is None


def _decision(r: Router, prefill: str):
    """A decision that chose ``prefill`` (as the failed leg's was)."""
    placed = r._place(JOB.cost, r.registry.prefill_pool.only({prefill}), r.registry.decode_pool, None)
    placed.lease.release()
    return placed.decision


def test_strict_retry_stays_in_the_failed_prefills_group():
    r = router(Mode.STRICT)
    failed = _decision(r, "10.0.0.1:1")
    retry = r.retry(JOB, failed, frozenset({"10.0.0.1:1"}))
    assert retry is not None and retry.decision.prefill.address == "10.0.0.2:1"
    assert retry.decision.decode.group == "a"
    retry.lease.release()
    assert r.retry(JOB, failed, frozenset({"10.0.0.1:1", "10.0.0.2:1"})) is None  # b is not a's group
    assert all(e.active_requests == 0 for e in r.registry.endpoints())
