"""The fast lane's reading of a request (gateway/server/lane.py ``parse``): what it takes, and
every head it leaves to aiohttp (which then parses the same bytes and answers as before)."""

from __future__ import annotations

import os

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gateway.server import lane

PATHS = {b"/v1/chat/completions": "/v1/chat/completions"}
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def _raw(*headers: str, body: bytes = BODY, line: str = "POST /v1/chat/completions HTTP/1.1",
         length: str | None = None, host: bool = True) -> bytes:
    fields = [*(["Host: gw"] if host and not any(h.lower().startswith("host:") for h in headers) else []),
              *headers, f"Content-Length: {len(body) if length is None else length}"]
    return ("\r\n".join([line, *fields]) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def _parse(data: bytes, **kw):
    args = {"max_head": 8190, "max_headers": 100, "max_body": float("inf"), **kw}
    return lane.parse(data, PATHS, args["max_head"], args["max_headers"], args["max_body"])


def test_a_plain_request_is_taken_whole_with_its_headers_as_sent():
    path, headers, body, keep_alive = _parse(_raw("Host: gw", "X-Request-Id: \t abc", "Accept:"))
    assert path == "/v1/chat/completions" and body == BODY and keep_alive
    assert headers["host"] == "gw" and headers["X-REQUEST-ID"] == "abc" and headers["accept"] == ""
    assert list(headers) == ["Host", "X-Request-Id", "Accept", "Content-Length"]
    assert _parse(_raw("X-Request-Id: abc"))[1]["host"] == "gw"


@pytest.mark.parametrize("value", ["abc ", "abc\t", " ", "a b \t"])
def test_a_value_that_ends_in_a_space_or_a_tab_is_left_to_aiohttp(value):
    # aiohttp strips it; the lane's one regular expression for the fields does not look for it
    assert _parse(_raw(f"X-Request-Id:{value}")) is None
    assert _parse(_raw(f"X-Request-Id:{value.rstrip()}")) is not None


def test_connection_close_is_kept_whatever_its_case_or_its_company():
    assert _parse(_raw("Connection: keep-alive"))[3] is True
    assert _parse(_raw("Connection: Upgrade-Insecure, CLOSE"))[3] is False
    assert _parse(_raw("Connection: keep-alive", "connection: close"))[3] is False
    assert _parse(_raw("Connection: closed"))[3] is True


def test_bytes_above_ascii_in_a_value_are_carried_as_aiohttp_carries_them():
    headers = _parse(_raw("X-Name: caf\xc3\xa9 \xff".encode("latin-1").decode("utf-8", "surrogateescape")))[1]
    assert headers["x-name"] == "café \udcff"


@pytest.mark.parametrize("data", [
    _raw("Host : gw"),                              # a space before the colon
    _raw("Ho st: gw"),                              # not a token
    _raw("Host: g\x00w"),                           # a control byte in a value
    _raw("Host: g\x7fw"),
    _raw("Host: g\rw"),                             # a bare CR
    _raw("Host: g\nw"),                             # a bare LF
    _raw("Host: gw", " folded"),                    # an obsolete line folding
    _raw("NoColon"),
    _raw("Transfer-Encoding: chunked"),             # framing, encodings and protocol switches
    _raw("Content-Encoding: gzip"),
    _raw("Expect: 100-continue"),
    _raw("Upgrade: h2c"),
    _raw("Content-Length: 3"),                      # two lengths
    _raw(host=False), _raw("Host: a", "Host: b"),   # HTTP/1.1 without one Host: aiohttp's 400
    # another field the parser takes once only (RFC 9110's singletons), twice: aiohttp's 400
    _raw("Content-Type: application/json", "Content-Type: text/plain"), _raw("User-Agent: a", "user-agent: a"),
    _raw("ETag: a", "ETag: b"), _raw("Server: a", "Server: b"), _raw("Max-Forwards: 1", "Max-Forwards: 2"),
    _raw("Content-Location: /a", "Content-Location: /b"), _raw("Content-Range: a", "Content-Range: b"),
    _raw(length="+57"), _raw(length="5 7"), _raw(length="٥٧"),
    _raw(length="0" * 4400 + str(len(BODY))),     # more digits than int() converts
    _raw(line="POST /v1/chat/completions HTTP/1.0"),
    _raw(line="POST /v1/chat/completions?x=1 HTTP/1.1"),
    _raw(line="POST /v1/models HTTP/1.1"),
    _raw(line="POST  /v1/chat/completions HTTP/1.1"),
    _raw(line="PUT /v1/chat/completions HTTP/1.1"),
    _raw(line="POST /v1/chat/completions HTTP/1.1 "),
])
def test_anything_else_is_left_to_aiohttp(data):
    assert _parse(data) is None


@pytest.mark.parametrize("rest", [b"POST", b" ", _raw()])
def test_bytes_after_a_whole_request_wait_their_turn(rest):
    """A read with a whole request and more: the request is taken, the rest held for after it."""
    got = _parse(_raw() + rest)
    assert isinstance(got, lane.Split) and got.first[2] == BODY and got.rest == rest
    assert _parse(_raw() + b"x" * (lane.HOLD_BYTES + 1)) is None     # past the hold: aiohttp's, as before


def test_limits_leave_it_to_aiohttp_which_answers_them():
    raw = _raw("Host: gw", "Accept: x")
    assert _parse(raw, max_head=raw.index(b"\r\n\r\n") + 3) is None
    assert _parse(raw, max_headers=2) is None
    assert _parse(raw, max_body=len(BODY) - 1) is None
    assert _parse(raw, max_headers=3)[2] == BODY


def test_a_body_that_comes_after_its_head_is_held_until_it_is_whole():
    raw = _raw("Host: gw", "x-request-id: r-1")
    cut = raw.index(b"\r\n\r\n") + 10
    pending = _parse(raw[:cut])
    assert isinstance(pending, lane.Pending) and pending.rid == "r-1"
    assert pending.more(raw[cut:cut + 5], float("inf")) is pending
    path, headers, body, keep_alive = pending.more(raw[cut + 5:], float("inf"))
    assert body == BODY and headers["x-request-id"] == "r-1" and keep_alive
    # more than its length (a next request behind it): aiohttp's, with every byte so far
    pending = _parse(raw[:cut])
    assert pending.more(raw[cut:] + b"POST", float("inf")) is None and bytes(pending.data) == raw + b"POST"
    # a body longer than the lane holds is aiohttp's from the start
    big = _raw("Host: gw", body=b"x" * (lane.HOLD_BODY + 1))
    assert _parse(big[:big.index(b"\r\n\r\n") + 10]) is None


# -- the lane reads what aiohttp reads --------------------------------------------------------------

_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_names = st.one_of(
    st.text(_TOKEN_CHARS, min_size=1, max_size=12),
    st.text(_TOKEN_CHARS, min_size=1, max_size=12),
    st.text(_TOKEN_CHARS + " :\t\x00\x7f\xe9{}()/\"", min_size=0, max_size=12),     # often not a token
    st.sampled_from(["Connection", "connection", "Transfer-Encoding", "Expect", "Content-Length", "X-Request-Id", "Host",
                     "Content-Type", "user-agent"]),
)
_values = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=20),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=20),
    st.text(" \t\r\n\x00\x01\x0b\x7fab,\xe9\xff", max_size=10),                        # whitespace, controls, obs-text
    st.sampled_from(["close", "Close", "keep-alive", "close, upgrade", "closed", "5", "+5", " 5 "]),
)


def _aiohttp_reading(data: bytes):
    """What aiohttp's own parser (the C one the edge runs) makes of ``data``: (headers, body,
    keep-alive) of its one complete message, or None when it refuses it or finds anything else."""
    import asyncio

    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.http_exceptions import HttpProcessingError
    from aiohttp.http_parser import HttpRequestParser

    loop = asyncio.new_event_loop()
    try:
        parser = HttpRequestParser(BaseProtocol(loop), loop, 2 ** 16, max_line_size=8190, max_field_size=8190,
                                   max_headers=128)
        try:
            messages, upgraded, tail = parser.feed_data(data)
        except HttpProcessingError:
            return None
        if len(messages) != 1 or upgraded or tail:
            return None
        msg, payload = messages[0]
        if not payload.is_eof():
            return None
        return list(msg.headers.items()), payload.read_nowait(), not msg.should_close
    finally:
        loop.close()


@settings(max_examples=int(os.environ.get("LANE_EXAMPLES", "400")), deadline=None, derandomize=os.environ.get("CI") == "true")
@given(fields=st.lists(st.tuples(_names, _values), max_size=6), body=st.binary(max_size=40))
def test_what_the_lane_takes_aiohttp_reads_alike(fields, body):
    """Property: a head the lane takes whole is one aiohttp reads as one complete request, with the
    same headers, body and keep-alive (the lane only takes what aiohttp would hand the handler)."""
    lines = [f"{n}: {v}" for n, v in fields]
    head = "\r\n".join(["POST /v1/chat/completions HTTP/1.1", "Host: gw", *lines, f"Content-Length: {len(body)}"])
    data = (head + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
    got = lane.parse(data, PATHS, 8190, 128, float("inf"))
    event("taken by the lane" if isinstance(got, tuple) else "left to aiohttp")
    if not isinstance(got, tuple):
        return                                  # declined (or held for its body): aiohttp's to read
    theirs = _aiohttp_reading(data)
    assert theirs is not None, data
    headers, their_body, keep_alive = theirs
    # names compare without case: aiohttp spells the headers it knows its own way ("CONNECTION" is
    # "Connection" there), the lane as the client sent them; both are case-insensitive mappings
    assert [(k.lower(), v) for k, v in got[1].items()] == [(k.lower(), v) for k, v in headers]
    assert got[2] == their_body and got[3] == keep_alive
