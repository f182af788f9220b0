"""The workers of one gateway (``--workers N``) read each other's figures, so that ``/metrics`` and
``/status.json`` show the whole gateway whichever worker the kernel handed the connection to.

Worker *i* listens on ``worker-<i>.sock`` in the parent's private directory (gateway/server/workers.py
``RunDirectory``, mode 0700). A sibling connects, sends one line naming what it wants
(``metrics``: this worker's own exposition; ``status``: its part of the status page; ``rget`` or
``rdel`` and a response id: an entry of the Responses memory backend, which each worker keeps for
the responses it answered), reads the answer to the end of the stream, and the connection closes. The worker that answers a scrape asks
all its siblings at once and waits at most ``timeout`` (0.5 s) in all: a worker that is restarting
or whose event loop is stuck is left out of that answer rather than holding it up. For
``/metrics``, its last answer is used in its place when there is one (so the gateway's counters do
not dip for one scrape), and ``switchyard_workers_scraped`` says how many answered.

A worker that dies takes its counts with it, and the sums would fall by them: Prometheus reads a
fall as a reset and counts everything the other workers had counted again. So each worker keeps
what it last reported (to a scrape it answered or to a sibling's question) in
``metrics-<i>.prom`` beside its socket, and a restarted worker adds its predecessor's counters,
histograms and summaries (not its gauges) to its own: the sums never fall below what a scrape saw.

Only built with several workers: one process opens no socket and runs no task for this.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.merge import merge, merge_texts, render
from gateway.server.workers import WorkerInfo

log = structlog.get_logger("switchyard.siblings")

TIMEOUT_S = 0.5
KINDS = (b"metrics", b"status")
# questions with an argument: the Responses memory backend's ``rget|rdel <store> <response id>``
# (gateway/apis/responses_state.py ``WorkerStore``)
QUESTIONS = (b"rget ", b"rdel ")
MAX_REQUEST = 320


class Siblings:
    """This worker's socket for its siblings, and its questions to them."""

    def __init__(self, worker: WorkerInfo, answer: Callable[[str], Awaitable[bytes]],
                 timeout: float = TIMEOUT_S) -> None:
        self.worker = worker
        self.path = worker.socket_path(worker.index)
        self.peers = {i: worker.socket_path(i) for i in range(worker.count) if i != worker.index}
        self._answer = answer
        self.timeout = timeout
        self._server: asyncio.AbstractServer | None = None
        self._last: dict[int, bytes] = {}            # a sibling's last /metrics answer
        self.reported_path = os.path.join(os.path.dirname(self.path), f"metrics-{worker.index}.prom")
        self._carried: str | None = None             # the counts of this index's earlier workers

    # -- this worker's side ----------------------------------------------------------------------

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):      # a restarted worker takes its predecessor's path
            os.unlink(self.path)
        self._carried = carried_counts(self.reported_path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    def own(self, text: bytes) -> bytes:
        """This worker's exposition as it reports it: its own, plus what its predecessors counted;
        kept as the last reported (written aside, then renamed: a reader never sees half)."""
        if self._carried is not None:
            text = merge_texts([text.decode(), self._carried])
        tmp = self.reported_path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(text)
            os.replace(tmp, self.reported_path)
        except OSError:             # the directory gone (the parent is stopping): nothing to carry
            pass
        return text

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5.0):
                kind = (await reader.readline())[:MAX_REQUEST].strip()
                if kind in KINDS or kind.startswith(QUESTIONS):
                    writer.write(await self._answer(kind.decode()))
                    await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.exception("answering a sibling failed")
        finally:
            writer.close()

    # -- asking the siblings ---------------------------------------------------------------------

    async def _ask_one(self, path: str, kind: str) -> bytes:
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(kind.encode() + b"\n")
            await writer.drain()
            return await reader.read()
        finally:
            writer.close()

    async def ask(self, kind: str) -> dict[int, bytes]:
        """The siblings that answered ``kind`` (one line: ``metrics``, ``status``, or a question of
        ``QUESTIONS``) within the timeout, by index (an empty answer is none)."""
        tasks = {i: asyncio.ensure_future(self._ask_one(path, kind)) for i, path in self.peers.items()}
        if tasks:
            await asyncio.wait(tasks.values(), timeout=self.timeout)
        out = {}
        for i, t in tasks.items():
            if not t.done():
                t.cancel()
            elif not t.cancelled() and t.exception() is None and t.result():
                out[i] = t.result()
        return out

    async def metrics(self, own: bytes) -> bytes:
        """The gateway's exposition: this worker's ``own`` merged with its siblings'."""
        answers = await self.ask("metrics")
        self._last.update(answers)
        texts = [own.decode()]
        texts += [(answers.get(i) or self._last[i]).decode() for i in self.peers if i in answers or i in self._last]
        families = merge(texts)
        workers = GaugeMetricFamily("switchyard_workers", "Worker processes of this gateway (server.workers)",
                                    value=self.worker.count)
        scraped = GaugeMetricFamily("switchyard_workers_scraped",
                                    "Workers whose figures this /metrics answer holds fresh (the others: their "
                                    "last answer, or nothing)", value=1 + len(answers))
        extra = [workers, scraped]
        beats = self.worker.heartbeats
        if beats is not None:           # the parent's count (gateway/server/heartbeat.py): the gateway's, not summed
            restarts = CounterMetricFamily("switchyard_worker_restarts",
                                           "Workers the parent started again: after one exited, or after it killed "
                                           "one whose event loop stalled (server.worker_stall_timeout_s)",
                                           labels=["reason"])
            for reason, n in beats.restarts().items():
                restarts.add_metric([reason], n)
            extra.append(restarts)
        return render([*families, *extra])


def carried_counts(path: str) -> str | None:
    """The counters, histograms and summaries of the exposition a dead worker last reported (its
    file at ``path``), as text; None when there is none. Its gauges held what that process held,
    gone with it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    try:
        families = [fam for fam in text_string_to_metric_families(text)
                    if fam.type in ("counter", "histogram", "summary")]
    except Exception:               # a damaged file: start from zero, as before
        log.warning("a dead worker's reported metrics could not be read", path=path)
        return None
    return render(families).decode() if families else None


def lifecycle(siblings: Siblings) -> Callable:
    async def ctx(_app) -> AsyncIterator[None]:
        await siblings.start()
        try:
            yield
        finally:
            await siblings.stop()
    return ctx
