"""The Responses stream scanner: bytes pass unchanged, first token, gaps, usage, the held end."""

from __future__ import annotations

import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.apis import responses_stream
from gateway.apis.responses_stream import ResponsesScanner, failed_after_error, failure_events
from gateway.pipeline.sse import MAX_EVENT_BYTES


def ev(kind: str, named: bool = True, **fields) -> bytes:
    data = orjson.dumps({"type": kind, **fields})
    return (b"event: " + kind.encode() + b"\n" if named else b"") + b"data: " + data + b"\n\n"


RESP = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
DONE = {**RESP, "status": "completed", "output": [{"type": "message", "content": [{"type": "output_text",
                                                                                   "text": "ab"}]}],
        "usage": {"input_tokens": 7, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 3}}}


def stream(named: bool = True) -> list[bytes]:
    return [ev("response.created", named, response=RESP), ev("response.in_progress", named, response=RESP),
            ev("response.output_item.added", named, item={"type": "message", "content": []}),
            ev("response.output_text.delta", named, delta="a"), ev("response.output_text.delta", named, delta="b"),
            ev("response.output_text.done", named, text="ab"),
            ev("response.completed", named, response=DONE)]


def test_first_token_gaps_usage_and_the_held_terminal_event():
    s = ResponsesScanner()
    out = []
    for t, chunk in enumerate(stream()):
        out.append(s.feed(chunk, float(t)))
    assert out[-1] == b"" and s.done                   # response.completed held back ...
    assert s.finish() == stream()[-1]                  # ... and released by finish()
    assert s.first_token_at == 2.0                     # the output item, before the first delta
    assert s.drain_itl() == [1.0]                      # gaps between deltas only
    assert s.usage == DONE["usage"] and s.response_id == "resp_1" and s.finish_reason == "completed"
    assert s.snapshot == RESP and s.final == DONE


def test_events_without_an_event_line_are_typed_from_their_json():
    s = ResponsesScanner()
    for t, chunk in enumerate(stream(named=False)):
        s.feed(chunk, float(t))
    s.finish()
    assert s.done and s.first_token_at == 2.0 and s.usage == DONE["usage"]


def test_an_error_event_and_a_failed_response_are_errors():
    s = ResponsesScanner()
    s.feed(ev("error", code="server_error", message="boom", param=None), 0.0)
    assert s.error["message"] == "boom" and not s.done
    failed = ev("response.failed", response={**RESP, "status": "failed", "error": {"code": "x", "message": "m"}})
    s.feed(failed, 1.0)
    # the error event's error stays the stream's: it is the one that names a status (501: the request's)
    assert s.done and s.error == {"code": "server_error", "message": "boom", "param": None, "type": "error"}
    assert s.finish_reason == "failed"
    s = ResponsesScanner()
    s.feed(failed, 0.0)
    assert s.done and s.error == {"code": "x", "message": "m"} and s.finish_reason == "failed"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(b"".join(stream())) - 1), max_size=12),
       st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_bytes_pass_unchanged_and_in_order_however_the_stream_is_cut(cuts, line_end):
    """... whatever its line ends: LF, CRLF, or bare CR (legal in SSE)."""
    raw = b"".join(stream()).replace(b"\n", line_end)
    points = sorted(set(cuts))
    chunks = [raw[i:j] for i, j in zip([0, *points], [*points, len(raw)], strict=True)]
    s = ResponsesScanner()
    sent = b""
    for c in chunks:
        sent += s.feed(c, 0.0)
        # whole events only: an event's start waits for its end (a read that ends between the CR
        # and the LF of a CRLF has its CR read as a line end, which ends the event as well)
        assert not sent or sent.endswith(line_end * 2) or sent.endswith(b"\r\n\r")
    out = sent + s.finish()
    assert out == raw
    assert s.done and s.usage == DONE["usage"]
    assert raw.index(b"event: response.completed") >= len(out) - len(stream()[-1].replace(b"\n", line_end))


def test_failure_events_continue_the_engines_sequence():
    s = ResponsesScanner()
    for chunk in stream()[:4]:
        s.feed(chunk, 0.0)
    raw = failure_events(s, "m", 504, "no output", "upstream_timeout")
    blocks = [b for b in raw.split(b"\n\n") if b]
    assert [b.split(b"\n")[0] for b in blocks] == [b"event: error", b"event: response.failed"]
    err = orjson.loads(blocks[0].split(b"data: ", 1)[1])
    failed = orjson.loads(blocks[1].split(b"data: ", 1)[1])
    assert err["sequence_number"] == 4 and failed["sequence_number"] == 5
    assert failed["response"]["id"] == "resp_1" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "upstream_timeout", "message": "no output"}


def test_an_engines_error_without_a_terminal_event_is_followed_by_response_failed():
    for code, named in ((None, "server_error"), (500, "server_error"), ("501", "server_error"), ("", "server_error"),
                        ("rate_limit_exceeded", "rate_limit_exceeded")):
        s = ResponsesScanner()
        for chunk in stream()[:4] + [ev("error", code=code, message="boom", param=None)]:
            s.feed(chunk, 0.0)
        assert s.finish() == b"" and not s.done
        ended = failed_after_error(s)
        assert ended is not None
        raw, snap = ended
        assert raw.startswith(b"event: response.failed\ndata: ") and raw.endswith(b"\n\n")
        failed = orjson.loads(raw.split(b"data: ", 1)[1])
        assert failed["sequence_number"] == 5 and failed["response"] == snap
        assert snap == {**RESP, "status": "failed", "error": {"code": named, "message": "boom"}}
    s = ResponsesScanner()                  # the engine named no response: there is none to fail
    s.feed(ev("error", message="boom"), 0.0)
    assert failed_after_error(s) is None
    s = ResponsesScanner()                  # no error: nothing to follow
    s.feed(stream()[0], 0.0)
    assert failed_after_error(s) is None


def test_a_stream_that_failed_before_its_response_was_created_names_one():
    for scanner in (None, ResponsesScanner()):
        raw = failure_events(scanner, "m", 504, "no output", "upstream_timeout")
        blocks = [b for b in raw.split(b"\n\n") if b]
        # a Responses stream opens with response.created (the openai SDK's stream() helper needs it)
        assert [b.split(b"\n")[0] for b in blocks] == [b"event: response.created", b"event: error",
                                                        b"event: response.failed"]
        created, err, failed = (orjson.loads(b.split(b"data: ", 1)[1]) for b in blocks)
        assert [e["sequence_number"] for e in (created, err, failed)] == [0, 1, 2]
        rid = created["response"]["id"]
        assert re.fullmatch(r"resp_[0-9a-f]{32}", rid) and created["response"]["status"] == "in_progress"
        assert failed["response"]["id"] == rid and failed["response"]["status"] == "failed"


def test_an_event_cut_short_by_the_engine_is_not_forwarded():
    """An engine whose stream ends in the middle of an event: that half event is not passed on
    (the stream ends in the gateway's failure events), and their sequence numbers go on from the
    last event the client was sent."""
    s = ResponsesScanner()
    events = stream()
    sent = b"".join(s.feed(chunk, 0.0) for chunk in events[:3]) + s.feed(events[3][:20], 0.0)
    assert sent == b"".join(events[:3])
    assert s.finish() == b"" and not s.done
    err = orjson.loads(failure_events(s, "m", 502, "cut", "upstream_incomplete").split(b"data: ", 1)[1].split(b"\n")[0])
    assert err["sequence_number"] == 3


def test_an_event_over_the_scan_limit_is_forwarded_as_it_comes():
    s = ResponsesScanner()
    huge = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"' + b"x" * MAX_EVENT_BYTES
    assert s.feed(stream()[0] + huge[:100], 0.0) == stream()[0]     # the event's start waits ...
    assert s.feed(huge[100:], 0.0) == huge[:100] + huge[100:]       # ... until it outgrows the limit
    assert s.feed(b'"}\n\n' + stream()[1][:10], 0.0) == b'"}\n\n'
    assert s.finish() == b""



@pytest.mark.parametrize("line_end", [b"\n", b"\r"])
def test_an_event_past_the_scan_limit_keeps_only_its_last_bytes_however_long_it_goes_on(monkeypatch, line_end):
    """Its bytes went out as they came: the scanner keeps the last two (a blank line split across
    reads), where it kept the event growing to the limit again before it was cut back."""
    monkeypatch.setattr(responses_stream, "MAX_EVENT_BYTES", 64 * 1024)
    huge = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"' \
        + b"x" * (8 * 64 * 1024) + b'"}\n\n'
    data = (stream()[0] + huge + stream()[-1]).replace(b"\n", line_end)
    s = ResponsesScanner()
    out, most = [], 0
    for i in range(0, len(data), 8192):
        out.append(s.feed(data[i:i + 8192], 0.0))
        if i > 2 * 64 * 1024:
            most = max(most, len(s._buf))
    out.append(s.finish())
    assert b"".join(out) == data and s.usage is not None
    assert most <= 8192, most



def test_a_big_event_in_bare_cr_lines_is_converted_once_not_at_every_read(monkeypatch):
    """A stream in bare-CR lines is read through a copy with LFs for its CRs: an event of MBs in
    many reads was converted again whole at every read (a 4 MiB one in 16 KiB reads: 0.6 s of the
    worker's loop, quadratic in its size). Each byte is converted about once; the bytes and what is
    read of them are those of the stream in LF lines."""
    converted = []
    real = responses_stream.as_lf
    monkeypatch.setattr(responses_stream, "as_lf", lambda d: converted.append(len(d)) or real(d))
    events = stream()
    big = ev("response.output_text.delta", delta="x" * (256 * 1024))
    lf = b"".join(events[:4]) + big + b"".join(events[4:])
    seen = []
    for data in (lf, lf.replace(b"\n", b"\r")):
        s = ResponsesScanner()
        out = [s.feed(data[i:i + 4096], float(i // 4096)) for i in range(0, len(data), 4096)] + [s.finish()]
        assert b"".join(out) == data
        seen.append((s.done, s.usage, s.token_events, s.first_token_at, s.itl))
    assert seen[0] == seen[1] and seen[0][0]
    assert sum(converted) < 2 * len(lf), (sum(converted), len(lf))


def test_the_output_a_failed_response_carries_is_what_the_client_was_sent_once():
    s = ResponsesScanner()
    msg = {"type": "message", "id": "m", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    call = {"type": "function_call", "id": "f", "call_id": "c", "name": "n", "arguments": "", "status": "in_progress"}
    events = [ev("response.created", response=RESP),
              ev("response.output_item.added", output_index=0, item=msg),
              ev("response.content_part.added", output_index=0, content_index=0, part=part),
              ev("response.output_text.delta", output_index=0, content_index=0, delta="a"),
              ev("response.output_text.delta", output_index=0, content_index=0, delta="b"),
              ev("response.content_part.done", output_index=0, content_index=0, part={**part, "text": "ab"}),
              ev("response.output_item.done", output_index=0, item={**msg, "status": "completed",
                                                                    "content": [{**part, "text": "ab"}]}),
              ev("response.output_item.added", output_index=1, item=call),
              ev("response.function_call_arguments.delta", output_index=1, delta='{"a":'),
              # what names no item the client was sent, or no part of one, is left out
              ev("response.output_text.delta", output_index=5, content_index=0, delta="x"),
              ev("response.content_part.added", output_index=1, content_index=3, part=part),
              ev("response.output_text.delta", output_index="1", content_index=0, delta="x")]
    for chunk in events:
        s.feed(chunk, 0.0)
    done = {**msg, "status": "completed", "content": [{**part, "text": "ab"}]}
    assert s.output() == [done, {**call, "arguments": '{"a":'}]
    failed = orjson.loads(failure_events(s, "m", 502, "cut", "upstream_incomplete").split(b"data: ")[-1])
    assert failed["response"]["output"] == [done, {**call, "arguments": '{"a":'}]
    assert failed["response"].get("usage") is None
    assert ResponsesScanner().output() == []


def test_a_byte_order_mark_before_response_created_hides_nothing():
    """A UTF-8 BOM before the first event (the SSE spec has the client skip it) does not hide
    response.created: its id is the response's; the bytes pass through as they came."""
    s = ResponsesScanner()
    chunks = [b"\xef\xbb\xbf" + stream()[0], *stream()[1:]]
    out = [s.feed(c, float(t)) for t, c in enumerate(chunks)]
    out.append(s.finish())
    assert b"".join(out) == b"".join(chunks)
    assert s.response_id == "resp_1" and s.snapshot == RESP and s.done and s.usage == DONE["usage"]
