"""Inter-token latency is one rule on every streaming API: the gaps between the engine's reads that
carry generated content, so events that come together in one read add no gap."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.metrics import metric

TOKENS = ("a", "b", "c", "d", "e")


def _chat() -> list[bytes]:
    def chunk(delta: dict, finish: str | None = None, **more) -> bytes:
        return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "model": "chat",
                                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                                         **more}) + b"\n\n"
    return [chunk({"role": "assistant", "content": ""}), *[chunk({"content": t}) for t in TOKENS],
            chunk({}, "stop"),
            b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "model": "chat", "choices": [],
                                      "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})
            + b"\n\n", b"data: [DONE]\n\n"]


def _named(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def _messages() -> list[bytes]:
    start = {"id": "msg_1", "type": "message", "role": "assistant", "model": "msg", "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    return [_named("message_start", {"message": start}),
            _named("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            *[_named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": t}})
              for t in TOKENS],
            _named("content_block_stop", {"index": 0}),
            _named("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                     "usage": {"output_tokens": 5}}),
            _named("message_stop", {})]


def _responses() -> list[bytes]:
    resp = {"id": "resp_1", "object": "response", "created_at": 1, "model": "resp", "status": "in_progress",
            "output": []}
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
    done_item = {**item, "status": "completed",
                 "content": [{"type": "output_text", "text": "".join(TOKENS), "annotations": []}]}
    usage = {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8,
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    events = [("response.created", {"response": resp}), ("response.in_progress", {"response": resp}),
              ("response.output_item.added", {"output_index": 0, "item": item}),
              ("response.content_part.added", {"output_index": 0, "content_index": 0, "item_id": "msg_1",
                                                "part": {"type": "output_text", "text": "", "annotations": []}}),
              *[("response.output_text.delta", {"output_index": 0, "content_index": 0, "item_id": "msg_1",
                                                "delta": t}) for t in TOKENS],
              ("response.output_item.done", {"output_index": 0, "item": done_item}),
              ("response.completed", {"response": {**resp, "status": "completed", "output": [done_item],
                                                   "usage": usage}})]
    return [_named(name, {"sequence_number": i, **data}) for i, (name, data) in enumerate(events)]


STREAMS = {"/v1/chat/completions": (_chat, b'"content":"c"'), "/v1/messages": (_messages, b'"text":"c"'),
           "/v1/responses": (_responses, b'"delta":"c"')}


async def test_events_that_come_in_one_read_add_no_inter_token_gap_on_any_api(gateway):
    """The engine writes its first three tokens' events in one write, and, once the client has
    them, the other two in another: two reads carrying tokens, one gap, on chat completions,
    Messages and Responses alike (docs/observability.md)."""
    go = asyncio.Event()

    async def engine(request: web.Request) -> web.StreamResponse:
        await request.read()
        events, third = STREAMS[request.path]
        events = events()
        at = next(i for i, e in enumerate(events) if third in e) + 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(events[:at]))
        await asyncio.wait_for(go.wait(), 30)
        await resp.write(b"".join(events[at:]))
        await resp.write_eof()
        return resp

    async with fake_engine(engine, paths=tuple(STREAMS)) as url:
        gw = await gateway([model_block(m, "vllm", [url]) for m in ("chat", "msg", "resp")])
        bodies = {"/v1/chat/completions": {"model": "chat", "stream": True, "max_tokens": 5,
                                           "messages": [{"role": "user", "content": "hi"}]},
                  "/v1/messages": {"model": "msg", "stream": True, "max_tokens": 5,
                                   "messages": [{"role": "user", "content": "hi"}]},
                  "/v1/responses": {"model": "resp", "stream": True, "input": "hi"}}
        async with aiohttp.ClientSession() as s:
            for path, body in bodies.items():
                go.clear()
                third = STREAMS[path][1]
                async with s.post(gw.url + path, json=body) as r:
                    assert r.status == 200
                    got = b""
                    while third not in got:         # the first write reached the client
                        got += await asyncio.wait_for(r.content.readany(), 30)
                    go.set()
                    got += await r.content.read()
                assert got.count(b"delta") >= 5 or got.count(b'"content":"') >= 5, got[-300:]
        text = await gw.metrics_text()
        for model in ("chat", "msg", "resp"):
            assert metric(text, "switchyard_time_to_first_token_seconds_count", model=model) == 1, model
            assert metric(text, "switchyard_inter_token_latency_seconds_count", model=model) == 1, model
