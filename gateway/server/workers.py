"""``--workers N``: N gateway processes sharing one port through SO_REUSEPORT.

The kernel spreads new connections over the workers' listening sockets, so a machine with more
cores serves more requests. Each worker is a whole gateway with its own state: round-robin
positions, health and metrics monitors, and (without Redis) rate-limit counters. Their routing
view (the prefix index, in-flight counts, sessions) is shared over a local bus in a private
directory the caller creates before the fork (gateway/view). Use ``state.redis_url`` to share
limits and in-flight counts between workers as between replicas.

The parent forks the workers before any event loop exists, forwards SIGTERM/SIGINT to them (each
drains as a single gateway does), restarts a worker that dies unexpectedly (with a short back-off),
kills and restarts one whose event loop stopped ticking its heartbeat for
``server.worker_stall_timeout_s`` (gateway/server/heartbeat.py), stops with a worker's exit code
when that worker fails before the gateway ever served (as one process would), kills a worker still
starting when the stop's grace period is over, and exits when all have exited after a signal (with 128 + a signal that killed a worker during the stop; a worker that
died before the stop and was started again does not count: a stop that drains every worker exits 0). SIGHUP is forwarded too: the parent reads the
config file (in a thread, so that it goes on forwarding stops and watching the workers while a large
file parses), hands every worker what it read (gateway/server/handoff.py), and each worker applies
that (gateway/server/reload.py); the workers it starts later start on it. A
worker asks for a reload of all (``POST /admin/reload``) by sending SIGHUP to the parent, having
counted the request where the parent reads it, so every worker's reload says it came from ``admin``
(gateway/server/heartbeat.py).

What the workers tell each other goes through a private directory the parent creates before the
fork (``gateway.server.rundir.RunDirectory``: mode 0700, removed when the parent exits, or by the last worker to
stop after the parent was killed outright, or by the next start when every process was): worker *i* listens there on a
Unix socket of its own, through which a sibling answering ``/metrics`` or ``/status.json`` reads
its figures (gateway/server/siblings.py). A restarted worker keeps its index, and so its path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from gateway.server import hup
from gateway.server.heartbeat import Beat, Heartbeats, Watchdog

RESTART_BACKOFF_S = 1.0
HELD_AT_FORK = {signal.SIGHUP, signal.SIGTERM, signal.SIGINT}   # the signals the parent handles
STOPS = {signal.SIGTERM, signal.SIGINT}     # held back in a worker from its fork until it handles them
RESTART_BACKOFF_MAX_S = 30.0    # a worker whose start-ups keep failing: 1, 2, 4, ... s, at most this
# a worker that ends sooner than this after its fork counts as a start that failed, whether or not it
# got past its start-up: one that serves a moment and dies, start after start (a request that crashes
# it, sent again; the OOM killer at each catch-up), backs off as one whose start-up fails, rather than
# being started again every second for good, each start costing its siblings a copy of their view
RESTART_STABLE_S = 10.0
# how long the parent, its workers stopped, waits for a reload's read the stop ended, so that its
# refusal is logged (a read waiting for a FIFO's text ends within 0.1 s of a stop)
STOPPED_READ_WAIT_S = 2.0
WATCH_POLL_S = 0.25         # how often the parent looks for ended or stalled workers and due restarts
# a worker's end wakes the parent at once (its SIGCHLD, held back and waited for, ends the poll's
# pause) rather than at the next poll: a stop ends as soon as its last worker has, and a crashed
# worker's restart is counted from its end. Where the platform has no sigtimedwait (macOS), the
# pause is a plain sleep.
_WAKE = {signal.SIGCHLD}
_SIGTIMEDWAIT = getattr(signal, "sigtimedwait", None)


@contextlib.contextmanager
def _held(signals: set[signal.Signals]):
    """``signals`` held back (blocked) in this thread meanwhile: a Python handler of one runs after."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _pause(seconds: float) -> None:
    """Until a child ends (its SIGCHLD, held back by the caller), or ``seconds`` at most."""
    if _SIGTIMEDWAIT is None:
        time.sleep(seconds)
    else:
        _SIGTIMEDWAIT(_WAKE, seconds)
WORKER_MEMORY_BYTES = 256 * 1024 * 1024    # auto: the cgroup's memory limit leaves each worker this much
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


def memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """The cgroup's memory limit in bytes (v2 ``memory.max``, v1 ``memory.limit_in_bytes``: what a
    Kubernetes memory limit sets), or None when there is none or it cannot be read."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            n = int(text)
        except ValueError:
            return None
        return n if 0 < n < 1 << 60 else None        # v1 writes a huge number for "no limit"
    return None


def auto_count(root: Path = CGROUP_ROOT) -> int:
    """``auto``: a worker per CPU (``cpu_limit``), and no more than the cgroup's memory limit gives
    ``WORKER_MEMORY_BYTES`` each (a pod with a memory limit and no CPU limit on a large node would
    otherwise start a worker per node CPU)."""
    n = cpu_limit(root)
    mem = memory_limit(root)
    if mem is not None:
        n = min(n, max(1, mem // WORKER_MEMORY_BYTES))
    return n


def resolve_workers(value: int | str) -> int:
    """``server.workers`` / ``--workers``: a count, or ``auto`` (``auto_count()``)."""
    return auto_count() if value == "auto" else int(value)


def per_process_state(config: Any) -> str | None:
    """What of ``config`` each worker would keep for itself, without ``state.redis_url`` to hold it
    for all: rate limits (each worker would count apart, so a user would get N times the limit)
    and the admin API's users and keys (one created through one worker is unknown to the others).
    ``None`` when nothing: then ``auto`` may start a worker per CPU."""
    if config.state.redis_url:
        return None
    lim = config.limits
    why = []
    if (any(u.any for u in lim.users.values()) or (lim.default_user is not None and lim.default_user.any)
            or any(m.rps for m in lim.models.values())):
        why.append("rate limits")
    if config.auth.admin_token:
        why.append("the admin API's users and keys")
    return " and ".join(why) or None


def auto_workers(value: int | str, config: Any) -> tuple[int, str | None]:
    """The worker count to run, and why ``auto`` ran one worker on a machine with more CPUs: state
    that would be per process (``per_process_state``), or admission control, whose priority is
    strict within a process only (each worker queues its own clients' requests and takes a share of
    the engines' room: a critical request waiting in one worker does not hold back a sheddable one
    another worker has room for; at three times capacity two workers shed critical requests one
    worker serves), or LoRA adapters the gateway loads and unloads on demand while the workers do
    not tell each other of them (``view.workers`` or ``view.share_monitoring`` off: each would
    unload an adapter another has requests in flight for). With them on, the workers tell each
    other of their loads, unloads, uses and adapters in flight (gateway/lora/adapters.py), and
    ``auto`` runs a worker per CPU for a model with adapters too."""
    n = resolve_workers(value)
    if value == "auto" and n > 1:
        why = per_process_state(config)
        if why is not None:
            return 1, f"{why} are kept per process without state.redis_url"
        if config.admission.enabled or any(config.admission_for(m.name).enabled for m in config.models):
            return 1, "admission's priority classes are strict within one process only"
        if adapters_apart(config):
            return 1, ("LoRA adapters are loaded and unloaded on what one process knows without "
                       "view.workers and view.share_monitoring (another worker could unload an adapter this one serves)")
    return n, None


def adapters_apart(config: Any) -> bool:
    """Whether a model lists LoRA adapters to load on demand while the workers would not tell each
    other of them (``view.workers`` or ``view.share_monitoring`` off)."""
    return any(m.adapters for m in config.models) and not (config.view.workers and config.view.share_monitoring)


def _die_with_parent(parent: int) -> bool:
    """Ask for SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing); False
    when the parent is already gone."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)       # PR_SET_PDEATHSIG = 1
    return os.getppid() == parent


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One of ``--workers N`` processes: its index (kept by a restarted worker), the count, and the
    parent's private directory where each worker listens for its siblings."""

    index: int
    count: int
    run_dir: str
    heartbeats: Heartbeats | None = None     # ticked by this worker's loop, watched by the parent
    # the config generation it starts with: a worker restarted after reloads runs the reloaded
    # config, and says so (``switchyard_config_generation``) as its siblings do
    generation: int = 1
    # when the gateway (the parent) started, unix seconds: what a worker, restarted or not, says
    # it started at (the status page's ``started_at``)
    started_at: float | None = None
    # the config text the parent read for its reload number n, as this worker applies it (a loader,
    # None when the parent has none: gateway/server/handoff.py); None: the worker reads the file
    handed: Callable[[int], Callable[[], Any] | None] | None = None
    # the parent's pid, as the parent knew it before the fork: a worker that asks it for a reload
    # signals that pid, not its own parent's at that moment (init, once the parent was killed)
    parent_pid: int | None = None

    def beat(self) -> Beat | None:
        """This worker's heartbeat (gateway/server/heartbeat.py), not yet started; None without one."""
        return None if self.heartbeats is None else Beat(self.heartbeats, self.index)

    def parent_stops(self) -> int | None:
        """How many stop signals the parent got so far (None: not known here)."""
        return None if self.heartbeats is None else self.heartbeats.stops()

    def socket_path(self, index: int) -> str:
        return os.path.join(self.run_dir, f"worker-{index}.sock")


def run_workers(n: int, serve_one: Callable[[int], int], log: Callable[..., None],
                on_reload: Callable[[str, Callable[[Callable[[], None]], None]], Callable[[], None] | None] | None = None,
                heartbeats: Heartbeats | None = None,
                stall_timeout: Callable[[], float] = lambda: 0.0,
                orphaned: Callable[[], None] | None = None,
                stop_grace: Callable[[], float] | None = None) -> int:
    """Fork ``n`` processes that each call ``serve_one(index)`` (which must bind with SO_REUSEPORT;
    a restarted worker gets its predecessor's index); ``on_reload(trigger, later)`` runs in a thread
    of the parent's at SIGHUP (``trigger``: ``admin`` or ``signal``), one at a time, while the
    parent goes on forwarding stops and watching the workers; ``later(step)`` has ``step`` run in
    the parent's loop (the main thread) soon, and what ``on_reload`` returns (a callable, or None)
    runs there once it returned, before the workers are told. A SIGHUP while it runs has it run
    again after. With
    ``heartbeats`` (which the workers tick), a worker that stops ticking for ``stall_timeout()``
    seconds (0: never) is killed and restarted, and a worker that
    fails before any worker ever ticked stops the gateway with its exit code
    (gateway/server/heartbeat.py). A worker whose start-ups keep failing, or that keeps ending
    within ``RESTART_STABLE_S`` of its fork, is started again after 1, 2, 4, ... s (at most
    ``RESTART_BACKOFF_MAX_S``); one that served longer, after 1 s.
    ``orphaned()`` runs in a worker that stops after the parent died (killed outright: the kernel's
    SIGTERM stopped the worker), in the parent's stead for what it would have cleaned up. The
    caller may hold SIGTERM and SIGINT back until this installs its handlers, which then take
    a stop that came meanwhile. ``serve_one`` starts with SIGTERM and SIGINT held back (blocked),
    a stop that came since the fork pending, and lets them through once it handles them (the
    gateway's ``serve`` does once its event loop's handlers are in place). With ``heartbeats``
    and ``stop_grace``, a worker still in its start-up (never ticked) ``stop_grace()`` seconds
    after the stop (at once after a second stop) is killed: its start-up would otherwise hold the
    stop for as long as it lasts."""
    children: dict[int, int] = {}      # pid → worker index
    forked: dict[int, float] = {}      # worker index → when its latest worker was forked (time.monotonic)
    stopping = False
    stopped_at = 0.0                   # when the first stop came (time.monotonic)
    watchdog = Watchdog(heartbeats, stall_timeout, log) if heartbeats is not None else None

    parent = os.getpid()

    def spawn(index: int) -> None:
        forked[index] = time.monotonic()
        if watchdog is not None:
            watchdog.spawning(index)
        # the signals the parent handles held back across the fork: the child must not run the
        # parent's handlers (they would forward the signal to its siblings) before it has its own,
        # and the parent's must not run before the child is among those they forward to
        signal.pthread_sigmask(signal.SIG_BLOCK, HELD_AT_FORK)
        if stopping:        # a stop came (its handler has run by now): a worker started now would miss it
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_AT_FORK)
            return
        pid = -1
        try:
            pid = os.fork()
            if pid > 0:
                children[pid] = index
        finally:
            if pid != 0:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_AT_FORK)
        if pid == 0:  # the worker
            if _SIGTIMEDWAIT is not None:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAKE)    # held back for the parent's pause only
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            hup.hold()          # noted until the worker's loop handles it, then a reload (gateway/server/hup.py)
            # a stop stays held back until the worker's loop handles it (serve_one lets it through
            # then): one that came now, from the parent or to the whole process group, would
            # otherwise end the worker by its default action before it ever served
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_AT_FORK - STOPS)
            # a parent killed outright (SIGKILL, OOM) cannot forward a signal: the kernel sends the
            # worker SIGTERM then, and it drains as at a stop, instead of serving on unsupervised
            if not _die_with_parent(parent):
                os._exit(0)
            hold_for_tests(HOLD_AFTER_FORK_ENV)
            code = 1
            try:
                code = serve_one(index)
            except SystemExit:
                pass
            except BaseException:       # as the interpreter would print it before exiting (os._exit does not)
                with contextlib.suppress(Exception):
                    traceback.print_exc()
                    sys.stderr.flush()
            finally:
                if orphaned is not None and os.getppid() != parent:
                    with contextlib.suppress(Exception):
                        orphaned()
                os._exit(code)
        if watchdog is not None:
            watchdog.spawned(pid, index)

    def forward(sig: int, _frame) -> None:
        nonlocal stopping, stopped_at
        if not stopping:
            stopped_at = time.monotonic()
        stopping = True
        if heartbeats is not None:      # counted before it reaches them: a worker tells a second stop from a copy
            heartbeats.stopping()
        for pid in list(children):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # the reload under way: its file read and parsed in a thread of its own (``on_reload``), so
    # that this loop goes on forwarding stops and watching the workers meanwhile (a file of a few
    # MiB takes seconds to parse; a FIFO no one writes, server.reload_read_timeout_s); what it returns is applied
    # and told to the workers here, in the loop, one reload at a time
    reloading: threading.Thread | None = None
    again = False                       # a SIGHUP came while it ran: the file is read again after it
    outcome: list[Any] = []             # what the thread returned (a callable), or the error it raised
    queued: list[Callable[[], None]] = []   # what the thread asked to run in the loop (``later``)

    def wake() -> None:
        """The loop's pause ends (its SIGCHLD, which it waits for; a spurious one is harmless)."""
        with contextlib.suppress(OSError):
            os.kill(parent, signal.SIGCHLD)

    def later(step: Callable[[], None]) -> None:
        """``step`` runs in the loop (the main thread) soon: the reload's thread logs through it.
        A fork while a thread writes a log line would leave the line's lock held in the worker."""
        queued.append(step)
        wake()

    def begin_reload() -> None:
        nonlocal reloading, again
        with _held({signal.SIGHUP}):    # a SIGHUP meanwhile waits: it would begin a second read
            again = False
            # admin or signal: the parent's line names it, and it goes with this reload to the
            # workers, whose lines name it too
            trigger = heartbeats.note_trigger() if heartbeats is not None else "signal"
            if heartbeats is not None:
                heartbeats.reloading(True)
            outcome.clear()

            def read() -> None:
                # the signals stay the main thread's: a stop or a SIGHUP wakes the loop at once
                signal.pthread_sigmask(signal.SIG_BLOCK, HELD_AT_FORK | _WAKE)
                try:
                    outcome.append(on_reload(trigger, later) if on_reload is not None else None)
                except BaseException as e:      # said in the loop
                    outcome.append(e)
                finally:
                    wake()

            reloading = threading.Thread(target=read, name=f"reload-{trigger}", daemon=True)
            reloading.trigger = trigger     # type: ignore[attr-defined]
            reloading.start()

    def run_queued() -> None:
        while queued:
            queued.pop(0)()

    def finish_reload() -> None:
        """The reload's thread has ended: its result applied, then the workers told and signalled."""
        nonlocal reloading
        run_queued()
        if reloading is None or reloading.is_alive():
            return
        with _held({signal.SIGHUP}):    # one that comes now is read after this one is told
            trigger = reloading.trigger     # type: ignore[attr-defined]
            done = outcome[0] if outcome else None
            if isinstance(done, BaseException):
                log("config reload failed", "error", trigger=trigger, error=f"{type(done).__name__}: {done}")
            elif done is not None:
                done()
            if heartbeats is not None:
                heartbeats.told(trigger)
                heartbeats.reloading(False)
            for pid in list(children):
                try:
                    os.kill(pid, signal.SIGHUP)
                except ProcessLookupError:
                    pass
            reloading = None
            if again:                   # the file may have changed since the read began: read it again
                begin_reload()

    def reload(sig: int, _frame) -> None:
        # one at a time: two reads at once could apply the older file after the newer one; a
        # SIGHUP meanwhile is applied once this one has been
        nonlocal again
        if reloading is not None:
            again = True
            return
        begin_reload()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, reload)
    # a stop the caller held back while it prepared (the run directory) is handled now: before
    # any worker is started, it ends the gateway at once
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_AT_FORK)
    if hup.take():              # one came while the gateway started: the workers start on the new file
        begin_reload()
        while reloading is not None:
            reloading.join()
            finish_reload()
    if _SIGTIMEDWAIT is not None:
        # from before the first fork: a worker that ends between a poll and the pause after it
        # leaves its SIGCHLD pending, and the pause returns at once
        signal.pthread_sigmask(signal.SIG_BLOCK, _WAKE)
    for i in range(n):
        spawn(i)
    log("workers started", "info", count=n, pids=sorted(children))
    worst = 0
    pending: dict[int, float] = {}      # worker index → when to start it again (time.monotonic)
    failed: dict[int, int] = {}         # worker index → start-ups in a row that ended before its first tick
    while children or (pending and not stopping):
        finish_reload()
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:       # none left, a restart still pending
            pid, status = 0, 0
        except InterruptedError:
            continue
        if pid == 0:                    # the poll: no child ended
            if watchdog is not None:
                watchdog.check()
                if stopping and stop_grace is not None:
                    assert heartbeats is not None
                    watchdog.end_starting(stopped_at, 0.0 if heartbeats.stops() >= 2 else stop_grace())
            now = time.monotonic()
            for index, due in list(pending.items()):
                if stopping:
                    pending.clear()
                elif now >= due:
                    del pending[index]
                    spawn(index)
            if children or pending:
                _pause(WATCH_POLL_S)
            continue
        index = children.pop(pid, None)
        reason, ticked = watchdog.gone(pid) if watchdog is not None else ("exited", True)
        code = os.waitstatus_to_exitcode(status)
        if stopping:
            log("worker stopped", "info" if code == 0 else "warning", worker=index, pid=pid, code=code)
            if code < 0 and -code not in (signal.SIGTERM, signal.SIGINT):
                # killed during the stop (the OOM killer, the stall watchdog): what it had in flight
                # was lost, and the gateway's exit code says so as a shell's would (the stop signal
                # itself, met before the worker's handler was in place, is a stop like any other)
                code = 128 - code
            worst = max(worst, code if code > 0 else 0)
            continue
        # a worker that ends before any stop is started again below: its code is the restart's
        # business, not the exit code's, which says how the stop went (a clean drain after a
        # crash that was recovered from long before exits 0)
        if index is None:
            continue
        if watchdog is not None and not ticked and code > 0 and not watchdog.served:
            # the gateway's own start-up failed (the port taken, a config the app refuses): stop
            # with that code, as one process would, rather than look alive and start it forever
            log("worker failed before the gateway started serving; stopping", "error", worker=index, pid=pid,
                code=code)
            worst = max(worst, code)
            forward(signal.SIGTERM, None)
            continue
        if heartbeats is not None:
            heartbeats.restarted(reason)
        # one that served a while starts the count again; one that ended soon after its fork, served
        # or not, adds to it
        lived = time.monotonic() - forked.get(index, 0.0)
        failed[index] = 0 if ticked and lived >= RESTART_STABLE_S else failed.get(index, 0) + 1
        backoff = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** max(0, failed[index] - 1))
        log("worker restarting", "warning", worker=index, pid=pid, reason=reason, code=code, restart_in_s=backoff)
        pending[index] = time.monotonic() + backoff
    # every worker has stopped: a reload now has nothing to reach, and the interpreter's exit puts
    # SIGHUP's default action back in place of the handler (it would end the gateway with 129)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if reloading is not None:   # a read the stop ended (a FIFO's text waited for) says so; a parse is not waited for
        reloading.join(STOPPED_READ_WAIT_S)
        again = False
        finish_reload()
    if _SIGTIMEDWAIT is not None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAKE)
    return worst


# For tests only: a directory where a worker just forked makes a FIFO named by its pid and waits
# until the test opens it, before it starts the gateway (the test stops it in that moment, or keeps
# its start-up waiting for good: tests/integration/server/test_workers.py). Unset in any deployment;
# read once per fork.
HOLD_AFTER_FORK_ENV = "SWITCHYARD_TEST_HOLD_AFTER_FORK"


def hold_for_tests(env: str) -> None:
    """A test-only pause (``HOLD_AFTER_FORK_ENV`` here, ``HOLD_AFTER_LISTEN_ENV`` in run.py): when
    ``env`` names a directory, make a FIFO there named by this pid and wait until the test opens it."""
    directory = os.environ.get(env)
    if not directory:
        return
    path = os.path.join(directory, str(os.getpid()))
    os.mkfifo(path)
    with open(path, "rb"):      # returns once the test opens it for writing
        pass


def parent_log(event: str, level: str = "info", **fields: Any) -> None:
    """The parent's lines, in the config's log format (structlog, configured before the fork)."""
    getattr(structlog.get_logger("switchyard.workers"), level)(event, **fields)
