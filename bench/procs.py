"""Process helpers the benchmark scripts share: wait for a port, stop a process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time


def wait_port(port: int, p: subprocess.Popen, timeout: float = 30.0) -> None:
    """Return once something listens on 127.0.0.1:``port``; fail if ``p`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"process exited with {p.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def stop(p: subprocess.Popen) -> None:
    """SIGINT to the process group, SIGKILL if it lingers (the process was started in its own session)."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
