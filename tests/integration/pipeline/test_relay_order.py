"""The relay writes a chunk it passes on unchanged before it scans it (gateway/pipeline/relay.py):
the scan (first token, gaps, usage) adds nothing to the chunk's latency. Shown by a scan that
fails: the chunk it failed on has already reached the client."""

from __future__ import annotations

import aiohttp
import pytest

from gateway.pipeline.sse import SSEScanner
from tests.support.factories import model_block

CHAT = [{"role": "user", "content": "Stream to me."}]


@pytest.mark.parametrize("usage", [True, False])
async def test_a_passed_through_chunk_reaches_the_client_before_it_is_scanned(sims, gateway, monkeypatch, usage):
    """``usage``: the client asks for usage itself (the stream passes through as it is), or the
    gateway asks for it and strips it (chunks with no usage in them still go out first)."""
    sim = await sims("vllm", "m", itl_ms=20)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    feed = SSEScanner.feed
    scanned: list[bytes] = []

    def failing(self, chunk, now):
        if b'"content"' in chunk and not scanned:
            scanned.append(chunk)
            raise RuntimeError("scan failed")
        return feed(self, chunk, now)

    monkeypatch.setattr(SSEScanner, "feed", failing)
    body = {"model": "m", "messages": CHAT, "max_tokens": 5, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        got = await resp.read()
    assert scanned and scanned[0] in got          # the chunk the scan failed on went out first
