"""The replica link: every process of every replica shares its routing facts through one Redis
stream (``<state.key_prefix>:view``), when ``state.redis_url`` is set.

* Writing: the facts a process learns wait in a bounded outbox (``view.outbox_max``; past it the
  oldest are dropped and counted) and go out as one ``XADD`` per ``view.flush_interval_s`` at
  most, one at a time, with ``MAXLEN ~ view.stream_maxlen``: Redis keeps a bounded tail.
* Reading: a background task ``XREAD``\\ s with ``BLOCK`` from the last id it saw, on a
  connection of its own, and hands every other process's entry to the view. Entries of this
  process, and of its sibling workers when the local bus carries theirs, are skipped unread (each
  entry names its sender beside its payload).
* Catching up: at start, the whole retained tail is read and applied (oldest first, a few hundred
  entries per event-loop turn), so a replica that starts knows the fleet's prefixes and sessions.
  After an outage, reading resumes from the last id seen; a Redis that restarted (its ``run_id``
  changed) is read from its beginning instead, and the facts this process queued meanwhile go out.
* Losing Redis: any call that fails marks the link down (counted, ``switchyard_view_redis_up``
  0, logged once); routing goes on with the local view; the link retries every ``view.retry_s``.
  It is up again only once the stream itself answers: the reader's probe reads the stream's key
  (a Cluster node answers ``INFO`` while the stream's slot is down), which must be a stream or
  none (a key of another type, another application's, refuses every read), and a writer that failed
  tries again by itself and brings it up with its first write that lands (a Redis that refuses
  writes, out of memory, still serves reads). So an outage is one loss and one line, not one each
  ``retry_s``. Nothing on a request's path ever awaits Redis.

The Redis client is made as the tenancy backend makes its own (socket timeouts of
``state.timeout_s``, no retries, maintenance notifications off); the reader's socket timeout is
longer than its ``BLOCK``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import structlog
from redis.exceptions import ResponseError

from gateway.config.schema import StateConfig
from gateway.state.redis import CALL_FAILED, forget_topology, held_loop_timeout, redis_client, refusal
from gateway.view.config import ViewConfig
from gateway.view.metrics import ViewMetrics
from gateway.view.wire import Insert, Session, encode

log = structlog.get_logger("switchyard.view")

STOP_WAIT_S = 2.0           # how long stop() waits for a loop to end, and for a client to close
CATCH_UP_CHUNK = 200        # entries applied per event-loop turn while catching up
READ_COUNT = 1000           # entries per XREAD
LOST_LOG_S = 30.0           # a lost link is logged at most this often (each loss is counted)


class ReplicaLink:
    """``queue`` facts for the stream; ``on_entry(payload, live)`` for every other process's entry
    (``live``: read as it came, not while catching up)."""

    def __init__(self, state: StateConfig, cfg: ViewConfig, sender: str, skip_prefix: str | None,
                 on_entry: Callable[[bytes, bool], None], metrics: ViewMetrics) -> None:
        self.state = state
        self.cfg = cfg
        self.sender = sender
        self._sender_b = sender.encode()
        self._skip = skip_prefix.encode() if skip_prefix else None
        self.on_entry = on_entry
        self.m = metrics
        self.key = f"{state.key_prefix}:view"
        # each runs one call at a time (one loop each), so state.max_connections never binds them
        pool_timeout = metrics.gm.state_pool_timeouts.labels("view").inc
        self.writer = redis_client(state, on_pool_timeout=pool_timeout)
        self.reader = redis_client(state, cfg.read_block_s + max(1.0, state.timeout_s * 4), on_pool_timeout=pool_timeout)
        self.outbox: deque[Insert | Session] = deque()
        self.up = False
        self.last_id: bytes | None = None
        self.run_id: str | None = None
        self._wake = asyncio.Event()
        self._write_failed = False        # the writer lost the link: it tries again by itself
        self._tasks: list[asyncio.Task] = []
        self._down_since = 0.0
        self._loss_logged = True          # the last loss was logged (the first up is, too)
        self._lost_logged_at = -LOST_LOG_S
        self._lost_quiet = 0              # losses not logged since the last line

    # -- state -------------------------------------------------------------------------------

    def _mark(self, up: bool, why: str = "", reason: str | None = None) -> None:
        """A loss is counted each time; its line is written at most once per ``LOST_LOG_S`` (a
        Redis at its memory limit refuses one write and takes the next: down and up again with
        each), the next one saying how many were not (``since_last``). The line that the stream
        is back follows a loss that was logged."""
        if up == self.up:
            return
        self.up = up
        self.m.redis_up = 1.0 if up else 0.0
        if up:
            if self._loss_logged:
                log.info("shared routing view: redis stream reachable", stream=self.key)
            return
        self.m.redis_lost.inc()
        now = self._down_since = time.monotonic()
        self._loss_logged = now - self._lost_logged_at >= LOST_LOG_S
        if not self._loss_logged:
            self._lost_quiet += 1
            return
        log.warning("shared routing view: redis stream lost; routing on the local view", error=why,
                    **({"reason": reason} if reason else {}), **({"since_last": self._lost_quiet} if self._lost_quiet else {}))
        self._lost_logged_at, self._lost_quiet = now, 0

    # -- writing -----------------------------------------------------------------------------

    def queue(self, facts: list[Insert | Session]) -> None:
        out = self.outbox
        out.extend(facts)
        over = len(out) - self.cfg.outbox_max
        if over > 0:
            for _ in range(over):
                out.popleft()
            self.m.dropped.labels("replica", "outbox_full" if self.up else "redis_down").inc(over)
        self._wake.set()

    async def _write_loop(self) -> None:
        cfg = self.cfg
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.up and not self._write_failed:
                continue                  # the reader's reconnect wakes us
            facts = list(self.outbox)
            if not facts:
                continue
            self.outbox.clear()
            inserts = [f for f in facts if f.__class__ is Insert]
            sessions = [f for f in facts if f.__class__ is not Insert]
            payloads = encode(self.sender, time.time(), inserts, sessions, None, 512 * 1024)  # type: ignore[arg-type]
            try:
                pipe = self.writer.pipeline(transaction=False)
                for p in payloads:
                    pipe.xadd(self.key, {b"s": self._sender_b, b"b": p}, maxlen=cfg.stream_maxlen, approximate=True)
                async with held_loop_timeout(self.state.timeout_s * 4):
                    await pipe.execute()
                self.m.sent.labels("replica").inc(len(payloads))
            except CALL_FAILED as e:     # no Cluster node reachable, a connection lost: down, not a bug
                _stop_if_cancelled()
                self._requeue(facts)
                # a refusal (out of memory, read-only, ...) says why without the refused command,
                # whose arguments (the facts' encoded bytes) the client library's text quotes
                why = refusal(e)
                self._write_down(f"{type(e).__name__}: Redis refused the write" if why else f"{type(e).__name__}: {e}", why)
                # a failed pipeline leaves a Cluster client on its old slot map (a promoted
                # replica would never be written to): read it again on the next call
                await forget_topology(self.writer)
                await self._retry_later()
                continue
            except Exception:         # a bug must not stop this replica's inserts for good
                _stop_if_cancelled()
                log.exception("shared routing view: stream writer failed")
                self._requeue(facts)
                self._write_down("writer error")
                await self._retry_later()
                continue
            if self._write_failed:
                self._write_failed = False
                self._mark(True)
            await asyncio.sleep(cfg.flush_interval_s)

    def _write_down(self, why: str, reason: str | None = None) -> None:
        self._write_failed = True
        self._mark(False, why, reason)

    async def _retry_later(self) -> None:
        """A writer that lost the link tries again after ``view.retry_s``, whatever the reader
        sees: reads can go on where writes fail (a Redis out of memory refuses writes only)."""
        await asyncio.sleep(self.cfg.retry_s)
        self._wake.set()

    def _requeue(self, facts: list[Insert | Session]) -> None:
        """Facts that did not go out wait again, before newer ones (within the outbox bound)."""
        room = self.cfg.outbox_max - len(self.outbox)
        if room < len(facts):
            self.m.dropped.labels("replica", "redis_down").inc(len(facts) - max(0, room))
            facts = facts[len(facts) - max(0, room):]
        self.outbox.extendleft(reversed(facts))

    # -- reading -----------------------------------------------------------------------------

    async def _connect(self) -> None:
        """Probe Redis; a restarted one (new run_id) is read from its beginning."""
        async with held_loop_timeout(self.state.timeout_s * 4):
            info = await self.reader.info("server")
            # the stream's own key: a Cluster node answers INFO while the stream's slot is down;
            # and a key another application wrote there (a string, a hash) would refuse each read
            kind = await self.reader.type(self.key)
        if kind not in (b"stream", b"none"):
            raise ResponseError(f"WRONGTYPE {self.key} holds a {kind.decode(errors='replace')}, not a stream")
        run_id = str(info.get("run_id", ""))
        if self.run_id is not None and run_id != self.run_id:
            self.last_id = b"0-0"
        self.run_id = run_id

    async def _catch_up(self) -> None:
        """At start: the retained tail, oldest first, a chunk per loop turn."""
        async with held_loop_timeout(max(2.0, self.state.timeout_s * 8)):
            entries = await self.reader.xrevrange(self.key, count=self.cfg.stream_maxlen)
        entries.reverse()
        self.last_id = entries[-1][0] if entries else b"0-0"
        for i in range(0, len(entries), CATCH_UP_CHUNK):
            self._deliver(entries[i:i + CATCH_UP_CHUNK], False)
            await asyncio.sleep(0)

    def _deliver(self, entries: list, live: bool) -> None:
        own, skip = self._sender_b, self._skip
        for _id, fields in entries:
            sender = fields.get(b"s", b"")
            if sender == own or (skip is not None and sender.startswith(skip)):
                continue
            payload = fields.get(b"b")
            if payload is not None:
                self.on_entry(payload, live)

    async def _read_loop(self) -> None:
        block_ms = int(self.cfg.read_block_s * 1000)
        while True:
            try:
                await self._connect()
                if self.last_id is None:
                    await self._catch_up()
                if not self._write_failed:     # else the writer's next write that lands does
                    self._mark(True)
                self._wake.set()           # what waited in the outbox goes out
                while True:
                    found = await self.reader.xread({self.key: self.last_id}, count=READ_COUNT, block=block_ms)
                    for _key, entries in found or ():
                        if entries:
                            self.last_id = entries[-1][0]
                            self._deliver(entries, True)
                            await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except CALL_FAILED as e:     # no Cluster node reachable, a connection lost: down, not a bug
                _stop_if_cancelled()
                self._mark(False, f"{type(e).__name__}: {e}")
                # a Cluster's slot map read again, by the writer too: it writes to the same node,
                # and would meet the dead one with its first facts after the reader is back
                await forget_topology(self.reader)
                await forget_topology(self.writer)
            except Exception:         # a bug must not stop the view's replication for good
                _stop_if_cancelled()
                log.exception("shared routing view: stream reader failed")
                self._mark(False, "reader error")
            await asyncio.sleep(self.cfg.retry_s)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read_loop(), name="view-stream-read"),
                       asyncio.create_task(self._write_loop(), name="view-stream-write")]

    async def stop(self) -> None:
        """End both loops and close the clients, within a bound: a Redis that is gone (or a client
        library that turns a cancel into an error of its own) must not hold a gateway's stop."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
            if pending:
                log.warning("shared routing view: a stream loop did not end when stopped",
                            tasks=sorted(t.get_name() for t in pending))
        for c in (self.writer, self.reader):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_WAIT_S):
                    await c.aclose()


def _stop_if_cancelled() -> None:
    """Re-raise a cancel that a client library caught and turned into an error of its own (the
    task still counts it as requested): a loop must end when it is stopped, not retry."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
