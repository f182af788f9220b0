"""A real ``redis-server`` on a free loopback port, for the tenancy tests.

The ``redis_server`` fixture (tests/conftest.py, function scope) starts one with no persistence
(``--save '' --appendonly no``) in a temporary directory and stops it by pid at teardown. Tests can ``kill()`` it (SIGKILL, an
outage), ``start()`` it again on the same port (recovery, empty), or ``pause()``/``resume()`` it
(SIGSTOP/SIGCONT: a Redis that accepts connections but never answers).

``make test`` installs Debian's ``redis-server`` when it is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import pytest

from tests.support.ports import listen_port


def popen(argv: list[str], **kw) -> subprocess.Popen:
    """``subprocess.Popen`` with the environment passed as a copy (``os.environ``'s, taken now).
    Without one, a child made by vfork (subprocess's way on Linux, the GIL released meanwhile)
    execs with the process's own environment array, read in the parent's memory, while another
    thread may be moving it: pytest sets and removes ``PYTEST_CURRENT_TEST`` at each test's phase,
    and a set is started ahead of its test in another thread (tests/conftest.py ``_Ahead``), so the
    exec failed now and then with EFAULT ("Bad address"). A copy is built before the fork."""
    return subprocess.Popen(argv, env=dict(os.environ), **kw)


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` with the environment passed as a copy (see :func:`popen`)."""
    return subprocess.run(argv, env=dict(os.environ), **kw)


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed (make test installs it: apt-get install redis-server)")
        self.port = port or listen_port()
        self.dir = tempfile.mkdtemp(prefix="switchyard-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.proc is None, "already running"
        self.proc = popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning", "--databases", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir)
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not answer PING")
            time.sleep(0.01)
        return self

    def ping(self) -> bool:
        return ping(self.port)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """An outage: SIGKILL, then wait until the process is gone (the port is free again)."""
        if self.proc is not None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=5)
            self.proc = None

    def cleanup(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir)


def ping(port: int) -> bool:
    """Whether a Redis (server or Sentinel) on the loopback ``port`` answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# -- a set of servers (tests/support/redis_cluster.py, redis_sentinel.py) ------------------------------

# what every server of a set runs with: loopback only, nothing on disk, quick first syncs
SET_FLAGS = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--repl-diskless-sync-delay", "0", "--loglevel", "warning", "--protected-mode", "no"]


@dataclass
class RedisProc:
    """One process of a set (a server or a Sentinel): its port, directory and command line."""

    port: int
    dir: str
    argv: list[str]
    proc: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, timeout: float = 10.0) -> None:
        """Start it and wait until it answers PING."""
        os.makedirs(self.dir, exist_ok=True)
        self.proc = popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir)
        deadline = time.monotonic() + timeout
        while not ping(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not answer PING")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None


def stop_set(procs: list[RedisProc], directory: str) -> None:
    """Stop every process (SIGTERM, then SIGKILL after 5 s) and remove the set's directory."""
    for p in procs:
        if p.alive:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        if p.proc is not None:
            try:
                p.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(timeout=5)
            p.proc = None
    with contextlib.suppress(OSError):
        shutil.rmtree(directory)


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` (errors of a half-ready set count as not yet) until true, else fail."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except (AssertionError, ValueError, IndexError, StopIteration, subprocess.TimeoutExpired):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout}s")
        time.sleep(0.05)
