"""The README's picture of the status page: ``python -m tests.support.status_screenshot OUT.png`` (or
``make status-screenshot``).

Starts ``python -m gateway --demo`` (the demo's engines on their fixed ports, so the picture shows
the addresses the demo's banner prints), sends it a few seconds of mixed traffic — streams and
plain answers on every model, a session that uses ``vtc-basic`` without a user (a routing
fallback), a few engine errors (``x-sim-fault``), an unknown model, and long streams still
running when the picture is taken — then photographs ``/status`` in headless Chromium.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys

import aiohttp

from gateway.demo import DEMO_ENGINES
from tests.support.cdp import Browser
from tests.support.ports import listen_port

MODELS = sorted({m for m, *_ in DEMO_ENGINES})
PROMPTS = ["What does a switchyard do?", "Explain prefill and decode in two sentences.",
           "Write a haiku about trains.", "Summarise the history of rail signalling. " * 6]


async def start_demo(port: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--demo", "--port", str(port), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen = b""
    async with asyncio.timeout(30):
        while b"Metrics:" not in seen:
            line = await proc.stdout.readline()
            if not line:
                raise RuntimeError("the demo exited:\n" + seen.decode())
            seen += line
    # keep draining its log so it never blocks on a full pipe
    asyncio.get_running_loop().create_task(_drain(proc))
    return proc


async def _drain(proc: asyncio.subprocess.Process) -> None:
    while await proc.stdout.read(65536):
        pass


async def one(s: aiohttp.ClientSession, url: str, rng: random.Random, **extra) -> None:
    model = extra.pop("model", rng.choice(MODELS))
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(8, 48), "stream": rng.random() < 0.7, **extra.pop("body", {})}
    headers = extra.pop("headers", {})
    with contextlib.suppress(aiohttp.ClientError):
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()


async def traffic(url: str, seconds: float, seed: int = 7) -> None:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    async with aiohttp.ClientSession() as s:
        async def worker(i: int) -> None:
            while loop.time() < end:
                r = rng.random()
                if r < 0.03:
                    await one(s, url, rng, headers={"x-sim-fault": rng.choice(["status=503", "status=500"])})
                elif r < 0.05:
                    await one(s, url, rng, model="llama-70b")
                elif r < 0.12:
                    await one(s, url, rng, model="demo-llama", headers={"routing-strategy": "vtc-basic"})
                else:
                    await one(s, url, rng, headers={"user": f"team-{i % 3}"})
        await asyncio.gather(*(worker(i) for i in range(6)))


async def main(out: str, seconds: float) -> None:
    port = listen_port()
    proc = await start_demo(port)
    browser = Browser.launch()
    url = f"http://127.0.0.1:{port}"
    try:
        page = await browser.new_page(width=1280, height=900)
        await page.navigate(url + "/status")
        await page.wait_for("document.querySelectorAll('#endpoints tbody tr').length > 0")
        await traffic(url, seconds)
        # a few long streams still running when the picture is taken
        async with aiohttp.ClientSession() as s:
            long = [asyncio.create_task(one(s, url, random.Random(i), model=m, body={"max_tokens": 400, "stream": True}))
                    for i, m in enumerate(["demo-llama", "demo-qwen-pd", "demo-llama-pd"])]
            await page.wait_for("document.getElementById('tile-inflight').textContent === '3'", timeout=10)
            await page.wait_for("[...document.querySelectorAll('#endpoints td[data-field=scraped]')]"
                                ".every(td => td.textContent.endsWith('ago'))")
            await page.screenshot(out)
            for t in long:
                t.cancel()
            await asyncio.gather(*long, return_exceptions=True)
        if page.problems:
            raise RuntimeError("the browser reported problems:\n" + "\n".join(page.problems))
        await page.close()
    finally:
        browser.close()
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(15):
                await proc.wait()
    print(f"wrote {out} ({os.path.getsize(out)} bytes)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="docs/status-page.png")
    ap.add_argument("--seconds", type=float, default=8.0, help="traffic before the picture")
    args = ap.parse_args()
    asyncio.run(main(args.out, args.seconds))
