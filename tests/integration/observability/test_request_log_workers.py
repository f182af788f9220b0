"""The request lines of ``--workers 2`` sharing one pipe for stderr (a container's): each line stays
whole, whatever a client sends, while the reader of the pipe falls behind (a log collector that
stalls, then catches up). A write to a pipe is whole only up to ``PIPE_BUF`` bytes; a longer one
waits for room part of the way, and the other worker's lines land inside it."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import sys

import openai
import pytest

from tests.integration.server.test_workers import children_of, own_metrics, sibling_sockets, workers_listening
from tests.support.metrics import metric
from tests.support.ports import listen_port

PIPE_BUF = getattr(select, "PIPE_BUF", 4096)
MESSAGES = [{"role": "user", "content": "hi"}]


def read_all(fd: int) -> bytes:
    """The pipe to its end, a little at a time (a collector that reads as it ships)."""
    out = bytearray()
    while chunk := os.read(fd, 1024):
        out += chunk
    return bytes(out)


@pytest.mark.timeout(120)
async def test_two_workers_lines_stay_whole_on_a_pipe_that_fell_behind(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_format: json}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    r, w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", stderr=w)
    finally:
        os.close(w)
    # a body's `model` of control characters, which JSON writes as \u0001: 6 bytes each, so the
    # error line (the model and the error naming it cut at 1024 characters) is over 12 KB. (A
    # claimed `user` that long is logged as its digest.)
    model = "\x01" * 2000
    n = 48
    try:
        await workers_listening(proc.pid, port)     # nothing read from the pipe yet: the start-up lines fit in it

        async def one(i: int, room: asyncio.Semaphore) -> None:
            async with room, openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                                max_retries=0, timeout=30) as client:    # a connection each
                with pytest.raises(openai.NotFoundError):
                    await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                                         extra_headers={"x-request-id": f"line-{i}"})

        room = asyncio.Semaphore(8)
        await asyncio.gather(*(one(i, room) for i in range(n)))
        served = [metric(await own_metrics(path), "switchyard_requests_total", status="404")
                  for path in sibling_sockets(children_of(proc.pid)).values()]
        assert sorted(served)[0] >= 1 and sum(served) == n        # both workers wrote lines
        # the collector catches up: the pipe is read to its end while the gateway stops (its
        # workers write what they still hold, then exit)
        reading = asyncio.create_task(asyncio.to_thread(read_all, r))
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(40):
            assert await proc.wait() == 0
            data = await reading
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(r)

    lines = [line for line in data.split(b"\n") if line]
    broken = [line[:120] for line in lines if not line.startswith(b"{") or not line.endswith(b"}")]
    assert not broken, f"{len(broken)} of {len(lines)} lines broken, e.g. {broken[:3]}"
    requests = [d for d in map(json.loads, lines) if d.get("event") == "request"]
    assert sorted(d["request_id"] for d in requests) == sorted(f"line-{i}" for i in range(n))
    for d in requests:
        assert d["status"] == 404 and d["error_class"] == "model_not_found"
        assert d["model"].startswith("\x01") and d["model"].endswith("… (2000 characters)")
    assert all(len(line) + 1 <= PIPE_BUF for line in lines)
