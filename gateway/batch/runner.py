"""The batch runner: one per ``batch.dir``, it moves batches through their states and runs their lines.

``validating`` → ``in_progress`` → ``finalizing`` → ``completed``; or ``failed`` (validation),
``cancelling`` → ``cancelled``, ``expired`` (``expires_at`` passed). Every state change is written
to the store before it is acted on, so a runner that dies anywhere resumes from the store.

Lines go through the gateway's own inference handler (``Submit``: the live generation's
pipeline, called in-process with a ``LineRequest``) as the ``sheddable`` class, on behalf of the
batch's owner, only while ``headroom.model_room`` finds free slots, under ``max_concurrency`` and
``max_lines_per_s`` per model. An answer is stored keyed by ``(batch, custom_id)`` (results are
committed in small groups; a line whose answer was not committed when the process died is run
again, and a line stored twice is kept once). A 429 (the owner's limits, admission shedding) waits
its Retry-After and is tried again without counting, and no line of the owner's for that model
starts meanwhile; a 502 of a line that reached no engine (the gateway could not connect to one:
an engine that died is ready until its probes notice) is tried again without counting, and no
line of that model starts meanwhile; a 503 no ready endpoint (or, for a model routed as
prefill/decode pairs, no ready pair) of a model that can no longer run a line since it started
goes back uncounted to wait, as a line that found none at its start does; another 5xx or a
timeout is tried again up to ``max_attempts``; anything else is the line's answer (a 4xx goes to
the error file).

A line naming a model the gateway does not know is answered 404 at once, unless the model may come
back: Kubernetes discovery has not listed the pods yet, or the gateway knew it while this runner ran
(its last pod deleted in a rollout, a reload without it), or it is the model of the line's batch,
which the gateway served when it validated the batch; then its lines wait as below (``_awaited``),
and one answered the gateway's 404 in flight waits too. A batch whose lines all name one model the
gateway does not serve (nor expects back) fails its validation, ``model_not_found``, as at OpenAI.

A model "can run a line" (``headroom.serves``) when it has a ready endpoint; one routed as
prefill/decode pairs needs a ready prefill and a ready decode of one roleset, or a ready
whole-request endpoint, and its room counts pairs (``headroom.model_room``). While a model cannot,
its lines wait in the queue uncounted, and the runner logs it once as the wait begins and once as
it ends.

The output and error files are written at the end by streaming the stored lines in input order,
so memory stays flat whatever the batch's size; every line that ran has exactly one line in one of
them, and so has every line of an expired batch (those it never ran say so in the error file). A
cancelled batch's lines that never ran are in neither, nor in its counts, as OpenAI documents a
cancel: its results so far in the output file.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import math
import os
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from gateway.batch import files as batch_files
from gateway.batch.config import BatchConfig
from gateway.batch.headroom import free_slots, model_room, serves
from gateway.batch.jsonl import Line, read_chunk, validate
from gateway.batch.line_request import LineRequest
from gateway.batch.metrics import BatchMetrics
from gateway.batch.store import BatchDb, BatchStore, Result, now_s
from gateway.endpoints import EndpointPool
from gateway.errors import ErrorClass, error_body
from gateway.request import BINARY_FORMATS, BINARY_PATHS, body_bytes, lax_bool

log = structlog.get_logger("switchyard.batch")

# the handler a line is submitted to: the live generation's pipeline (gateway/server/app.py)
Submit = Callable[[LineRequest], Awaitable[Any]]
RETRY_STATUSES = frozenset({408, 500, 502, 503, 504})
MAX_BACKOFF_S = 30.0
DROPPED = ("stream", "stream_options")     # a batch line's body loses them: its answer is one body
NO_USAGE = (0, 0, 0, 0)      # a line's usage (prompt, completion, cached, reasoning tokens) when it has none
STREAMING_PATHS = ("/v1/chat/completions", "/v1/completions")     # where a line's ``stream`` would stream
FLUSH_LINES = 256
HELD_BACK = 1024       # lines of models without room a dispatch steps over to reach other models
IDLE_MODELS = 4096     # models remembered as unable to run a line (for the log at the wait's end)
# what the gateway's 502 says (x-error-upstream) when it could not connect to any engine of the
# line's model: no engine took the request, so the line is not at fault
UNREACHED = "connect"
# how a line its runner stops is logged (error_class, error, the trace's abort.by): not a client's cancel
PREEMPTED = (ErrorClass.BATCH_PREEMPTED, "stopped to give its slot to an interactive request; the batch line "
             "runs again", "batch_preemption")
EXPIRED = (ErrorClass.BATCH_EXPIRED, "the batch expired (its completion window ended) before this request "
           "was answered", "gateway")
STOPPING = (ErrorClass.DRAINING, "the batch runner stopped (the gateway stops); the batch line runs again "
            "once batches run again", "gateway")


@dataclass(slots=True)
class _Job:
    doc: dict[str, Any]
    path: str
    owner: str
    offset: int = 0
    line_no: int = 0
    eof: bool = False
    ready: deque[tuple[Line, int]] = field(default_factory=deque)     # (line, attempts so far)
    waiting: list[tuple[float, int, Line, int]] = field(default_factory=list)   # heap: (due, seq, line, attempts)
    tasks: set[asyncio.Task] = field(default_factory=set)
    results: list[Result] = field(default_factory=list)
    stopping: str | None = None          # cancelled | expired | failed: no new line goes
    reading: bool = False                # a chunk of input lines is being read
    validating: bool = False             # its input is being validated (a task of its own)
    validated: bool = False              # by this runner: a look at the store read before says validating
    ending: bool = False                 # its end is being written (a task of its own: ``_finalize``)
    unreadable: str | None = None        # why the input could not be read on (the batch fails)

    @property
    def id(self) -> str:
        return self.doc["id"]


class BatchRunner:
    def __init__(self, cfg: BatchConfig, db: BatchDb, submit: Submit, pool: EndpointPool, metrics: BatchMetrics,
                 *, engine_signals: Callable[[], bool], metrics_max_age: Callable[[], float],
                 admission_waiting: Callable[[str], int], draining: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic,
                 targets: Callable[[str], tuple[str, ...] | None] | None = None,
                 pairs: Callable[[str], bool] = lambda model: False,
                 allowed: Callable[[str, str], bool] = lambda owner, model: True) -> None:
        self.cfg, self.db, self.submit, self.pool, self.m = cfg, db, submit, pool, metrics
        self.engine_signals, self.max_age, self.admission_waiting = engine_signals, metrics_max_age, admission_waiting
        self.clock, self.draining = clock, draining
        # the models a line's ``model`` runs on (an alias's targets, an adapter's base model); None:
        # no such model, the handler answers it
        self.targets = targets or (lambda name: (name,) if self.pool.has_model(name) else None)
        # whether a model routes as prefill/decode pairs (its strategy chooses pairs: ``pd``)
        self.pairs = pairs
        # whether a batch's creator may ask for a model (their ``limits.users.<name>.models``)
        self.allowed = allowed
        # models whose lines wait as they cannot run one (no ready endpoint, or no ready pair)
        self.idle: set[str] = set()
        # models the gateway was seen to know (by name: a model, an alias, an adapter): one it no
        # longer knows may come back (its pods all gone in a rollout), so its lines wait for it
        self.known: set[str] = set()
        self.jobs: dict[str, _Job] = {}
        self.in_flight: dict[str, int] = {}          # model → lines in flight
        self.next_start: dict[str, float] = {}       # model → earliest start of its next line (rate cap)
        # the earliest start the rate cap held a line back for at the last dispatch: the loop wakes
        # then, not at its next poll (a line that ends wakes it too, but none may end meanwhile)
        self.rate_due: float | None = None
        self.wake = asyncio.Event()
        self.look = False       # a batch changed in this process (created, cancelled): the store is read now
        self.fault: BaseException | None = None     # a task of the runner's failed: the runner fails
        self.ending: set[asyncio.Task] = set()         # batches' ends being written (``_finalize``)
        # batches this runner ended that a look at the store begun before their end may still list
        # as running: not taken on again (their files would be written twice)
        self.ended: set[str] = set()
        self._seq = 0
        self.lines_on: dict[str, dict[str, asyncio.Task]] = {}     # endpoint → request id → its line's task
        self.placed: dict[str, str] = {}                            # request id → endpoint
        self.preempted: set[str] = set()
        self._tasks_by_rid: dict[str, asyncio.Task] = {}
        self._requests: dict[str, LineRequest] = {}     # request id → its line's request, while it runs
        # (owner, model) → until when no line of theirs starts: a line met a 429, whose Retry-After
        # says when the limit (or admission) takes requests again
        self.held: dict[tuple[str, str], float] = {}
        # model → (until when none of its lines starts, how many such waits in a row): its lines
        # reached no engine (an engine that died is ready until its probes notice); the wait
        # doubles from retry_backoff_s while they keep reaching none, and an answer ends the run
        self.unreached: dict[str, tuple[float, int]] = {}

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: refresh from the store, dispatch, flush; woken by finished lines."""
        last_refresh = -1.0
        models = asyncio.ensure_future(self._read_models())
        try:
            # the lines of batches a runner ended and stopped before it dropped them
            if dropped := await self.db.run(BatchStore.drop_ended_results):
                log.info("answered lines of batches that ended dropped from the job store", lines=dropped)
            while True:
                if self.fault is not None:
                    raise self.fault
                now = self.clock()
                if self.look or now - last_refresh >= self.cfg.poll_interval_s:
                    last_refresh, self.look = now, False
                    await self._refresh()
                self._dispatch()
                await self._flush_all()
                await self._finish_ready()
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._next_wait()):
                        await self.wake.wait()
        finally:
            models.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await models
            await self._stop_lines()

    def changed(self, doc: dict[str, Any]) -> None:
        """A batch this process's API created or cancelled (``doc``, as stored): read the store now
        rather than at the next ``poll_interval_s``; and a batch cancelled that runs here stops at
        once (no line of it starts after the cancel's answer, those in flight are stopped), so a
        client that saw its cancel answered sees no more of its requests reach an engine."""
        job = self.jobs.get(doc.get("id", ""))
        if job is not None and doc.get("status") == "cancelling":
            job.doc = doc
            self._halt(job, "cancelled")
        self.look = True
        self.wake.set()

    async def _read_models(self) -> None:
        """The ``model`` of each batch an older gateway validated, which it never read (it stored
        null): read from the batch's input file once, in the background, one file at a time, and
        stored, so the batch and the lists show it from then on. A batch never validated (cancelled
        before) has none to read; one whose input file is gone (expired, deleted) keeps null. A
        fault of the store's is logged and ends the reading; the next runner's start resumes it."""
        try:
            await self._read_models_once()
        except Exception:
            log.exception("reading the model of batches from an older version failed")

    async def _read_models_once(self) -> None:
        while True:
            docs = await self.db.run(BatchStore.models_unread, 16)
            if not docs:
                return
            for doc in docs:
                model: str | None = None
                validated = doc.get("in_progress_at") is not None or doc["status"] == "failed"
                if validated and batch_files.valid_id(doc.get("input_file_id") or ""):
                    path = batch_files.path_of(self.db.dir, doc["input_file_id"])
                    try:
                        _, _, model = await asyncio.to_thread(validate, path, doc["endpoint"], 0)
                    except (OSError, ValueError) as e:
                        log.info("the model of a batch from an older version cannot be read; it stays null",
                                 batch_id=doc["id"], error=str(e))
                await self.db.run(BatchStore.set_model_read, doc["id"], model)
                if model is not None:
                    log.info("the model of a batch from an older version read from its input", batch_id=doc["id"],
                             model=model)

    def _next_wait(self) -> float:
        wait = self.cfg.poll_interval_s
        now = self.clock()
        if self.rate_due is not None:
            wait = min(wait, max(0.0, self.rate_due - now))
        for job in self.jobs.values():
            if job.waiting:
                wait = min(wait, max(0.0, job.waiting[0][0] - now))
        return wait

    async def _stop_lines(self) -> None:
        """Shutting down: lines in flight are cancelled (they run again after a restart); what was
        answered is committed. A batch's end being written waits for its files' write (``_finalize``)."""
        tasks = [t for job in self.jobs.values() for t in job.tasks] + list(self.ending)
        for req in self._requests.values():     # their log lines say the gateway stopped them
            if req.stopped_as is None:
                req.stopped_as = STOPPING
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.shield(self._flush_all())

    # -- batches ------------------------------------------------------------------------------

    async def _refresh(self) -> None:
        docs = await self.db.run(BatchStore.active_batches)
        seen = set()
        now = now_s()
        for doc in docs:
            bid = doc["id"]
            seen.add(bid)
            if bid in self.ended:       # read before its end was stored (``_finalize`` runs beside)
                continue
            job = self.jobs.get(bid)
            if job is None:
                owner = await self.db.run(BatchStore.batch_owner, bid) or ""
                job = self.jobs[bid] = _Job(doc, batch_files.path_of(self.db.dir, doc["input_file_id"]), owner)
            else:
                job.doc = doc
            status = doc["status"]
            if status != "validating" and isinstance(model := doc.get("model"), str) and model:
                # the batch's model, which the gateway served when the batch was validated: if it is
                # gone now (this runner started since, in a rollout), its lines wait for it to come back
                self._remember(model)
            if status == "validating":
                self._validate_soon(job)
            elif status == "in_progress" and doc.get("expires_at") and now >= doc["expires_at"]:
                # a batch already finalizing answered every line: it completes, whenever that ends
                self._halt(job, "expired")
            elif status == "cancelling":
                self._halt(job, "cancelled")
        for bid in list(self.jobs):
            if bid not in seen and not self.jobs[bid].tasks:
                del self.jobs[bid]
        self.ended &= seen          # a look begun after their end lists them no more
        await self._overview()

    async def _overview(self) -> None:
        self.m.set_overview(await self.db.run(BatchStore.status_counts),
                            min((j.doc["created_at"] for j in self.jobs.values()), default=None),
                            await self.db.run(BatchStore.stored_bytes))

    def _validate_soon(self, job: _Job) -> None:
        """The batch's validation, in a task of its own: it reads the whole input file (seconds for
        one of max_file_bytes), and the other batches go on meanwhile, their lines started and
        answered, their cancels seen. A fault it does not handle fails the runner, as before."""
        if job.validating or job.validated:
            return
        job.validating = True
        task = asyncio.ensure_future(self._validate(job))
        job.tasks.add(task)

        def validated(t: asyncio.Task) -> None:
            job.tasks.discard(t)
            job.validating = False
            if not t.cancelled() and t.exception() is not None and self.fault is None:
                self.fault = t.exception()
            self.wake.set()
        task.add_done_callback(validated)

    async def _validate(self, job: _Job) -> None:
        doc = job.doc
        model: str | None = None
        try:
            total, errors, model = await asyncio.to_thread(validate, job.path, doc["endpoint"])
        except OSError as e:
            total, errors = 0, [{"code": "file_unreadable", "message": f"the input file cannot be read: {e.strerror}",
                                 "param": "input_file_id", "line": None}]
        if not errors and model is not None and (self.targets(model) is None and self._awaited(model) is None
                                                 or not self.allowed(job.owner, model)):
            # every request names one model, which the gateway does not serve (nor expects back), or
            # which the batch's creator may not use (answered alike): the batch fails whole, as at
            # OpenAI, rather than each line being answered 404
            shown = model if len(model) <= 256 else model[:256] + "…"
            errors = [{"code": "model_not_found", "message": f"The model `{shown}` does not exist or you do not have access to it.",
                       "param": "body.model", "line": None}]
        now = now_s()

        made: list[bool] = []

        def change(d: dict[str, Any]) -> bool:
            if d["status"] != "validating":
                return False
            made.append(True)
            d["model"] = model      # the one its lines name (None: several, each line runs on its own)
            if errors:      # refused whole: no line of it is a request (OpenAI counts none either)
                d.update(status="failed", failed_at=now, errors={"object": "list", "data": errors})
            else:
                d["request_counts"]["total"] = total
                d.update(status="in_progress", in_progress_at=now)
            return True
        job.doc = await self.db.run(BatchStore.update_batch, job.id, change, True) or job.doc
        job.validated = True
        if not made:        # cancelled meanwhile, or validated already (a look at the store read before)
            return
        log.info("batch validated", batch_id=job.id, status=job.doc["status"], lines=total)
        if job.doc["status"] == "failed":
            self.m.batch_done("failed")
            await self._overview()

    def _halt(self, job: _Job, why: str) -> None:
        """No new line goes; those in flight are cancelled and run no more."""
        if job.stopping is None:
            job.stopping = why
            job.ready.clear()
            job.waiting.clear()
            if why == "expired":        # their log lines say so (a cancel is the owner's: a client's)
                for req in self._requests.values():
                    if req.stopped_as is None and (req.log_fields or {}).get("batch_id") == job.id:
                        req.stopped_as = EXPIRED
            for t in job.tasks:
                t.cancel()

    async def _finish_ready(self) -> None:
        for job in list(self.jobs.values()):
            if job.tasks or job.results or job.ending:
                continue
            status = job.doc["status"]
            if job.stopping is not None:
                self._finalize_soon(job, job.stopping)
            elif status == "finalizing" or (status == "in_progress" and job.eof and not job.ready and not job.waiting):
                self._finalize_soon(job, "completed")

    def _finalize_soon(self, job: _Job, final: str) -> None:
        """The batch's end, in a task of its own: writing its files (and naming the lines a cancelled
        or expired batch never ran) takes seconds for a large batch, and the other batches go on
        meanwhile. Not stopped by ``_halt`` (a batch whose end began completes, or, cancelled before
        it was finalizing, ends again as cancelled); a fault it does not handle fails the runner."""
        job.ending = True
        task = asyncio.ensure_future(self._finalize(job, final))
        self.ending.add(task)

        def ended(t: asyncio.Task) -> None:
            self.ending.discard(t)
            job.ending = False
            if not t.cancelled() and t.exception() is not None and self.fault is None:
                self.fault = t.exception()
            self.wake.set()
        task.add_done_callback(ended)

    async def _finalize(self, job: _Job, final: str) -> None:
        """Write the output and error files by streaming the stored lines, then the final state."""
        bid, doc = job.id, job.doc
        now = now_s()
        if final == "completed" and doc["status"] != "finalizing":
            # the store says whether it is still in_progress: a cancel answered since this end began
            # (its doc may be the one the cancel stored) ends it cancelled, at the next look
            def to_finalizing(d: dict[str, Any]) -> bool:
                if d["status"] != "in_progress":
                    return False
                d.update(status="finalizing", finalizing_at=now)
                return True
            job.doc = doc = await self.db.run(BatchStore.update_batch, bid, to_finalizing) or doc
            if doc["status"] != "finalizing":
                return          # cancelled meanwhile: the next refresh halts it
        if final in ("cancelled", "expired"):
            if not doc["request_counts"]["total"]:
                # cancelled before it was validated: its total is its lines, as its upload counted them
                total = await self.db.run(BatchStore.file_lines, doc["input_file_id"])

                def counted(d: dict[str, Any]) -> bool:
                    if d["request_counts"]["total"] >= total:
                        return False
                    d["request_counts"]["total"] = total
                    return True
                if total:
                    job.doc = doc = await self.db.run(BatchStore.update_batch, bid, counted) or doc
        if final == "expired":      # a cancelled batch's lines never run are neither completed nor failed
            try:
                await self._unanswered(job, "batch_expired")
            except OSError as e:        # the lines never answered cannot be named: the batch fails, saying why
                log.error("batch input unreadable", batch_id=bid, exc_info=e)
                job.unreadable = f"the input file could not be read on: {e.strerror or e}"
                final = "failed"
        write = asyncio.ensure_future(asyncio.to_thread(self._write_outputs, bid, job.owner))
        try:
            out_id, err_id = await asyncio.shield(write)
        except asyncio.CancelledError:
            # the gateway stops: a thread cannot be interrupted, and this process waits for it as it
            # exits anyway; waiting here keeps runner.lock held until the files are written, so no
            # other runner writes this batch's files beside them (the next one removes them first)
            log.info("the batch runner stops once the batch's files it writes are written", batch_id=bid)
            with contextlib.suppress(BaseException):      # a second cancel: stop at once
                await asyncio.wait({write})
            if write.done() and not write.cancelled():
                write.exception()       # a failed write removed its files; the next runner writes them
            raise
        now = now_s()

        def done(d: dict[str, Any]) -> bool:
            if d["status"] in ("completed", "failed", "expired", "cancelled"):
                return False
            d.update(status=final, output_file_id=out_id, error_file_id=err_id)
            d[{"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at",
               "failed": "failed_at"}[final]] = now
            counts = d["request_counts"]    # a batch cancelled before it was validated: its lines
            counts["total"] = max(counts["total"], counts["completed"] + counts["failed"])
            if final == "failed":
                d["errors"] = {"object": "list", "data": [{"code": "file_unreadable", "message": job.unreadable,
                                                           "param": "input_file_id", "line": None}]}
            return True
        job.doc = await self.db.run(BatchStore.update_batch, bid, done) or doc
        self.ended.add(bid)
        self.jobs.pop(bid, None)
        await self.db.run(BatchStore.drop_results, bid)
        self.m.batch_done(final)
        await self._overview()
        counts = job.doc["request_counts"]
        log.info("batch finished", batch_id=bid, status=job.doc["status"], completed=counts["completed"],
                 failed=counts["failed"], output_file_id=out_id, error_file_id=err_id)

    async def _unanswered(self, job: _Job, code: str) -> None:
        """An expired batch: each line never answered gets its error line."""
        message = "the batch expired before this request ran"
        offset, line_no = 0, 0
        while True:
            lines, offset, line_no = await asyncio.to_thread(read_chunk, job.path, offset, line_no, 1024)
            if not lines:
                return
            answered = await self.db.run(BatchStore.answered_in, job.id, lines[0].line_no, lines[-1].line_no)
            missing = [Result(ln.custom_id, ln.line_no, False, _output_line(ln.custom_id, None, None, None,
                                                                             {"code": code, "message": message}))
                       for ln in lines if ln.line_no not in answered]
            if missing:
                by_model: dict[str, int] = {}       # counted under the model each names, as a line run is
                for ln in lines:
                    if ln.line_no not in answered:
                        model = self._model_of(ln)
                        by_model[model] = by_model.get(model, 0) + 1
                for model, n in by_model.items():
                    self.m.lines(model, "failed", n)
                await self.db.run(BatchStore.record, job.id, missing)

    def _model_of(self, line: Line) -> str:
        """The model a line counts under: the name it gives when the gateway knows it, else ''."""
        model = line.body.get("model")
        return model if isinstance(model, str) and model and self.targets(model) is not None else ""

    def _write_outputs(self, bid: str, owner: str) -> tuple[str | None, str | None]:
        """On a thread of its own (the store's thread serves the API meanwhile): reads through a
        second connection, as any worker's reader does."""
        store = BatchStore(os.path.join(self.db.dir, "batches.sqlite3"))
        ids: list[str | None] = []
        names = (f"{bid}_output.jsonl", f"{bid}_error.jsonl")
        try:
            # files an earlier try wrote for this batch, which names none of them yet: a gateway
            # stopped (or killed) while it wrote them, whose writing thread a stop cannot interrupt,
            # or stopped before it stored the batch's end; the owner gets one file of each
            for stale in store.output_files_named(owner, names):
                store.delete_file(stale)
                batch_files.remove(self.db.dir, stale)
                log.info("a batch's output file from an earlier try removed", batch_id=bid, file_id=stale)
            ttl_s = batch_files.lifetime(store.output_ttl(bid), self.cfg.file_ttl_s)
            for ok, filename in zip((True, False), names, strict=True):
                if not store.count_results(bid, ok):
                    ids.append(None)
                    continue
                f = batch_files.write_lines(self.db.dir, filename, store.result_lines(bid, ok), ttl_s)
                store.add_file(f, owner)
                ids.append(f["id"])
            return ids[0], ids[1]
        except BaseException:
            # the output file written before the error file failed (a full disk) goes too: the
            # runner started again writes both, and this one would be a file of no batch
            for fid in ids:
                if fid is not None:
                    try:
                        store.delete_file(fid)
                    except Exception:
                        continue            # still in the store: its bytes stay with it
                    batch_files.remove(self.db.dir, fid)
            raise
        finally:
            store.close()

    # -- lines --------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Start every line that has room, oldest batch first."""
        self.rate_due = None
        if self.draining():         # the gateway stops: lines wait for the next start
            return
        now = self.clock()
        room: dict[str, int] = {}
        for job in list(self.jobs.values()):
            if job.doc["status"] != "in_progress" or job.stopping is not None:
                continue
            while job.waiting and job.waiting[0][0] <= now:
                _, _, line, attempts = heapq.heappop(job.waiting)
                job.ready.appendleft((line, attempts))
            # lines in input order, but a line whose model has no room now does not hold back
            # the lines of other models behind it: it waits in place (up to HELD_BACK lines)
            held: list[tuple[Line, int]] = []
            full: set[str] = set()
            while True:
                if not job.ready:
                    if not job.eof and len(held) < HELD_BACK:
                        self._read_ahead(job)
                    break
                line, attempts = job.ready[0]
                model = line.body.get("model")
                model = model if isinstance(model, str) else ""
                if (model and model not in room and model not in full and self.targets(model) is None
                        and self._awaited(model) is None):
                    # no such model (the handler answers it 404): such lines are capped and counted
                    # together, not each model name the file made up on its own, in a dict and a series
                    model = ""
                if model in full or self._held(job.owner, model, now) or not self._may_start(model, room, now):
                    full.add(model)
                    held.append(job.ready.popleft())
                    if len(held) >= HELD_BACK:
                        break
                    continue
                job.ready.popleft()
                self._start(job, line, attempts, model, now)
            if held:
                job.ready.extendleft(reversed(held))

    def _held(self, owner: str, model: str, now: float) -> bool:
        if (cut := self.unreached.get(model)) is not None and cut[0] > now:
            return True
        until = self.held.get((owner, model))
        if until is None:
            return False
        if until > now:
            return True
        del self.held[(owner, model)]
        return False

    def _may_start(self, model: str, room: dict[str, int], now: float) -> bool:
        cfg = self.cfg
        if self.in_flight.get(model, 0) >= cfg.max_concurrency:
            return False
        if cfg.max_lines_per_s and (due := self.next_start.get(model, 0.0)) > now:
            self.rate_due = due if self.rate_due is None else min(self.rate_due, due)
            return False
        if model not in room:
            targets = self.targets(model) if model else None
            if targets is None and (why := self._awaited(model)) is not None:
                self._idle(model, why)      # it may come back: its lines wait for it, uncounted
                room[model] = 0
            elif targets is None:           # no such model: the handler answers it
                room[model] = cfg.max_concurrency
            else:                           # where it may run, the least room (an alias's targets)
                self._know(model, targets)
                room[model] = min(self._room(t, now) for t in targets)
        if room[model] < 1:
            return False
        room[model] -= 1
        return True

    def _room(self, model: str, now: float) -> int:
        """Lines ``model``'s engines take now: none while it cannot run one (no ready endpoint; for a
        model routed as pairs, no ready prefill/decode pair nor whole-request endpoint: its lines
        wait for one), nor while interactive requests wait in its admission queue (this worker's or,
        with ``--workers N``, a sibling's)."""
        cfg = self.cfg
        eps = self.pool.ready(model)
        pairs = self.pairs(model)
        if not serves(eps, pairs):
            self._idle(model, "no ready prefill/decode pair" if pairs and eps else "no ready endpoint")
            return 0
        if model in self.idle:
            self.idle.discard(model)
            log.info("batch lines of a model can run again", model=model)
        if self.admission_waiting(model):
            return 0
        return model_room(eps, cfg.endpoint_capacity, cfg.reserve_slots, cfg.max_kv_usage,
                          self.max_age(), self.engine_signals(), now, pairs)

    def _idle(self, model: str, reason: str) -> None:
        """``model`` cannot run a line: said once as its lines begin to wait."""
        if model in self.idle:
            return
        if len(self.idle) >= IDLE_MODELS:   # models come and go (Kubernetes): kept bounded
            self.idle.clear()
        self.idle.add(model)
        log.warning("batch lines of a model wait: it cannot run one now; they start once it can, uncounted",
                    model=model, reason=reason)

    def _remember(self, model: str) -> None:
        if model not in self.known:
            if len(self.known) >= IDLE_MODELS:
                self.known.clear()
            self.known.add(model)

    def _know(self, model: str, targets: tuple[str, ...]) -> None:
        """The gateway knows ``model`` (it runs on ``targets``): remembered, and a wait for it to
        come back (``_awaited``) ends."""
        self._remember(model)
        if model not in targets and model in self.idle:     # an alias, an adapter: its targets log their own
            self.idle.discard(model)
            log.info("batch lines of a model can run again", model=model)

    def _awaited(self, model: str) -> str | None:
        """Why the lines of ``model``, a name the gateway does not know now, wait for it rather than
        being answered 404 (None: they are): Kubernetes discovery has not listed the pods yet (a
        gateway started again, its API server slow), so it may be one of theirs; or the gateway knew
        it while this runner ran (its pods all gone in a rollout, its config reloaded without it),
        so it may come back within the batch's window; or discovery expects endpoints of it soon (a
        pod of it waits for its address, its last pod left moments ago: ``EndpointPool.awaited``),
        as a request to it then is a 503 to retry."""
        if not model:
            return None
        if not getattr(self.pool, "listed", True):
            return "pods not listed yet"
        if model in self.known:
            return "no such model"
        return "pods on their way" if self.pool.awaited(model) else None

    def _read_ahead(self, job: _Job) -> None:
        """The next chunk of input lines, read on a thread; lines already answered are skipped."""
        if job.reading:
            return
        job.reading = True
        task = asyncio.ensure_future(self._read(job))
        job.tasks.add(task)

        def read(t: asyncio.Task) -> None:
            job.tasks.discard(t)
            job.reading = False
            if not t.cancelled() and t.exception() is not None:
                e = t.exception()
                log.error("batch input unreadable", batch_id=job.id, exc_info=e)
                job.eof = True          # the lines not read are not known: the batch fails, saying why
                job.unreadable = f"the input file could not be read on: {getattr(e, 'strerror', None) or e}"
                self._halt(job, "failed")
            self.wake.set()
        task.add_done_callback(read)

    async def _read(self, job: _Job) -> None:
        lines, job.offset, job.line_no = await asyncio.to_thread(read_chunk, job.path, job.offset, job.line_no)
        if not lines:
            job.eof = True
            return
        answered = await self.db.run(BatchStore.answered_in, job.id, lines[0].line_no, lines[-1].line_no)
        done_here = {r[1] for r in job.results}
        job.ready.extend((ln, 0) for ln in lines if ln.line_no not in answered and ln.line_no not in done_here)

    def _start(self, job: _Job, line: Line, attempts: int, model: str, now: float) -> None:
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        self.m.in_flight(model, 1)
        if self.cfg.max_lines_per_s:
            self.next_start[model] = max(now, self.next_start.get(model, now)) + 1.0 / self.cfg.max_lines_per_s
        rid = "batch_req_" + secrets.token_hex(16)
        task = asyncio.ensure_future(self._run_line(job, line, attempts, model, rid))
        job.tasks.add(task)
        self._tasks_by_rid[rid] = task

        def ended(t: asyncio.Task) -> None:
            job.tasks.discard(t)
            self._tasks_by_rid.pop(rid, None)
            self._requests.pop(rid, None)
            self.preempted.discard(rid)
            ep = self.placed.pop(rid, None)
            if ep is not None:
                self._unplace(rid, ep)
            self.in_flight[model] -= 1
            self.m.in_flight(model, -1)
            self.wake.set()
        task.add_done_callback(ended)

    def _unplace(self, rid: str, endpoint: str) -> None:
        if (on := self.lines_on.get(endpoint)) is not None:
            on.pop(rid, None)
            if not on:                  # endpoints come and go: no empty entry kept per name
                del self.lines_on[endpoint]

    # -- preemption: an interactive request that would wait in an engine's queue takes a batch line's slot

    def on_decision(self, ireq: Any, decision: Any, _fallbacks: Any, _elapsed: float) -> None:
        """A routing decision (a claim: before the request is charged). A batch line's tells where it
        runs; an interactive request that would find no free slot on its endpoint stops the newest
        batch line there, which goes back to the queue (uncounted)."""
        ep = decision.endpoint
        rid = ireq.request_id
        task = self._tasks_by_rid.get(rid)
        if task is not None:
            # a retry elsewhere moves the line: it no longer runs where it was first placed
            if (was := self.placed.get(rid)) is not None and was != ep.name:
                self._unplace(rid, was)
            self.placed[rid] = ep.name
            self.lines_on.setdefault(ep.name, {})[rid] = task
            return
        if ep.name in self.lines_on:
            # not charged yet: it needs one free slot, more where batch lines fill the engine past its
            # capacity (filled to endpoint_capacity before the engine was seen queueing: some queue)
            free = free_slots(ep, self.cfg.endpoint_capacity, self.engine_signals())
            if free < 1:
                self.preempt(ep.name, math.ceil(1 - free))

    def preempt(self, endpoint: str, slots: int = 1) -> bool:
        """The newest batch lines on ``endpoint`` stop and go back to the queue (uncounted), for an
        interactive request routed there with no free slot (here, or in a sibling worker): as many
        as ``slots`` (the slots it lacks: one, or more where batch lines wait in the engine's queue
        ahead of it), less the lines stopped already that have not ended yet (they still count
        there); at least the newest one. Whether one stopped."""
        running = self.lines_on.get(endpoint)
        if not running:
            return False
        ending = sum(1 for rid in self.preempted if self.placed.get(rid) == endpoint)
        for _ in range(max(1, slots - ending)):
            if not running:
                break
            victim = next(reversed(running))
            self.preempted.add(victim)
            if (req := self._requests.get(victim)) is not None:     # its log line says why it stopped
                req.stopped_as = PREEMPTED
            running.pop(victim).cancel()
        return True

    async def _run_line(self, job: _Job, line: Line, attempts: int, model: str, rid: str) -> None:
        body = dict(line.body)
        err = _refused(line.url, body)
        for key in DROPPED:                 # a batch line's answer is one body
            body.pop(key, None)
        if err is not None:
            job.results.append(Result(line.custom_id, line.line_no, False,
                                      _output_line(line.custom_id, 400, rid, err, None)))
            self.m.lines(model, "failed")
            return
        headers = {"content-type": "application/json", "x-priority": "sheddable", "x-request-id": rid}
        if job.owner:
            headers["user"] = job.owner
        retry_after: float | None = None
        unreached = unready = False
        try:        # the body made in here too: a line whose request cannot be made is answered, never lost
            req = LineRequest(line.url, body_bytes(body, _digits_of(line.raw)), headers, {},
                              log_fields={"batch_id": job.id, "custom_id": line.custom_id},
                              acting_for=job.owner or None)
            self._requests[rid] = req
            resp = await self.submit(req)
            status, raw = resp.status, _body_of(resp)
            if status == 429:
                retry_after = _retry_after(resp)
            elif status == 502:
                unreached = _upstream_kind(resp) == UNREACHED
            elif status == 503:       # no ready endpoint, or (the P/D routing's) no ready pair
                unready = (_no_backends(resp) or _no_route(resp)) and self._unready(model)
            elif status == 404:       # the model went meanwhile (its last pod deleted)
                unready = _model_not_found(resp) and self._unready(model)
        except asyncio.CancelledError:
            if rid not in self.preempted:
                raise
            self.preempted.discard(rid)     # gave its slot to an interactive request: again, uncounted
            self._seq += 1
            heapq.heappush(job.waiting, (self.clock(), self._seq, line, attempts))
            self.m.lines(model, "preempted")
            return
        except Exception as e:      # the handler answers every error itself; this is a bug
            log.exception("batch line failed in the gateway", batch_id=job.id, custom_id=line.custom_id)
            status, raw = 500, orjson.dumps({"error": {"message": f"internal gateway error: {type(e).__name__}",
                                                       "type": "server_error", "param": None, "code": "internal_error"}})
        if not unreached and not unready:   # an engine answered (or the gateway itself): the model is reached
            self.unreached.pop(model, None)
        # not the line's fault: a limit, a drain, no engine could be connected to, or none was ready
        free = status == 429 or unreached or unready or (status == 503 and self.draining())
        if free or (status in RETRY_STATUSES and attempts + 1 < self.cfg.max_attempts):
            counted = attempts if free else attempts + 1
            delay = min(MAX_BACKOFF_S, self.cfg.retry_backoff_s * (2 ** max(0, counted - 1)))
            if unreached:               # none of the model's lines starts until the wait ends
                delay = self._unreached(model)
            elif unready:               # back in the queue at once: the dispatch holds it until one is ready
                delay = 0.0
            if status == 429:           # the limit says when: until then no line of the owner's goes there
                if retry_after is not None:
                    delay = min(MAX_BACKOFF_S, retry_after)
                key = (job.owner, model)
                self.held[key] = max(self.held.get(key, 0.0), self.clock() + delay)
            self._seq += 1
            heapq.heappush(job.waiting, (self.clock() + delay, self._seq, line, counted))
            self.m.lines(model, "retried")
            return
        try:
            parsed = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            parsed = raw.decode("utf-8", "replace")
        ok = status == 200
        usage = _usage(parsed) if ok else NO_USAGE
        out = _output_line(line.custom_id, status, rid, parsed, None)
        job.results.append(Result(line.custom_id, line.line_no, ok, out, usage))
        self.m.lines(model, "completed" if ok else "failed")

    def _unready(self, model: str) -> bool:
        """A line of ``model`` was answered 503 no ready endpoint (or no ready pair) after the
        dispatch found it room: whether a model it runs on cannot run a line now (its engine, or
        every decode of a P/D model, went unready in between), so the line waits as a line that
        found none at its start, where ``_room`` holds it. Where the model still can, the routing
        refused for its own reasons (prefill and decode endpoints routed whole, none serving the
        path), and the 503 is counted as before."""
        targets = self.targets(model) if model else None
        if targets is None:         # the model went, or the pods are not listed yet: it may come back
            return self._awaited(model) is not None
        return any(not serves(self.pool.ready(t), self.pairs(t)) for t in targets)

    def _unreached(self, model: str) -> float:
        """A line of ``model`` reached no engine: the seconds until its lines start again. A line
        ending so during the model's wait waits its end; after it, the next wait is twice as long
        (from ``retry_backoff_s``, at most ``MAX_BACKOFF_S``). Its probes soon find the engine not
        ready, and the lines wait for a ready one, as without this."""
        now = self.clock()
        until, run = self.unreached.get(model, (0.0, 0))
        if until > now:
            return until - now
        delay = min(MAX_BACKOFF_S, self.cfg.retry_backoff_s * 2 ** min(run, 16))
        self.unreached[model] = (now + delay, run + 1)
        if run == 0:
            log.warning("batch lines of a model reached no engine; they wait and are tried again uncounted",
                        model=model or "-", retry_in_s=delay)
        return delay

    async def _flush_all(self) -> None:
        for job in list(self.jobs.values()):
            if job.results:
                results, job.results = job.results, []
                doc = await self.db.run(BatchStore.record, job.id, results)
                if doc is not None:
                    job.doc["request_counts"] = doc["request_counts"]


def _refused(url: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The 400 of a line whose answer could not be one JSON body in the output file, no engine
    asked: a chat or completions line asking for a stream (as OpenAI's Batch API refuses it; a
    false ``stream`` is dropped with ``stream_options``), an embeddings line asking for vLLM's binary
    embeddings (the vectors' bytes and a metadata header). None for any other line."""
    stream = body.get("stream")
    if stream is not None and stream is not False and url in STREAMING_PATHS:
        try:
            streams = lax_bool(stream)
        except ValueError as e:
            return error_body(400, f"stream: {e}", param="stream")
        if streams:
            return error_body(400, "a batch line is answered with one JSON body in the output file: "
                                   "'stream' must be false or left out", param="stream")
    if url in BINARY_PATHS and body.get("encoding_format") in BINARY_FORMATS:
        return error_body(400, f"encoding_format {body['encoding_format']!r} answers bytes, which a batch's "
                               "output file cannot hold; use 'base64'", param="encoding_format")
    return None


def _digits_of(raw: bytes) -> bytes:
    """What a line's re-encoded body takes its integers past 64 bits from (``body_bytes``): its
    body alone, less the keys a line's body loses, as Python's json writes it (an integer with its
    digits), so that no integer elsewhere in the line (a key of the line's own beside ``body``, a
    dropped ``stream_options``) read as the same double takes the place of one of the body's.
    Empty for a line that holds no such integer (``raw`` empty)."""
    if not raw:
        return b""
    try:
        body = json.loads(raw)["body"]
        for key in DROPPED:
            body.pop(key, None)
        return json.dumps(body, ensure_ascii=False).encode()
    except (RecursionError, ValueError):     # nested deeper than Python's json goes: the whole line, as before
        return raw


def _body_of(resp: Any) -> bytes:
    body = getattr(resp, "body", None)
    if isinstance(body, bytes | bytearray):
        return bytes(body)
    return b""


def _upstream_kind(resp: Any) -> str | None:
    """Why the gateway could not get an engine's answer (its ``x-error-upstream``), if it says."""
    headers = getattr(resp, "headers", None)
    return None if headers is None else headers.get("x-error-upstream")


def _no_backends(resp: Any) -> bool:
    """The gateway's 503 for a model with no ready endpoint (its ``x-error-no-model-backends``)."""
    headers = getattr(resp, "headers", None)
    return headers is not None and headers.get("x-error-no-model-backends") == "true"


def _model_not_found(resp: Any) -> bool:
    """The gateway's 404 for a model it does not know (its ``x-error-no-model-backends`` names it),
    not an engine's 404."""
    headers = getattr(resp, "headers", None)
    return headers is not None and headers.get("x-error-no-model-backends") is not None


def _no_route(resp: Any) -> bool:
    """The routing's 503 when its strategy found nothing to route to (``x-error-routing``): the
    P/D strategy's when no roleset has a ready prefill and a ready decode."""
    headers = getattr(resp, "headers", None)
    return headers is not None and headers.get("x-error-routing") == "true"


def _retry_after(resp: Any) -> float | None:
    """The wait a 429 asks for, in seconds (``retry-after-ms``, else ``Retry-After``), if it says."""
    headers = getattr(resp, "headers", None)
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1000.0), ("Retry-After", 1.0)):
        try:
            wait = float(headers.get(name, ""))
        except ValueError:
            continue
        if wait >= 0:
            return wait / scale
    return None


def _usage(body: Any) -> tuple[int, int, int, int]:
    """An answer's prompt, completion, cached and reasoning tokens: the reasoning tokens where vLLM
    puts them (``completion_tokens_details``, with a reasoning parser), else where SGLang does (beside
    ``prompt_tokens``); 0 for a figure it does not give."""
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return NO_USAGE
    p, c = u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") or 0 if isinstance(details, dict) else 0
    details = u.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else None
    if reasoning is None:
        reasoning = u.get("reasoning_tokens")
    return (_count(p), _count(c), _count(cached), _count(reasoning))


def _count(v: Any) -> int:
    return v if type(v) is int and v >= 0 else 0


def _output_line(custom_id: str, status: int | None, request_id: str | None, body: Any,
                 error: dict[str, Any] | None) -> bytes:
    """A line of the output or error file, in OpenAI's shape."""
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return orjson.dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
                         "response": response, "error": error})
