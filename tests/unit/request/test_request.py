"""parse_request: prompt token estimates, output budget precedence, and precise errors."""

from __future__ import annotations

import json

import pytest

from ext_proc.request import MAX_JSON_DEPTH, MAX_OUTPUT_BUDGET, RequestError, RequestInfo, parse_request

DEFAULT_BUDGET = 256


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def parse(**fields: object) -> RequestInfo:
    return parse_request(body(**fields), DEFAULT_BUDGET)


def tokens(**fields: object) -> int:
    return parse(**fields).prompt_tokens


def error_of(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(raw, DEFAULT_BUDGET)
    return info.value


def message(content: object, role: str = "user") -> dict[str, object]:
    return {"role": role, "content": content}


# --- prompt token counting -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("", 0), ("a", 1), ("abcd", 1), ("abcde", 2), ("x" * 8, 2), ("x" * 9, 3), ("é" * 5, 2)],
)
def test_string_prompt_counts_ceil_of_chars_over_four(prompt: str, expected: int) -> None:
    assert tokens(model="m", prompt=prompt) == expected


def test_list_of_strings_prompt_ceils_the_total_not_each_string() -> None:
    assert tokens(prompt=["abcde", "fghij"]) == 3  # 10 chars -> ceil(2.5) = 3, not 2 + 2 = 4


def test_token_id_prompt_is_counted_exactly() -> None:
    assert tokens(prompt=[101, 2023, 2003, 1037, 3231, 0]) == 6


def test_list_of_token_id_lists_counts_every_id() -> None:
    assert tokens(prompt=[[1, 2, 3], [4], []]) == 4


def test_empty_prompt_list_is_zero_tokens() -> None:
    assert tokens(prompt=[]) == 0


def test_chat_string_content_is_summed_over_messages() -> None:
    messages = [message("x" * 10, "system"), message("y" * 7)]
    assert tokens(messages=messages) == 5  # 17 chars -> ceil(4.25)


def test_chat_null_content_counts_zero() -> None:
    assert tokens(messages=[message(None, "assistant"), message("abcd")]) == 1


def test_chat_message_without_content_key_counts_zero() -> None:
    assert tokens(messages=[{"role": "assistant", "tool_calls": []}]) == 0


def test_chat_list_of_parts_counts_text_parts_and_ignores_others() -> None:
    content = [
        {"type": "text", "text": "x" * 6},
        {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}},
        {"type": "text", "text": "y" * 3},
    ]
    assert tokens(messages=[message(content)]) == 3  # 9 chars


def test_messages_take_precedence_over_prompt_and_input() -> None:
    assert tokens(messages=[message("abcd")], prompt="x" * 400, input="y" * 400) == 1


def test_prompt_takes_precedence_over_input() -> None:
    assert tokens(prompt="abcd", input="y" * 400) == 1


def test_embeddings_string_input_is_counted() -> None:
    assert tokens(model="e", input="x" * 12) == 3


def test_responses_api_input_items_are_counted_like_messages() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "x" * 10}]},
        {"type": "message", "role": "assistant", "content": "y" * 3},
        {"type": "function_call_output", "call_id": "c1", "output": "ignored"},
    ]
    assert tokens(model="m", input=items) == 4  # 13 chars


def test_body_without_any_prompt_field_has_zero_prompt_tokens() -> None:
    assert tokens(model="m") == 0


def test_model_and_stream_are_reported() -> None:
    info = parse(model="llama", stream=True, prompt="abcd")
    assert info == RequestInfo(model="llama", stream=True, prompt_tokens=1, output_budget=DEFAULT_BUDGET)


def test_missing_model_and_null_stream_are_accepted() -> None:
    info = parse(stream=None)
    assert info.model is None
    assert info.stream is False


# --- output budget -----------------------------------------------------------------------------


def test_budget_defaults_when_no_limit_is_given() -> None:
    assert parse_request(body(prompt="a"), 77).output_budget == 77


def test_max_tokens_overrides_default() -> None:
    assert parse(max_tokens=12).output_budget == 12


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse(max_completion_tokens=5, max_tokens=500).output_budget == 5


def test_zero_max_completion_tokens_is_a_real_budget_not_missing() -> None:
    assert parse(max_completion_tokens=0, max_tokens=500).output_budget == 0


def test_zero_max_tokens_is_allowed() -> None:
    assert parse(max_tokens=0).output_budget == 0


def test_null_max_completion_tokens_falls_back_to_max_tokens() -> None:
    assert parse(max_completion_tokens=None, max_tokens=9).output_budget == 9


# --- errors ------------------------------------------------------------------------------------


def test_non_json_body_is_rejected_without_param() -> None:
    exc = error_of(b"{not json")
    assert exc.param is None
    assert str(exc).startswith("request body is not valid JSON: ")


def test_non_utf8_body_is_rejected_as_invalid_json() -> None:
    exc = error_of(b'{"model": "\xff\xfe\xfa"}')
    assert exc.param is None
    assert str(exc).startswith("request body is not valid JSON: ")


def test_empty_body_is_rejected() -> None:
    assert str(error_of(b"")).startswith("request body is not valid JSON")


@pytest.mark.parametrize("raw", [b"[]", b'[{"model": "m"}]', b'"text"', b"42", b"null"])
def test_non_object_json_body_is_rejected(raw: bytes) -> None:
    exc = error_of(raw)
    assert exc.param is None
    assert str(exc) == "request body must be a JSON object"


@pytest.mark.parametrize("model", [1, ["m"], {"name": "m"}, True])
def test_model_must_be_a_string(model: object) -> None:
    exc = error_of(body(model=model))
    assert (exc.param, str(exc)) == ("model", "'model' must be a string")


@pytest.mark.parametrize("stream", ["true", 1, 0, [True]])
def test_stream_must_be_a_boolean(stream: object) -> None:
    exc = error_of(body(stream=stream))
    assert (exc.param, str(exc)) == ("stream", "'stream' must be a boolean")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [-1, 1.5, 16.0, True, False, "16", [16]])
def test_output_limits_must_be_non_negative_integers(field: str, value: object) -> None:
    exc = error_of(body(prompt="x", **{field: value}))
    assert exc.param == field
    assert str(exc) == f"'{field}' must be a non-negative integer"


@pytest.mark.parametrize(
    ("prompt", "message_text"),
    [
        (["a", 1], "'prompt' mixes strings with other types"),
        (["a", ["b"]], "'prompt' mixes strings with other types"),
        ([1, "a"], "'prompt' token ids must all be integers"),
        ([1, 2.0], "'prompt' token ids must all be integers"),
        ([1, True], "'prompt' token ids must all be integers"),
        ([[1, 2], [3, "x"]], "'prompt' must be a list of token-id lists"),
        ([[1], 2], "'prompt' must be a list of token-id lists"),
        ([[1], [True]], "'prompt' must be a list of token-id lists"),
        (12, "'prompt' must be a string, a list of strings or a list of token ids"),
        ({"text": "a"}, "'prompt' must be a string, a list of strings or a list of token ids"),
        ([1.5], "'prompt' must be a string, a list of strings or a list of token ids"),
        ([True, 1], "'prompt' must be a string, a list of strings or a list of token ids"),
        ([None], "'prompt' must be a string, a list of strings or a list of token ids"),
    ],
)
def test_malformed_prompt_is_rejected_naming_prompt(prompt: object, message_text: str) -> None:
    exc = error_of(body(prompt=prompt))
    assert (exc.param, str(exc)) == ("prompt", message_text)


def test_malformed_input_names_input_not_prompt() -> None:
    exc = error_of(body(input=["a", 2]))
    assert (exc.param, str(exc)) == ("input", "'input' mixes strings with other types")


@pytest.mark.parametrize("messages", ["hello", {"role": "user"}, None, 3])
def test_messages_must_be_a_list(messages: object) -> None:
    exc = error_of(body(messages=messages))
    assert (exc.param, str(exc)) == ("messages", "'messages' must be a list of message objects")


def test_each_message_must_be_an_object_and_the_index_is_named() -> None:
    exc = error_of(body(messages=[message("ok"), "not a message"]))
    assert (exc.param, str(exc)) == ("messages[1]", "'messages[1]' must be an object")


def test_responses_input_item_that_is_not_an_object_is_named_by_index() -> None:
    exc = error_of(body(input=[message("ok"), message("ok"), 7]))
    assert (exc.param, str(exc)) == ("input[2]", "'input[2]' must be an object")


@pytest.mark.parametrize("content", [5, {"type": "text", "text": "a"}, True])
def test_content_must_be_string_null_or_list(content: object) -> None:
    exc = error_of(body(messages=[message("ok"), message(content)]))
    assert exc.param == "messages[1].content"
    assert str(exc) == "'messages[1].content' must be a string, null or a list of content parts"


def test_content_parts_must_be_objects() -> None:
    exc = error_of(body(messages=[message(["plain string part"])]))
    assert (exc.param, str(exc)) == ("messages[0].content", "'messages[0].content' parts must be objects")


@pytest.mark.parametrize("text", [3, ["a"], {"value": "a"}])
def test_content_part_text_must_be_a_string(text: object) -> None:
    exc = error_of(body(messages=[message([{"type": "text", "text": text}])]))
    assert exc.param == "messages[0].content"
    assert str(exc) == "'messages[0].content' part text must be a string"


def test_request_error_is_a_value_error_with_param_attribute() -> None:
    exc = RequestError("boom", "field")
    assert isinstance(exc, ValueError)
    assert exc.param == "field"
    assert RequestError("boom").param is None


# --- regressions found in review ----------------------------------------------------------------


def test_an_invalid_max_tokens_is_reported_even_beside_a_valid_max_completion_tokens() -> None:
    with pytest.raises(RequestError) as info:
        parse_request(b'{"max_completion_tokens": 5, "max_tokens": "abc"}', 256)
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize(("extra", "budget"), [({"n": 3}, 30), ({"best_of": 4, "n": 2}, 40), ({"n": 1}, 10)])
def test_every_generated_sequence_counts_in_the_output_budget(extra: dict, budget: int) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 10, **extra}).encode()
    assert parse_request(body, 256).output_budget == budget


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True])
def test_n_must_be_a_positive_integer(n: object) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(json.dumps({"prompt": "x", "n": n}).encode(), 256)
    assert info.value.param == "n"


# --- the output budget must fit the int64 load accounting ----------------------------------------


def test_the_largest_output_budget_is_accepted() -> None:
    assert parse(max_tokens=MAX_OUTPUT_BUDGET).output_budget == MAX_OUTPUT_BUDGET
    body = json.dumps({"prompt": "x", "max_tokens": MAX_OUTPUT_BUDGET // 4, "n": 4}).encode()
    assert parse_request(body, 256).output_budget == MAX_OUTPUT_BUDGET


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": MAX_OUTPUT_BUDGET + 1}, "max_tokens"),
        ({"max_completion_tokens": 10**30, "max_tokens": 5}, "max_completion_tokens"),
        ({"max_tokens": MAX_OUTPUT_BUDGET // 2, "n": 3}, "max_tokens"),
        ({"n": 2**40}, "n"),
        ({"n": 2, "best_of": 2**40}, "best_of"),
    ],
)
def test_an_output_budget_beyond_the_limit_is_rejected_naming_the_field(extra: dict, field: str) -> None:
    body = json.dumps({"prompt": "x", **extra}).encode()
    with pytest.raises(RequestError) as info:
        parse_request(body, 256)
    assert info.value.param == field
    assert f"'{field}' is too large" in str(info.value)
    assert str(MAX_OUTPUT_BUDGET) in str(info.value)


# --- nesting depth: bad input, never a RecursionError --------------------------------------------

TOO_DEEP = f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"


def nested(levels: int, field: str = "tools", inner: bytes = b"[", close: bytes = b"]") -> bytes:
    """A chat body whose ``field`` holds ``levels - 1`` nested containers: ``levels`` deep in all."""
    opening, closing = inner * (levels - 1), close * (levels - 1)
    return b'{"model": "m", "messages": [], "%s": %s0%s}' % (field.encode(), opening, closing)


@pytest.mark.parametrize("field", ["tools", "messages", "prompt", "x-unknown"])
def test_a_body_nested_100000_deep_in_any_field_is_bad_input(field: str) -> None:
    exc = error_of(nested(100_000, field))
    assert (exc.param, str(exc)) == (None, TOO_DEEP)


@pytest.mark.parametrize(("inner", "close"), [(b"[", b"]"), (b'{"a": ', b"}")], ids=["arrays", "objects"])
def test_the_depth_limit_is_exact(inner: bytes, close: bytes) -> None:
    assert parse_request(nested(MAX_JSON_DEPTH, inner=inner, close=close), DEFAULT_BUDGET).prompt_tokens == 0
    # deeper than the limit but well within what json.loads parses: refused all the same
    exc = error_of(nested(MAX_JSON_DEPTH + 1, inner=inner, close=close))
    assert (exc.param, str(exc)) == (None, TOO_DEEP)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_the_depth_limit_holds_in_every_json_encoding(encoding: str) -> None:
    deep = nested(MAX_JSON_DEPTH + 1).decode().encode(encoding)
    assert str(error_of(deep)) == TOO_DEEP
    assert parse_request(nested(MAX_JSON_DEPTH).decode().encode(encoding), DEFAULT_BUDGET).model == "m"


def test_many_brackets_are_not_depth() -> None:
    """Bodies with far more brackets than the limit, but shallow, are routed as usual."""
    conversation = [message([{"type": "text", "text": "[{"}]) for _ in range(3 * MAX_JSON_DEPTH)]
    assert tokens(messages=conversation) == 3 * MAX_JSON_DEPTH // 2  # 2 chars each
    assert tokens(prompt=[[1, 2]] * (3 * MAX_JSON_DEPTH)) == 6 * MAX_JSON_DEPTH
    assert tokens(prompt="[" * 10 * MAX_JSON_DEPTH) == 10 * MAX_JSON_DEPTH // 4
