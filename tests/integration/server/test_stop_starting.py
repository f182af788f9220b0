"""A gateway of one process (``--workers 1``) stopped while it starts: before it reads its config,
once its app is built, once it listens but before its event loop handles signals, and when its
start-up never ends. Each moment is held open by a test-only hook: the gateway makes a FIFO named
by its pid in the directory the hook's variable names, and waits until the test opens it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.support.ports import listen_port
from tests.support.waiting import release_held

HOLD_BEFORE_CONFIG = "SWITCHYARD_TEST_HOLD_BEFORE_CONFIG"   # read by gateway/__main__.py, for tests only
HOLD_AFTER_BUILD = "SWITCHYARD_TEST_HOLD_AFTER_BUILD"       # read by gateway/server/run.py, for tests only
HOLD_AFTER_LISTEN = "SWITCHYARD_TEST_HOLD_AFTER_LISTEN"     # read by gateway/server/run.py, for tests only
STOPS = [signal.SIGTERM, signal.SIGINT]


def config(tmp_path: Path, port: int, url: str, grace: float = 5) -> Path:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   f"server: {{drain_delay_s: 0, shutdown_grace_s: {grace:g}, log_level: info}}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{url}']}}]\n")
    return cfg


def events(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]


@contextlib.asynccontextmanager
async def held_gateway(tmp_path: Path, cfg: Path, hook: str, workers: int = 1):
    """A ``--workers 1`` gateway (or ``workers``) held by ``hook``: yields the process, its pid's FIFO
    and its log's path."""
    hold = tmp_path / "hold"
    hold.mkdir()
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", str(workers), "--log-format", "json", stderr=log_file,
                                                    env={**os.environ, hook: str(hold)})
    try:
        fifo = hold / str(proc.pid)
        async with asyncio.timeout(30):
            while not fifo.exists():
                await asyncio.sleep(0.02)
        yield proc, fifo, log_path
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()




@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
async def test_a_stop_before_the_config_is_read_ends_the_gateway_with_a_line(sims, tmp_path, sig, workers):
    """A stop that comes before the gateway reads its config (nothing listens yet) ends it at once
    once the config is read: exit 0 and a line in the config's log format, no traceback, nothing
    listened, no worker started. Before, SIGTERM's default action ended it with no word (killed by
    the signal), and SIGINT was a KeyboardInterrupt (exit 130, no line)."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with held_gateway(tmp_path, config(tmp_path, port, sim.url), HOLD_BEFORE_CONFIG, workers) as (
            proc, fifo, log_path):
        proc.send_signal(sig)     # pending once this returns: the gateway takes it while held
        await release_held(fifo)
        async with asyncio.timeout(20):
            code = await proc.wait()
    assert code == 0
    text = log_path.read_text()
    assert "Traceback" not in text, text
    lines = events(log_path)
    names = [e["event"] for e in lines]
    assert "listening" not in names and "workers started" not in names, names
    stopped = [e for e in lines if e["event"] == "stopped while starting, before listening"]
    assert len(stopped) == 1 and stopped[0]["signal"] == sig.name, lines


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
async def test_a_stop_once_the_app_is_built_is_held_then_drained(sims, tmp_path, sig):
    """A stop that comes once the app is built, before the gateway listens, waits for the event
    loop's handler: the gateway listens, drains, logs its stop and exits 0."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with held_gateway(tmp_path, config(tmp_path, port, sim.url), HOLD_AFTER_BUILD) as (proc, fifo, log_path):
        proc.send_signal(sig)     # pending once this returns: the gateway takes it while held
        await release_held(fifo)
        async with asyncio.timeout(20):
            code = await proc.wait()
    assert code == 0
    assert "Traceback" not in log_path.read_text()
    names = [e["event"] for e in events(log_path)]
    assert names.count("draining") == 1 and names.count("stopped") == 1, names


def send_request(port: int) -> socket.socket:
    """A connection the kernel queues on the listening socket, its whole request sent."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def read_answer(s: socket.socket) -> bytes:
    """Everything the gateway sends until it closes (raises ConnectionResetError on a reset)."""
    chunks = []
    with s:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
async def test_connections_queued_before_a_stop_between_listen_and_handler_are_answered(sims, tmp_path, sig):
    """Connections the kernel queued on the listening socket before a stop that comes between the
    listen and the event loop's handler each get an answer (200, or 503 with Connection: close),
    not a reset nor a close without a word; the gateway drains, logs its stop and exits 0."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with held_gateway(tmp_path, config(tmp_path, port, sim.url), HOLD_AFTER_LISTEN) as (proc, fifo, log_path):
        clients = [send_request(port) for _ in range(3)]
        proc.send_signal(sig)     # pending once this returns: the gateway takes it while held
        await release_held(fifo)
        async with asyncio.timeout(30):
            answers = await asyncio.gather(*(asyncio.to_thread(read_answer, s) for s in clients))
            code = await proc.wait()
    for answer in answers:
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith((b"http/1.1 200", b"http/1.1 503")), answer
        if head.startswith(b"http/1.1 503"):
            assert b"\r\nconnection: close" in head, answer
    assert code == 0
    assert "Traceback" not in log_path.read_text()
    names = [e["event"] for e in events(log_path)]
    assert names.count("stopped") == 1, names


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hook", [HOLD_AFTER_BUILD, HOLD_AFTER_LISTEN])
async def test_a_stop_ends_a_start_up_that_outlasts_the_grace_period(sims, tmp_path, hook):
    """A start-up that never ends (held for good by the hook) does not hold a stop for longer than
    ``server.shutdown_grace_s``: the gateway then says so and exits 137, as a gateway of several
    workers does when it kills a worker still starting. Before, nothing but SIGKILL ended it."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with held_gateway(tmp_path, config(tmp_path, port, sim.url, grace=1), hook) as (proc, _fifo, log_path):
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await proc.wait()
    assert code == 128 + signal.SIGKILL
    assert "Traceback" not in log_path.read_text()
    ended = [e for e in events(log_path) if e["event"] == "still starting when the stop's grace period ended; exiting"]
    assert len(ended) == 1 and ended[0]["shutdown_grace_s"] == 1 and ended[0]["signal"] == "SIGTERM", ended
    assert ended[0]["listening"] is (hook == HOLD_AFTER_LISTEN)


@pytest.mark.timeout(90)
async def test_a_second_stop_ends_a_start_up_that_hangs_at_once(sims, tmp_path):
    """A second stop ends a start-up that hangs at once, whatever the grace period (60 s here)."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with held_gateway(tmp_path, config(tmp_path, port, sim.url, grace=60), HOLD_AFTER_BUILD) as (
            proc, _fifo, log_path):
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            code = await proc.wait()
    assert code == 128 + signal.SIGKILL
    ended = [e for e in events(log_path) if e["event"] == "still starting when the stop's grace period ended; exiting"]
    assert len(ended) == 1 and ended[0]["second_signal"] is True, events(log_path)


def pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` waits to be delivered to ``pid`` (not yet taken by any of its threads)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    return any(int(fields[k], 16) & 1 << (sig - 1) for k in ("SigPnd", "ShdPnd"))


@pytest.mark.timeout(90)
async def test_the_drain_after_a_slow_start_up_counts_its_grace_from_the_stop(sims, tmp_path):
    """A stop taken while the gateway starts is drained, once it serves, within what is left of
    ``server.shutdown_grace_s`` counted from the stop, as the drain of any stop is: the gateway's
    whole stop stays within the grace a supervisor gives it (the chart's
    terminationGracePeriodSeconds). The bound is by cause: the stop was taken before the test saw it
    taken, and the start-up went on for 1.5 s after that. Before, the drain took the whole grace
    period again from the moment the start-up ended."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with held_gateway(tmp_path, config(tmp_path, port, sim.url, grace=20), HOLD_AFTER_BUILD) as (
            proc, fifo, log_path):
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):     # taken by the gateway while it starts
            while pending(proc.pid, signal.SIGTERM):
                await asyncio.sleep(0.02)
        await asyncio.sleep(1.5)            # the start-up goes on
        await release_held(fifo)
        async with asyncio.timeout(30):
            code = await proc.wait()
    assert code == 0
    draining = [e for e in events(log_path) if e["event"] == "draining"]
    assert len(draining) == 1 and 0 < draining[0]["grace_s"] <= 18.5, draining


@pytest.mark.timeout(60)
async def test_a_stop_while_the_config_file_is_a_fifo_no_one_writes_ends_the_gateway(tmp_path):
    """A config path that is a FIFO (or a terminal, or /dev/stdin) waits for its text, and a stop is
    held back while the gateway reads its config: a stop then still ends the gateway, exit 0 and
    the line of a stop while starting. Before, the read waited with SIGTERM and SIGINT held back,
    and only SIGKILL ended it."""
    cfg = tmp_path / "gw.yaml"
    os.mkfifo(cfg)
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "1", stderr=log_file)
    writer = -1
    try:
        async with asyncio.timeout(30):
            while writer < 0:       # the write end opens once the gateway has the file open to read
                try:
                    writer = os.open(cfg, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            code = await proc.wait()
    finally:
        if writer >= 0:
            os.close(writer)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0, log_path.read_text()
    assert "stopped while starting, before listening" in log_path.read_text()


@pytest.mark.timeout(60)
async def test_a_pause_while_the_gateway_starts_is_no_stop(sims, tmp_path):
    """A gateway paused while it starts (SIGSTOP then SIGCONT: a debugger, a container runtime's
    freeze, a terminal's Ctrl-Z and fg) wakes its start-up guard's wait for a stop with EINTR and
    no signal: it starts and serves as if not paused, and a later stop drains it (exit 0)."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with held_gateway(tmp_path, config(tmp_path, port, sim.url), HOLD_AFTER_BUILD) as (proc, fifo, log_path):
        for _ in range(3):
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(0.2)        # past the guard's poll: its wait ends on the resume
            proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.05)
        await release_held(fifo)
        async with asyncio.timeout(30):
            while True:
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                    break
                assert proc.returncode is None, log_path.read_text()[-3000:]
                await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            code = await proc.wait()
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text
    names = [e["event"] for e in events(log_path)]
    assert "still starting when the stop's grace period ended; exiting" not in names
    assert names.count("draining") == 1 and names.count("stopped") == 1, names
