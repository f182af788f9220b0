"""``BatchService``: the Files and Batches API of every worker, and the runner of one.

Every process of the gateway on a ``batch.dir`` answers the API from the shared job store. The
batches run in one process only: the one holding an exclusive ``flock`` on ``<dir>/runner.lock``.
The others try again every few seconds, so when the holder dies (even by SIGKILL: the kernel
releases its lock) another worker, or the restarted gateway, takes over and resumes from the
store. Two gateways pointed at one directory on one host behave the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import os
import sqlite3
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
from aiohttp import web

from gateway.batch import files as batch_files
from gateway.batch.api import BatchApi
from gateway.batch.config import BatchConfig
from gateway.batch.headroom import free_slots
from gateway.batch.metrics import BatchMetrics
from gateway.batch.runner import BatchRunner, Submit
from gateway.batch.store import GONE_KEPT_S, BatchDb, BatchStore, FileInUse, now_s
from gateway.endpoints import Endpoint, EndpointPool
from gateway.tenants.service import NoTenancy, Tenancy, Ticket

log = structlog.get_logger("switchyard.batch")

LOCK_RETRY_S = 2.0
# a runner that failed is started again after this, doubling to the most while it keeps failing
RESTART_S, RESTART_MAX_S = 1.0, 60.0
SWEEP_EVERY_S = 60.0


def sweep_interval(file_ttl_s: float) -> float:
    """Seconds between sweeps: a minute, or a quarter of a short ``file_ttl_s`` (at least 1 s), so a
    file outlives its expiry by at most that much."""
    return min(SWEEP_EVERY_S, max(1.0, file_ttl_s / 4)) if file_ttl_s > 0 else SWEEP_EVERY_S


class DirLock:
    """An exclusive, non-blocking ``flock`` on a file; the kernel releases it when the process dies."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class BatchService:
    def __init__(self, cfg: BatchConfig, tenancy: Tenancy | NoTenancy, pool: EndpointPool, registry,
                 *, engine_signals: Callable[[], bool], metrics_max_age: Callable[[], float],
                 admission_waiting: Callable[[str], int], draining: Callable[[], bool],
                 targets: Callable[[str], tuple[str, ...] | None] | None = None,
                 pairs: Callable[[str], bool] = lambda model: False) -> None:
        self.cfg = cfg

        def allowed(owner: str, model: str) -> bool:
            """Whether the batch's creator may ask for ``model`` (their ``models`` list)."""
            names = tenancy.models_for(Ticket(user=owner or None), owner or None)
            return names is None or model in names
        self.db = BatchDb(os.path.abspath(cfg.dir))
        self.metrics = BatchMetrics(registry, pool.models)
        self.api = BatchApi(cfg, self.db, tenancy, self._changed)
        self.pool = pool
        self._signals = dict(engine_signals=engine_signals, metrics_max_age=metrics_max_age,
                             admission_waiting=admission_waiting, draining=draining, targets=targets,
                             pairs=pairs, allowed=allowed)
        self.runner: BatchRunner | None = None
        self.lock = DirLock(os.path.join(self.db.dir, "runner.lock"))
        self._task: asyncio.Task | None = None
        self.tell_siblings: Callable[[Endpoint], None] | None = None
        self.tell_batches: Callable[[], None] | None = None

    def _changed(self, doc: dict[str, Any]) -> None:
        """A batch this worker's API created or cancelled: the runner, if it runs here, takes it up
        now (a cancel stops the batch's lines at once), not at its next look at the store."""
        if self.runner is not None:
            self.runner.changed(doc)
        elif self.tell_batches is not None:     # --workers N: the one that runs them reads the store now
            self.tell_batches()

    def sibling_changed(self) -> None:
        """A sibling worker's API created or cancelled a batch: the runner, if it runs here, reads the
        job store now (a cancel's lines stop then)."""
        if self.runner is not None:
            self.runner.look = True
            self.runner.wake.set()

    @property
    def running(self) -> bool:
        """This process runs the batches (holds the directory's lock)."""
        return self.lock.fd is not None

    def lifecycle(self, submit: Submit, claims: list, tell_siblings: Callable[[Endpoint], None] | None = None,
                  tell_batches: Callable[[], None] | None = None):
        """``claims``: the routing decisions' claims, where the runner learns where its lines run and
        preempts one for an interactive request that would otherwise wait in an engine's queue.
        ``tell_siblings``: with ``--workers N``, how a worker that does not run batches asks the one
        that does for a slot its interactive request found taken (``sibling_preempt`` there), and
        ``tell_batches`` how it tells that one a batch was created or cancelled (``sibling_changed``)."""
        self.tell_siblings, self.tell_batches = tell_siblings, tell_batches
        claims.append(self.on_decision)

        async def batches(_app: web.Application) -> AsyncIterator[None]:
            try:
                await self.db.open()
                await asyncio.to_thread(batch_files.prepare, self.db.dir)
            except (OSError, sqlite3.Error) as e:
                # a read-only volume, a directory the gateway's user may not write: the operator's
                # to fix, said in one line as a config error is (gateway/__main__.py), not a traceback
                await self.db.close()
                raise ValueError(f"batch.dir {self.db.dir} cannot be used: {e}") from None
            self._task = asyncio.create_task(self._hold(submit), name="batch-runner")
            try:
                yield
            finally:
                if self.on_decision in claims:
                    claims.remove(self.on_decision)
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
                self.lock.release()
                await self.db.close()
        return batches

    async def _hold(self, submit: Submit) -> None:
        """Wait for the directory's lock, then run the batches (and sweep expired files) until stopped."""
        while not await asyncio.to_thread(self.lock.try_acquire):
            await asyncio.sleep(LOCK_RETRY_S)
        log.info("running batches", dir=self.db.dir, pid=os.getpid())
        failures = 0
        while True:
            self.runner = BatchRunner(self.cfg, self.db, submit, self.pool, self.metrics, **self._signals)
            sweeper = asyncio.create_task(self._sweep(), name="batch-sweeper")
            began = asyncio.get_running_loop().time()
            try:
                await self.runner.run()
                return
            except Exception:
                # a fault the runner does not handle (a full disk while writing a batch's output, a
                # bug): its lines in flight were stopped (``BatchRunner.run``), so a runner started
                # again from the job store runs them again, as after a restart
                ran = asyncio.get_running_loop().time() - began
                failures = 1 if ran >= RESTART_MAX_S else failures + 1
                wait = min(RESTART_MAX_S, RESTART_S * 2 ** (failures - 1))
                self.metrics.runner_failed()
                log.exception("the batch runner failed; started again from the job store", retry_in_s=wait)
            finally:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
            await asyncio.sleep(wait)

    def on_decision(self, ireq: Any, decision: Any, fallbacks: Any, elapsed: float) -> None:
        """A routing decision's claim. Where batches run, the runner's (its lines' places, and
        preemption); in a sibling worker, an interactive request routed to an endpoint with no free
        slot, where that worker's lines may run (requests of other processes are on it), asks it
        to stop one."""
        runner = self.runner
        if runner is not None:
            runner.on_decision(ireq, decision, fallbacks, elapsed)
            return
        ep = decision.endpoint
        if (self.tell_siblings is not None and ep.remote_in_flight > 0
                and free_slots(ep, self.cfg.endpoint_capacity, self._signals["engine_signals"]()) < 1):
            self.tell_siblings(ep)

    def sibling_preempt(self, ep: Endpoint) -> bool:
        """A sibling worker's interactive request found no free slot on ``ep``: the newest batch lines
        there stop, if this worker runs batches and has some there, as many as it lacks slots (it is
        counted here already, in ``remote_in_flight``), at least one."""
        if self.runner is None:
            return False
        free = free_slots(ep, self.cfg.endpoint_capacity, self._signals["engine_signals"]())
        return self.runner.preempt(ep.name, max(1, math.ceil(-free)))

    async def _sweep(self) -> None:
        """Expired files leave the store and the disk; so do files on disk the store forgot, the
        places kept of files gone more than ``GONE_KEPT_S`` ago, and temporary files no process
        holds."""
        while True:
            try:
                inputs = {b["input_file_id"] for b in await self.db.run(BatchStore.active_batches)}
                for fid in await self.db.run(BatchStore.expired_files, now_s()):
                    if fid in inputs:       # a running batch reads it: it goes once the batch ends
                        continue
                    try:        # checked again in the delete's transaction: another worker may create one
                        await self.db.run(BatchStore.delete_file, fid, True)
                    except FileInUse:
                        continue
                    await asyncio.to_thread(batch_files.remove, self.db.dir, fid)
                await self.db.run(BatchStore.forget_gone, now_s() - GONE_KEPT_S)
                known = await self.db.run(BatchStore.file_ids)
                for fid in await asyncio.to_thread(batch_files.strays, self.db.dir, known):
                    await asyncio.to_thread(batch_files.remove, self.db.dir, fid)
                # temporary files a process that died left since this one started
                await asyncio.to_thread(batch_files.clear_temps, self.db.dir)
            except Exception:
                log.exception("batch file sweep failed")
            await asyncio.sleep(sweep_interval(self.cfg.file_ttl_s))

    async def status(self) -> dict:
        """The status page's batch section."""
        counts = await self.db.run(BatchStore.status_counts) if self.db.store is not None else {}
        return {"enabled": True, "runs_here": self.running, "batches": counts,
                "lines_in_flight": sum(self.metrics.lines_in_flight.values())}
