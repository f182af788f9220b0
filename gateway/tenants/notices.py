"""Directory change notices: a key or user written on one replica reaches every other at once.

Every directory write (``redis_state.DIRECTORY``) adds its new version to a stream,
``<state.key_prefix>:dirnotes`` (Redis keeps its last hundred entries or so), in the same script
step as the change itself, so no change is written without its notice. Each process of each
replica (every worker of ``--workers N`` keeps a mirror of its own) blocks reading that stream
on a connection of its own (``XREAD BLOCK`` from the last entry it saw) and, for every batch of
entries read, brings its mirror up to date: what changed since its version, read from the change
log (``Tenancy.refresh``). A key made on one replica is served by the others, and one revoked there
refused by them, within a Redis round trip or two, not at their next sync.

A stream rather than pub/sub: a message published while a subscriber reconnects is lost to it,
where an entry waits in the stream; and a stream is read with one command, the same on a
standalone Redis, behind Sentinel and on a Cluster (it carries the directory's hash tag, so the
write's script adds to it on the directory's node), as the routing view reads its own
(``gateway.view.replicas``), where pub/sub would be a subscription to keep per mode (plain or
sharded channels, a subscriber per Cluster node to follow through resharding and failover). The periodic sync (``state.sync_interval_s``) stays as the backstop. When
the read fails (Redis gone, a failover, a Cluster's slot moving) the reader tries again every
``RETRY_S``; once it reads again it first brings the mirror up to date (a change written while it
was away is taken in then, whatever the stream still holds), then reads from the stream's newest
entry. Nothing on a request's path awaits this reader.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from gateway.config.schema import StateConfig
from gateway.state.redis import CALL_FAILED, close_client, forget_topology, held_loop_timeout, redis_client

log = structlog.get_logger("switchyard.tenancy")

BLOCK_S = 5.0         # how long one XREAD waits for an entry
RETRY_S = 0.5         # after a failed read, the wait before the next try
READ_COUNT = 100      # entries per XREAD: a burst of writes is one mirror update
STOP_WAIT_S = 2.0


class DirectoryNotices:
    """Reads ``key`` and awaits ``on_notices(n)`` for each batch of ``n`` entries read, and
    ``on_notices(0)`` each time reading (re)starts (the changes it may have missed meanwhile).
    ``on_notices`` may raise: the read starts again after ``RETRY_S``."""

    def __init__(self, cfg: StateConfig, key: str, on_notices: Callable[[int], Awaitable[None]],
                 on_pool_timeout: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.key = key
        self.on_notices = on_notices
        self.client = redis_client(cfg, BLOCK_S + max(1.0, cfg.timeout_s * 4), on_pool_timeout=on_pool_timeout)
        self.up = False
        self.last_id: bytes | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._read_loop(), name="tenancy-directory-notices")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            _, pending = await asyncio.wait([task], timeout=STOP_WAIT_S)
            if pending:
                log.warning("directory notices: the reader did not end when stopped")
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STOP_WAIT_S):
                await close_client(self.client)

    def _mark(self, up: bool, why: str = "") -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log.info("directory notices: reading changes as they are written", stream=self.key)
        else:
            log.warning("directory notices: stream lost; keys and users made or revoked elsewhere reach this "
                        "replica at its next sync until it is back", stream=self.key, error=why)

    async def _read_loop(self) -> None:
        block_ms = int(BLOCK_S * 1000)
        while True:
            try:
                if self.last_id is None:
                    async with held_loop_timeout(max(2.0, self.cfg.timeout_s * 4)):
                        newest = await self.client.xrevrange(self.key, count=1)
                    self.last_id = newest[0][0] if newest else b"0-0"
                    # what was written before this point, while the reader was away or starting
                    await self.on_notices(0)
                    self._mark(True)
                while True:
                    found = await self.client.xread({self.key: self.last_id}, count=READ_COUNT, block=block_ms)
                    for _key, entries in found or ():
                        if entries:
                            self.last_id = entries[-1][0]
                            await self.on_notices(len(entries))
            except asyncio.CancelledError:
                raise
            except CALL_FAILED as e:        # Redis gone, a failover, a slot moving: read again later
                _stop_if_cancelled()
                self._mark(False, f"{type(e).__name__}: {e}")
                await forget_topology(self.client)
            except Exception as e:          # the mirror's update failed (the state down): the same
                _stop_if_cancelled()
                self._mark(False, f"{type(e).__name__}: {e}")
            # the position is taken again (a Redis restarted empty, a promoted replica that had not
            # all of the stream): what was missed meanwhile is read from the change log
            self.last_id = None
            await asyncio.sleep(RETRY_S)


def _stop_if_cancelled() -> None:
    """Re-raise a cancel that the client library turned into an error of its own."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
