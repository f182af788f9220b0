"""``--workers N``: several processes serve one port, a SIGTERM drains them all, and ``/metrics`` and
``/status.json`` show the whole gateway whichever worker answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import jsonschema
import pytest

from tests.support.gateway_process import per_worker, post_new
from tests.support.metrics import metric
from tests.support.ports import listen_port
from tests.support.waiting import release_held, sigstop, wait_for


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


def one_engine_config(tmp_path: Path, port: int, url: str, grace: float, stall_timeout: float | None = None,
                      log_level: str = "warning") -> Path:
    """A gateway on ``port`` in front of one vLLM engine at ``url`` (model ``m``), its log at
    ``log_level``; ``stall_timeout``: ``server.worker_stall_timeout_s`` (None: its default)."""
    stall = "" if stall_timeout is None else f", worker_stall_timeout_s: {stall_timeout:g}"
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   f"server: {{drain_delay_s: 0, shutdown_grace_s: {grace:g}, log_level: {log_level}{stall}}}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{url}']}}]\n")
    return cfg


@pytest.mark.timeout(60)
async def test_two_workers_share_the_port_and_drain(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = one_engine_config(tmp_path, port, sim.url, grace=5)
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


SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "docs" / "status.schema.json").read_text())


def sibling_sockets(pids: list[int]) -> dict[int, str]:
    """Each worker's socket for its siblings (gateway/server/siblings.py), found by its inode."""
    paths = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[7].endswith(".sock") and "/worker-" in f[7]:
            paths[f[6]] = f[7]
    out = {}
    for pid in pids:
        found = [paths[i] for i in socket_inodes(pid) if i in paths]
        if found:
            out[pid] = found[0]
    return out


async def own_metrics(path: str) -> str:
    """One worker's own exposition, read as a sibling reads it (its length on a line, then itself)."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"metrics\n")
    await writer.drain()
    size = int(await reader.readline())
    body = await reader.readexactly(size)
    writer.close()
    return body.decode()


async def fresh_get(url: str) -> tuple[int, str, dict]:
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn) as s, s.get(url) as r:
        return r.status, await r.text(), dict(r.headers)


@pytest.mark.timeout(90)
async def test_metrics_and_status_show_the_whole_gateway(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = one_engine_config(tmp_path, port, sim.url, grace=5)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    n = 24
    try:
        await workers_listening(proc.pid, port, timeout=30)
        ids, completion_ids = set(), set()
        for _ in range(n):          # fresh connections: the kernel spreads them over both workers
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as one, one.post(
                    f"{base}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200
                ids.add(r.headers["x-request-id"])
                completion_ids.add((await r.json())["id"])
        workers = children_of(proc.pid)
        sockets = sibling_sockets(workers)
        own = {pid: metric(await own_metrics(path), "switchyard_requests_total", status="200")
               for pid, path in sockets.items()}
        assert len(own) == 2 and all(v >= 1 for v in own.values()) and sum(own.values()) == n
        # each worker draws its own request ids (and the engine's completion ids follow them)
        assert len(ids) == n and len(completion_ids) == n

        for _ in range(6):          # whichever worker answers, the page is the gateway's
            status, text, _ = await fresh_get(f"{base}/metrics")
            assert status == 200
            assert metric(text, "switchyard_requests_total", status="200") == n
            assert metric(text, "switchyard_workers") == 2 and metric(text, "switchyard_workers_scraped") == 2
            assert metric(text, "switchyard_endpoint_ready", endpoint=sim.url.removeprefix("http://")) == 1        # the same fact, not 2
            assert text.count("# TYPE switchyard_requests_total counter") == 1

            status, text, _ = await fresh_get(f"{base}/status.json")
            doc = json.loads(text)
            jsonschema.validate(doc, SCHEMA)
            assert doc["gateway"]["workers"]["count"] == 2 and doc["gateway"]["workers"]["reporting"] == 2
            assert doc["gateway"]["pid"] in workers
            assert doc["gateway"]["workers"]["answered"] in (0, 1)
            assert doc["totals"]["requests_since_start"] == n
            assert doc["totals"]["window"]["requests"] == n
            assert doc["models"][0]["window"]["requests"] == n

        # a killed worker is restarted; the merged page answers throughout and then holds it again,
        # its sums never below what a scrape saw: the new worker carries on from its predecessor's
        # last reported counts (a fall would read as a reset, and rate() would count it all again)
        victim = workers[0]
        os.kill(victim, signal.SIGKILL)
        async with asyncio.timeout(30):
            while True:
                try:
                    status, text, _ = await fresh_get(f"{base}/metrics")
                except (aiohttp.ClientConnectionError, ConnectionResetError):
                    await asyncio.sleep(0.05)       # queued on the killed worker's socket: reset
                    continue
                assert status == 200
                assert metric(text, "switchyard_requests_total", status="200") == n
                now = children_of(proc.pid)
                if victim not in now and len(now) == 2 and metric(text, "switchyard_workers_scraped") == 2:
                    break
                await asyncio.sleep(0.1)
        for _ in range(4):              # and it counts on from there
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as one, one.post(
                    f"{base}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200
        for _ in range(4):
            text = (await fresh_get(f"{base}/metrics"))[1]
            assert metric(text, "switchyard_requests_total", status="200") == n + 4
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            code = await proc.wait()
    assert code == 0


async def _started_workers(cfg: Path, port: int) -> tuple[int, str]:
    """``python -m gateway --config cfg`` with no worker count: the workers it ran (status page),
    and its stderr."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as s:
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                        if r.status == 200:
                            count = (await r.json())["gateway"]["workers"]["count"]
                            break
                await asyncio.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    return count, err.decode()


@pytest.mark.timeout(90)
async def test_by_default_a_worker_per_cpu_unless_limits_would_be_per_process(sims, tmp_path):
    from gateway.server.workers import auto_count

    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    base = (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    cfg.write_text(base + "server: {drain_delay_s: 0, shutdown_grace_s: 5}\n")
    count, err = await _started_workers(cfg, port)
    assert count == auto_count()
    assert "auto runs fewer workers" not in err
    # rate limits kept in each process would multiply by the workers: auto runs one, and says why
    cfg.write_text(base + "server: {drain_delay_s: 0, shutdown_grace_s: 5}\n"
                   "limits: {users: {alice: {rpm: 60}}}\n")
    count, err = await _started_workers(cfg, port)
    assert count == 1
    if auto_count() > 1:                   # (one CPU: one worker anyway, nothing to say)
        line = next(json.loads(x) for x in err.splitlines() if "auto runs fewer workers" in x)
        assert line["level"] == "warning" and line["workers"] == 1 and "rate limits" in line["reason"]
        assert line["cpus"] == auto_count()


@pytest.mark.timeout(60)
async def test_workers_stop_when_their_parent_is_killed_outright(sims, tmp_path):
    """SIGKILL (or the OOM killer) gives the parent no chance to forward a signal: the workers get
    SIGTERM from the kernel and stop, rather than serve on unsupervised. Nor can it remove its
    private directory, where the workers' last reports were left behind for good (one directory
    in /tmp per gateway killed so): the last worker to stop removes it."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = one_engine_config(tmp_path, port, sim.url, grace=2)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.DEVNULL)
    async with asyncio.timeout(20):
        while len(kids := children_of(proc.pid)) < 2 or len(listening_inodes(port)) < 2:
            await asyncio.sleep(0.05)
    await both_ready(port, proc.pid)
    await per_worker(port, 2)                   # each answers a scrape: its report is kept there
    run_dirs = {os.path.dirname(p) for p in sibling_sockets(kids).values()}
    assert len(run_dirs) == 1 and os.listdir(run_dirs.copy().pop())
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    async with asyncio.timeout(15):             # the workers end, and nothing listens on the port
        while alive(kids) or listening_inodes(port):
            await asyncio.sleep(0.05)
    (run_dir,) = run_dirs
    assert not os.path.exists(run_dir), os.listdir(run_dir)


def alive(pids: list[int]) -> bool:
    """Any of ``pids`` still running (a zombie, or a process gone, is not)."""
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            return True
    return False


def worker_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.timeout(90)
async def test_a_worker_whose_loop_stalls_is_killed_and_restarted(sims, tmp_path):
    """A stopped worker (SIGSTOP: its event loop runs no more, as when a call blocks it) would keep
    taking its share of new connections and answer none. The parent sees its heartbeat stop, kills
    it, starts a new one, and counts it; every client, the openai SDK's included, is then answered."""
    import openai

    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = one_engine_config(tmp_path, port, sim.url, grace=2, stall_timeout=2)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    stopped = None
    try:
        async with asyncio.timeout(20):
            while len(children_of(proc.pid)) < 2 or len(listening_inodes(port)) < 2:
                await asyncio.sleep(0.05)
            while (await fresh_get(url + "/ready"))[0] != 200:
                await asyncio.sleep(0.05)
        before = children_of(proc.pid)
        assert len(before) == 2
        _, text, _ = await fresh_get(url + "/metrics")
        assert metric(text, "switchyard_worker_restarts_total", reason="stalled") == 0
        stopped = before[0]
        os.kill(stopped, signal.SIGSTOP)
        async with asyncio.timeout(15):         # killed (no longer a live process) and replaced
            while worker_state(stopped) not in (None, "Z", "X"):
                await asyncio.sleep(0.05)
            while len(kids := children_of(proc.pid)) < 2 or stopped in kids or len(listening_inodes(port)) < 2:
                await asyncio.sleep(0.05)
        stopped = None
        # the healthy one stayed, idle longer than the stall timeout while its sibling's stall was timed
        # (and the parent's log below names no other stalled worker, through the whole test)
        assert before[1] in kids
        async with asyncio.timeout(20):         # the new worker serves (both listeners answer /ready)
            for _ in range(20):
                while (await fresh_get(url + "/ready"))[0] != 200:
                    await asyncio.sleep(0.05)
        for _ in range(16):                     # fresh connections: the kernel spreads them over both
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
            try:
                done = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                assert done.choices[0].message.content
            finally:
                await client.close()
        _, text, _ = await fresh_get(url + "/metrics")
        assert metric(text, "switchyard_worker_restarts_total", reason="stalled") == 1
        assert metric(text, "switchyard_worker_restarts_total", reason="exited") == 0
        # a worker that dies (here SIGKILL) is restarted too, and counted apart
        crashed = children_of(proc.pid)[0]
        os.kill(crashed, signal.SIGKILL)
        async with asyncio.timeout(15):
            while len(kids := children_of(proc.pid)) < 2 or crashed in kids or len(listening_inodes(port)) < 2:
                await asyncio.sleep(0.05)
            while True:
                status, body, _ = await fresh_get(url + "/status.json")
                doc = json.loads(body) if status == 200 else {}
                if doc and doc["gateway"]["workers"]["reporting"] == 2:
                    break
                await asyncio.sleep(0.05)
        jsonschema.validate(doc, SCHEMA)
        assert doc["gateway"]["workers"]["restarts"] == {"exited": 1, "stalled": 1}
        await page_shows_the_restart(url)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await proc.wait()
        err = (await proc.stderr.read()).decode()
    events = parent_events(err)
    assert [(e["worker"], e["pid"]) for e in events["worker's event loop stalled; killing it"]] == [(0, before[0])]
    assert events["worker's event loop stalled; killing it"][0]["level"] == "error"
    restarts = [(e["pid"], e["reason"], e["code"], e["restart_in_s"]) for e in events["worker restarting"]]
    assert restarts == [(before[0], "stalled", -9, 1.0), (crashed, "exited", -9, 1.0)]


def parent_events(err: str) -> dict[str, list[dict]]:
    """The JSON lines of stderr (the parent's and the workers'), by event."""
    out: dict[str, list[dict]] = {}
    for line in err.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out.setdefault(d.get("event", ""), []).append(d)
    return out


@pytest.mark.timeout(60)
async def test_a_gateway_whose_workers_cannot_start_exits_as_one_process_would(tmp_path):
    """The port is taken by another program: every worker fails to bind. The parent stops with the
    workers' exit code, as a single process does, instead of starting them again forever."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = one_engine_config(tmp_path, port, "http://127.0.0.1:9", grace=1)
        for workers in ("2", "1"):
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                        "--workers", workers, stderr=asyncio.subprocess.PIPE)
            async with asyncio.timeout(30):
                err = (await proc.stderr.read()).decode()
                code = await proc.wait()
            assert code == 1, err
            assert "address already in use" in err and f"switchyard: cannot listen on 127.0.0.1:{port}" in err
            assert "Traceback" not in err           # one line, as a config error
            if workers == "2":
                events = parent_events(err)
                assert events["worker failed before the gateway started serving; stopping"][0]["code"] == 1
                assert "worker restarting" not in events


async def page_shows_the_restart(url: str) -> None:
    """The status page, in a real headless Chromium, names the restart in its heading."""
    from tests.support.cdp import Browser, chromium_binary

    if chromium_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make test installs Debian's chromium)")
        return
    browser = Browser.launch()
    try:
        page = await browser.new_page()
        try:
            await page.navigate(url + "/status")
            meta = await page.wait_for("(() => { const t = document.querySelector('#meta').textContent;"
                                       " return t.includes('workers restarted') && t; })()")
            assert "2 workers" in meta and "workers restarted: 1 stalled, 1 exited" in meta
            assert page.problems == [], "\n".join(page.problems)
        finally:
            await page.close()
    finally:
        browser.close()


RESTARTS_SCRIPT = r"""
import json, os, sys, time
from gateway.server.heartbeat import Heartbeats
from gateway.server import workers
from gateway.server.workers import run_workers

workers.RESTART_STABLE_S = 0.3      # the first worker's 0.6 s counts as a while
beats = Heartbeats(1)

def serve_one(index):
    # the first worker serves (ticks) for a while, then dies; every later one fails its start-up
    if not os.path.exists(sys.argv[1]):
        open(sys.argv[1], "w").close()
        beats.tick(index)
        time.sleep(0.6)
        return 3
    return 4

def log(event, level="info", **fields):
    print(json.dumps({"event": event, "level": level, "t": time.monotonic(), **fields}), flush=True)

sys.exit(run_workers(1, serve_one, log, heartbeats=beats, stall_timeout=lambda: 0.0))
"""


async def _restarts(tmp_path: Path, name: str, text: str, state: str, count: int) -> list[dict]:
    """Runs ``text`` (a script driving ``run_workers``) with ``tmp_path / state`` as its argument
    until its parent logged ``count`` "worker restarting" lines, stops it, and gives the lines it read."""
    script = tmp_path / name
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), str(tmp_path / state),
                                                stdout=asyncio.subprocess.PIPE, env=env)
    events: list[dict] = []
    try:
        async with asyncio.timeout(30):
            while len([e for e in events if e["event"] == "worker restarting"]) < count:
                line = await proc.stdout.readline()
                assert line, "the parent ended"
                events.append(json.loads(line))
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await proc.wait()
    return events


@pytest.mark.timeout(60)
async def test_a_worker_that_served_then_keeps_failing_is_restarted_with_a_growing_back_off(tmp_path):
    """Only a failure before the gateway ever served stops it: a worker that served and then keeps
    failing its start-ups is started again after 1, 1, 2, 4 s, and the parent stays up."""
    events = await _restarts(tmp_path, "restarts.py", RESTARTS_SCRIPT, "served", 4)
    restarts = [e for e in events if e["event"] == "worker restarting"]
    assert [(e["code"], e["reason"], e["restart_in_s"]) for e in restarts] == [
        (3, "exited", 1.0), (4, "exited", 1.0), (4, "exited", 2.0), (4, "exited", 4.0)]
    assert not [e for e in events if "stopping" in e["event"]]


CRASH_LOOP_SCRIPT = r"""
import json, os, sys, time
from gateway.server import workers
from gateway.server.heartbeat import Heartbeats

workers.RESTART_BACKOFF_S = 0.05       # 0.05, 0.1, 0.2, ... s: the test stays short
workers.RESTART_STABLE_S = 1.5
beats = Heartbeats(1)
starts = sys.argv[1]

def serve_one(index):
    # every worker gets past its start-up (ticks) and dies a moment later, but the fourth, which
    # serves longer than RESTART_STABLE_S before it dies
    with open(starts, "a") as f:
        f.write("x")
    n = os.path.getsize(starts)
    beats.tick(index)
    time.sleep(1.6 if n == 4 else 0.02)
    return 3

def log(event, level="info", **fields):
    print(json.dumps({"event": event, "level": level, "t": time.monotonic(), **fields}), flush=True)

sys.exit(workers.run_workers(1, serve_one, log, heartbeats=beats, stall_timeout=lambda: 0.0))
"""


@pytest.mark.timeout(60)
async def test_a_worker_that_dies_soon_after_each_start_is_restarted_with_a_growing_back_off(tmp_path):
    """A worker that gets past its start-up and dies a moment later, start after start (a request
    that crashes it, sent again and again; the OOM killer at each catch-up), is started again after
    a growing back-off, as one whose start-ups fail is, and once one has served a while, after the
    shortest again: each start costs its siblings a copy of their whole view."""
    events = await _restarts(tmp_path, "crash_loop.py", CRASH_LOOP_SCRIPT, "starts", 5)
    restarts = [e["restart_in_s"] for e in events if e["event"] == "worker restarting"]
    assert restarts == [0.05, 0.1, 0.2, 0.05, 0.05], restarts
    assert not [e for e in events if "stopping" in e["event"]]


async def workers_listening(parent: int, port: int, workers: int = 2, timeout: float = 40) -> None:
    """Until ``parent`` has ``workers`` workers each listening on its sibling socket, and the
    gateway on ``port`` answers ``/ready``."""
    async with asyncio.timeout(timeout):
        while len(children_of(parent)) < workers or len(sibling_sockets(children_of(parent))) < workers:
            await asyncio.sleep(0.05)
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                if (await fresh_get(f"http://127.0.0.1:{port}/ready"))[0] == 200:
                    return
            await asyncio.sleep(0.05)


async def both_ready(port: int, parent: int) -> None:
    """Until the gateway on ``port`` is ready and ``parent`` has its two workers."""
    async with asyncio.timeout(20):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                status, _, _ = await fresh_get(f"http://127.0.0.1:{port}/ready")
                if status == 200 and len(children_of(parent)) == 2:
                    return
            await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_a_worker_killed_during_the_drain_makes_the_gateway_exit_non_zero(sims, tmp_path):
    """A stop during which a worker died of a signal (the OOM killer's SIGKILL) lost whatever that
    worker had in flight: the gateway's exit code says so (128 + the signal), as a shell's would."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 4, shutdown_grace_s: 10, log_level: warning}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.PIPE)
    try:
        await both_ready(port, proc.pid)
        # both have answered, so both have their stop handlers in place: a worker still starting
        # when the stop came would die of the signal's default action, a stop like any other
        await per_worker(port, 2, "/health")
        workers = children_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):           # the drain has begun: /ready says 503
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    if (await fresh_get(f"http://127.0.0.1:{port}/ready"))[0] == 503:
                        break
                await asyncio.sleep(0.05)
        # still draining (not exited and waiting to be reaped), so its death is the signal's
        assert Path(f"/proc/{workers[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        os.kill(workers[0], signal.SIGKILL)
        async with asyncio.timeout(30):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 128 + signal.SIGKILL


@pytest.mark.timeout(60)
async def test_reloads_that_come_until_the_gateway_has_exited_do_not_end_it_with_sighup(sims, tmp_path):
    """SIGHUPs (a config watcher's reloads) sent through a stop: a worker whose loop had closed, or
    the parent once its workers had exited, met SIGHUP's default action, so a gateway that drained
    cleanly exited 129, as if killed, instead of 0."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = one_engine_config(tmp_path, port, sim.url, 2)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.DEVNULL)
    try:
        await both_ready(port, proc.pid)
        await per_worker(port, 2, "/health")        # both serve: their SIGHUP handlers are in place
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            while proc.returncode is None:
                # os.kill, not proc.send_signal: Popen.send_signal polls first, and a poll that finds
                # the gateway exited reaps it, so asyncio's watcher, which waits for that pid, finds
                # none and reports 255 for its exit code
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGHUP)
                await asyncio.sleep(0.001)
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0


NESTED_RELOAD_SCRIPT = r"""
import json, os, signal, sys
from gateway.server import hup
from gateway.server.workers import run_workers

hup.hold()
calls = []

def on_reload(trigger, later):
    calls.append("begin")
    if len(calls) == 1:                 # a second SIGHUP comes while the first is applied
        os.kill(os.getpid(), signal.SIGHUP)
    sum(range(10000))                   # the file read and checked meanwhile
    calls.append("end")
    if calls.count("end") == 2:
        print(json.dumps(calls), flush=True)
        os._exit(0)

os.kill(os.getpid(), signal.SIGHUP)     # noted, and applied as run_workers starts
sys.exit(run_workers(1, lambda index: 0, lambda *a, **k: None, on_reload=on_reload))
"""


@pytest.mark.timeout(30)
async def test_a_sighup_that_comes_while_the_parent_applies_another_waits_for_it(tmp_path):
    """The parent's handler ran inside itself when a second SIGHUP came while it re-read the file:
    the inner one took the newer file, then the outer one put back the older file it had read, so a
    worker restarted later served the older config while its siblings served the newer."""
    script = tmp_path / "nested.py"
    script.write_text(NESTED_RELOAD_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), stdout=asyncio.subprocess.PIPE, env=env)
    async with asyncio.timeout(20):
        out, _ = await proc.communicate()
    assert json.loads(out) == ["begin", "end", "begin", "end"]


PROMPT_STOP_SCRIPT = r"""
import json, signal, sys, time
from gateway.server import workers

workers.WATCH_POLL_S = 60.0             # the parent's poll: far longer than the test waits

def serve_one(index):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    while True:                         # until the stop the parent forwards ends it
        time.sleep(1)

def log(event, level="info", **fields):
    print(json.dumps({"event": event, **fields}), flush=True)

sys.exit(workers.run_workers(2, serve_one, log))
"""


@pytest.mark.timeout(30)
async def test_the_parent_ends_when_its_last_worker_does_not_at_its_next_poll(tmp_path):
    """A worker's end wakes the parent (its SIGCHLD): the stop is over as soon as the last worker
    has stopped. With a poll of a minute, the parent still exits within the test's 15 s; it
    noticed the workers' ends only at its next poll, a minute later."""
    script = tmp_path / "stop.py"
    script.write_text(PROMPT_STOP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), stdout=asyncio.subprocess.PIPE, env=env)
    try:
        async with asyncio.timeout(15):
            assert proc.stdout is not None
            while json.loads(await proc.stdout.readline())["event"] != "workers started":
                pass
            await asyncio.sleep(0.3)    # the parent is in its pause
            proc.send_signal(signal.SIGTERM)
            out = await proc.stdout.read()
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    stopped = [json.loads(line) for line in out.splitlines()]
    assert [e["event"] for e in stopped] == ["worker stopped", "worker stopped"]


@pytest.mark.timeout(90)
async def test_a_worker_whose_restarts_failed_a_while_does_not_make_a_clean_stop_fail(sims, tmp_path):
    """A worker killed while few more files can be opened (RLIMIT_NOFILE a few descriptors above
    those the parent holds: a container's limit met, say) fails each start-up it is given (exit
    code 1: too many open files) while its sibling serves every request; once files can be opened
    again it starts and serves. A stop after that drains both and loses nothing: the gateway
    exits 0, where it exited 1, the code of start-ups that had failed before the stop, as if the
    stop had."""
    import resource

    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = one_engine_config(tmp_path, port, sim.url, grace=5)
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", "--log-format", "json", stderr=log_file)
    try:
        await both_ready(port, proc.pid)
        await per_worker(port, 2, "/health")
        soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        held = len(os.listdir(f"/proc/{proc.pid}/fd"))
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (held + 8, hard))
        os.kill(children_of(proc.pid)[0], signal.SIGKILL)
        async with asyncio.timeout(30):         # a start-up failed for want of a file
            while not [e for e in parent_events(log_path.read_text()).get("worker restarting", [])
                       if e["code"] != -signal.SIGKILL]:
                await asyncio.sleep(0.05)
        for _ in range(4):                      # the sibling serves meanwhile
            status, _, _ = await post_new(port, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
            assert status == 200
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        await both_ready(port, proc.pid)
        await per_worker(port, 2, "/health")    # the restarted worker serves
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0, log_path.read_text()[-3000:]


def _unix_lines() -> list[list[str]]:
    return [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]


def queued_on(path: str) -> int:
    """Connections made to the listening socket at ``path`` and not accepted (its owner stopped):
    each stays listed, with the path and no inode, whether or not its client still holds it."""
    return sum(1 for f in _unix_lines() if len(f) >= 8 and f[7] == path and f[6] == "0")


def unix_clients(pid: int) -> int:
    """The unix stream sockets ``pid`` holds that have no path of their own: its questions to its
    siblings, beside those it was started with (its socket pairs with its parent)."""
    mine = socket_inodes(pid)
    return sum(1 for f in _unix_lines() if len(f) == 7 and f[4] == "0001" and f[6] in mine)


async def _on_worker(port: int, pid: int, wait: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A kept-alive connection that worker ``pid`` serves (its /status.json says so), or None when
    the kernel handed it to another worker (closed then)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /status.json HTTP/1.1\r\nHost: gateway.test\r\n\r\n")
    try:
        async with asyncio.timeout(wait):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            doc = json.loads(await reader.readexactly(length))
    except TimeoutError:
        doc = None
    if doc is None or doc["gateway"]["pid"] != pid:
        writer.close()
        return None
    return reader, writer


@pytest.mark.timeout(120)
async def test_scrapes_whose_client_leaves_hold_nothing_of_a_stuck_sibling(sims, tmp_path):
    """A worker answering /metrics or /status.json asks its siblings and waits for them at most half
    a second; a client that leaves meanwhile cancels that wait, and the questions to a sibling whose
    loop is stuck (stopped here) must end with it, where each stayed, holding a socket to that
    sibling, until the sibling answered or was restarted (server.worker_stall_timeout_s, 20 s by
    default): clients that leave at once could pile up a socket each meanwhile."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = one_engine_config(tmp_path, port, sim.url, grace=2, stall_timeout=0)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.DEVNULL)
    stopped = None
    try:
        async with asyncio.timeout(30):     # both workers listen on the port and on their sibling sockets
            while len(children_of(proc.pid)) < 2 or len(sibling_sockets(children_of(proc.pid))) < 2 \
                    or len(listening_inodes(port)) < 2:
                await asyncio.sleep(0.05)
        await both_ready(port, proc.pid)
        live, stopped = children_of(proc.pid)
        stuck = sibling_sockets([stopped])[stopped]
        before = unix_clients(live)
        os.kill(stopped, signal.SIGSTOP)
        conns: list = []
        async with asyncio.timeout(60):
            # connections the live worker serves: the kernel hands each new one to either worker, and
            # one the stopped worker took is never answered, so several are tried at once (one wait
            # for all of them, not one for each the stopped worker took)
            while len(conns) < 4:
                got = await asyncio.gather(*(_on_worker(port, live, wait=3.0) for _ in range(8)))
                conns += [c for c in got if c is not None]
            for left, (_, writer) in enumerate(conns[:4]):
                asked = queued_on(stuck)
                path = b"/metrics" if left % 2 == 0 else b"/status.json"
                writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: gateway.test\r\n\r\n")
                while queued_on(stuck) == asked:    # the worker asked the stuck sibling, and waits
                    await asyncio.sleep(0.01)
                writer.close()                  # the client leaves
            for _, writer in conns[4:]:
                writer.close()
        # what those scrapes opened is closed with them, the sibling still stuck
        assert await wait_for(lambda: unix_clients(live) == before, timeout=10.0, interval=0.05), (
            before, unix_clients(live))
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await proc.wait()


HOLD_AFTER_LISTEN = "SWITCHYARD_TEST_HOLD_AFTER_LISTEN"      # read by gateway/server/run.py, for tests only


def stop_pending(pid: int) -> bool | None:
    """Whether ``pid`` holds a SIGTERM back (blocked, and waiting to be delivered: it stays so)
    (None: it is gone, or a zombie)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    if fields.get("State", "").startswith(("Z", "X")):
        return None
    bit = 1 << (signal.SIGTERM - 1)
    return bool(int(fields["SigBlk"], 16) & bit) and any(int(fields[k], 16) & bit for k in ("SigPnd", "ShdPnd"))


async def release_with_their_stop_pending(workers: list[int], hold: Path) -> None:
    """Once the stop is held back in each held worker (not fatal to any), let them go on: each
    handles the stop it got."""
    async with asyncio.timeout(10):
        while not all(stop_pending(pid) in (True, None) for pid in workers):
            await asyncio.sleep(0.02)
    assert [stop_pending(pid) for pid in workers] == [True] * len(workers)
    for pid in workers:
        await release_held(hold / str(pid))



@pytest.mark.timeout(60)
async def test_a_stop_that_comes_between_a_worker_s_listen_and_its_handler_is_drained(sims, tmp_path):
    """A stop (SIGTERM to the gateway, passed on to the workers) that reaches a worker after it
    began to listen and before its event loop handles the signal waits for the handler, and the
    worker drains as at any stop: whatever the kernel had queued on its listening socket gets its
    answer or a refused connection, not a reset. The moment is held open by a test-only hook (each
    worker, listening, waits for this test to open a FIFO it made). Before, the signal's default
    action killed the worker on the spot."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: info}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    hold = tmp_path / "hold"
    hold.mkdir()
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", "--log-format", "json", stderr=log_file,
                                                    env={**os.environ, HOLD_AFTER_LISTEN: str(hold)})
    try:
        async with asyncio.timeout(30):         # both listen, and wait in the hook
            while len(os.listdir(hold)) < 2 or len(listening_inodes(port)) < 2:
                await asyncio.sleep(0.05)
        workers = [int(name) for name in os.listdir(hold)]
        assert sorted(workers) == sorted(children_of(proc.pid))
        proc.send_signal(signal.SIGTERM)        # the parent passes it on
        await release_with_their_stop_pending(workers, hold)
        async with asyncio.timeout(30):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0
    events = [json.loads(line)["event"] for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert events.count("draining") == 2 and events.count("stopped") == 2, events


HOLD_AFTER_FORK = "SWITCHYARD_TEST_HOLD_AFTER_FORK"      # read by gateway/server/workers.py, for tests only


async def start_held_workers(tmp_path: Path, url: str, grace: float, hook: str
                             ) -> tuple[asyncio.subprocess.Process, Path, Path]:
    """A two-worker gateway in front of ``url`` whose workers both wait in the test-only ``hook``
    (each made its FIFO in the returned directory): (the process, that directory, its log file).
    The process leads a session of its own; it is killed if the workers never get there."""
    cfg = one_engine_config(tmp_path, listen_port(), url, grace=grace, log_level="info")
    hold = tmp_path / "hold"
    hold.mkdir()
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", "--log-format", "json", stderr=log_file,
                                                    env={**os.environ, hook: str(hold)}, start_new_session=True)
    try:
        async with asyncio.timeout(30):         # both forked, and wait in the hook
            while len(os.listdir(hold)) < 2:
                await asyncio.sleep(0.05)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    return proc, hold, log_path


@pytest.mark.timeout(60)
async def test_a_stop_that_comes_between_a_worker_s_fork_and_its_start_is_drained(sims, tmp_path):
    """A stop sent to the whole gateway (its process group, as systemd and a terminal's Ctrl-C do)
    that reaches a worker after its fork and before it starts serving waits for the worker's event
    loop to handle it: the worker starts, drains and exits 0, and the parent says each worker
    stopped with 0. The moment is held open by a test-only hook (each worker, just forked, waits
    for this test to open a FIFO it made). Before, the signal's default action killed the worker
    on the spot."""
    sim = await sims("vllm", "m")
    proc, hold, log_path = await start_held_workers(tmp_path, sim.url, 5, HOLD_AFTER_FORK)
    try:
        workers = sorted(int(name) for name in os.listdir(hold))
        assert workers == sorted(children_of(proc.pid))
        os.killpg(proc.pid, signal.SIGTERM)     # the parent and both workers
        await release_with_their_stop_pending(workers, hold)
        async with asyncio.timeout(30):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert code == 0
    events = parent_events(log_path.read_text())
    assert len(events.get("draining", [])) == 2 and len(events.get("stopped", [])) == 2, events
    assert sorted((e["pid"], e["code"]) for e in events.get("worker stopped", [])) == [(pid, 0) for pid in workers]
    assert "worker restarting" not in events


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hook", [HOLD_AFTER_FORK, HOLD_AFTER_LISTEN])
async def test_a_stop_ends_a_worker_whose_start_up_outlasts_the_grace_period(sims, tmp_path, hook):
    """A worker whose start-up never ends (held for good by a test-only hook: just forked, or
    listening before its loop handles signals) does not hold the gateway's stop for longer than
    ``server.shutdown_grace_s``: the parent then kills it, says so, and exits, with 137 as for any
    worker killed during the stop. Before, the parent waited for it for as long as it lived, until
    a supervisor's SIGKILL."""
    sim = await sims("vllm", "m")
    proc, hold, log_path = await start_held_workers(tmp_path, sim.url, 1, hook)
    try:
        workers = sorted(int(name) for name in os.listdir(hold))
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert code == 128 + signal.SIGKILL
    assert all(worker_state(pid) is None for pid in workers)       # reaped by the parent
    events = parent_events(log_path.read_text())
    ended = events.get("worker still starting when the stop's grace period ended; killing it", [])
    assert sorted(e["pid"] for e in ended) == workers and all(e["shutdown_grace_s"] == 1 for e in ended), events
    assert sorted((e["pid"], e["code"]) for e in events.get("worker stopped", [])) == [
        (pid, -signal.SIGKILL) for pid in workers]


EARLY_STOP_SCRIPT = r"""
import json, os, signal, sys
from gateway.server.heartbeat import Heartbeats
from gateway.server.workers import run_workers

when, out = sys.argv[1], sys.argv[2]


class StopWhileStarting(Heartbeats):
    def reset(self, index):
        super().reset(index)
        if when == "between" and index == 1:    # the stop comes once the first worker runs
            os.kill(os.getpid(), signal.SIGTERM)


def serve_one(index):
    open(os.path.join(out, f"started-{index}"), "w").close()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})   # handled from now on
    while True:                                 # serves until a stop reaches it
        signal.pause()


if when == "before":                            # held back while the caller prepares, as the gateway's is
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    os.kill(os.getpid(), signal.SIGTERM)
code = run_workers(2, serve_one, lambda *a, **k: None, heartbeats=StopWhileStarting(2))
print(json.dumps({"code": code, "started": sorted(os.listdir(out))}), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before", "between"])
async def test_a_stop_that_comes_while_the_parent_starts_its_workers_stops_them_all(tmp_path, when):
    """A stop that reaches the parent before its handlers are in place (held back while it makes its
    run directory) or between two of its workers' starts stops the gateway: no worker is started
    after it, and those started drain. Before, the parent went on to start the workers after the
    stop, which were never told to stop: the gateway served on with a parent that would never exit."""
    script = tmp_path / "early.py"
    script.write_text(EARLY_STOP_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), when, str(out),
                                                stdout=asyncio.subprocess.PIPE, env=env)
    try:
        async with asyncio.timeout(20):
            stdout, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            for pid in children_of(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            await proc.wait()
    result = json.loads(stdout)
    assert result["code"] == 0
    # the first worker, started before the stop, may have been stopped before it got to say so
    assert result["started"] == [] if when == "before" else result["started"] in ([], ["started-0"])


async def stream_on_each_worker(port: int, workers: int) -> dict[int, tuple[aiohttp.ClientSession, aiohttp.ClientResponse]]:
    """A completion stream in flight on each of ``workers`` workers, its first event read:
    {pid: (its session, its response)}; closing the session ends it."""
    held: dict[int, tuple[aiohttp.ClientSession, aiohttp.ClientResponse]] = {}
    async with asyncio.timeout(20):
        while len(held) < workers:
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                pid = (await r.json())["gateway"]["pid"]
            if pid in held:
                await s.close()
                continue
            resp = await s.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"model": "m", "prompt": "hi", "max_tokens": 5000, "stream": True})
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: ")
            held[pid] = (s, resp)
    return held


@pytest.mark.timeout(90)
async def test_the_last_worker_out_removes_the_run_directory_when_a_sibling_was_killed(sims, tmp_path):
    """The parent killed outright, its workers drain; one of them is killed outright too (the OOM
    killer) and leaves its sockets in the run directory. The last worker to stop still removes the
    directory. Before, it took the dead sibling's sockets for a worker still running and left the
    directory behind for good."""
    sim = await sims("vllm", "m", itl_ms=100.0)
    port = listen_port()
    cfg = one_engine_config(tmp_path, port, sim.url, grace=60)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.DEVNULL)
    held: dict[int, tuple[aiohttp.ClientSession, aiohttp.ClientResponse]] = {}
    kids: list[int] = []
    try:
        await both_ready(port, proc.pid)
        kids = children_of(proc.pid)
        (run_dir,) = {os.path.dirname(p) for p in (await _sibling_sockets_of(kids)).values()}
        held = await stream_on_each_worker(port, 2)      # each worker drains until its stream ends
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        async with asyncio.timeout(15):             # both got the kernel's SIGTERM: their listeners closed
            while listening_inodes(port):
                await asyncio.sleep(0.05)
        killed, last = kids
        os.kill(killed, signal.SIGKILL)
        async with asyncio.timeout(15):             # all its threads gone: its descriptors closed
            while not all_threads_ended(killed):
                await asyncio.sleep(0.05)
        assert alive([last]) and os.path.isdir(run_dir)
        session, _ = held.pop(last)                 # its stream ends: its drain is over
        await session.close()
        async with asyncio.timeout(15):
            while alive([last]):
                await asyncio.sleep(0.05)
        assert not os.path.exists(run_dir), os.listdir(run_dir)
    finally:
        for session, _ in held.values():
            await session.close()
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def all_threads_ended(pid: int) -> bool:
    """Whether every thread of ``pid`` has exited: its main thread may be a zombie while the others
    still close the descriptors they share with it."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return tasks == [str(pid)] and worker_state(pid) in (None, "Z", "X")


async def _sibling_sockets_of(pids: list[int]) -> dict[int, str]:
    """Each worker's socket for its siblings, once all of ``pids`` have one."""
    async with asyncio.timeout(20):
        while len(found := sibling_sockets(pids)) < len(pids):
            await asyncio.sleep(0.05)
    return found


async def _gateway_with_run_dir(cfg: Path, port: int) -> tuple[asyncio.subprocess.Process, list[int], str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.DEVNULL)
    await both_ready(port, proc.pid)
    kids = children_of(proc.pid)
    (run_dir,) = {os.path.dirname(p) for p in (await _sibling_sockets_of(kids)).values()}
    return proc, kids, run_dir


@pytest.mark.timeout(120)
async def test_a_start_removes_the_run_directory_of_a_gateway_whose_every_process_was_killed(sims, tmp_path):
    """A gateway whose parent and workers were all killed outright (SIGKILL to each, a node's OOM
    killer) has no process left to remove its run directory: the next gateway to start removes it,
    and leaves alone the directory of a gateway still running, which serves on. Before, the dead
    gateway's directory stayed in the temporary directory for good, one per such death."""
    sim = await sims("vllm", "m")
    port_live, port_dead, port_next = listen_port(), listen_port(), listen_port()
    (tmp_path / "live").mkdir()
    (tmp_path / "dead").mkdir()
    (tmp_path / "next").mkdir()
    procs: list[asyncio.subprocess.Process] = []
    try:
        live, _, live_dir = await _gateway_with_run_dir(
            one_engine_config(tmp_path / "live", port_live, sim.url, grace=2), port_live)
        procs.append(live)
        dead, dead_kids, dead_dir = await _gateway_with_run_dir(
            one_engine_config(tmp_path / "dead", port_dead, sim.url, grace=2), port_dead)
        procs.append(dead)
        for pid in dead_kids:                       # stopped: the kernel's SIGTERM finds them so
            await sigstop(pid)
        dead.send_signal(signal.SIGKILL)
        await dead.wait()
        for pid in dead_kids:
            os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(15):             # all their threads gone: their descriptors closed
            while not all(all_threads_ended(pid) for pid in dead_kids):
                await asyncio.sleep(0.05)
        assert os.path.isdir(dead_dir)

        nxt, _, next_dir = await _gateway_with_run_dir(
            one_engine_config(tmp_path / "next", port_next, sim.url, grace=2), port_next)
        procs.append(nxt)
        assert not os.path.exists(dead_dir), os.listdir(dead_dir)
        assert os.path.isdir(live_dir) and os.path.isdir(next_dir)
        for port in (port_live, port_next):        # both serve, with their siblings
            await per_worker(port, 2)
            status, _, body = await post_new(port, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
            assert status == 200, body
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            async with asyncio.timeout(30):
                await p.wait()


def old_run_directory(base: Path, live: list | None = None, extra: str | None = None,
                      prefix: str = "switchyard-", age_s: float = 3600.0) -> Path:
    """A run directory as a version before the lock file made it (``mkdtemp``; the workers' sockets
    for each other and the bus, their last reports), last changed ``age_s`` seconds ago. Its
    sockets are closed (their files stay, as a killed process leaves them), or with ``live`` kept
    open, bound and listening, in that list, as a gateway still running holds them; ``extra``: a
    file of another name in it."""
    import socket
    import tempfile
    import time

    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    for i in range(2):
        stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stream.bind(str(path / f"worker-{i}.sock"))
        stream.listen()
        datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        datagram.bind(str(path / f"w{i}.sock"))
        if live is None:
            stream.close()
            datagram.close()
        else:
            live += [stream, datagram]
        (path / f"status-{i}.json").write_text("{}")
        (path / f"metrics-{i}.prom").write_text("")
    if extra is not None:
        (path / extra).write_text("")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


@pytest.mark.timeout(90)
async def test_a_start_removes_a_run_directory_an_older_version_left_without_a_lock_file(sims, tmp_path):
    """A run directory made before the lock file was (by a version that had none), whose gateway
    is gone, is removed by the next start: it holds only a run directory's files, none of its
    sockets has a process behind it, and it has not changed for a while. Left alone: such a
    directory whose sockets a process still holds (an older gateway still running), one changed a
    moment ago (being made), one holding a file of another name, and another program's directory
    whose name begins the same way. Before, a directory without a lock file was never removed."""
    import shutil
    import tempfile

    sim = await sims("vllm", "m")
    port = listen_port()
    base = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))      # short: the sockets' paths fit in sun_path
    held: list = []
    proc = None
    try:
        stale = old_run_directory(base)
        running = old_run_directory(base, live=held)
        fresh = old_run_directory(base, age_s=0)
        other_files = old_run_directory(base, extra="notes.txt")
        other_program = old_run_directory(base, prefix="switchyard-demo-batch-")
        cfg = one_engine_config(tmp_path, port, sim.url, grace=2)
        cfg.write_text(cfg.read_text().replace("log_level: warning", "log_level: info"))
        log_path = tmp_path / "gw.log"
        with log_path.open("wb") as log_file:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                        "--workers", "2", "--log-format", "json", stderr=log_file,
                                                        env={**os.environ, "TMPDIR": str(base)})
        await both_ready(port, proc.pid)
        assert not stale.exists(), sorted(os.listdir(stale))
        for kept in (running, fresh, other_files, other_program):
            assert sorted(os.listdir(kept))[:2] == ["metrics-0.prom", "metrics-1.prom"], kept
        removed = parent_events(log_path.read_text())["run directories of gateways no longer running removed"]
        assert [str(stale)] in [e["paths"] for e in removed], removed
        await per_worker(port, 2)                   # the new gateway's own directory serves its siblings
    finally:
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                await proc.wait()
        for s in held:
            s.close()
        shutil.rmtree(base, ignore_errors=True)
