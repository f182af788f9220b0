"""A gateway at its file-descriptor limit (RLIMIT_NOFILE), as a container's low limit, a client's
bug or a flood of connections held open makes it: a real ``--workers 2`` process (uvloop, the loop
it runs) with a soft and hard limit of 256 in front of a simulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import sys
from pathlib import Path

import orjson
import pytest

from tests.support.gateway_process import post_new
from tests.support.metrics import metric
from tests.support.ports import listen_port
from tests.support.waiting import until

NOFILE = 256
FLOOD = 700                 # more than both workers may hold together
KEPT = 20                   # connections opened before the flood, each then sends a request at once


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def accept_queues(port: int) -> list[int]:
    """The connections waiting in each listening socket on ``port`` to be accepted (a listening
    socket's rx_queue in /proc/net/tcp)."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
            out.append(int(f[4].split(":")[1], 16))
    return out


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> tuple[int, bytes]:
    """One request on a kept connection: (status, body); the body is read by its Content-Length."""
    writer.write(head)
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return int(status_line.split()[1]), await reader.readexactly(length)


def completion(max_tokens: int) -> bytes:
    body = orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": max_tokens})
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


METRICS = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.timeout(120)
async def test_connections_held_past_the_fd_limit_leave_room_for_engine_connections(sims, tmp_path):
    """Clients hold more connections than the workers may open files: each worker takes client
    connections up to its share of the limit and closes the ones past it at accept, counted and
    logged once, so the requests of connections already open still get their engine connection
    (20 at once, each a new one) and an answer, and once the clients let go, new connections are
    served. Before, every descriptor went to client connections (libuv accepts and closes the rest
    silently: nothing counted, nothing logged), and a request that needed an engine connection got
    502 upstream_unavailable "Too many open files", blamed on the engine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, header_timeout_s: 300, keepalive_timeout_s: 300,"
                   " log_level: warning}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    log_path = tmp_path / "gw.log"

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", "--log-format", "json", stderr=log_file,
                                                    preexec_fn=limited)
    kept: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    flood: list[socket.socket] = []
    try:
        async with asyncio.timeout(30):
            while len(children_of(proc.pid)) < 2 or len(accept_queues(port)) < 2:
                await asyncio.sleep(0.05)
        for _ in range(KEPT):
            kept.append(await asyncio.open_connection("127.0.0.1", port))
        for reader, writer in kept[:2]:     # the engine is reachable: one request each
            assert (await answer(reader, writer, completion(2)))[0] == 200
        before = len(log_path.read_text().splitlines())

        for _ in range(FLOOD):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            flood.append(s)
        # every connection of the flood was taken off the accept queues (held, or closed)
        await until(lambda: accept_queues(port) == [0, 0], timeout=30.0)

        answers = await asyncio.gather(*(answer(r, w, completion(30)) for r, w in kept))
        statuses = [status for status, _ in answers]
        assert statuses == [200] * KEPT, [(s, b[:200]) for s, b in answers if s != 200]

        status, page = await answer(*kept[0], METRICS)
        assert status == 200
        assert metric(page.decode(), "switchyard_connections_rejected_total") > 0
        limit = metric(page.decode(), "switchyard_client_connections_limit")
        assert 0 < limit < 2 * NOFILE

        lines = [json.loads(line) for line in log_path.read_text().splitlines()[before:] if line.startswith("{")]
        events = [e["event"] for e in lines]
        at_limit = [e for e in lines if e["event"] == "client connections at the worker's limit; closing new ones"]
        assert 1 <= len(at_limit) <= 2, events          # one a worker, not one a refused connection
        assert len(lines) == len(at_limit), events      # and nothing else: no engine blamed

        for s in flood:
            s.close()
        flood.clear()
        for _ in range(6):                  # new connections are served again, by both workers
            status, _, body = await post_new(port, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
            assert status == 200, body
    finally:
        for s in flood:
            s.close()
        for _r, w in kept:
            w.close()
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()


STATUS = b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.timeout(120)
async def test_a_worker_out_of_descriptors_answers_503_and_blames_no_engine(sims, tmp_path):
    """A worker that can open no file (its limit lowered under what it holds, as a leak or a
    limit met by other files would leave it) cannot connect to any engine: the requests that need
    a new engine connection get a 503 service_unavailable with Retry-After that says the gateway
    is short of file descriptors, no engine is counted a fault, and no breaker opens. Before, each
    was a 502 upstream_unavailable blamed on the engine: its connect error counted against it and,
    with health.passive (the default), opened the breaker of a healthy engine at once, an ejection
    the worker shared with its siblings."""
    sim_a = await sims("vllm", "m", itl_ms=20.0)
    sim_b = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, header_timeout_s: 300, keepalive_timeout_s: 300,"
                   " log_level: warning}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim_a.url}', '{sim_b.url}']}}]\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", "--log-format", "json",
                                                stderr=asyncio.subprocess.DEVNULL)
    kept: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        async with asyncio.timeout(30):
            while len(children_of(proc.pid)) < 2 or len(accept_queues(port)) < 2:
                await asyncio.sleep(0.05)
        by_worker: dict[int, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        for _ in range(20):
            conn = await asyncio.open_connection("127.0.0.1", port)
            kept.append(conn)
            status, body = await answer(*conn, STATUS)
            assert status == 200
            by_worker.setdefault(orjson.loads(body)["gateway"]["pid"], []).append(conn)
        worker, conns = max(by_worker.items(), key=lambda kv: len(kv[1]))
        assert len(conns) >= 4
        soft, hard = resource.prlimit(worker, resource.RLIMIT_NOFILE)
        held = len(list(Path(f"/proc/{worker}/fd").iterdir()))
        resource.prlimit(worker, resource.RLIMIT_NOFILE, (held, hard))     # no new file: none free
        try:
            answers = await asyncio.gather(*(answer(r, w, completion(30)) for r, w in conns[:4]))
        finally:
            resource.prlimit(worker, resource.RLIMIT_NOFILE, (soft, hard))
        refused = [orjson.loads(body) for status, body in answers if status != 200]
        assert refused, "every request found an engine connection open"
        assert all(status in (200, 503) for status, _ in answers), answers
        for err in refused:
            assert err["error"]["code"] == "service_unavailable", err
            assert "file descriptor" in err["error"]["message"], err

        status, page = await answer(*conns[0], METRICS)
        assert status == 200
        text = page.decode()
        assert metric(text, "switchyard_breaker_transitions_total") == 0, text
        assert metric(text, "switchyard_upstream_errors_total") == 0
        for _ in range(4):                  # and both engines serve
            status, _ = await answer(*conns[1], completion(2))
            assert status == 200
    finally:
        for _r, w in kept:
            w.close()
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()


@pytest.mark.timeout(120)
async def test_health_probes_a_worker_cannot_send_for_want_of_descriptors_mark_no_engine_down(sims, tmp_path):
    """Workers that can open no file cannot probe the engine: such a probe tells nothing of it, and
    is counted as not sent (switchyard_health_probes_total{result="not_sent"}), not as a failure, so
    a healthy engine stays in rotation. Before, each counted as a failed probe; two in a row marked
    the engine down, and the watcher told its siblings, so every worker took a healthy engine out
    of rotation for as long as the descriptors were short and healthy_threshold probes after."""
    sim = await sims("vllm", "m", keepalive_timeout_s=0.05)    # each probe needs a connection of its own
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, header_timeout_s: 300, keepalive_timeout_s: 300,"
                   " log_level: warning}\n"
                   "health: {interval_s: 0.2, timeout_s: 1}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", "--log-format", "json",
                                                stderr=asyncio.subprocess.DEVNULL)
    kept: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    limits: dict[int, tuple[int, int]] = {}
    try:
        async with asyncio.timeout(30):
            while len(children_of(proc.pid)) < 2 or len(accept_queues(port)) < 2:
                await asyncio.sleep(0.05)
        by_worker: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        async with asyncio.timeout(30):
            while len(by_worker) < 2:
                conn = await asyncio.open_connection("127.0.0.1", port)
                kept.append(conn)
                status, body = await answer(*conn, STATUS)
                assert status == 200
                by_worker.setdefault(orjson.loads(body)["gateway"]["pid"], conn)
        for worker in by_worker:            # a new descriptor takes the lowest free number: none is under 3
            limits[worker] = resource.prlimit(worker, resource.RLIMIT_NOFILE)
            resource.prlimit(worker, resource.RLIMIT_NOFILE, (3, limits[worker][1]))

        async def seen() -> list[tuple[bool, bool]]:
            """Each worker's view of the engine: (healthy, ready)."""
            out = []
            for conn in by_worker.values():
                status, body = await answer(*conn, STATUS)
                assert status == 200
                out += [(e["healthy"], e["ready"]) for e in orjson.loads(body)["endpoints"]]
            return out

        async def not_sent() -> float:
            status, page = await answer(*next(iter(by_worker.values())), METRICS)
            assert status == 200
            return metric(page.decode(), "switchyard_health_probes_total", result="not_sent")

        # until more probes than unhealthy_threshold could not be sent, or a worker took the engine out
        async with asyncio.timeout(30):
            while await seen() == [(True, True)] * 2 and await not_sent() < 4:
                await asyncio.sleep(0.1)
        assert await seen() == [(True, True)] * 2
    finally:
        for worker, (soft, hard) in limits.items():
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(worker, resource.RLIMIT_NOFILE, (soft, hard))
        for _r, w in kept:
            w.close()
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()


def workers_soft_nofile(pids: list[int]) -> list[int]:
    return [resource.prlimit(pid, resource.RLIMIT_NOFILE)[0] for pid in pids]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("raise_limit", [True, False])
async def test_a_low_soft_limit_is_raised_to_the_hard_limit_at_start(sims, tmp_path, raise_limit):
    """A gateway started with a soft RLIMIT_NOFILE of 256 under a hard one of 4096 (systemd's and
    Docker's 1024 under 524288 or more, in small) raises its soft limit to the hard one before it
    forks, says so once, and its workers cap client connections at their share of 4096, not of 256;
    with server.raise_nofile_limit off it keeps the limit it was given. Before, the soft limit was
    kept: each worker took about 80 client connections, though the process could raise it itself."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    opt_out = "" if raise_limit else ", raise_nofile_limit: false"     # true is the default
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   f"server: {{drain_delay_s: 0, shutdown_grace_s: 5{opt_out}}}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    log_path = tmp_path / "gw.log"

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, 4096))

    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", "--log-format", "json", stderr=log_file,
                                                    preexec_fn=limited)
    try:
        async with asyncio.timeout(30):
            while len(children_of(proc.pid)) < 2 or len(accept_queues(port)) < 2:
                await asyncio.sleep(0.05)
        workers = children_of(proc.pid)
        conn = await asyncio.open_connection("127.0.0.1", port)
        try:
            status, page = await answer(*conn, METRICS)
        finally:
            conn[1].close()
        assert status == 200
        limit = metric(page.decode(), "switchyard_client_connections_limit")
        lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        raised = [e for e in lines if e["event"] == "file descriptor limit raised"]
        capped = [e for e in lines if e["event"] == "file descriptor limit caps client connections below "
                                                     "server.max_connections"]
        if raise_limit:
            assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (4096, 4096)
            assert workers_soft_nofile(workers) == [4096, 4096]
            # each worker: half of what 4096 leaves free after what it holds and 64 more
            assert 2 * 1800 < limit < 4096, page.decode()
            assert len(raised) == 1, lines       # the parent's line, before the fork
            assert raised[0]["nofile_before"] == NOFILE and raised[0]["nofile"] == 4096
            assert raised[0]["nofile_hard"] == 4096
            assert sorted(e["nofile"] for e in capped) == [4096, 4096]
        else:
            assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (NOFILE, 4096)
            assert workers_soft_nofile(workers) == [NOFILE, NOFILE]
            assert 0 < limit < NOFILE
            assert raised == []
            assert sorted(e["nofile"] for e in capped) == [NOFILE, NOFILE]
    finally:
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()
