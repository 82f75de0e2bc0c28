"""The served-model values: names, declared lists, vLLM's model list and the gateway's answer."""

from __future__ import annotations

import json
import re

import pytest

from ext_proc.models import (
    ModelNameError,
    ServedModel,
    check_model_name,
    model_list_body,
    parse_model_list,
)

VLLM_LIST = {
    "object": "list",
    "data": [
        {"id": "Qwen/Qwen3-0.6B", "object": "model", "root": "Qwen/Qwen3-0.6B", "parent": None},
        {"id": "ad1", "object": "model", "root": "/adapters/ad1", "parent": "Qwen/Qwen3-0.6B"},
    ],
}


def test_vllms_list_gives_the_base_model_and_its_adapters_with_their_parent() -> None:
    assert parse_model_list(json.dumps(VLLM_LIST).encode()) == (
        ServedModel("Qwen/Qwen3-0.6B"),
        ServedModel("ad1", "Qwen/Qwen3-0.6B"),
    )


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{", "not JSON"),
        (b"[]", "no 'data' list"),
        (b'{"data": {}}', "no 'data' list"),
        (b'{"data": []}', "empty"),
        (b'{"data": [3]}', "data[0] is not an object"),
        (b'{"data": [{"id": ""}]}', "data[0].id must not be empty"),
        (b'{"data": [{"id": "a", "parent": 5}]}', "data[0].parent must be a string"),
        (json.dumps({"data": [{"id": f"m{i}"} for i in range(300)]}).encode(), "300 models listed"),
    ],
)
def test_a_list_that_is_not_one_is_refused(raw: bytes, says: str) -> None:
    with pytest.raises(ModelNameError, match=re.escape(says)):
        parse_model_list(raw)


def test_the_gateways_answer_is_openais_list_shape_sorted_by_name() -> None:
    body = json.loads(model_list_body([ServedModel("b"), ServedModel("a-lora", "a"), ServedModel("a")]))
    assert body == {
        "object": "list",
        "data": [
            {"id": "a", "object": "model", "created": 0, "owned_by": "pd-extproc", "parent": None},
            {"id": "a-lora", "object": "model", "created": 0, "owned_by": "pd-extproc", "parent": "a"},
            {"id": "b", "object": "model", "created": 0, "owned_by": "pd-extproc", "parent": None},
        ],
    }


def test_a_name_is_a_string_of_1_to_512_characters_not_only_white_space() -> None:
    assert check_model_name("m" * 512, "x") == "m" * 512
    for bad in ("", " \t", "m" * 513, None, 1, ["m"]):
        with pytest.raises(ModelNameError):
            check_model_name(bad, "x")
