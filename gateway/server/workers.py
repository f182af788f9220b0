"""``--workers N``: N gateway processes sharing one port through SO_REUSEPORT.

The kernel spreads new connections over the workers' listening sockets, so a machine with more
cores serves more requests. Each worker is a whole gateway with its own state: round-robin
positions, health and metrics monitors, and (without Redis) rate-limit counters. Their routing
view (the prefix index, in-flight counts, sessions) is shared over a local bus in a private
directory the caller creates before the fork (gateway/view). Use ``state.redis_url`` to share
limits and in-flight counts between workers as between replicas.

The parent forks the workers before any event loop exists, forwards SIGTERM/SIGINT to them (each
drains as a single gateway does), restarts a worker that dies unexpectedly (with a short back-off),
and exits when all have exited after a signal. SIGHUP is forwarded too: every worker reloads the
config file (gateway/server/reload.py), and the parent re-reads it for the workers it starts later. A
worker asks for a reload of all (``POST /admin/reload``) by sending SIGHUP to the parent.

What the workers tell each other goes through a private directory the parent creates before the
fork (``gateway.server.rundir.RunDirectory``: mode 0700, removed when the parent exits): worker *i* listens there on a
Unix socket of its own, through which a sibling answering ``/metrics`` or ``/status.json`` reads
its figures (gateway/server/siblings.py). A restarted worker keeps its index, and so its path.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RESTART_BACKOFF_S = 1.0
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_limit(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use: the cgroup's CPU quota rounded up (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, what a Kubernetes CPU limit sets), capped by the
    CPUs it is allowed to run on (``sched_getaffinity``: cpusets, ``taskset``). At least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(root)
    if quota is not None:
        cpus = min(cpus, max(1, -(-quota[0] // quota[1])))
    return max(1, cpus)


def _cgroup_quota(root: Path) -> tuple[int, int] | None:
    """(quota, period) in µs, or None when unlimited or unreadable."""
    try:
        fields = (root / "cpu.max").read_text().split()       # v2: "max 100000" or "200000 100000"
        if len(fields) == 2 and fields[0] != "max":
            return int(fields[0]), int(fields[1])
        return None
    except (OSError, ValueError):
        pass
    try:                                                      # v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return (quota, period) if quota > 0 and period > 0 else None


def resolve_workers(value: int | str) -> int:
    """``server.workers`` / ``--workers``: a count, or ``auto`` (= ``cpu_limit()``)."""
    return cpu_limit() if value == "auto" else int(value)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One of ``--workers N`` processes: its index (kept by a restarted worker), the count, and the
    parent's private directory where each worker listens for its siblings."""

    index: int
    count: int
    run_dir: str

    def socket_path(self, index: int) -> str:
        return os.path.join(self.run_dir, f"worker-{index}.sock")


def run_workers(n: int, serve_one: Callable[[int], int], log: Callable[[str], None],
                on_reload: Callable[[], None] | None = None) -> int:
    """Fork ``n`` processes that each call ``serve_one(index)`` (which must bind with SO_REUSEPORT;
    a restarted worker gets its predecessor's index); ``on_reload`` runs in the parent at SIGHUP,
    before the workers are told."""
    children: dict[int, int] = {}      # pid → worker index
    stopping = False

    def spawn(index: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)    # until the worker's loop handles it
            code = 1
            try:
                code = serve_one(index)
            finally:
                os._exit(code)
        children[pid] = index

    def forward(sig: int, _frame) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def reload(sig: int, _frame) -> None:
        if on_reload is not None:
            on_reload()
        for pid in list(children):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, reload)
    for i in range(n):
        spawn(i)
    log(f"started {n} workers: {sorted(children)}")
    worst = 0
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        index = children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        worst = max(worst, code if code > 0 else 0)
        if index is not None and not stopping:
            log(f"worker {index} (pid {pid}) exited with {code}; restarting")
            time.sleep(RESTART_BACKOFF_S)
            if not stopping:
                spawn(index)
    return worst


def stderr_log(msg: str) -> None:
    print(f"switchyard: {msg}", file=sys.stderr, flush=True)
