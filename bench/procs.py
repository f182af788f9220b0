"""Process helpers the benchmark scripts share: start a process in its own group, wait for a port,
stop a process group, read a process's CPU time."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable


def _die_with_parent() -> Callable[[], None] | None:
    """What the child runs before exec: SIGKILL it if the benchmark dies without cleaning up (kill
    -9). libc is looked up here, in the parent, so the child (forked from a process that may run
    threads) only makes the one system call."""
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def start_group(argv: list[str], **kwargs) -> subprocess.Popen:
    """``argv`` in its own session (so its pid names its process group, and a Ctrl-C at the terminal
    reaches the benchmark only), killed by the kernel if the benchmark dies first."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent(), **kwargs)


def signal_group(p: subprocess.Popen, sig: signal.Signals) -> None:
    """``sig`` to ``p``'s process group (``p`` was started with ``start_group``), if it still runs."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)


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


def terminate(p: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace`` seconds (a clean stop for a gateway)."""
    signal_group(p, signal.SIGTERM)
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        signal_group(p, signal.SIGKILL)
        p.wait(5)


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, all its threads (``/proc/PID/stat``, in
    clock ticks of usually 10 ms)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK
