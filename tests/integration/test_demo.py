"""`python -m gateway --demo` as a newcomer runs it: the real process, answered through the SDK."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import openai
import pytest

from gateway.demo import DEMO_ENGINES
from gateway.server import free_port

MODELS = sorted({m for m, *_ in DEMO_ENGINES})


async def test_demo_answers_every_model_streaming_and_not():
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--demo", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        banner = b""
        async with asyncio.timeout(30):
            while b"Metrics:" not in banner:
                line = await proc.stdout.readline()
                if not line:
                    pytest.fail(f"demo exited early:\n{banner.decode()}")
                banner += line
        assert b"curl" in banner and b"OpenAI" in banner
        assert f"http://127.0.0.1:{port}/status ".encode() in banner
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert {m.id for m in (await client.models.list()).data} == set(MODELS)
        for model in MODELS:
            r = await client.chat.completions.create(model=model, max_tokens=5,
                                                     messages=[{"role": "user", "content": "Hello!"}])
            assert r.choices[0].message.content
            stream = await client.chat.completions.create(model=model, max_tokens=5, stream=True,
                                                          messages=[{"role": "user", "content": "Hello!"}])
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/status.json") as r:
            doc = await r.json()
        assert {m["name"] for m in doc["models"]} == set(MODELS) and len(doc["endpoints"]) == len(DEMO_ENGINES)
        assert {m["name"]: m["minute"]["requests"] for m in doc["models"]} == {m: 2 for m in MODELS}
    finally:
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(15):
            await proc.wait()
