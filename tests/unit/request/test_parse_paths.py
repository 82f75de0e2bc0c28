"""parse_body's fast path (msgspec) and its depth walk decide as Python's ``json`` with the strict hooks."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ext_proc.request import MAX_JSON_DEPTH, RequestError, _parse_strictly, parse_body

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
values = st.recursive(
    scalars, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=30
)


def _by_json(raw: bytes) -> object:
    """What the strict ``json`` path makes of ``raw``: the object, or the refusal's message."""
    try:
        return _parse_strictly(raw)
    except RequestError as exc:
        return str(exc)


@settings(deadline=None)
@given(st.dictionaries(st.text(), values), st.binary(max_size=8), st.integers(0, 40))
@example({"a": "\ud800"}, b"", 0)
@example({"a": 1}, b"NaN", 5)
@example({"a": 1}, b"1e400", 5)
@example({"a": 1}, b"\xed\xa0\x80", 6)
def test_the_fast_path_agrees_with_json_on_valid_and_mangled_bodies(body, splice, at) -> None:
    text = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    for raw in (text, text[:at] + splice + text[at:]):
        expected = _by_json(raw)
        try:
            got: object = parse_body(raw)
        except RequestError as exc:
            got = str(exc)
        if isinstance(expected, dict):
            assert got == expected, raw
        else:  # refused both ways (or not an object: parse_body refuses what json parses as a list)
            assert isinstance(got, str), raw


def test_a_deep_body_is_refused_whether_its_values_are_few_or_many() -> None:
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    for many in (0, 10_000):  # few values: walked; many: the brackets counted first
        raw = f'{{"prompt": {json.dumps(list(range(many)))}, "x": {deep}}}'.encode()
        with pytest.raises(RequestError, match="deeper than"):
            parse_body(raw)
        shallow = f'{{"prompt": {json.dumps(list(range(many)))}, "x": [[1]]}}'.encode()
        assert parse_body(shallow)["x"] == [[1]]
