"""Body rewriting of the engine handoffs and the reading of prefill answers (pure functions)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ext_proc.handoff.body import (
    BOOTSTRAP_FIELDS,
    KV_TRANSFER_PARAMS,
    PREFILL_REQUEST_PARAMS,
    prefill_leg_body,
    with_fields,
    without_fields,
)
from ext_proc.handoff.kv_transfer import engine_error, read_prefill_reply
from ext_proc.handoff.leg import LegOutcome, LegReply
from ext_proc.handoff.sglang import bootstrap_fields, bootstrap_host, prompt_count

OWNED = (KV_TRANSFER_PARAMS,)
PARAMS = {
    "do_remote_prefill": True,
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "extra": [1, {"a": None}],
}


def leg(body: dict) -> dict:
    return json.loads(prefill_leg_body(body))


def test_prefill_leg_asks_for_one_token_without_streaming():
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 99, "stream_options": {"x": 1}}
    assert leg(body) == {
        "model": "m",
        "prompt": "hi",
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": PREFILL_REQUEST_PARAMS,
    }
    assert body["stream"] is True and "stream_options" in body  # the client's body is not touched


def test_prefill_leg_caps_completion_tokens_only_when_the_client_set_them():
    assert leg({"max_completion_tokens": 50})["max_completion_tokens"] == 1
    assert "max_completion_tokens" not in leg({"max_tokens": 50})
    assert leg({"max_completion_tokens": None})["max_completion_tokens"] is None


@pytest.mark.parametrize(
    ("given_value", "expected"), [(7, 1), (1, 1), (0, 0), (2.5, 1), ("9", "9"), (True, True)]
)
@pytest.mark.parametrize("key", ["min_tokens", "min_completion_tokens"])
def test_prefill_leg_min_tokens_never_above_one(key, given_value, expected):
    assert leg({key: given_value})[key] == expected


def test_prefill_leg_replaces_client_kv_transfer_params():
    assert (
        leg({"kv_transfer_params": {"do_remote_prefill": True}})[KV_TRANSFER_PARAMS] == PREFILL_REQUEST_PARAMS
    )


def test_fields_are_spliced_into_the_clients_bytes():
    raw = b'{"model": "m",  "prompt": "caf\\u00e9"}  \n'
    out = with_fields(raw, json.loads(raw), {KV_TRANSFER_PARAMS: PARAMS}, OWNED)
    assert out.startswith(b'{"model": "m",  "prompt": "caf\\u00e9",')
    assert json.loads(out) == {"model": "m", "prompt": "café", KV_TRANSFER_PARAMS: PARAMS}


def test_fields_added_to_an_empty_object():
    assert json.loads(with_fields(b"{ }", {}, {KV_TRANSFER_PARAMS: PARAMS}, OWNED)) == {
        KV_TRANSFER_PARAMS: PARAMS
    }


def test_client_supplied_owned_fields_are_replaced_not_duplicated():
    raw = b'{"kv_transfer_params": {"remote_host": "evil"}, "kv_transfer_params": {"x": 1}, "n": 1}'
    out = with_fields(raw, json.loads(raw), {KV_TRANSFER_PARAMS: PARAMS}, OWNED)
    assert out.count(b"kv_transfer_params") == 1
    assert json.loads(out) == {"n": 1, KV_TRANSFER_PARAMS: PARAMS}


def test_an_escaped_owned_key_is_recognised():
    raw = b'{"kv\\u005ftransfer_params": {"remote_host": "evil"}}'
    assert json.loads(with_fields(raw, json.loads(raw), {KV_TRANSFER_PARAMS: PARAMS}, OWNED)) == {
        KV_TRANSFER_PARAMS: PARAMS
    }


def test_a_non_utf8_body_is_re_serialised():
    body = {"prompt": "hi"}
    raw = json.dumps(body).encode("utf-16")
    assert json.loads(with_fields(raw, body, {KV_TRANSFER_PARAMS: PARAMS}, OWNED)) == {
        **body,
        **{KV_TRANSFER_PARAMS: PARAMS},
    }


def test_without_fields_leaves_a_clean_body_alone():
    raw = b'{"prompt": "hi"}'
    assert without_fields(raw, json.loads(raw), BOOTSTRAP_FIELDS) is None
    dirty = b'{"prompt": "hi", "bootstrap_room": 7, "bootstrap_host": "10.0.0.9"}'
    assert json.loads(without_fields(dirty, json.loads(dirty), BOOTSTRAP_FIELDS) or b"") == {"prompt": "hi"}


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(
    body=st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=8),
    owned_present=st.booleans(),
    indent=st.sampled_from([None, 2]),
)
def test_every_field_not_owned_reaches_the_engine_unchanged(body, owned_present, indent):
    if owned_present:
        body = {**body, "bootstrap_room": 1, KV_TRANSFER_PARAMS: {"remote_host": "evil"}}
    raw = json.dumps(body, indent=indent).encode()
    owned = (KV_TRANSFER_PARAMS, *BOOTSTRAP_FIELDS)
    out = json.loads(with_fields(raw, body, {KV_TRANSFER_PARAMS: PARAMS}, owned))
    assert out == {**{k: v for k, v in body.items() if k not in owned}, KV_TRANSFER_PARAMS: PARAMS}
    plain = without_fields(raw, body, owned)
    assert json.loads(plain if plain is not None else raw) == {
        k: v for k, v in body.items() if k not in owned
    }


def reply(status: int, body: object) -> LegReply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return LegReply(status, data, None, 0.01)


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, {"kv_transfer_params": PARAMS}, LegOutcome.OK),
        (200, {"choices": []}, LegOutcome.NO_KV_TRANSFER_PARAMS),
        (200, {"kv_transfer_params": None}, LegOutcome.NO_KV_TRANSFER_PARAMS),
        (200, {"kv_transfer_params": "x"}, LegOutcome.BAD_RESPONSE),
        (200, [1], LegOutcome.BAD_RESPONSE),
        (200, b"\xff not json", LegOutcome.BAD_RESPONSE),
        (200, b"[" * 100_000 + b"]" * 100_000, LegOutcome.BAD_RESPONSE),  # too deep to parse
        (400, {"error": {"message": "bad"}}, LegOutcome.CLIENT_ERROR),
        (404, b"nope", LegOutcome.CLIENT_ERROR),
        (408, b"", LegOutcome.SERVER_ERROR),
        (429, b"", LegOutcome.SERVER_ERROR),
        (500, b"", LegOutcome.SERVER_ERROR),
        (503, b"upstream connect error", LegOutcome.SERVER_ERROR),
        (302, b"", LegOutcome.BAD_RESPONSE),
    ],
)
def test_prefill_answers_are_classified(status, body, outcome):
    got, params, detail = read_prefill_reply(reply(status, body))
    assert got is outcome
    assert params == (PARAMS if outcome is LegOutcome.OK else None)
    assert detail


def test_an_openai_style_engine_error_is_passed_through_verbatim():
    raw = json.dumps({"error": {"message": "too long", "type": "BadRequestError", "code": 400}}).encode()
    assert engine_error(reply(400, raw)) == ("too long", raw)


def test_a_too_deep_engine_error_is_quoted():
    message, body = engine_error(reply(400, b"{" * 100_000))
    assert body is None and message.startswith("the prefill engine refused the request: {{")


def test_any_other_engine_error_is_quoted():
    message, body = engine_error(reply(422, b"unprocessable"))
    assert body is None and message.endswith("unprocessable")


@pytest.mark.parametrize(("address", "host"), [("10.0.0.1:8000", "10.0.0.1"), ("[fd00::1]:8000", "fd00::1")])
def test_bootstrap_host_is_the_ip(address, host):
    assert bootstrap_host(address) == host


@pytest.mark.parametrize(
    ("body", "count"),
    [
        ({"prompt": "one"}, 1),
        ({"prompt": [1, 2, 3]}, 1),  # one tokenized prompt
        ({"prompt": ["a", "b", "c"]}, 3),
        ({"prompt": [[1, 2], [3]]}, 2),
        ({"prompt": []}, 1),
        ({"messages": [{"role": "user", "content": "x"}]}, 1),
        ({"prompt": [True, 1]}, 2),  # not token ids: SGLang reads it as a batch
    ],
)
def test_prompt_count_is_the_batch_sglang_makes(body, count):
    assert prompt_count(body) == count


def test_bootstrap_fields_are_scalars_for_one_prompt_and_lists_for_a_batch():
    one = bootstrap_fields("10.0.0.1", 8998, 1)
    assert (one["bootstrap_host"], one["bootstrap_port"]) == ("10.0.0.1", 8998)
    assert type(one["bootstrap_room"]) is int and 0 <= one["bootstrap_room"] < 2**63
    batch = bootstrap_fields("10.0.0.1", 8998, 3)
    assert batch["bootstrap_host"] == ["10.0.0.1"] * 3 and batch["bootstrap_port"] == [8998] * 3
    rooms = batch["bootstrap_room"]
    assert len(rooms) == 3 == len(set(rooms)) and all(0 <= r < 2**63 for r in rooms)
