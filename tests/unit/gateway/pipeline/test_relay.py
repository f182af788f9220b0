"""The relay's stream watchdog: one timer per stream that bounds each wait for the next chunk; what
the relay reads of a large whole answer."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.pipeline.relay import VIEW_ABOVE, Watchdog, WatchdogFired, answer_view
from gateway.pipeline.sse import message_text
from handlers.base import openai_usage as usage_of
from tests.support.waiting import until


class FakeResponse:
    def __init__(self) -> None:
        self.waiting = False
        self.interrupted: list[BaseException] = []

    def interrupt(self, exc: BaseException) -> None:
        self.interrupted.append(exc)


async def test_a_wait_longer_than_the_first_chunk_bound_fires_that_phase():
    resp = FakeResponse()
    resp.waiting = True
    w = Watchdog(resp, 0.05, 10.0)
    await until(lambda: resp.interrupted)
    [exc] = resp.interrupted
    assert isinstance(exc, WatchdogFired) and (exc.phase, exc.seconds) == ("first_chunk", 0.05)
    w.cancel()


async def test_time_spent_writing_is_not_a_wait_and_the_idle_bound_follows_the_first_chunk():
    resp = FakeResponse()
    w = Watchdog(resp, 0.03, 0.05)
    w.first_chunk_came()
    await asyncio.sleep(0.2)           # writing to the client: no wait in progress
    assert resp.interrupted == []
    w.since = asyncio.get_running_loop().time()
    resp.waiting = True
    await until(lambda: resp.interrupted)
    [exc] = resp.interrupted
    assert (exc.phase, exc.seconds) == ("idle", 0.05)
    w.cancel()


async def test_no_idle_bound_stops_the_timer_after_the_first_chunk():
    resp = FakeResponse()
    resp.waiting = True
    w = Watchdog(resp, 30.0, 0.0)
    w.first_chunk_came()
    assert w.handle is None
    await asyncio.sleep(0.05)
    assert resp.interrupted == []


async def test_cancel_stops_it():
    resp = FakeResponse()
    resp.waiting = True
    w = Watchdog(resp, 0.02, 0.02)
    w.cancel()
    await asyncio.sleep(0.1)
    assert resp.interrupted == [] and w.handle is None


def _padded(obj: dict) -> bytes:
    """``obj`` as JSON with a member large enough for ``answer_view`` to read it in part."""
    return orjson.dumps({"pad": ["x" * 64] * (VIEW_ABOVE // 64), **obj})


@pytest.mark.parametrize("obj", [
    {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi", "tool_calls": []},
                  "logprobs": {"content": []}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3}},
    {"choices": [{"finish_reason": None}, {"index": None, "text": "x"}, {}], "usage": None},
    {"choices": [], "usage": {"prompt_tokens": 1.0, "completion_tokens": True}},
    {"choices": None, "usage": [1, 2]},
    {"choices": [1, "two"]},
    {"choices": {"index": 0}},
    {"object": "list", "data": [{"embedding": [0.5, 1.5]}]},
])
def test_a_large_answers_view_holds_what_the_relay_reads_of_it_as_the_whole_decode_does(obj):
    whole = orjson.loads(_padded(obj))
    view = answer_view(_padded(obj))
    assert usage_of(view) == usage_of(whole) and message_text(view) == message_text(whole)
    choices = whole.get("choices", [])
    if isinstance(choices, list) and all(isinstance(c, dict) for c in choices):
        assert [(c.get("index", 0), c.get("finish_reason"), c.get("message")) for c in view.get("choices", [])] == \
            [(c.get("index", 0), c.get("finish_reason"), c.get("message")) for c in choices]
        assert ("choices" in view) == ("choices" in whole) and view.keys() <= {"choices", "usage"}
    else:               # choices that are not a list of objects: decoded whole
        assert view == whole


@pytest.mark.parametrize("raw", [b'["' + b"x" * VIEW_ABOVE + b'", 1]', b'"' + b"x" * VIEW_ABOVE + b'"'])
def test_a_large_answer_that_is_no_object_is_decoded_whole(raw):
    assert answer_view(raw) == orjson.loads(raw)


@pytest.mark.parametrize("raw", [_padded({"usage": {}})[:-1], _padded({"usage": {}, "bad": "é"}).replace("é".encode(), b"\xc3\x28"),
                                 _padded({"usage": {}}) + b"x", _padded({"usage": {}}).replace(b"{", b"\xef\xbb\xbf{", 1)])
def test_a_large_answer_that_is_not_json_is_refused_as_by_the_whole_decode(raw):
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    with pytest.raises(orjson.JSONDecodeError):
        answer_view(raw)


@pytest.mark.parametrize("large", [False, True])
def test_a_number_beyond_a_doubles_range_is_refused_only_in_a_member_the_relay_reads(large):
    """RFC 8259 sets no bound on a number's size (orjson refuses one past a double's): in a member
    the relay does not read it is skipped, in a small answer as in a large one; in one it reads
    (usage), the answer is refused at either size."""
    obj = {"choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": [-7.0], "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 3}}
    raw = (_padded(obj) if large else orjson.dumps(obj)).replace(b"-7.0", b"-1e999")
    view = answer_view(raw)
    assert view["choices"] == [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]
    assert view["usage"] == {"prompt_tokens": 3}
    with pytest.raises(orjson.JSONDecodeError):
        answer_view(raw.replace(b'"prompt_tokens":3', b'"prompt_tokens":1e999'))
