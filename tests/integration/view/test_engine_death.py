"""An engine killed under load and started again, behind a gateway of two workers that share its
monitoring (``view.share_monitoring``, the default): real processes on loopback, the engines too,
so that the kill is a kill (connections reset, then refused) and the engines' pauses are not the
test's.

What a client and an operator must see: the streams on the dead engine are the only requests
that can fail, nothing sent after the kill fails, both workers take the engine out once and put
it back once when it is up again, and the healthy engines are never taken out."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from tests.support.gateway_process import interrupt, per_worker
from tests.support.ports import listen_port
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[3]
ENGINE_ARGS = ("--engine", "vllm", "--model", "m", "--ttft-base-ms", "5", "--itl-ms", "5")
TOKENS = 24                 # a stream lasts about 0.13 s on the engine
CLIENTS = 12


@dataclass
class Seen:
    """One streamed request as its client saw it."""

    sent: float
    done: float
    status: int
    pod: str
    ok: bool                # a 200 whose stream ended with [DONE] and carried no error event


def _engine(port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "enginesim", *ENGINE_ARGS, "--host", "127.0.0.1",
                             "--port", str(port)], cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


async def _up(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            return r.status == 200
    except (aiohttp.ClientError, OSError):
        return False


async def _stream(port: int) -> Seen:
    sent = time.monotonic()
    body = {"model": "m", "stream": True, "max_tokens": TOKENS, "messages": [{"role": "user", "content": "hi"}]}
    status, pod, ok = 0, "", False
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
            status, pod = r.status, r.headers.get("target-pod", "")
            raw = (await r.read()).decode()
        frames = [f[len("data: "):] for f in raw.split("\n\n") if f.startswith("data: ")]
        ok = status == 200 and frames[-1:] == ["[DONE]"] and \
            not any("error" in orjson.loads(f) for f in frames if f != "[DONE]")
    except (aiohttp.ClientError, OSError):
        pass
    return Seen(sent, time.monotonic(), status, pod, ok)


def _health_changes(log: Path) -> list[tuple[str, bool]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event":"endpoint health changed"' in line:
            rec = orjson.loads(line)
            out.append((rec["endpoint"], rec["healthy"]))
    return out


async def test_an_engine_killed_under_load_is_taken_out_and_back_once_by_both_workers(tmp_path):
    ports = [listen_port() for _ in range(3)]
    names = [f"127.0.0.1:{p}" for p in ports]
    urls = [f"http://{n}" for n in names]
    engines = [_engine(p, tmp_path / f"engine{i}.log") for i, p in enumerate(ports)]
    gw_port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {gw_port}}}\n"
                   "health: {interval_s: 0.2, timeout_s: 2.0}\n"
                   "scrape: {interval_s: 0.2}\n"
                   "server: {workers: 2}\n"
                   f"models:\n  - name: m\n    engine: vllm\n    endpoints: {orjson.dumps(urls).decode()}\n")
    gw_log = tmp_path / "gw.log"
    gw = None
    seen: list[Seen] = []
    try:
        await until(lambda: all_up(urls), timeout=30)
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(cfg)], cwd=ROOT,
                              stdout=gw_log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        await until(lambda: _up(f"http://127.0.0.1:{gw_port}"), timeout=40)
        assert len(await per_worker(gw_port, 2, path="/ready", timeout=40)) == 2

        stop = asyncio.Event()

        async def client() -> None:
            while not stop.is_set():
                seen.append(await _stream(gw_port))

        clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]
        await asyncio.sleep(1.5)
        engines[0].send_signal(signal.SIGKILL)
        engines[0].wait()
        killed = time.monotonic()
        await asyncio.sleep(2.0)
        engines[0] = _engine(ports[0], tmp_path / "engine0.log")
        await until(lambda: all_up(urls[:1]), timeout=30)
        back = time.monotonic()
        # both workers route to it again, each of their own accord (one line each)
        await until(lambda: _health_changes(gw_log).count((names[0], True)) >= 2, timeout=20)
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*clients)
    finally:
        if gw is not None:
            await interrupt([gw], 20)
        for e in engines:
            with contextlib.suppress(ProcessLookupError):
                e.kill()
            e.wait()

    changes = _health_changes(gw_log)
    report = f"health changes {changes}\n" + _unusual(gw_log)
    failed = [s for s in seen if not s.ok]
    again = min((s.done for s in seen if s.pod == names[0] and s.sent > back and s.ok), default=None)
    print(f"{len(seen)} requests, {len(failed)} failed (sent, ended after the kill, s): "
          f"{[(round(s.sent - killed, 3), round(s.done - killed, 3)) for s in failed]}; "
          f"last sent to it {max(s.sent for s in seen if s.pod == names[0] and s.sent < back) - killed:.3f} s "
          f"after the kill; first answer from it {again - back if again else None} s after it was up")
    # only streams the dead engine was serving when it died may fail; nothing sent after it
    assert all(s.pod == names[0] and s.sent < killed for s in failed), report
    assert all(s.status == 200 for s in seen), report
    # the healthy engines were never taken out; the dead one once by each worker, and back once
    assert [c for c in changes if c[0] != names[0]] == [], report
    assert [c for c in changes if c[0] == names[0]] == [(names[0], False)] * 2 + [(names[0], True)] * 2, report
    # the engine served again, and the load went on over all three
    assert any(s.pod == names[0] and s.sent > back and s.ok for s in seen), report
    assert {s.pod for s in seen if s.sent > killed and s.done < back} == set(names[1:]), report


async def all_up(urls: list[str]) -> bool:
    return all(await asyncio.gather(*(_up(u) for u in urls)))


def _unusual(log: Path) -> str:
    """What the gateway wrote besides its plain 200s (to tell a failure's cause from the log)."""
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if '"status":200,' not in line and ('"level":"info"' not in line or '"event":"request"' in line
                                                 or '"event":"endpoint health changed"' in line)]
    return "\n".join(lines)[-8000:]
