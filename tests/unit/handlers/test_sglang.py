"""SGLang P/D payloads: the client's members on both legs, controlled keys, rids and rooms."""

from __future__ import annotations

import hashlib
import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from handlers import sglang as sg
from tests.support.fork import drawn_in_child

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


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(max_codepoint=0x2FF, blacklist_categories=("Cs",)) | st.sampled_from('"\\{}[],: \n\t'), max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


@given(st.dictionaries(st.text(max_size=8), _JSON, max_size=6), st.sampled_from([None, 1, 2]),
       st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]), st.booleans())
def test_split_members_matches_the_parsed_object(obj, indent, separators, ascii_only):
    """Any object, however it is spaced or escaped: the members are its keys in order, and each
    raw member is exactly ``"key": value`` of the body."""
    body = json.dumps(obj, indent=indent, separators=separators, ensure_ascii=ascii_only).encode()
    members = sg.split_members(b" \n" + body + b"\n")
    assert [k for k, _ in members] == list(obj)
    for key, raw in members:
        assert raw in body and raw == raw.strip()
        assert orjson.loads(b"{" + raw + b"}") == {key: obj[key]}


def test_split_members_refuses_what_is_not_an_object():
    for body in (b"[1, 2]", b'"x"', b"", b"  "):
        with pytest.raises(sg.BodyError):
            sg.split_members(body)


def test_sglang_bodies():
    p, d = sg.build_bodies(orjson.loads(RAW), bootstrap_host="10.0.0.1", bootstrap_port=8998, room=42, rid="r-1")
    pj, dj = orjson.loads(p), orjson.loads(d)
    for j in (pj, dj):
        assert (j["bootstrap_host"], j["bootstrap_port"], j["bootstrap_room"], j["rid"]) == ("10.0.0.1", 8998, 42, "r-1")
    assert pj["max_tokens"] == 1 and pj["max_completion_tokens"] == 1 and pj["stream"] is False
    assert "stream_options" not in pj and "min_tokens" not in pj
    assert dj["max_tokens"] == 40 and dj["stream"] is True and dj["min_tokens"] == 2
    assert dj["stream_options"] == {"include_usage": True}
    raw = orjson.loads(RAW)
    for key in ("messages", "tools", "model"):   # the client's values, the same bytes on both legs
        assert _member(p, key) == _member(d, key)
        assert pj[key] == dj[key] == raw[key]


def test_sglang_duplicate_controlled_key_is_refused():
    with pytest.raises(sg.BodyError, match='duplicate top-level key "stream"'):
        sg.check_members(sg.split_members(b'{"model":"m","stream":true,"prompt":"x","stream":false}'))
    sg.check_members(sg.split_members(b'{"model":"m","x":1,"x":2}'))  # not ours: passes through
    dup = b'{"model":"m","stream":true,"prompt":"x","stream":false}'
    assert sg.duplicate_controlled_key(dup) == 'duplicate top-level key "stream" in SGLang request body'
    # the name twice, but once as a value or nested: not a duplicate member
    assert sg.duplicate_controlled_key(b'{"model":"stream","stream":true,"x":{"stream":1}}') is None
    assert sg.duplicate_controlled_key(b'{"model":"m","x":1,"x":2}') is None


def test_sglang_messages_and_tools_identical_across_100_runs():
    digests = set()
    rooms = set()
    for _ in range(100):
        rid = sg.new_rid("req")
        room = sg.new_room()
        rooms.add(room)
        p, d = sg.build_bodies(orjson.loads(RAW), bootstrap_host="h", bootstrap_port=1, room=room, rid=rid)
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


def test_rids_of_a_forked_worker_are_its_own():
    """Two workers forked from one parent make different rids: SGLang's /abort_request of one
    request must not stop another worker's."""
    child = drawn_in_child(lambda: sg.new_rid("abc"))
    mine = [sg.new_rid("abc") for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(mine)


def test_bootstrap_host_ipv6():
    assert sg.bootstrap_host_of("::1") == "[::1]" and sg.bootstrap_host_of("10.0.0.1") == "10.0.0.1"
