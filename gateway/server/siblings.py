"""The workers of one gateway (``--workers N``) read each other's figures, so that ``/metrics`` and
``/status.json`` show the whole gateway whichever worker the kernel handed the connection to.

Worker *i* listens on ``worker-<i>.sock`` in the parent's private directory (gateway/server/workers.py
``RunDirectory``, mode 0700). A sibling connects, sends one line naming what it wants
(``metrics``: this worker's own exposition; ``status``: its part of the status page; ``view``: its
whole routing view, for a sibling catching up (gateway/view/service.py); ``rget`` or
``rdel`` and a response id: an entry of the Responses memory backend, which each worker keeps for
the responses it answered), reads the answer, and the connection closes. The answer is its length
in decimal on a line of its own, then that many bytes: a worker killed while it wrote a long
answer (an exposition of hundreds of KB takes several writes) leaves its asker the first part and
the end of the stream, which without the length would read as the whole answer (a cut exposition's
missing series, a sum that falls; half a JSON document). An answer cut short is taken as the
worker's death (``GONE``). The worker that answers a scrape asks
all its siblings at once and waits at most ``timeout`` (0.5 s) in all: a worker that is restarting
or whose event loop is stuck is left out of that answer rather than holding it up (and a scrape
whose client leaves first ends its questions with it, so that none waits on a stuck sibling with a
socket held until that sibling is restarted). For
``/metrics``, what it last reported is used in its place (below), and ``switchyard_workers_scraped``
says how many answered.

A worker that dies takes its counts with it, and the sums would fall by them: Prometheus reads a
fall as a reset and counts everything the other workers had counted again. So each worker keeps
what it last reported (to a scrape it answered or to a sibling's question) in
``metrics-<i>.prom`` beside its socket: its own exposition, then (after the line ``CARRIED``) the
counters, histograms and summaries of the earlier workers of its index. The worker answering a
scrape reads that file for a sibling that does not answer: all of it for one that is slow (its
gauges are still what it holds), only the counts for one that is gone (its socket refuses: dead or
not yet started again; what it held went with it). A restarted worker carries its predecessor's
counts on in its own reports, so the sums never fall below what a scrape saw, whichever worker
answered it; it writes them as its report as soon as it starts, so that one slow to make its first
report is not read with its predecessor's gauges.

An endpoint's counts are in the answer while every living worker has the endpoint (in its pool,
or gone from it for less than ``server.removed_endpoint_series_s``: ``RetiredSeries``; each says
which in its report, ``ENDPOINTS``), every worker's and every carried part alike: the workers drop
a removed endpoint's series each on its own sweep, and once one has, the sum of the others would
fall before the series went; and a carried part or a dead worker's would bring the endpoint back.
A worker that drops an endpoint's series drops the ones it carries too.

The status page's counts since start (requests, fallbacks, requests with latency objectives) are kept the same way, in
``status-<i>.json``, with each report of the metrics and each part of the page.

Only built with several workers: one process opens no socket and runs no task for this.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import orjson
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from gateway.observability.merge import (
    COUNTER_RULES,
    OPENMETRICS,
    counts_only,
    endpoints_of,
    merge,
    merge_chains,
    openmetrics,
    parse,
    render,
    without_endpoints,
)
from gateway.server.workers import WorkerInfo

log = structlog.get_logger("switchyard.siblings")

TIMEOUT_S = 0.5
KINDS = (b"metrics", b"status", b"view")
# questions with an argument: the Responses memory backend's ``rget|rdel <store> <response id>``
# (gateway/apis/responses_state.py ``WorkerStore``)
QUESTIONS = (b"rget ", b"rdel ")
MAX_REQUEST = 320
# in a worker's report, the line between its own exposition and the counts of its index's earlier workers
CARRIED = b"# carried: the counts of this worker's predecessors\n"
# in a worker's own part, the (model, endpoint) it has series of, as a JSON list of pairs (a comment
# to the exposition's parser)
ENDPOINTS = b"# endpoints: "
# a sibling that refused (or dropped) the connection, or whose answer was cut short, is gone; one that
# did not answer in time is slow
GONE = (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, BrokenPipeError)


class CutShort(ConnectionResetError):
    """A sibling's answer ended before the length it announced: the sibling died while it wrote it."""


class Siblings:
    """This worker's socket for its siblings, and its questions to them."""

    def __init__(self, worker: WorkerInfo, answer: Callable[[str], Awaitable[bytes]],
                 timeout: float = TIMEOUT_S, endpoints: Callable[[], set[tuple[str, str]]] | None = None,
                 counter_rules: dict[str, str] = COUNTER_RULES) -> None:
        self.worker = worker
        self.counter_rules = counter_rules          # the counters taken as the largest of the workers'
        self.path = worker.socket_path(worker.index)
        self.peers = {i: worker.socket_path(i) for i in range(worker.count) if i != worker.index}
        self._answer = answer
        # the (model, endpoint) this worker has series of: its pool's, and those that left it lately
        self.endpoints = endpoints
        self.timeout = timeout
        self._server: asyncio.AbstractServer | None = None
        self.reported_path = self.report_path(worker.index)
        self.status_path = os.path.join(worker.run_dir, f"status-{worker.index}.json")
        self._carried: list[Metric] = []             # the counts of this index's earlier workers
        self._carried_text = b""
        # the status page's counts since start (``StatusBoard.carry``): told those of this index's
        # earlier workers at start
        self.carry_status: Callable[[dict], None] | None = None
        # and read (``StatusBoard.counts``) to be kept with each report of this worker's metrics
        self.status_counts: Callable[[], dict] | None = None

    def report_path(self, index: int) -> str:
        return os.path.join(self.worker.run_dir, f"metrics-{index}.prom")

    # -- this worker's side ----------------------------------------------------------------------

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):      # a restarted worker takes its predecessor's path
            os.unlink(self.path)
        self._set_carried(gone_counts(self.reported_path))
        # its report until it makes one: nothing of its own, its predecessors' counts. A sibling
        # that finds it slow reads this file gauges included, and the predecessor's gauges (its
        # requests in flight, its connections) went with it
        _write(self.reported_path, CARRIED + self._carried_text)
        if self.carry_status is not None:
            counts = _read_json(self.status_path)
            if counts is not None:
                self.carry_status(counts)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    def _set_carried(self, families: list[Metric]) -> None:
        self._carried = families
        self._carried_text = render(families) if families else b""

    def forget(self, endpoints: Collection[tuple[str, str]]) -> None:
        """This worker dropped these endpoints' series, ``(model, endpoint)`` pairs
        (gateway/observability/metrics.py ``RetiredSeries``): the ones it carries go too, in one
        pass over what it carries however many they are."""
        carried = endpoints_of(self._carried)
        if not carried.isdisjoint(endpoints):
            self._set_carried(without_endpoints(self._carried, carried.difference(endpoints)))

    def own(self, text: bytes) -> bytes:
        """This worker's report: its own exposition ``text`` and the endpoints it has series of, then
        what its predecessors counted; kept as the last reported (written aside, then renamed: a
        reader never sees half)."""
        if self.endpoints is not None:
            text += ENDPOINTS + orjson.dumps(sorted(self.endpoints())) + b"\n"
        report = text + CARRIED + self._carried_text if self._carried_text else text
        _write(self.reported_path, report)
        if self.status_counts is not None:      # the page's counts since start, kept as often as these
            self.keep_status(self.status_counts())
        return report

    def keep_status(self, counts: dict) -> None:
        """The status page's counts since start as this worker last reported them."""
        _write(self.status_path, orjson.dumps(counts))

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
                    answer = await self._answer(kind.decode())
                    writer.write(b"%d\n" % len(answer))    # its length first: an asker can tell a cut answer
                    writer.write(answer)
                    await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # the loop is ending (a stop, a failed start). The task ends quietly: on Python 3.11 the
            # stream server asks a cancelled handler for its exception from a callback, and that
            # prints "Exception in callback" and a traceback on every worker's way out
            pass
        except Exception:
            log.exception("answering a sibling failed")
        finally:
            writer.close()

    # -- asking the siblings ---------------------------------------------------------------------

    async def _ask_one(self, path: str, kind: str) -> bytes:
        """The sibling's answer to ``kind``: b"" when it closed without one; ``CutShort`` when it
        ended before the length it announced."""
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(kind.encode() + b"\n")
            await writer.drain()
            head = await reader.readline()
            if not head:
                return b""
            if not head.endswith(b"\n") or not head[:-1].isdigit():
                raise CutShort(f"a sibling's answer to {kind!r} was cut short")
            try:
                return await reader.readexactly(int(head))
            except asyncio.IncompleteReadError:
                raise CutShort(f"a sibling's answer to {kind!r} was cut short") from None
        finally:
            writer.close()

    async def _gather(self, kind: str) -> tuple[dict[int, bytes], set[int]]:
        """The siblings' answers to ``kind`` within the timeout, by index, and the siblings that are
        gone (refused or dropped the connection: dead, or not started again yet)."""
        tasks = {i: asyncio.ensure_future(self._ask_one(path, kind)) for i, path in self.peers.items()}
        try:
            if tasks:
                await asyncio.wait(tasks.values(), timeout=self.timeout)
        except asyncio.CancelledError:
            # the asker was cancelled (its client left): the questions end with it, each holding a
            # socket to a sibling that may not answer for long (a stuck loop, until it is restarted)
            for t in tasks.values():
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()           # retrieved: not reported as never retrieved
            raise
        out, gone = {}, set()
        for i, t in tasks.items():
            if not t.done():
                t.cancel()
            elif not t.cancelled() and t.exception() is None and t.result():
                out[i] = t.result()
            elif not t.cancelled() and isinstance(t.exception(), GONE):
                gone.add(i)
        return out, gone

    async def ask_worker(self, index: int, kind: str, timeout: float) -> bytes | None:
        """Sibling ``index``'s answer to ``kind``: b"" when it did not answer within ``timeout``
        (stuck, or broke off), None when it is not there (dead, or not started yet)."""
        path = self.peers.get(index)
        if path is None:
            return None
        try:
            async with asyncio.timeout(timeout):
                return await self._ask_one(path, kind)
        except GONE:
            return None
        except (OSError, TimeoutError):
            return b""

    async def ask(self, kind: str) -> dict[int, bytes]:
        """The siblings that answered ``kind`` (one line: ``metrics``, ``status``, or a question of
        ``QUESTIONS``) within the timeout, by index (an empty answer is none)."""
        return (await self._gather(kind))[0]

    async def status_parts(self) -> tuple[list[bytes], list[dict]]:
        """The siblings' parts of the status page, and the counts since start last reported by
        those that did not answer (``keep_status``)."""
        answers, _ = await self._gather("status")
        kept = [_read_json(os.path.join(self.worker.run_dir, f"status-{i}.json")) for i in self.peers
                if i not in answers]
        return list(answers.values()), [k for k in kept if k is not None]

    async def metrics(self, own: bytes, fmt: tuple[Callable[[Any], bytes], str] | None = None) -> bytes:
        """The gateway's exposition: this worker's ``own`` (its registry's, in the text format)
        merged with its siblings' and the counts carried from the dead; in the text format, or in
        ``fmt``, what ``choose_encoder`` chose for the scrape (its encoder and Content-Type)."""
        self.own(own)
        answers, gone = await self._gather("metrics")
        living: list[list[Metric]] = [parse(own.decode())]
        # each index's parts: its worker's own (counts only for a gone one), then what it carries
        chains: list[list[list[Metric]]] = [[living[0], self._carried]]
        known = self.endpoints() if self.endpoints is not None else None
        for i in self.peers:
            report = answers.get(i)
            if report is None:          # slow or gone: what it last reported
                report = _read(self.report_path(i))
                if report is None:
                    continue
            mine, _, before = report.partition(CARRIED)
            try:
                fams = parse(mine.decode())
                earlier = parse(before.decode())
            except Exception:           # a damaged file: left out
                log.warning("a worker's reported metrics could not be read", worker=i)
                continue
            if i in gone:
                chains.append([counts_only(fams), earlier])
            else:
                chains.append([fams, earlier])
                living.append(fams)
                theirs = _endpoints_in(mine)
                if known is not None and theirs is not None:
                    # shown while every living worker has it: the workers drop a removed
                    # endpoint's series each on its own sweep, and once one has, the sum would fall
                    known &= theirs
        if known is None:
            known = set().union(*(endpoints_of(fams) for fams in living))
        families = merge_chains([[without_endpoints(fams, known) for fams in chain] for chain in chains],
                                self.counter_rules)
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
        if fmt is None:
            return render([*families, *extra])
        encoder, content_type = fmt
        return render(openmetrics([*families, *extra]) if content_type.startswith(OPENMETRICS) else [*families, *extra],
                      encoder)


def _endpoints_in(part: bytes) -> set[tuple[str, str]] | None:
    """The (model, endpoint) a worker's own part says it has series of (``ENDPOINTS``); None when it
    says nothing."""
    at = part.rfind(ENDPOINTS)
    if at < 0:
        return None
    line = part[at + len(ENDPOINTS):part.find(b"\n", at)]
    try:
        return {(m, e) for m, e in orjson.loads(line)}
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None


def _write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:             # the directory gone (the parent is stopping): nothing to carry
        pass


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _read_json(path: str) -> dict | None:
    data = _read(path)
    if data is None:
        return None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def gone_counts(path: str) -> list[Metric]:
    """The counters, histograms and summaries of the report a gone worker last made (its file at
    ``path``, see ``Siblings.own``): its own and those it carried. Its gauges held what that
    process held, gone with it. Empty when there is none."""
    report = _read(path)
    if report is None:
        return []
    mine, _, before = report.partition(CARRIED)
    try:
        # one index's workers, one after the other: every count added up, those taken as the
        # largest over the workers too (``merge_chains``)
        return merge([counts_only(parse(mine.decode())), parse(before.decode())], upward=True, counter_rules={})
    except Exception:               # a damaged file: start from zero, as before
        log.warning("a dead worker's reported metrics could not be read", path=path)
        return []


def lifecycle(siblings: Siblings) -> Callable:
    async def ctx(_app) -> AsyncIterator[None]:
        await siblings.start()
        try:
            yield
        finally:
            await siblings.stop()
    return ctx
