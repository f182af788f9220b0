"""The fast lane's reading of a request (gateway/server/lane.py ``parse``): what it takes, and
every head it leaves to aiohttp (which then parses the same bytes and answers as before)."""

from __future__ import annotations

import pytest

from gateway.server import lane

PATHS = {b"/v1/chat/completions": "/v1/chat/completions"}
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def _raw(*headers: str, body: bytes = BODY, line: str = "POST /v1/chat/completions HTTP/1.1",
         length: str | None = None) -> bytes:
    fields = [*headers, f"Content-Length: {len(body) if length is None else length}"]
    return ("\r\n".join([line, *fields]) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def _parse(data: bytes, **kw):
    args = {"max_head": 8190, "max_headers": 100, "max_body": float("inf"), **kw}
    return lane.parse(data, PATHS, args["max_head"], args["max_headers"], args["max_body"])


def test_a_plain_request_is_taken_whole_with_its_headers_as_sent():
    path, headers, body, keep_alive = _parse(_raw("Host: gw", "X-Request-Id:  abc \t", "Accept:"))
    assert path == "/v1/chat/completions" and body == BODY and keep_alive
    assert headers["host"] == "gw" and headers["X-REQUEST-ID"] == "abc" and headers["accept"] == ""
    assert list(headers) == ["Host", "X-Request-Id", "Accept", "Content-Length"]


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
    _raw(length="+57"), _raw(length="5 7"), _raw(length="٥٧"),
    _raw(line="POST /v1/chat/completions HTTP/1.0"),
    _raw(line="POST /v1/chat/completions?x=1 HTTP/1.1"),
    _raw(line="POST /v1/models HTTP/1.1"),
    _raw(line="POST  /v1/chat/completions HTTP/1.1"),
    _raw(line="PUT /v1/chat/completions HTTP/1.1"),
    _raw(line="POST /v1/chat/completions HTTP/1.1 "),
    _raw() + b"POST",                               # bytes of a next request behind it
    _raw(body=BODY + b" ", length=str(len(BODY))),
])
def test_anything_else_is_left_to_aiohttp(data):
    assert _parse(data) is None


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
