"""SGLang P/D payloads: byte-identical members, controlled keys, rids and rooms."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from handlers import sglang as sg

# -- SGLang payloads -------------------------------------------------------------------------------

RAW = (b'{ "model" : "m", "messages":[{"role":"user","content":"caf\\u00e9 \\"q\\" {[,]}"}],\n'
       b' "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{}}}}],'
       b' "stream": true, "max_tokens": 40, "bootstrap_room": 7, "stream_options": {"include_usage": true},'
       b' "min_tokens": 2, "rid": "client-rid"}')


def _member(body: bytes, key: str) -> bytes:
    return dict(sg.split_members(body))[key]


def test_split_members_keeps_bytes():
    members = sg.split_members(RAW)
    assert [k for k, _ in members] == ["model", "messages", "tools", "stream", "max_tokens", "bootstrap_room",
                                       "stream_options", "min_tokens", "rid"]
    assert dict(members)["messages"].startswith(b'"messages":[{"role"')
    for _, raw in members:
        assert raw in RAW


def test_sglang_bodies():
    members = sg.split_members(RAW)
    p, d = sg.build_bodies(members, bootstrap_host="10.0.0.1", bootstrap_port=8998, room=42, rid="r-1")
    pj, dj = orjson.loads(p), orjson.loads(d)
    for j in (pj, dj):
        assert (j["bootstrap_host"], j["bootstrap_port"], j["bootstrap_room"], j["rid"]) == ("10.0.0.1", 8998, 42, "r-1")
    assert pj["max_tokens"] == 1 and pj["max_completion_tokens"] == 1 and pj["stream"] is False
    assert "stream_options" not in pj and "min_tokens" not in pj
    assert dj["max_tokens"] == 40 and dj["stream"] is True and dj["min_tokens"] == 2
    assert dj["stream_options"] == {"include_usage": True}
    for key in ("messages", "tools", "model"):
        assert _member(p, key) == _member(RAW, key) == _member(d, key)


def test_sglang_duplicate_controlled_key_is_refused():
    with pytest.raises(sg.BodyError, match='duplicate top-level key "stream"'):
        sg.check_members(sg.split_members(b'{"model":"m","stream":true,"prompt":"x","stream":false}'))
    sg.check_members(sg.split_members(b'{"model":"m","x":1,"x":2}'))  # not ours: passes through


def test_sglang_messages_and_tools_identical_across_100_runs():
    digests = set()
    rooms = set()
    for _ in range(100):
        rid = sg.new_rid("req")
        room = sg.new_room()
        rooms.add(room)
        p, d = sg.build_bodies(sg.split_members(RAW), bootstrap_host="h", bootstrap_port=1, room=room, rid=rid)
        for body in (p, d):
            digests.add(hashlib.sha256(_member(body, "messages") + _member(body, "tools")).hexdigest())
        assert orjson.loads(p)["bootstrap_room"] == orjson.loads(d)["bootstrap_room"] < 2**63
    assert len(digests) == 1
    assert len(rooms) > 90


def test_rids_are_fixed_width_and_never_prefixes():
    rids = [sg.new_rid("abc") for _ in range(1000)]
    assert all(len(r) == len("abc-") + 16 for r in rids)
    assert len(set(rids)) == 1000
    assert not any(a != b and b.startswith(a) for a in rids[:50] for b in rids)


def test_bootstrap_host_ipv6():
    assert sg.bootstrap_host_of("::1") == "[::1]" and sg.bootstrap_host_of("10.0.0.1") == "10.0.0.1"
