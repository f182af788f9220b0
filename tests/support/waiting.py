"""Waiting for a condition on a real socket's far side: bounds for slow machines, never latency assertions."""

from __future__ import annotations

import asyncio
import errno
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


async def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02) -> Any:
    """Poll a sync or async predicate until it is truthy; returns its last value (falsy if time ran out)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = predicate()
        if inspect.isawaitable(v):
            v = await v
        if v or loop.time() > deadline:
            return v
        await asyncio.sleep(interval)


async def until(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> Any:
    """Like :func:`wait_for`, but the test fails when the predicate is still false after ``timeout``."""
    v = await wait_for(predicate, timeout, interval)
    assert v, f"condition not reached within {timeout}s"
    return v


def process_stopped(pid: int) -> bool:
    """The process is in a stop (``T`` in /proc/PID/stat: a SIGSTOP taken, not only sent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] in "Tt"


async def sigstop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until it has stopped. ``kill`` only queues the signal: a process
    that has not run since takes it later, and takes a lower-numbered signal sent meanwhile first
    (a SIGHUP, 1, before the SIGSTOP, 19), which a test that sends the stop to hold that signal
    pending would then miss."""
    import os
    import signal

    os.kill(pid, signal.SIGSTOP)
    await until(lambda: process_stopped(pid), timeout=timeout, interval=0.001)


async def release_held(fifo: Path, timeout: float = 10.0) -> None:
    """Open a FIFO a held process made (the gateway's test-only holds) for writing, which lets it go
    on. The FIFO is there as soon as it is made, a moment before its process opens it for reading;
    until then a writer's open fails with ENXIO, so it is tried again, within ``timeout``."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
            await asyncio.sleep(0.01)
