"""``body_bytes``: a re-encoded body keeps the integers past 64 bits its client wrote."""

from __future__ import annotations

import json

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.request import body_bytes

BIG = 123456789012345678901234567890


def test_a_body_without_wide_integers_is_orjsons_encoding():
    for raw in (b'{"a": 1, "b": 1e30, "c": "e+ 1234567890123456789012"}', b'{"a": [1.5, -2, "x"]}'):
        data = orjson.loads(raw)
        assert body_bytes(data, raw) == orjson.dumps(data)


def test_digits_in_strings_are_not_taken_for_integers():
    raw = f'{{"text": "{BIG}", "x": 1e300}}'.encode()
    data = orjson.loads(raw)
    assert body_bytes(data, raw) == orjson.dumps(data)


def test_rewritten_bodies_keep_the_clients_digits_in_order():
    raw = f'{{"model": "a", "x": [{BIG}, {float(BIG)!r}, {BIG + 1}], "y": {{"z": {-BIG}}}}}'.encode()
    data = orjson.loads(raw)
    data = {**data, "model": "b", "stream_options": {"include_usage": True}}
    got = json.loads(body_bytes(data, raw))
    assert got["x"] == [BIG, float(BIG), BIG + 1] and type(got["x"][1]) is float
    assert got["y"]["z"] == -BIG and got["model"] == "b"
    # a rewritten body holding one more of them than the client's: the last literal again
    data["w"] = data["y"]["z"]
    assert json.loads(body_bytes(data, raw))["w"] == -BIG


def test_deep_nesting_keeps_the_digits_too():
    raw = b'{"a": ' + b"[" * 250 + str(BIG).encode() + b"]" * 250 + b"}"
    data = orjson.loads(raw)
    got = json.loads(body_bytes(data, raw))["a"]
    for _ in range(250):
        got = got[0]
    assert got == BIG


def test_nesting_past_what_orjson_writes_is_written_as_orjson_writes():
    for depth in (250, 255, 1020):
        raw = b'{"a": [{"k": "v\\" [", "n": [1.5, true, null]}, ' + b"[" * depth + b"]" * depth + b"]}"
        data = orjson.loads(raw)
        got = body_bytes({**data, "model": "b"}, raw)
        assert got == raw.replace(b", ", b",").replace(b": ", b":")[:-1] + b',"model":"b"}'
    raw = b'{"a": ' + b"[" * 1000 + str(-BIG).encode() + b"]" * 1000 + b"}"
    assert body_bytes(orjson.loads(raw), raw) == raw.replace(b" ", b"")


def test_a_key_given_twice_carries_the_digits_of_its_last_value():
    # JSON readers (orjson, Python's json in front of the engines) keep a repeated key's last value
    # at its first place: the digits written back are that value's, whatever the key's spelling
    for raw in (f'{{"x": {BIG}, "x": {BIG + 1}}}',
                f'{{"x": {{"a": {BIG}}}, "x": 1, "y": {BIG + 1}}}',
                f'{{"a": {BIG}, "b": {BIG + 1}, "a": {BIG + 2}}}',
                f'{{"x": [{BIG}], "\\u0078": [{BIG + 2}], "y": {BIG + 1}}}'):
        data = orjson.loads(raw)
        assert json.loads(body_bytes({**data, "model": "b"}, raw.encode())) == {**json.loads(raw), "model": "b"}, raw


_KEYS = st.sampled_from(['"a"', '"b"', '"\\u0061"', '"a\\"b"', '"[{"'])
_NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([BIG, BIG + 1, -BIG, 2**64, -2**63 - 1]).map(str),
                     st.sampled_from([BIG, -BIG, 2**64]).map(lambda n: repr(float(n))))
_SCALARS = st.one_of(_NUMBERS.map(str), st.sampled_from(['"1234567890123456789012"', '"x\\"1e+30"', "true", "null",
                                                         '"\\u00e9"', "1.5"]))


def _arrays(items: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(items, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]")


def _objects(items: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(st.tuples(_KEYS, items), max_size=4).map(
        lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")


def _exact(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_exact(a[k], b[k]) for k in a)   # type: ignore[index]
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_exact, a, b))     # type: ignore[arg-type]
    return a == b


@given(_objects(st.recursive(_SCALARS, lambda c: _arrays(c) | _objects(c), max_leaves=10)))
def test_a_rewritten_body_holds_what_pythons_json_reads_of_the_clients(raw):
    # the reference: Python's json, which reads integers exactly and a repeated key as orjson does
    data = orjson.loads(raw)
    got = json.loads(body_bytes({**data, "model": "b"}, raw.encode()))
    assert _exact(got, {**json.loads(raw), "model": "b"})
