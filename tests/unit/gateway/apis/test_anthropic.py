"""The Anthropic Messages API object: parsing, error shapes, the Messages stream scanner."""

from __future__ import annotations

from unittest import mock

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.apis import anthropic
from gateway.apis.anthropic import AnthropicApi, MessagesScanner
from gateway.endpoints import EndpointPool
from gateway.errors import ErrorClass, GatewayError
from gateway.pipeline.sse import MAX_EVENT_BYTES

ANTHROPIC = AnthropicApi(EndpointPool())
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image", "source": {}}]}]


def parse_messages(body: dict, path: str = "/v1/messages", headers: dict | None = None):
    return ANTHROPIC.parse(path, orjson.dumps(body), headers or {}, "rid")


def test_messages_parse_keys_the_prefix_on_system_then_messages():
    ireq = parse_messages({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "SYS"}],
                           "messages": MESSAGES, "metadata": {"user_id": "u1"}, "stream": True})
    assert ireq.prompt_text == "SYS\nuser\nhello"
    assert ireq.stream and ireq.include_usage and ireq.user == "u1" and ireq.model == "m"
    assert ireq.multimodal                  # the image block
    assert not parse_messages({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}).multimodal
    assert parse_messages({"model": "m", "messages": MESSAGES}, "/v1/messages/count_tokens").prompt_tokens_est >= 1
    assert parse_messages({"model": "m", "max_tokens": 1, "messages": MESSAGES},
                          headers={"user": "h"}).user == "h"


def test_claude_codes_per_request_attribution_block_is_not_part_of_the_prefix():
    """Claude Code sends ``x-anthropic-billing-header: ...; cch=<hash>`` as the first system block, a
    new hash per request; vLLM drops it before rendering, so keying the prefix on it would scatter
    conversations that share a system prompt (and the engine's cache) over every endpoint."""
    def prompt(system, messages=MESSAGES):
        return parse_messages({"model": "m", "max_tokens": 5, "system": system, "messages": messages}).prompt_text
    plain = prompt([{"type": "text", "text": "SYS", "cache_control": {"type": "ephemeral"}}])
    for cch in ("a1b2c", "f00d9"):
        billing = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli; cch={cch};"}
        assert prompt([billing, {"type": "text", "text": "SYS", "cache_control": {"type": "ephemeral"}}]) == plain
    # only system text is filtered: a user who types the words keeps them
    said = [{"role": "user", "content": [{"type": "text", "text": "x-anthropic-billing-header: hi"}]}]
    assert "x-anthropic-billing-header: hi" in prompt("SYS", said)


@pytest.mark.parametrize("body,message", [
    ({"messages": MESSAGES, "max_tokens": 1}, "model: Field required"),
    ({"model": "m", "messages": MESSAGES}, "max_tokens: Field required"),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 0}, "max_tokens: Input should be a positive integer"),
    ({"model": "m", "max_tokens": 1}, "messages: Field required"),
    ({"model": "m", "max_tokens": 1, "messages": []}, "messages: at least one message is required"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": 3}]},
     "messages.0.content: Input should be a valid string or a list of content blocks"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "stream": "maybe"},
     "stream: Input should be a valid boolean, unable to interpret input"),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 2.5},
     "max_tokens: Input should be a valid integer, got a number with a fractional part"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": 5, "content": "hi"}]},
     "messages.0.role: Input should be 'user' or 'assistant'"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "hi"}, *MESSAGES]},
     "messages.0.role: Input should be 'user' or 'assistant'"),
    ({"model": "m", "max_tokens": True, "messages": MESSAGES}, "max_tokens: Input should be a valid integer"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "system": [{"type": "image", "source": {}}]},
     "system.0.type: Input should be 'text'"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "system": [{"type": "text", "text": "a"}, {"type": "tool_use"}]},
     "system.1.type: Input should be 'text'"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "stop_sequences": "END"},
     "stop_sequences: Input should be a valid list"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "stop_sequences": ["END", 7]},
     "stop_sequences.1: Input should be a valid string"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "tool_choice": {"type": "tool"}},
     "tool_choice.name: Field required"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "tool_choice": {"type": "tool", "name": None}},
     "tool_choice.name: Field required"),
    ({"model": "m", "max_tokens": 1, "messages": MESSAGES, "tool_choice": {"type": "tool", "name": ["a"]}},
     "tool_choice.name: Input should be a valid string"),
])
def test_messages_parse_refuses_bad_bodies(body, message):
    with pytest.raises(GatewayError) as ei:
        parse_messages(body)
    assert ei.value.status == 400 and ei.value.message == message
    assert orjson.loads(ANTHROPIC.error_body(ei.value)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": message}}


def test_anthropic_error_shapes():
    e = GatewayError(429, "slow down")
    assert orjson.loads(ANTHROPIC.error_body(e))["error"]["type"] == "rate_limit_error"
    assert ANTHROPIC.stream_error(None, 504, "late", "upstream_timeout") == (
        b'event: error\ndata: {"type":"error","error":{"type":"timeout_error","message":"late"}}\n\n')
    # vLLM's own envelope keeps its status and message; its exception-name type becomes Anthropic's
    status, body, message = ANTHROPIC.upstream_error(404, b'{"type":"error","error":{"type":"NotFoundError","message":"no"}}')
    assert (status, orjson.loads(body), message) == (404, {"type": "error", "error": {"type": "not_found_error",
                                                                                      "message": "no"}}, "no")
    _, body, _ = ANTHROPIC.upstream_error(400, b'{"error":{"message":"bad","type":"BadRequestError","code":400}}')
    assert orjson.loads(body)["error"] == {"type": "invalid_request_error", "message": "bad"}
    _, body, _ = ANTHROPIC.upstream_error(529, b'{"type":"error","error":{"type":"overloaded_error","message":"x"}}')
    assert orjson.loads(body)["error"]["type"] == "overloaded_error"
    # an engine's 503 (SGLang's flat shape here) is overload, Anthropic's 529
    status, body, _ = ANTHROPIC.upstream_error(503, b'{"object":"error","message":"queue full","type":"ServiceUnavailableError"}')
    assert (status, orjson.loads(body)["error"]) == (529, {"type": "overloaded_error", "message": "queue full"})


@pytest.mark.parametrize("error,status,type_", [
    (GatewayError(503, "no ready endpoint", error_class=ErrorClass.NO_ENDPOINT, headers={"Retry-After": "5"}),
     529, "overloaded_error"),
    (GatewayError(503, "no route", error_class=ErrorClass.NO_ROUTE), 529, "overloaded_error"),
    (GatewayError(503, "shutting down", error_class=ErrorClass.DRAINING), 529, "overloaded_error"),
    (GatewayError(503, "no sockets", error_class=ErrorClass.GATEWAY_RESOURCES), 529, "overloaded_error"),
    (GatewayError(503, "no prefill", error_class=ErrorClass.PD_PREFILL_TRANSPORT), 529, "overloaded_error"),
    (GatewayError(503, "full", header=("x-error-lora-load", "full"), error_class=ErrorClass.LORA_LOAD),
     529, "overloaded_error"),
    (GatewayError(503, "failed", header=("x-error-lora-load", "cooldown"), error_class=ErrorClass.LORA_LOAD),
     503, "api_error"),
    (GatewayError(503, "state", error_class=ErrorClass.STATE_UNAVAILABLE), 503, "api_error"),
    (GatewayError(503, "prefill busy", error_class=ErrorClass.PD_PREFILL_HTTP_STATUS), 503, "overloaded_error"),
    (GatewayError(429, "queue full", error_class=ErrorClass.ADMISSION_QUEUE_FULL), 429, "rate_limit_error"),
    (GatewayError(504, "late", error_class=ErrorClass.UPSTREAM_TIMEOUT), 504, "timeout_error"),
])
def test_the_gateways_own_errors_take_anthropics_status_and_type(error, status, type_):
    """Overload is Anthropic's 529 ``overloaded_error``; a 503 for a failure is ``api_error``; a
    prefill's own 503 stays the engine's busy signal; other statuses are kept. The error is a new
    one, its headers and class kept: the same error may be raised to several requests."""
    answered = ANTHROPIC.own_error(error)
    assert answered.status == status and orjson.loads(ANTHROPIC.error_body(answered))["error"]["type"] == type_
    assert (answered.headers, answered.error_class, answered.message) == (error.headers, error.error_class, error.message)
    assert error.status in (503, 429, 504)      # not changed in place
    assert ANTHROPIC.own_error(answered) is answered


def _frame(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


STREAM = b"".join([
    _frame("message_start", {"type": "message_start", "message": {"id": "m", "usage": {
        "input_tokens": 7, "cache_read_input_tokens": 5, "output_tokens": 0}}}),
    _frame("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    _frame("ping", {"type": "ping"}),
    *[_frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": f" w{i}"}}) for i in range(3)],
    _frame("content_block_stop", {"type": "content_block_stop", "index": 0}),
    _frame("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}),
    _frame("message_stop", {"type": "message_stop"}),
])


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12, unique=True),
       st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_messages_scanner_sees_the_same_stream_however_it_is_split(cuts, line_end):
    """... and whatever its line ends: LF, CRLF, or bare CR (legal in SSE)."""
    stream = STREAM.replace(b"\n", line_end)
    sc = MessagesScanner()
    out, prev = [], 0
    for t, cut in enumerate(sorted(cuts) + [len(stream)]):
        out.append(sc.feed(stream[prev:cut], float(t)))
        prev = cut
        # whole events only: an event's start waits for its end (a read that ends between the CR
        # and the LF of a CRLF has its CR read as a line end, which ends the event as well)
        sent = b"".join(out)
        assert not sent or sent.endswith(line_end * 2) or sent.endswith(b"\r\n\r")
    out.append(sc.finish())
    assert b"".join(out) == stream          # bytes pass through unchanged
    assert sc.done and sc.error is None and sc.finish_reason == "end_turn"
    # input tokens from message_start (cache reads included), output from message_delta
    assert sc.usage == {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 5}}
    # a gap between reads that carry deltas: none for deltas that came in one read
    gaps = sc.drain_itl()
    assert sc.first_token_at is not None and len(gaps) <= 2 and all(g > 0 for g in gaps)


def test_a_tool_use_blocks_start_is_the_first_generated_output_the_client_sees():
    """A tool's name, which the model generated, reaches the client in its block's
    ``content_block_start``: TTFT is there and the block's input deltas follow it one gap each, as
    a chat stream's chunk of the tool's name is its first token. A text or thinking block's start,
    which holds no text, is none; an event without its ``event:`` line is read alike."""
    tool_start = {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}}
    events = [
        _frame("message_start", {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 7}}}),
        _frame("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        _frame("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _frame("content_block_start", tool_start),
        *[_frame("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
            "type": "input_json_delta", "partial_json": p}}) for p in ('{"city": ', '"Paris"}')],
    ]
    for eventless in (False, True):
        sc = MessagesScanner()
        for t, ev in enumerate(events):
            if eventless:
                ev = ev[ev.index(b"data:"):]
            sc.feed(ev, float(t))
        assert (sc.first_token_at, sc.token_events, sc.drain_itl()) == (3.0, 3, [1.0, 1.0]), eventless
    # a tool_use block whose start names no tool carries no token; "tool_use" in a text is no start
    sc = MessagesScanner()
    sc.feed(_frame("content_block_start", {**tool_start, "content_block": {"type": "tool_use", "name": ""}}), 1.0)
    sc.feed(_frame("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
        "type": "text", "text": '"tool_use"'}}), 2.0)
    assert sc.first_token_at is None and sc.token_events == 0


def test_messages_scanner_forwards_an_event_over_the_scan_limit_as_it_comes():
    sc = MessagesScanner()
    start = _frame("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 1}}})
    huge = b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"' + b"x" * MAX_EVENT_BYTES
    assert sc.feed(start + huge[:100], 1.0) == start            # the event's start waits ...
    assert sc.feed(huge[100:], 2.0) == huge[:100] + huge[100:]  # ... until it outgrows the limit
    assert sc.feed(b'"}}\n\n' + STREAM[:10], 3.0) == b'"}}\n\n'
    assert sc.finish() == b""               # an incomplete last event is not forwarded



@pytest.mark.parametrize("line_end", [b"\n", b"\r"])
def test_messages_scanner_keeps_only_the_last_bytes_of_an_event_past_the_scan_limit(monkeypatch, line_end):
    """Its bytes went out as they came: the scanner keeps the last two (a blank line split across
    reads), where it kept the event growing to the limit again before it was cut back."""
    monkeypatch.setattr(anthropic, "MAX_EVENT_BYTES", 64 * 1024)
    huge = _frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": "x" * (8 * 64 * 1024)}})
    cut = STREAM.index(b"event: content_block_stop")
    data = (STREAM[:cut] + huge + STREAM[cut:]).replace(b"\n", line_end)
    sc = MessagesScanner()
    out, most = [], 0
    for i in range(0, len(data), 8192):
        out.append(sc.feed(data[i:i + 8192], float(i)))
        if i > 2 * 64 * 1024:
            most = max(most, len(sc._buf))
    out.append(sc.finish())
    assert b"".join(out) == data and sc.done and sc.finish_reason == "end_turn"
    assert most <= 8192, most



def test_messages_scanner_converts_a_big_bare_cr_event_once_not_at_every_read(monkeypatch):
    """A stream in bare-CR lines is read through a copy with LFs for its CRs: an event of MBs in
    many reads was converted again whole at every read (a 4 MiB one in 16 KiB reads: 0.5 s of the
    worker's loop, quadratic in its size). Each byte is converted about once; the bytes and what is
    read of them are those of the stream in LF lines."""
    converted = []
    real = anthropic.as_lf
    monkeypatch.setattr(anthropic, "as_lf", lambda d: converted.append(len(d)) or real(d))
    cut = STREAM.index(b"event: content_block_stop")
    big = _frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": "x" * (256 * 1024)}})
    lf = STREAM[:cut] + big + STREAM[cut:]
    seen = []
    for data in (lf, lf.replace(b"\n", b"\r")):
        sc = MessagesScanner()
        out = [sc.feed(data[i:i + 4096], float(i // 4096)) for i in range(0, len(data), 4096)] + [sc.finish()]
        assert b"".join(out) == data
        seen.append((sc.done, sc.finish_reason, sc.usage, sc.token_events, sc.first_token_at, sc.itl))
    assert seen[0] == seen[1] and seen[0][0]
    assert sum(converted) < 2 * len(lf), (sum(converted), len(lf))


def test_messages_scanner_in_stream_error_and_eventless_frames():
    sc = MessagesScanner()
    sc.feed(b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}\n\n', 1.0)
    sc.feed(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}', 2.0)
    assert sc.first_token_at == 1.0 and sc.error is None
    sc.finish()                              # a trailing frame without its blank line is still read
    assert sc.error == {"type": "overloaded_error", "message": "busy"} and not sc.done



# a stream the engine cut with its own error event of a type that is none of Anthropic's (vLLM's),
# after an event over the scan limit (forwarded as it comes) and a few whole ones
_SCAN_LIMIT = 4096      # the scan limit the split test sets (MAX_EVENT_BYTES, 8 MiB, made each example copy 16 MB)
_HUGE = _frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": "x" * _SCAN_LIMIT}})
_ENGINE_ERROR = _frame("error", {"type": "error", "error": {"type": "internal_error", "message": "boom"}})
_API_ERROR = _frame("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})


@given(st.lists(st.integers(min_value=1, max_value=600), max_size=8, unique=True),
       st.sampled_from([b"\n", b"\r\n", b"\r"]), st.booleans(), st.booleans())
def test_messages_scanner_gives_an_engines_error_event_anthropics_type_however_it_is_split(
        cuts, line_end, huge, blank_line):
    """Only the error frame changes (its type, as Anthropic's clients know it), wherever the reads
    of the stream end, with or without an event forwarded unscanned before it and with or without
    the blank line after it."""
    head = STREAM[:STREAM.index(b"event: content_block_stop")]
    if huge:
        head = head[:len(head) // 2] + _HUGE + head[len(head) // 2:]
    stream = (head + _ENGINE_ERROR).replace(b"\n", line_end)
    if not blank_line:
        stream = stream[:-2 * len(line_end)]
    marks = sorted({len(stream) - c for c in cuts if c < len(stream)})
    sc = MessagesScanner()
    out, prev = [], 0
    with mock.patch.object(anthropic, "MAX_EVENT_BYTES", _SCAN_LIMIT):
        for t, cut in enumerate(marks + [len(stream)]):
            out.append(sc.feed(stream[prev:cut], float(t)))
            prev = cut
        out.append(sc.finish())
    rewritten = _API_ERROR[:-2]             # the new frame, its lines ended with LFs
    want = head.replace(b"\n", line_end) + rewritten + (line_end * 2 if blank_line else b"\n\n")
    assert b"".join(out) == want
    assert sc.error == {"type": "internal_error", "message": "boom"} and not sc.done


def test_messages_scanner_keeps_an_error_of_anthropics_type_and_names_the_type_of_its_code():
    sc = MessagesScanner()
    ok = _frame("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    assert sc.feed(ok, 1.0) == ok
    for error, want in [({"message": "full", "code": 503}, {"type": "overloaded_error", "message": "full", "code": 503}),
                        ({"type": ["x"], "message": "m", "code": "429"}, {"type": "rate_limit_error", "message": "m", "code": "429"}),
                        ("plain", {"type": "api_error", "message": "plain"})]:
        sc = MessagesScanner()
        out = sc.feed(b"data: " + orjson.dumps({"type": "error", "error": error}) + b"\n\n", 1.0)
        assert out == b"event: " + b"error\ndata: " + orjson.dumps({"type": "error", "error": want}) + b"\n\n"



def test_messages_carry_the_slo_headers_and_refuse_a_bad_one_in_anthropic_shape():
    body = {"model": "m", "max_tokens": 1, "messages": MESSAGES}
    ireq = parse_messages(body, headers={"x-slo-ttft-ms": "300", "x-slo-tpot-ms": "20"})
    assert (ireq.slo_ttft_ms, ireq.slo_tpot_ms) == (300.0, 20.0)
    with pytest.raises(GatewayError) as ei:
        parse_messages(body, headers={"x-slo-tpot-ms": "soon"})
    err = orjson.loads(ANTHROPIC.error_body(ei.value))
    assert ei.value.status == 400 and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error" and "x-slo-tpot-ms" in err["error"]["message"]


def test_messages_scanner_counts_the_deltas_that_carry_tokens_only():
    """Thinking, text and a tool's input JSON are generated tokens; a thinking block's signature
    (``signature_delta``) and a text block's citation (``citations_delta``) are not, and add no
    inter-token gap. A text that names those types, or a delta spaced differently, changes nothing."""
    def delta(d: dict, spaced: bool = False) -> bytes:
        data = {"type": "content_block_delta", "index": 0, "delta": d}
        body = orjson.dumps(data).replace(b'":', b'": ') if spaced else orjson.dumps(data)
        return b"event: content_block_delta\ndata: " + body + b"\n\n"
    events = [
        delta({"type": "thinking_delta", "thinking": "Hmm"}),                     # 1.0: the first token
        delta({"type": "thinking_delta", "thinking": 'say "signature_delta"'}),   # 2.0
        delta({"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA"}),
        delta({"type": "citations_delta", "citation": {"type": "char_location", "cited_text": '"text_delta"',
                                                       "document_index": 0, "start_char_index": 0,
                                                       "end_char_index": 12}}),
        delta({"type": "signature_delta", "signature": "Zm9v"}, spaced=True),
        delta({"type": "text_delta", "text": "It"}, spaced=True),                 # 6.0
        delta({"type": "input_json_delta", "partial_json": '{"a": '}),           # 7.0
    ]
    sc = MessagesScanner()
    for t, ev in enumerate(events, 1):
        assert sc.feed(ev, float(t)) == ev
    assert sc.token_events == 4 and sc.first_token_at == 1.0 and sc.last_token_at == 7.0
    assert sc.drain_itl() == [1.0, 4.0, 1.0]
    sc = MessagesScanner()                  # a frame without its event line: named by its data's type
    sc.feed(b'data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"x"}}\n\n', 1.0)
    assert sc.token_events == 0 and sc.first_token_at is None


@pytest.mark.parametrize("spaced", [False, True])
@pytest.mark.parametrize("named", [True, False])
def test_messages_scanner_does_not_count_an_empty_delta(spaced, named):
    """A delta whose text, thinking or input JSON is empty (an engine's empty token) carries no
    generated token, as a chat chunk whose content is empty does not: no token event, no gap. A
    text of quotes (``""`` in the bytes, escaped) is a token."""
    def delta(d: dict) -> bytes:
        data = {"type": "content_block_delta", "index": 0, "delta": d}
        body = orjson.dumps(data).replace(b'":', b'": ') if spaced else orjson.dumps(data)
        return (b"event: content_block_delta\n" if named else b"") + b"data: " + body + b"\n\n"
    events = [
        delta({"type": "thinking_delta", "thinking": ""}),
        delta({"type": "thinking_delta", "thinking": "Hmm"}),                     # 2.0: the first token
        delta({"type": "thinking_delta", "thinking": ""}),
        delta({"type": "text_delta", "text": ""}),
        delta({"type": "text_delta", "text": 'say ""'}),                          # 5.0
        delta({"type": "input_json_delta", "partial_json": ""}),
        delta({"type": "input_json_delta", "partial_json": '{"a": ""}'}),        # 7.0
        delta({"type": "text_delta", "text": ""}),
    ]
    sc = MessagesScanner()
    for t, ev in enumerate(events, 1):
        assert sc.feed(ev, float(t)) == ev
    assert sc.token_events == 3 and sc.first_token_at == 2.0 and sc.last_token_at == 7.0
    assert sc.drain_itl() == [3.0, 2.0]


def test_messages_scanner_reads_the_first_event_after_a_byte_order_mark():
    """A UTF-8 BOM before message_start (the SSE spec has the client skip it) does not hide its
    input tokens; the bytes pass through as they came."""
    stream = b"\xef\xbb\xbf" + STREAM
    sc = MessagesScanner()
    out = sc.feed(stream, 1.0) + sc.finish()
    assert out == stream and sc.done and sc.finish_reason == "end_turn"
    assert sc.usage == {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 5}}


def test_messages_scanner_counts_no_delta_after_message_stop():
    """message_stop ends the answer: a delta an engine sends after it is no token of the answer's."""
    sc = MessagesScanner()
    late = _frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": " late"}})
    sc.feed(STREAM, 1.0)
    sc.feed(late, 2.0)
    sc.finish()
    assert sc.done and sc.token_events == 3 and sc.last_token_at == 1.0 and sc.drain_itl() == []
