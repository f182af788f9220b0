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

import pytest

from gateway.server.run import free_port


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed (make test installs it: apt-get install redis-server)")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="switchyard-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
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
