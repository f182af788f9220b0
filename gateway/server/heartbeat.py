"""Workers' heartbeats: the parent of ``--workers N`` restarts a worker whose event loop stopped.

With SO_REUSEPORT the kernel hands every worker its share of new connections whatever the worker is
doing. A worker whose event loop is stuck (a call that blocks, a lock that never comes free, a
process stopped by a signal) keeps taking connections it never answers, and a liveness probe that
happens to reach a healthy sibling keeps passing, so nothing would ever restart it.

So each worker's event loop ticks a counter every ``BEAT_S`` in memory it shares with its parent (an
anonymous shared mapping the parent makes before it forks: one 8-byte slot per worker, then the
restart counts, then the stop signals the parent got, then the config generation the parent
counts, then the parent's last reload as it told the workers of it, then each worker's count of
the reloads it asked for, then for each worker how many of its asks the parent's last told reload
came after, then the parent's reloads by result, then for each worker the last told reload it
applied or refused, then whether the parent is reading a reload's file). The parent reads the counters while it waits for its children; a worker
that has ticked at least once (start-up is not judged) and has not ticked for
``server.worker_stall_timeout_s`` is logged and killed with SIGKILL (a stuck loop would never run a
SIGTERM handler). The kernel resets the connections waiting in its accept queue, and the parent
starts it again as it restarts a worker that exits. The restarts are counted by reason
(``exited``, ``stalled``) in the same mapping, which every worker reads for ``/metrics``
(``switchyard_worker_restarts_total``) and the status page.

The first tick also tells the parent that a worker got past its start-up (it ticks once it
listens). A worker that fails before any worker of the gateway ever ticked (the port taken, a config
the app refuses) stops the gateway with its exit code, as one process would, instead of being
started again every second by a parent that looks alive; a worker that fails its start-up later is
started again with a growing back-off. At a stop, a worker that has not ticked yet (its start-up
holds the stop back until its loop handles it) is killed once the stop's grace period is over: a
start-up that hangs would otherwise hold the gateway's stop for as long as it lasts.

The config generation is the parent's count of the reloads it applied (1 at start): SIGHUPs sent
close together reach the parent and each worker a different number of times (a signal that comes
while one of the same is pending is one), so a worker that counted the reloads it ran itself fell
behind its siblings for good; each takes the parent's number instead (gateway/server/reload.py).
A worker asked ``POST /admin/reload`` counts it in its slot before it sends the parent SIGHUP; at a
SIGHUP the parent notes ``admin`` as the trigger when a count moved since the last one, else
``signal``. Once it has applied that reload, and before it signals the workers, it tells them of it
in one slot written at once: its number, its trigger and the generation it led to (``Told``). A
worker that handles a SIGHUP reads that slot: a reload it has not applied yet is the parent's, whose
trigger and generation its log line names, as one process would (and a worker asked POST
/admin/reload answers with it); none is a SIGHUP sent to the worker itself, which reloads
nothing (the parent reads the file for every worker: gateway/server/handoff.py). The
trigger is told with its reload and its generation, once both are known: a worker that handles a
SIGHUP late reads a reload's trigger with that reload's generation, never the next one's trigger
(noted while the parent applies it) with the previous one's generation.

A worker asked POST /admin/reload answers with a reload the parent began after the ask, one that
read the file as it was then: the parent notes each worker's count of asks when it begins a reload,
and tells it with that reload (a slot per worker: the reload's number and the count). The parent's
SIGHUP for a reload it began earlier can reach a worker after that worker's ask (the parent signals
the workers one after another, and a worker may run late): that reload is applied, but it does not
answer the ask, whose own reload follows and moves the generation once more; the answer was the
generation a moment later.

Each worker notes the last told reload it applied (or refused) in a slot of its own, from its start
(the reloads told before it was forked are in the config it loaded): a worker asked POST
/admin/reload answers once every sibling that serves (has ticked) noted that reload, so that an API
key the reload removed is refused by every worker once the answer came.

Only the worker writes its slots and only the parent the counts. The parent decides on whether a
slot changed, never on its value, so a read that catches a write half done can only look like a
tick (which delays a kill by one poll), never like a stall.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

BEAT_S = 0.5                    # how often a worker's loop ticks (server.worker_stall_timeout_s is 0 or >= 2)
REASONS = ("exited", "stalled")
TRIGGERS = ("signal", "admin")  # what a reload the parent applied came from
# the parent's reloads, counted by result, and those that waited for the file to be whole
RESULTS = ("ok", "invalid", "restart_required", "deferred")
_MASK = (1 << 64) - 1
_TOLD_MASK = (1 << 24) - 1      # the parent's count of told reloads, as the told slot holds it (wraps)
_ASKS_MASK = (1 << 40) - 1      # a worker's count of asks, as the slot of the asks a reload came after holds it


@dataclass(frozen=True, slots=True)
class Told:
    """A reload the parent applied (or refused) and told the workers of: its number among those it
    told (``seq``), what it came from (``trigger``) and the config generation it led to."""

    seq: int
    trigger: str
    generation: int
    # the asking worker's count of POST /admin/reload the parent had seen when it began this reload
    # (None: not known, as for no reload yet, or a reload told since this was read)
    asks: int | None = None

    def after(self, ask: int) -> bool:
        """Whether the parent began this reload after the worker's ask number ``ask`` (the count
        ``Heartbeats.asked_reload`` gave), so that it read the file as the ask found it."""
        return self.asks is not None and (self.asks - ask) & _ASKS_MASK < 1 << 39


class Heartbeats:
    """The shared counters: a tick count per worker, then the parent's restarts by reason."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        # anonymous and shared across fork
        self._map = mmap.mmap(-1, 8 * (4 * workers + len(REASONS) + 4 + len(RESULTS)))
        self._slots = memoryview(self._map).cast("Q")
        self._slots[self.workers + len(REASONS) + 1] = 1
        self._asks = self.workers + len(REASONS) + 3    # then a count per worker of its POST /admin/reload
        self._after = self._asks + self.workers         # then per worker: the told reload, the asks it came after
        self._results = self._after + self.workers      # then the parent's reloads by result
        self._applied = self._results + len(RESULTS)    # then per worker: the last told reload it applied
        self._reading = self._applied + workers         # then 1 while the parent reads and checks a reload
        self._asks_seen = 0             # the parent's: the sum of those counts at its last reload
        self._asks_noted = [0] * workers    # the parent's: each count when it began its last reload
        # the parent's count of the reloads it told the workers of; a worker's copy is the count
        # when it was forked (the reloads told before it started are in the config it loaded)
        self.told_count = 0
        # the parent's counts by result, likewise: a worker's copy is what was counted before it started
        self.counted_at_fork = dict.fromkeys(RESULTS, 0)

    def tick(self, index: int) -> None:
        """Worker ``index``'s loop ran (called by that worker only)."""
        self._slots[index] = (self._slots[index] + 1) & _MASK

    def ticks(self, index: int) -> int:
        return self._slots[index]

    def reset(self, index: int) -> None:
        """Before worker ``index`` is started (again): no tick yet."""
        self._slots[index] = 0

    def restarted(self, reason: str) -> None:
        """The parent restarted a worker for ``reason`` (one of ``REASONS``)."""
        at = self.workers + REASONS.index(reason)
        self._slots[at] = (self._slots[at] + 1) & _MASK

    def restarts(self) -> dict[str, int]:
        return {r: self._slots[self.workers + i] for i, r in enumerate(REASONS)}

    def stopping(self) -> None:
        """The parent got a stop signal (SIGTERM, SIGINT), and passes it on to the workers."""
        at = self.workers + len(REASONS)
        self._slots[at] = (self._slots[at] + 1) & _MASK

    def stops(self) -> int:
        """How many stop signals the parent got: a worker tells the parent's second signal from
        the same one reaching it twice (gateway/server/run.py)."""
        return self._slots[self.workers + len(REASONS)]

    def reloaded(self, generation: int) -> None:
        """The parent applied a reload: its config generation is now ``generation``."""
        self._slots[self.workers + len(REASONS) + 1] = generation

    def generation(self) -> int:
        """The parent's config generation, which a worker takes at its next reload."""
        return self._slots[self.workers + len(REASONS) + 1]

    def asked_reload(self, index: int) -> int:
        """Worker ``index`` was asked ``POST /admin/reload`` and is about to send the parent SIGHUP:
        the ask's number, which a told reload that came after it covers (``Told.after``)."""
        at = self._asks + index
        self._slots[at] = (self._slots[at] + 1) & _MASK
        return self._slots[at]

    def note_trigger(self) -> str:
        """The parent, at a SIGHUP, before it applies the reload: ``admin`` when a worker asked for a
        reload since the last one (a SIGHUP sent meanwhile is the same reload), else ``signal``."""
        self._asks_noted = list(self._slots[self._asks:self._asks + self.workers])
        asks = sum(self._asks_noted) & _MASK
        trigger = "admin" if asks != self._asks_seen else "signal"
        self._asks_seen = asks
        return trigger

    def counted(self, result: str) -> None:
        """The parent applied (``ok``) or refused a reload, before it tells the workers of it; or
        deferred it, waiting for the file to be whole (``deferred``, before its result)."""
        at = self._results + RESULTS.index(result)
        self._slots[at] = (self._slots[at] + 1) & _MASK
        self.counted_at_fork[result] += 1

    def results(self) -> dict[str, int]:
        """The parent's reloads by result so far: what ``switchyard_config_reload_total`` counts
        (gateway/server/reload.py), one per reload of the gateway's however many SIGHUPs a worker
        got for them; and under ``deferred``, what ``switchyard_config_reload_deferred_total`` counts."""
        return {r: self._slots[self._results + i] for i, r in enumerate(RESULTS)}

    def next_told(self) -> int:
        """The number the parent's next ``told`` gives its reload (gateway/server/handoff.py names
        the config text it read for that reload by it)."""
        return (self.told_count + 1) & _TOLD_MASK

    def told(self, trigger: str) -> None:
        """The parent applied (or refused) a reload that came from ``trigger`` and is about to
        signal the workers: its number, trigger and generation, in one slot written at once, after
        each worker's slot of the asks it came after (those ``note_trigger`` saw), with its number."""
        self.told_count = (self.told_count + 1) & _TOLD_MASK
        for index, asks in enumerate(self._asks_noted):
            self._slots[self._after + index] = self.told_count << 40 | asks & _ASKS_MASK
        generation = self._slots[self.workers + len(REASONS) + 1] & 0xFFFFFFFF
        self._slots[self.workers + len(REASONS) + 2] = (
            self.told_count << 40 | TRIGGERS.index(trigger) << 32 | generation)

    def reloading(self, under_way: bool) -> None:
        """The parent began a reload (reads the file and checks it, in a thread), or told the
        workers of it (``under_way`` False)."""
        self._slots[self._reading] = int(under_way)

    def parent_reloading(self) -> bool:
        """Whether the parent is reading and checking a reload (a worker asked POST /admin/reload
        that waited its time out says the reload is under way rather than not begun)."""
        return self._slots[self._reading] != 0

    def applied(self, index: int, seq: int) -> None:
        """Worker ``index`` applied (or refused) the told reload number ``seq``, or started with
        the config it led to (called by that worker only)."""
        self._slots[self._applied + index] = seq & _TOLD_MASK

    def applied_by_siblings(self, index: int, seq: int) -> bool:
        """Whether every worker but ``index`` that serves (has ticked since it was last started)
        has applied the told reload number ``seq`` or a later one. A worker not started yet, or
        being started again, is left out: it starts on the config the parent read last."""
        for i in range(self.workers):
            if i == index or self._slots[i] == 0:
                continue
            if (self._slots[self._applied + i] - seq) & _TOLD_MASK >= 1 << 23:
                return False
        return True

    def last_told(self, index: int | None = None) -> Told:
        """The last reload the parent told the workers of (number 0, ``signal``: none yet); with
        ``index``, the count of worker ``index``'s asks it came after, when this slot, read after
        the told one, is still that reload's (the parent writes it first)."""
        value = self._slots[self.workers + len(REASONS) + 2]
        if value == 0:
            return Told(0, "signal", self.generation())
        seq = value >> 40
        asks = None
        if index is not None:
            after = self._slots[self._after + index]
            if after >> 40 == seq:
                asks = after & _ASKS_MASK
        return Told(seq, TRIGGERS[(value >> 32) & 0xFF], value & 0xFFFFFFFF, asks)


class Beat:
    """A worker's side: tick its slot from its event loop every ``BEAT_S`` until ``stop``."""

    def __init__(self, heartbeats: Heartbeats, index: int) -> None:
        self.heartbeats = heartbeats
        self.index = index
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tick()

    def _tick(self) -> None:
        self.heartbeats.tick(self.index)
        assert self._loop is not None
        self._handle = self._loop.call_later(BEAT_S, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


@dataclass(slots=True)
class _Watched:
    index: int
    last: int = 0
    since: float = 0.0          # the parent's clock when ``last`` was read first
    beaten: bool = False        # ticked at least once: past its start-up
    killed: bool = False


class Watchdog:
    """The parent's side: which children stopped ticking, and the kill of those."""

    def __init__(self, heartbeats: Heartbeats, timeout: Callable[[], float], log: Callable[..., None],
                 clock: Callable[[], float] = time.monotonic,
                 kill: Callable[[int, int], None] = os.kill) -> None:
        self.heartbeats = heartbeats
        self.timeout = timeout
        self.log = log
        self.clock = clock
        self.kill = kill
        self._children: dict[int, _Watched] = {}
        self.served = False             # some worker has ticked: the gateway got past its start-up

    def spawning(self, index: int) -> None:
        """Before worker ``index`` is forked: its slot starts at no tick."""
        self.heartbeats.reset(index)

    def spawned(self, pid: int, index: int) -> None:
        self._children[pid] = _Watched(index, since=self.clock())

    def gone(self, pid: int) -> tuple[str, bool]:
        """``pid`` was reaped: why it ended (``stalled`` when this watchdog killed it, else
        ``exited``), and whether it had ticked (got past its start-up; its slot is read once more,
        since a tick may have come after the last poll)."""
        w = self._children.pop(pid, None)
        if w is None:
            return "exited", True
        ticked = w.beaten or self.heartbeats.ticks(w.index) != 0
        self.served = self.served or ticked
        # it serves nothing until started again (after a back-off), on the config read last: no
        # sibling's POST /admin/reload waits for it meanwhile (``Heartbeats.applied_by_siblings``)
        self.heartbeats.reset(w.index)
        return ("stalled" if w.killed else "exited"), ticked

    def end_starting(self, since: float, grace: float) -> None:
        """At a stop that came at ``since`` (this watchdog's clock): once ``grace`` seconds have
        passed, kill the workers still in their start-up (never ticked). A worker holds a stop back
        until its loop handles it, so one whose start-up hangs would hold the gateway's stop for as
        long as it lives; it serves nothing yet, and nothing but SIGKILL ends it."""
        if self.clock() - since < grace:
            return
        for pid, w in self._children.items():
            if w.beaten or w.killed or self.heartbeats.ticks(w.index) != 0:
                continue
            self.log("worker still starting when the stop's grace period ended; killing it", "warning",
                     worker=w.index, pid=pid, shutdown_grace_s=grace)
            w.killed = True
            try:
                self.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def check(self) -> None:
        timeout = self.timeout()
        now = self.clock()
        for pid, w in self._children.items():
            ticks = self.heartbeats.ticks(w.index)
            if ticks != w.last:
                w.last, w.since, w.beaten = ticks, now, True
                self.served = True
                continue
            if not w.beaten or w.killed or timeout <= 0 or now - w.since < timeout:
                continue
            self.log("worker's event loop stalled; killing it", "error", worker=w.index, pid=pid,
                     stalled_s=round(now - w.since, 1), worker_stall_timeout_s=timeout)
            w.killed = True
            try:
                self.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
