"""Fuzzing the request parser and the body phase: whatever the body, routing either routes it or
answers a JSON ``400 invalid_request``, never another status and never an exception; a refusal of a
JSON object naming a field names one the body has, and its message quotes it.

Bodies of every shape (hypothesis): arbitrary bytes, bytes that are not UTF-8, JSON of any shape,
wrong types in every field routing reads, NaN/Infinity literals, numbers beyond a float or with
thousands of digits, duplicate keys, deep nesting, very long strings, lone surrogates. Routed by the
synchronous path of all three handoffs: sidecar (with a prefill), kv-transfer-params and
sglang-bootstrap (decode-only: their prefill legs need a network).
"""

from __future__ import annotations

import contextlib
import json

import pytest
from builders import CHAT_META, D_SAME_IDLE, P1, endpoint, make_router
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ext_proc.app import build_handoff
from ext_proc.config import load_config
from ext_proc.envoy_messages import error_body
from ext_proc.outcome import Refused, Routed
from ext_proc.request import MAX_JSON_DEPTH, RequestError, describe, parse_body
from ext_proc.router import Router

FIELDS = (
    "messages",
    "prompt",
    "input",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "stream",
    "model",
    "stream_options",
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "temperature",
)
"""What routing reads, and what the handoffs own (replaced or removed): every one may hold anything."""
fuzz = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.slow  # 300 examples a test: `make test-fast` leaves this module out

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(0, 4000).map(lambda digits: -(10**digits))  # up to Python's 4,300-digit limit
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.integers(0xD800, 0xDFFF).map(chr)  # a lone surrogate: JSON escapes one, UTF-8 cannot hold it
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"])}, optional={"content": values})
    | values,
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {}, optional={**{field: values for field in FIELDS}, "messages": messages | values}
).flatmap(
    lambda known: st.dictionaries(st.text(max_size=8), values, max_size=3).map(
        lambda extra: {**extra, **known}
    )
)

LITERALS = (
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e400",
    b"-1e400",
    b"9" * 5000,
    b"1" * 4300,
    b'"\\ud800"',
    b"\xff",
)


def _routers() -> dict[str, Router]:
    """One router per handoff: sidecar over a prefill and a decode, the engine handoffs decode-only."""
    routers = {"sidecar": make_router([endpoint(P1, "g1")], [endpoint(D_SAME_IDLE, "g1")])}
    for mode in ("kv-transfer-params", "sglang-bootstrap"):
        router = routers[mode] = make_router([], [endpoint(D_SAME_IDLE, "g1")])
        router.handoff = build_handoff(load_config(None, {"handoff.mode": mode}, environ={}), router.metrics)
    return routers


ROUTERS = _routers()


def _check(raw: bytes) -> None:
    """Route ``raw`` with every handoff: routed, or a 400 ``invalid_request`` whose param (if any) is a
    field of the body quoted by its message; the error body is JSON."""
    parsed: object = None
    with contextlib.suppress(ValueError, RecursionError):
        parsed = json.loads(raw)
    for mode, router in ROUTERS.items():
        outcome = router.route_body(raw, CHAT_META)
        if isinstance(outcome, Routed):
            outcome.lease.release()
            assert isinstance(parsed, dict), (mode, raw[:200])
            continue
        assert isinstance(outcome, Refused), (mode, outcome)
        assert (outcome.status, outcome.code) == (400, "invalid_request"), (mode, outcome)
        json.loads(error_body(outcome.status, outcome.message, outcome.code, outcome.param))
        if outcome.param is None:  # a problem of the whole body, never of a field
            assert outcome.message.startswith("request body "), outcome.message
        else:
            assert isinstance(parsed, dict)
            assert outcome.param.split("[")[0].split(".")[0] in parsed, (outcome.param, list(parsed))
            assert f"'{outcome.param}'" in outcome.message


@fuzz
@given(st.binary(max_size=400))
@example(b"\xff\xfe{}")
@example(b'{"model": "\xc3\x28"}')
def test_any_bytes(raw: bytes) -> None:
    _check(raw)


@fuzz
@given(bodies)
def test_any_json_object(body: dict[str, object]) -> None:
    raw = json.dumps(body).encode()
    _check(raw)
    parsed = json.loads(raw)
    try:
        info = describe(parse_body(raw), 16)
    except RequestError as exc:
        assert exc.param is None or exc.param.split("[")[0].split(".")[0] in parsed
    else:
        assert info.prompt_tokens >= 0 and info.output_budget >= 0


@fuzz
@given(bodies, st.data())
def test_json_with_odd_literals_spliced_in(body: dict[str, object], data: st.DataObject) -> None:
    """A JSON object whose values are replaced by NaN/Infinity, overlong numbers, lone surrogates,
    invalid UTF-8, or whose keys repeat."""
    raw = json.dumps(body).encode()
    if body:
        key = data.draw(st.sampled_from(sorted(body)))
        literal = data.draw(st.sampled_from(LITERALS))
        raw = b"{" + json.dumps(key).encode() + b":" + literal + b"," + raw[1:]  # a duplicate key too
    _check(raw)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(
    "value", [None, True, 0, -1, 1.5, "s", [], [1], ["s"], [[]], {}, {"a": 1}, [None], [{"content": 1}]]
)
def test_every_field_with_every_type(field: str, value: object) -> None:
    _check(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}).encode())


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 5000, 100_000])
def test_deep_nesting(depth: int) -> None:
    _check(b'{"a":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}")


def test_very_long_strings_and_huge_budgets() -> None:
    _check(
        json.dumps(
            {"messages": [{"content": "x" * 5_000_000}], "max_tokens": 10**4000, "n": 10**4000}
        ).encode()
    )
    _check(json.dumps({"prompt": ["y" * 1_000_000] * 4, "best_of": 10**4200}).encode())


@pytest.mark.parametrize(
    ("literal", "reason"),
    [
        (b"NaN", "NaN is not a JSON number"),
        (b"Infinity", "Infinity is not a JSON number"),
        (b"-Infinity", "-Infinity is not a JSON number"),
        (b"1e400", "the number 1e400 is beyond the range of a 64-bit float"),
        (b"-1.5e999", "the number -1.5e999 is beyond the range of a 64-bit float"),
        (b"9" * 5000, "Exceeds the limit (4300 digits)"),
    ],
)
def test_non_strict_json_numbers_are_refused(literal: bytes, reason: str) -> None:
    """NaN/Infinity (Python's json accepts them), a float overflowing to infinity, an integer beyond
    Python's digit limit: a 400 for the body, wherever the number sits."""
    for raw in (b'{"temperature": ' + literal + b"}", b'{"messages": [], "x": [1, ' + literal + b"]}"):
        with pytest.raises(RequestError, match=r"^request body is not valid JSON: ") as info:
            parse_body(raw)
        assert reason in str(info.value) and info.value.param is None


def test_duplicate_keys_are_accepted_and_the_last_wins() -> None:
    assert describe(parse_body(b'{"max_tokens": "x", "max_tokens": 7}'), 16).output_budget == 7
    with pytest.raises(RequestError) as info:
        describe(parse_body(b'{"max_tokens": 7, "max_tokens": "x"}'), 16)
    assert info.value.param == "max_tokens"


def test_a_lone_surrogate_survives_a_rewritten_body() -> None:
    """kv-transfer-params rewrites a body that carries the field it owns: the client's escaped lone
    surrogate goes out escaped (UTF-8 cannot encode it)."""
    raw = rb'{"messages": [{"content": "a\ud800\u00e9"}], "kv_transfer_params": {"x": 1}}'
    outcome = ROUTERS["kv-transfer-params"].route_body(raw, CHAT_META)
    assert isinstance(outcome, Routed)
    outcome.lease.release()
    sent = outcome.instructions.body
    assert sent is not None and json.loads(sent) == {"messages": [{"content": "a\ud800\u00e9"}]}


def test_a_huge_budget_is_refused_naming_the_field_without_printing_the_number() -> None:
    with pytest.raises(RequestError) as info:
        describe(parse_body(json.dumps({"max_tokens": 10**4000, "n": 10**4000}).encode()), 16)
    assert info.value.param == "max_tokens" and len(str(info.value)) < 300
