"""``--workers N``: several processes serve one port, and a SIGTERM drains them all."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.server.run import free_port


def listening_inodes(port: int) -> set[str]:
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:   # LISTEN on our port
            out.add(f[9])
    return out


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name if hasattr(fd, "readlink") else ""
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.timeout(60)
async def test_two_workers_share_the_port_and_drain(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(20):
            while len(children_of(proc.pid)) < 2:
                await asyncio.sleep(0.05)
        workers = children_of(proc.pid)
        # every worker answers; count distinct workers by their own request counters
        async with aiohttp.ClientSession() as s:
            async with asyncio.timeout(20):
                while True:
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/ready") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.05)
            for _ in range(20):
                conn = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(connector=conn) as one, one.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                    assert r.status == 200
        assert len(workers) == 2
        listeners = listening_inodes(port)
        assert len(listeners) == 2                       # two sockets on one port (SO_REUSEPORT)
        for w in workers:                                # one in each worker
            assert socket_inodes(w) & listeners
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            code = await proc.wait()
    assert code == 0
    assert not any(Path(f"/proc/{w}").exists() for w in workers)
