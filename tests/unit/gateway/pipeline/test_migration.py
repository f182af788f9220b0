"""The migration's refusal list and its event splicing, without sockets."""

from __future__ import annotations

import orjson
import pytest

from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.migration import Migration, StopSeam, refusal, stops_of
from gateway.request import parse
from handlers.continuation import TEXT, TOKEN, Partial, continuation, fitted

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def ireq(path=CHAT, **data):
    base = {"model": "m", "stream": True}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "Once"})
    base.update(data)
    return parse(path, orjson.dumps(base), {}, "rid")


@pytest.mark.parametrize("data,why", [
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": {"type": "object"}}, "guided"),
    ({"structured_outputs": {"regex": "a"}}, "guided"),
    ({"n": 2}, "n"),
    ({"n": 1}, None),
    ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"seed": 1}, "seed"),                              # temperature defaults to sampling
    ({"seed": 1, "temperature": 0}, None),              # greedy: the seed changes nothing
    ({"frequency_penalty": 0.5}, "penalty"),
    ({}, None),
])
def test_refusals(data, why):
    assert refusal(ireq(**data)) == why


def test_a_batch_of_prompts_is_refused_like_n():
    assert refusal(ireq(COMPL, prompt=["a", "b"])) == "n"
    assert refusal(ireq(COMPL, logprobs=2)) == "logprobs"
    # vLLM's prompt as tensors, in the place of a prompt or beside an empty one: nothing to continue from
    assert refusal(ireq(COMPL, prompt=None, prompt_embeds="AAAA")) == "prompt_embeds"
    assert refusal(ireq(COMPL, prompt="", prompt_embeds=["AAAA"])) == "prompt_embeds"
    assert refusal(ireq(COMPL, prompt_embeds=[])) is None


def feed(m: Migration, *events: dict) -> list:
    out = []
    for e in events:
        r = m._event(b"data: " + orjson.dumps(e))
        out.append(orjson.loads(r[6:]) if isinstance(r, bytes) else r)
    return out


def chunk(delta=None, fr=None, **top):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": fr, "token_ids": None}], **top}


def test_a_tool_call_in_progress_refuses():
    m = Migration(ireq(tools=[{"type": "function", "function": {"name": "f"}}]), 1, TEXT, None, None,
                  GatewayMetrics())
    feed(m, chunk({"role": "assistant", "content": ""}),
         chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{"}}]}))
    assert m._refused_now() == "tool_calls"


def test_splicing_strips_what_the_client_did_not_ask_and_rewrites_later_legs():
    m = Migration(ireq(), 1, TOKEN, None, None, GatewayMetrics())
    got = feed(m, {**chunk({"role": "assistant", "content": ""}), "prompt_token_ids": [5, 6]},
               {**chunk({"content": " ka"}), "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
    assert got[0]["prompt_token_ids"] is None and "usage" not in got[1]
    assert m.partial.prompt_ids == [5, 6] and "".join(m._text) == " ka"
    assert feed(m, {"error": {"message": "boom"}}) == [False]
    # the continuation leg: a completion chunk, framed as a chat chunk of the first leg's stream
    m.leg, m.leg_path = 1, COMPL
    m.partial.completion_tokens = 1
    (ev,) = feed(m, {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m",
                     "choices": [{"index": 0, "text": " lo", "token_ids": [7], "finish_reason": "length",
                                  "prompt_token_ids": [5, 6, 4]}]})
    assert ev["id"] == "chatcmpl-1" and ev["created"] == 1 and ev["object"] == "chat.completion.chunk"
    assert ev["choices"][0]["delta"] == {"content": " lo"} and ev["choices"][0]["finish_reason"] == "length"
    assert m._merged(final=True)["completion_tokens"] == 2


def test_continuation_bodies():
    p = Partial(path=CHAT, data={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                                 "min_tokens": 4, "temperature": 0, "tools": None},
                text=" ka lo", prompt_ids=[1, 2], token_ids=[3, 4], completion_tokens=2)
    path, body = continuation(p, TOKEN, None)
    assert path == COMPL and body["prompt"] == [1, 2, 3, 4] and body["max_tokens"] == 8 and body["min_tokens"] == 2
    assert body["temperature"] == 0 and "messages" not in body and body["return_token_ids"] is True
    path, body = continuation(p, TEXT, None)
    assert path == CHAT and body["messages"][-1] == {"role": "assistant", "content": " ka lo"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    p2 = Partial(path=COMPL, data={"model": "m", "prompt": "Once", "echo": True}, text=" ka", completion_tokens=1)
    path, body = continuation(p2, TEXT, 16)
    assert body["prompt"] == "Once ka" and body["max_tokens"] == 15 and body["echo"] is False


async def test_events_before_an_error_event_in_the_same_read_reach_the_client():
    class Resp:
        def __init__(self, chunks):
            self.chunks = list(chunks)

        async def readany(self):
            return self.chunks.pop(0) if self.chunks else b""

    class Out:
        def __init__(self):
            self.data = b""

        async def write(self, b):
            self.data += b

    from gateway.pipeline.sse import SSEScanner
    m = Migration(ireq(), 1, TEXT, None, None, GatewayMetrics())
    one = b"data: " + orjson.dumps(chunk({"content": " ka"})) + b"\n\n"
    err = b'data: {"error": {"message": "boom"}}\n\n'
    out = Out()
    assert await m._leg(Resp([one + err]), out, SSEScanner(), None) == ("upstream_stream_error", "in-stream error")
    assert b" ka" in out.data and "".join(m._text) == " ka"


def test_stops_of_takes_a_string_or_a_list_and_drops_empty_ones():
    assert stops_of({"stop": "END"}) == ["END"]
    assert stops_of({"stop": ["", "a", 3, "bc"]}) == ["a", "bc"]
    assert stops_of({}) == [] and stops_of({"stop": None}) == []


def test_a_stop_string_across_the_seam_is_held_then_matched():
    seam = StopSeam("once upon a ti", ["time!"], include=False)
    assert seam.tail == "a ti"                          # the longest stop string's length, less one
    assert seam.feed("m") == ("", None, True)           # " tim" may still become "time!"
    assert seam.feed("e!") == ("", "time!", False)      # what comes before "ti" was sent already


def test_what_cannot_complete_one_is_released_at_once_and_the_seam_closes():
    seam = StopSeam("once upon a ti", ["time!"], include=False)
    assert seam.feed("mex") == ("mex", None, False)
    assert StopSeam("abc", ["xyz"], include=False).feed("q") == ("q", None, False)


def test_held_text_is_released_when_the_stop_string_goes_another_way_or_the_leg_ends():
    seam = StopSeam("a ti", ["time!"], include=False)
    assert seam.feed("m") == ("", None, True)
    assert seam.feed("ber") == ("mber", None, False)
    seam = StopSeam("a ti", ["time!"], include=False)
    assert seam.feed("me", final=True) == ("me", None, False)


def test_include_stop_str_in_output_sends_the_stop_strings_end():
    seam = StopSeam("upon a ti", ["time"], include=True)
    assert seam.feed("mes") == ("me", "time", False)


def test_the_first_stop_string_in_the_requests_order_wins_and_min_tokens_defers_the_check():
    assert StopSeam("xab", ["bc", "abc"], include=False).feed("c") == ("", "bc", False)
    # below min_tokens an engine does not look for stop strings: nothing is matched, nothing held
    assert StopSeam("xab", ["abc"], include=False).feed("c", may_stop=False) == ("c", None, False)


def test_a_one_character_stop_string_never_spans_the_seam():
    seam = StopSeam("abc", ["@"], include=False)
    assert seam.tail == "" and seam.feed("@x") == ("@x", None, False)


def test_a_client_text_shorter_than_the_longest_stop_string_is_looked_at_whole():
    seam = StopSeam("abc", ["abcdef"], include=False)
    assert seam.tail == "abc"
    assert seam.feed("de") == ("", None, True)
    assert seam.feed("f") == ("", "abcdef", False)


@pytest.mark.parametrize("refusal_text,fits", [
    # vLLM today, vLLM before, SGLang (which wants the total short of the context)
    ("'max_tokens' or 'max_completion_tokens' is too large: 40. This model's maximum context length is 64 "
     "tokens and your request has 27 input tokens (40 > 64 - 27).", 37),
    ("This model's maximum context length is 64 tokens. However, you requested 67 tokens (27 in the messages, "
     "40 in the completion). Please reduce the length of the messages or completion.", 37),
    ("Requested token count exceeds the model's maximum context length of 64 tokens. You requested a total of "
     "67 tokens: 27 tokens from the input messages and 40 tokens for the completion.", 36),
])
def test_a_continuation_refused_past_the_context_is_fitted_to_it(refusal_text, fits):
    body = {"model": "m", "max_tokens": 40, "min_tokens": 39}
    refused = orjson.dumps({"error": {"message": refusal_text, "code": 400}}).decode()
    assert fitted(body, refused) == {"model": "m", "max_tokens": fits, "min_tokens": fits}
    assert body["max_tokens"] == 40


def test_other_refusals_are_not_fitted():
    assert fitted({"max_tokens": 40}, '{"error": {"message": "bad temperature"}}') is None
    assert fitted({}, "maximum context length is 64 tokens and your request has 27 input tokens") is None
    # the prompt alone fills the context: no max_tokens fits
    assert fitted({"max_tokens": 40}, "maximum context length is 64 tokens and your request has 64 input tokens") is None
