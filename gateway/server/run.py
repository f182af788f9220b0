"""Run the gateway: listen, serve, and drain on SIGTERM.

Drain, as Kubernetes needs it (the pod is taken out of the Service's endpoints *while* it gets
SIGTERM, and load balancers learn of it a few seconds later):

1. at SIGTERM ``/ready`` answers 503 at once, and requests are still served as usual, but no
   connection is kept alive any more: each closes after its next answer (``EdgeServer.drain``),
   so that pooled clients reconnect, through load balancers that learn of the stop meanwhile;
2. after ``server.drain_delay_s`` (capped at the grace period) the listener closes: new
   connections are refused, a kept-alive connection still idle closes (silently, as at its
   keep-alive timeout), and a request arriving on a connection still open gets 503 with
   ``Connection: close``;
3. requests in flight, streams included, may finish until ``server.shutdown_grace_s`` after the
   SIGTERM; then the remaining ones are cut (each client told: a 503, or a stream's last event),
   and the process exits 0.

A stop that comes while the process starts (builds its app, listens) waits for the loop to handle
it (held back: its default action would end the process, resetting what the kernel had queued);
a gateway of one process whose start-up still runs ``server.shutdown_grace_s`` after it (at once
after a second stop) ends itself (``StartGuard``), as the parent of ``--workers N`` kills such a
worker. One that came before the config was read ended it then (gateway/__main__.py).
SIGINT (Ctrl-C) skips the delay; a second signal during the drain stops at once, cutting the
requests in flight the same way. A worker of ``--workers N`` may get one stop twice: from whoever
signalled the whole process group (Ctrl-C in a terminal, systemd stopping the service's cgroup) and
from its parent, which passes every stop on; that is one signal (``second_signal``). SIGHUP reloads the
config file (gateway/server/reload.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import structlog
from aiohttp import web

from gateway.batch.api import MULTIPART_SLACK
from gateway.config.schema import Config
from gateway.server import hup
from gateway.server.app import DIRECT_KEY, GATEWAY_KEY, LIFECYCLE_KEY, NOT_READY_KEY, RELOAD_KEY, build_app
from gateway.server.edge import Edge, EdgeLimits, EdgeRunner, EdgeServer, inline_request_handlers
from gateway.server.workers import WorkerInfo, hold_for_tests

log = structlog.get_logger("switchyard.server")


class ListenError(Exception):
    """The gateway could not open its listening socket (the port taken, the host unknown)."""


async def start(config: Config, *, reuse_port: bool = False, loader: Callable[[], Config] | None = None,
                worker: WorkerInfo | None = None) -> tuple[web.AppRunner, web.Application, int]:
    """Start serving; returns the runner, the app and the bound port (useful with port 0).
    ``loader`` re-reads the config file at a reload; ``worker``: this process's place among
    ``--workers N``."""
    app = build_app(config, loader=loader, worker=worker)
    hold_for_tests(HOLD_AFTER_BUILD_ENV)
    # the edge (gateway/server/edge.py): slow-client clocks, connection cap, header limits, shaped errors
    limits = EdgeLimits.from_config(config.server)
    if config.batch.enabled:        # an upload to /v1/files may be larger than an inference body
        limits = dataclasses.replace(limits, upload_max_bytes=config.batch.max_file_bytes + MULTIPART_SLACK,
                                     upload_file_bytes=config.batch.max_file_bytes)
    gw = app[GATEWAY_KEY]
    # the connection cap in force: server.max_connections, or the worker's share of its descriptors
    nofile = _nofile()
    configured = limits.max_connections
    cap = connection_limit(configured, nofile, _open_files())
    if cap != configured:
        log.warning("file descriptor limit caps client connections below server.max_connections",
                    nofile=nofile, max_connections=configured, connection_limit=cap)
        limits = dataclasses.replace(limits, max_connections=cap)
    edge = Edge(limits, gw.metrics.registry, gw.metrics.cors_requests, gw.request_log)
    if cap != configured:
        edge.limit_from, edge.nofile = "nofile", nofile
    inline_request_handlers(asyncio.get_running_loop())    # Python 3.11: no task hop per request
    runner = EdgeRunner(app, edge, app[DIRECT_KEY], handler_cancellation=True, access_log=None,
                        shutdown_timeout=1.0)  # the grace period is waited out in drain_and_stop
    await runner.setup()
    # a request the fast lane holds for its body is in flight for the drain, and ended by its cut
    lifecycle = app[LIFECYCLE_KEY]
    edge.lifecycle = lifecycle
    if isinstance(runner.server, EdgeServer):
        lifecycle.on_cut(runner.server.cut_held)
    site = web.TCPSite(runner, config.listen.host, config.listen.port, reuse_port=reuse_port or None,
                       backlog=1024)
    try:
        await site.start()
    except BaseException as e:      # e.g. the port is taken: close what startup opened, then report
        await runner.cleanup()
        if isinstance(e, OSError):
            raise ListenError(f"cannot listen on {config.listen.host}:{config.listen.port}: {e}") from None
        raise
    port = config.listen.port
    server = site._server
    if server is not None and server.sockets:
        port = server.sockets[0].getsockname()[1]
    return runner, app, port


async def drain_and_stop(runner: web.AppRunner, app: web.Application, grace: float, *,
                         delay: float = 0.0) -> None:
    """Drain as described in the module docstring; ``grace`` counts from the call."""
    lifecycle = app[LIFECYCLE_KEY]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    app[NOT_READY_KEY].set()
    # pooled clients learn of the stop with their next answer: every connection closes after it
    server = runner.server
    edge = server if isinstance(server, EdgeServer) else None
    if edge is not None:
        edge.drain()
    delay = max(0.0, min(delay, grace))
    log.info("draining", in_flight=lifecycle.in_flight, delay_s=delay, grace_s=grace)
    if delay:
        await asyncio.sleep(delay)
    for site in list(runner.sites):
        await site.stop()                   # the listening socket closes: new connections refused
    # an idle kept-alive connection no request came on during the delay closes now, when the load
    # balancers have had the delay to send its client elsewhere, not at the SIGTERM, while they
    # still send traffic here and a request sent on it as it closes would be lost
    idle_closed = edge.drain(close_idle=True) if edge is not None else 0
    lifecycle.begin_drain()                        # a request on a connection still open: 503 + Connection: close
    log.info("listener closed", in_flight=lifecycle.in_flight, idle_closed=idle_closed)
    finished = await lifecycle.wait_idle(max(0.0, deadline - loop.time()))
    if not finished:
        log.warning("grace period over; closing remaining requests", in_flight=lifecycle.in_flight,
                    cut=lifecycle.cut())
    await runner.cleanup()      # waits a moment for the cut requests' last words


# The cyclic collector's young generation is collected after this many allocations (Python's
# default is 700). Each request allocates a few hundred tracked objects (coroutines, futures, dicts)
# that plain reference counting frees; at 700 the collector ran every few requests and scanned
# whatever the requests in flight held at that moment, per collection.
GC_GEN0_THRESHOLD = 10_000


def tune_gc() -> None:
    """Once the app is built: what start-up allocated (modules, config, routers) moves out of the
    collector's generations for good, and the young generation is collected less often."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


async def serve(config: Config, *, ready_message: str | None = None, reuse_port: bool = False,
                loader: Callable[[], Config] | None = None, worker: WorkerInfo | None = None,
                source: str | None = None) -> None:
    """``worker``: one of ``--workers N`` processes, whose parent forwards SIGHUP to every worker;
    ``source``: the config file's path, which the warnings of an applied reload name."""
    # a SIGHUP is noted by the loop from now on (gateway/server/hup.py) until the reload's handler
    # is in place: the loop's wakeup pipe gets its byte anyway, which that handler would otherwise
    # take as a second SIGHUP after the one noted by hup's own handler
    with contextlib.suppress(NotImplementedError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hup.note)
    # a stop that comes once the socket listens, before the loop handles it, is held back until it
    # does, then drains: its default action would end the process with connections in its accept
    # queue, which the kernel then resets. Held from before the app is built, not just before the
    # listen: the threads start-up makes (libuv's pool) take this thread's mask, and the kernel
    # hands a process's signal to any thread that does not block it, where the default action
    # ends the whole process (the threads keep it blocked: the loop's thread handles it). A worker
    # of ``--workers N`` has held it back since its fork (gateway/server/workers.py)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # a gateway of one process has no parent to end a start-up that outlasts a stop's grace period
    # (a worker's kills it): a thread does, which exists until the loop handles signals
    guard = StartGuard(config.server.shutdown_grace_s) if worker is None and hasattr(signal, "sigtimedwait") else None
    try:
        runner, app, port = await start(config, reuse_port=reuse_port, loader=loader, worker=worker)
    except BaseException:
        if guard is not None:
            guard.finish()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)      # nothing listens: a stop ends it
        raise
    if guard is not None:
        guard.listening = True
    hold_for_tests(HOLD_AFTER_LISTEN_ENV)
    tune_gc()
    log.info("listening", host=config.listen.host, port=port, models=[m.name for m in config.models],
             kubernetes=config.kubernetes.enabled)
    if ready_message:
        print(ready_message.format(port=port), flush=True)
    stop = asyncio.Event()
    received: list[signal.Signals] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig)
    # a stop the guard took while the gateway started is pending again; the drain's grace period
    # counts from when it came, as for any stop
    stopped_at = guard.finish() if guard is not None else None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)      # one held back is handled now
    reloader = app[RELOAD_KEY]
    reloader.source = source
    if worker is not None:      # POST /admin/reload asks the parent, which signals every worker
        reloader.parent_pid = worker.parent_pid if worker.parent_pid is not None else os.getppid()
        if worker.heartbeats is not None:       # the generation is the parent's count, the same in every worker
            # and each reload the parent tells of names its trigger, and the asks of this worker it
            # came after (gateway/server/heartbeat.py); those told before this worker was forked
            # are in the config it started with
            reloader.parent_told = functools.partial(worker.heartbeats.last_told, worker.index)
            reloader.told_seen = worker.heartbeats.told_count
            reloader.parent_asked = functools.partial(worker.heartbeats.asked_reload, worker.index)
            # and what each reload applies is the text the parent read (gateway/server/handoff.py)
            reloader.handed = worker.handed
            # and counted as the parent counts the gateway's reloads
            reloader.parent_results = worker.heartbeats.results
            reloader.results_base = dict(worker.heartbeats.counted_at_fork)
            # and a POST /admin/reload answers once every worker applied the reload (its first
            # tick, below, tells its siblings that this note is this worker's)
            reloader.mark_applied = functools.partial(worker.heartbeats.applied, worker.index)
            reloader.mark_applied(reloader.told_seen)
            reloader.siblings_applied = functools.partial(worker.heartbeats.applied_by_siblings, worker.index)
            # and one whose answer is due while the parent still reads the file says it is under way
            reloader.parent_reloading = worker.heartbeats.parent_reloading
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGHUP, reloader.on_signal)
    if hup.take():              # one came while the gateway started (gateway/server/hup.py)
        reloader.on_signal(starting=True)
    beat = worker.beat() if worker is not None else None      # the parent restarts a worker whose loop stalls
    if beat is not None:
        beat.start()
    try:
        await stop.wait()
    finally:
        delay = config.server.drain_delay_s if received and received[0] == signal.SIGTERM else 0.0
        grace = config.server.shutdown_grace_s
        if stopped_at is not None:
            grace = max(0.0, grace - (time.monotonic() - stopped_at))
        drain = asyncio.ensure_future(drain_and_stop(runner, app, grace, delay=delay))

        def again(sig: signal.Signals) -> None:
            received.append(sig)
            if second_signal(len(received), worker):
                drain.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):     # a second signal: stop now
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, again, sig)
        try:
            await drain
        except asyncio.CancelledError:
            log.warning("second signal: stopping now", in_flight=app[LIFECYCLE_KEY].in_flight,
                        cut=app[LIFECYCLE_KEY].cut())
            with contextlib.suppress(Exception):
                await runner.cleanup()
        if beat is not None:
            beat.stop()
        reloader.stopping.set()
        ignore_reloads(loop)
        log.info("stopped")


START_GUARD_POLL_S = 0.05      # how long the start-up guard waits for a stop before it looks again
STARTING_EXIT = 128 + signal.SIGKILL      # a start-up ended by its guard: what the gateway of N workers exits with


class StartGuard:
    """A gateway of one process while it starts, stop signals held back (``serve``): a thread takes a
    stop that comes meanwhile (``sigtimedwait``: the signals stay blocked in every thread) and, if
    the start-up still runs ``grace`` seconds later (at once at a second stop), logs and ends the
    process with ``STARTING_EXIT``, as the parent of ``--workers N`` kills a worker still starting.
    ``finish()``, once the loop's handlers are in place, ends it: a stop it took, or takes after
    that, is sent to the process again, and the loop's handler takes it as any stop once the
    signals are let through (in a loop turn of its own: the connections the kernel queued are
    accepted first). Nothing of it is left once the gateway serves."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.listening = False          # for its line: the listening socket was open
        self._taken: list[int] = []
        self._taken_at: float | None = None     # when the first stop was taken (time.monotonic)
        self._done = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="switchyard-start-guard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline: float | None = None
        while True:
            wait = START_GUARD_POLL_S if deadline is None else min(START_GUARD_POLL_S,
                                                                    max(0.0, deadline - time.monotonic()))
            info = signal.sigtimedwait(STOP_SIGNALS, wait)
            if info is not None and info.si_signo not in STOP_SIGNALS:
                # no stop: a wait interrupted (EINTR, as a resume after SIGSTOP makes it) once its
                # timeout ran out, which Python answers with a siginfo the kernel never filled
                info = None
            with self._lock:
                if self._done:
                    if info is not None:        # the loop's handler takes it
                        os.kill(os.getpid(), info.si_signo)
                    return
                if info is not None:
                    self._taken.append(info.si_signo)
                    if self._taken_at is None:
                        self._taken_at = time.monotonic()
                        deadline = self._taken_at + self.grace
                if deadline is not None and (len(self._taken) >= 2 or time.monotonic() >= deadline):
                    self._end()

    def _end(self) -> None:
        log.warning("still starting when the stop's grace period ended; exiting",
                    signal=signal.Signals(self._taken[0]).name, second_signal=len(self._taken) >= 2,
                    shutdown_grace_s=self.grace, listening=self.listening)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(STARTING_EXIT)

    def finish(self) -> float | None:
        """The start-up is over (or failed): the guard ends, and the stop it took (none, or one) is
        pending again; returns when it came (``time.monotonic``), None if none came."""
        with self._lock:
            self._done = True
            for sig in self._taken:
                os.kill(os.getpid(), sig)
            return self._taken_at


# For tests only: a directory where a gateway process that has begun to listen makes a FIFO named
# by its pid and waits until the test opens it, before it handles stop signals, so a test can stop
# it in that moment (tests/integration/server/test_workers.py). Unset in any deployment.
HOLD_AFTER_LISTEN_ENV = "SWITCHYARD_TEST_HOLD_AFTER_LISTEN"
# the same, once the app is built and before the listening socket is opened
HOLD_AFTER_BUILD_ENV = "SWITCHYARD_TEST_HOLD_AFTER_BUILD"


def ignore_reloads(loop: asyncio.AbstractEventLoop) -> None:
    """Stopped: SIGHUP is ignored from now on, set straight from the loop's handler to ignored.
    Removing the loop's handler first (``remove_signal_handler``) put SIGHUP's default action in
    force for a moment, and a reload that came then ended a process that had drained cleanly (a
    worker's death by a signal makes the gateway exit 129, not 0). Holding the signal back in this
    thread meanwhile did not help: the kernel then hands it to another thread of the process
    (libuv's pool, the log writer), where the default action ends the whole process. The loop keeps
    its entry for SIGHUP: uvloop, which a gateway process runs, leaves the disposition alone when it
    closes after it stopped running (it resets a signal only while it listens for signals); the
    asyncio loop would reset it to the default action as it closes."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def second_signal(received: int, worker: WorkerInfo | None) -> bool:
    """Whether the ``received``-th stop signal (the 2nd or later) stops the gateway at once. A
    worker whose parent's signal reached its whole process group gets that signal twice, directly
    and passed on by the parent: it stops at once when the parent got a second one, or when it got
    two more than the parent passed on (it was signalled itself, twice)."""
    parent = worker.parent_stops() if worker is not None else None
    if parent is None:
        return True
    return parent >= 2 or received - parent >= 2


# descriptors a worker keeps beyond its client and engine connections: its listening and sibling
# sockets, the monitor's probes and scrapes, Redis clients, a question to a sibling, log files
FD_RESERVE = 64


def connection_limit(max_connections: int, nofile: int | None, open_now: int) -> int:
    """The client connections a worker takes: ``server.max_connections`` (0: no cap), or less when
    the file-descriptor limit ``nofile`` (None: none) would run out first. Of the descriptors free
    (``nofile`` less the ``open_now`` held at start and ``FD_RESERVE``), half go to client
    connections and half stay for their engine connections, one each, so a worker whose clients
    hold every connection it takes still opens the engine connection of each request they send.
    Never under 1."""
    if nofile is None:
        return max_connections
    share = max(1, (nofile - open_now - FD_RESERVE) // 2)
    return share if not max_connections or share < max_connections else max_connections


# the most a start raises the soft RLIMIT_NOFILE to: a hard limit of "infinity" (the kernel's
# fs.nr_open, 1073741816 where a runtime sets it so) is no limit to take whole, since a program
# that loops over every descriptor it may hold (some close them all before they exec) would take
# a billion steps
NOFILE_MAX = 1 << 20
NR_OPEN = "/proc/sys/fs/nr_open"


@dataclasses.dataclass(frozen=True, slots=True)
class NofileRaise:
    """What ``raise_nofile_limit`` did: the soft limit before and after, the hard one, and why it
    could not (``error``: the soft limit stayed ``before``)."""

    before: int
    after: int
    hard: int
    error: str | None = None


def raise_nofile_limit(nr_open_path: str = NR_OPEN) -> NofileRaise | None:
    """Raise the soft RLIMIT_NOFILE to the hard one, at most ``NOFILE_MAX`` and the kernel's
    ``fs.nr_open``; never lower it. Done once at start, before the fork, so every worker inherits
    it and computes its connection cap (``connection_limit``) from it. None when nothing was to be
    done (no such limit here, the soft one already there or unlimited)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    target = NOFILE_MAX if hard == resource.RLIM_INFINITY else min(hard, NOFILE_MAX)
    try:
        with open(nr_open_path) as f:
            target = min(target, int(f.read()))
    except (OSError, ValueError):
        pass
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as e:
        return NofileRaise(soft, soft, hard, str(e))
    return NofileRaise(soft, target, hard)


def _nofile() -> int | None:
    """The soft RLIMIT_NOFILE, None when there is none (or it cannot be read)."""
    try:
        import resource
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def _open_files() -> int:
    """The descriptors this process holds now (Linux's /proc/self/fd, else /dev/fd; 0 if neither)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d))
        except OSError:
            continue
    return 0


_given_ports: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now, and that this process was not given before: the port is
    let go at once, so two calls made before either port is bound could otherwise return the same."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _given_ports:
            _given_ports.add(port)
            return port
    return port
