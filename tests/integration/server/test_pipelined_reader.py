"""A client that pipelines requests and reads no answer: the gateway runs its next request only
once the answers before it are on their way (the transport under its limit), on the fast lane and
on aiohttp's path alike. Without that a client could have the gateway run every request it sends
and hold all their answers in memory until the write-stall cut, 30 s later by default."""
from __future__ import annotations

import asyncio
import socket

import orjson
import pytest
from aiohttp import web

from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.waiting import wait_for

ANSWER_BYTES = 1_000_000
SENT = 40          # 40 MB of answers, ten times what the kernel's buffers on loopback can hold


def _one(chunked: bool) -> bytes:
    body = orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": 4})
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
    if chunked:         # a framing the fast lane leaves to aiohttp
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("chunked", [False, True], ids=["fast_lane", "aiohttp"])
async def test_requests_behind_an_unread_answer_wait_for_the_client_to_read(gateway, chunked):
    ran = 0
    text = "x" * ANSWER_BYTES

    async def completions(_request: web.Request) -> web.Response:
        nonlocal ran
        ran += 1
        return web.json_response({"id": f"cmpl-{ran}", "object": "text_completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}})

    async with fake_engine(completions, paths=("/v1/completions",)) as url:
        gw = await gateway([model_block("m", "vllm", [url])])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gw.port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock, limit=2 * ANSWER_BYTES)
        try:
            writer.write(_one(chunked) * SENT)
            await writer.drain()
            # the engine hears requests while the answers still fit in the buffers, then none
            seen = -1

            def settled() -> bool:
                nonlocal seen
                still, seen = ran == seen, ran
                return still and ran > 0

            assert await wait_for(settled, timeout=20.0, interval=0.5), "requests never stopped coming"
            assert ran < SENT / 2, f"the gateway ran {ran} of {SENT} requests for a client reading nothing"
            answered = 0
            while answered < SENT:       # reading again: every request is run and answered, in order
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
                assert head.startswith(b"HTTP/1.1 200"), head[:200]
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                body = orjson.loads(await asyncio.wait_for(reader.readexactly(length), 20))
                answered += 1
                assert body["id"] == f"cmpl-{answered}"
            assert ran == SENT
        finally:
            writer.close()
