"""``body_bytes``: a re-encoded body keeps the integers past 64 bits its client wrote."""

from __future__ import annotations

import json

import orjson

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
