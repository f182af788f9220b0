"""Subscribe to the engines' KV-cache events and keep the event index (``gateway.kv.index``).

One subscriber task per endpoint whose model enables ``kv_events`` (or whose pod carries the
``switchyard.io/kv-events`` annotation): a ZMQ SUB socket on ``tcp://<endpoint host>:<port>``
filtered by ``topic``, reading ``(topic, seq, payload)`` messages (``gateway.kv.wire``).

* Reading costs the event loop little: the socket is a plain one whose descriptor the loop watches;
  its reader callback receives, decodes (typed, ``gateway.kv.wire``) and applies every message
  already there in one go, with no future or task switch per message. A malformed message is
  counted (``switchyard_kv_events_decode_errors_total``) and skipped; nothing stops the stream. A
  message over ``MAX_MESSAGE_BYTES`` is refused by the socket, which drops the connection; the
  subscriber connects again, and what it missed is a gap. A message over ``STRETCH_BYTES`` (a long
  prompt's prefill) goes to the subscriber's task with every message after it, and is applied in
  stretches with the loop let run between them (``EventIndex.stretches``).
* Sequence numbers: the next message must carry the next number. On a gap the subscriber asks the
  engine's replay socket (a DEALER to ``replay_port``: the start seq as 8 bytes big-endian; frames
  ``(seq, payload)`` back, ending with seq -1) for what it missed and applies it in order. Without
  a replay port, or when the engine's buffer no longer holds the start, the endpoint's entries are
  cleared (a partial history would point requests at blocks the engine may have dropped).
* Each time the SUB socket connects (the first time, and after every reconnect) the subscriber
  asks the replay socket for what it has not heard (``Subscriber.catch_up``): an idle engine
  publishes nothing, so neither a first contact nor a gap would show until its next batch. A first
  message past 0 with no catch-up before it still replays from 0.
* A sequence number lower than expected means a new publisher: the engine restarted, and its
  entries are cleared; its stream is then taken up as at first contact, replayed from 0 when the
  number is past 0 (what the new engine published before the socket connected again). A restarted engine that publishes nothing (no request came) is found by
  the scraper instead, its start time having changed (``engine_restarted``): its entries are
  cleared then, and its streams taken up again as at first contact.
* Every endpoint of an enabled model is synced with the pool once a second: a new endpoint gets a
  subscriber, a removed one loses its subscriber and its entries.
* A clear (any of the above, or an ``AllBlocksCleared``) takes the endpoint's entries out of routing
  at once; a task of the manager unlinks them from the index, ``CLEAR_STRETCH`` of them a loop turn
  (``EventIndex.drain``).
* Data parallelism (``data_parallel_size`` N > 1): the engine behind the endpoint runs N ranks, and
  rank r publishes on ``port + r`` (replay on ``replay_port + r``), as vLLM's and SGLang's
  publishers offset their endpoints. The endpoint gets one subscriber per rank, each with its own
  sequence numbers, first-contact replay and gap replay; its hashes are qualified by its rank
  (``gateway.kv.wire``), so a gap that cannot be replayed, a restart or an ``AllBlocksCleared`` on
  one rank clears that rank's entries only: out of routing at once, dropped from the endpoint's
  maps by the same task, a stretch a loop turn (``EventIndex.clear_rank``). Liveness stays per endpoint: an event from any rank
  counts, because the engine, not the gateway, picks the rank that serves a request, and a rank it
  leaves idle publishes nothing (a per-rank stall timer would take an idle rank for a dead one).

Routing reads the index through ``match`` / ``routed`` / ``covers`` (the ``prefix-cache`` strategy's
``PreciseIndex``), never awaiting anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import structlog
from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.apis.paths import PASSTHROUGH_PATHS, RESPONSES
from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv.index import CLEAR_STRETCH, Applied, EndpointState, EventIndex, request_root
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import AHEAD_CHARS, ANSWER_SAMPLE, ANSWERS_UNHELD, INLINE_CHARS, ModelTokenizer
from gateway.kv.wire import END_SEQ, Batch, BatchDecoder, WireError, seq_of
from gateway.request import CHAT, EMBEDDINGS, InferenceRequest

log = structlog.get_logger("switchyard.kv_events")

SYNC_INTERVAL_S = 1.0
_DRAIN = 256              # messages one reader callback applies before yielding to the loop
# what a replay takes in (an engine's replay buffer holds its recent batches; more than this is
# not a replay): frames and bytes; beyond either it stops, incomplete
REPLAY_MAX_FRAMES = 20_000
# requests whose prompt is not keyed on the events (nor counted as failing to tokenize)
NOT_KEYED = frozenset((EMBEDDINGS, *PASSTHROUGH_PATHS))
REPLAY_MAX_BYTES = 64 << 20
# messages held while a replay is under way (an engine whose replay never answers, with a gap in
# every other message, filled it without end): beyond this they are dropped, the publisher's
# entries cleared, and its stream taken up again as at first contact
BACKLOG_MAX = 4096
# the largest message taken from an engine (a live batch, or one batch of a replay). An engine step's
# events are tens of KB (a 128k-token prefill's BlockStored is about 0.5 MB); a larger message is
# refused by the socket itself, which drops the connection before holding it in memory, so what
# the engine sent meanwhile is a gap (replayed, or the entries cleared). A 32 MB message of 1.2M
# blocks held a worker's loop for 13 s and 600 MB of memory, and a 200 MB one for longer than
# worker_stall_timeout_s
MAX_MESSAGE_BYTES = 8 << 20
# a message larger than this (a long prompt's prefill: a 128k-token one is about 0.6 MB) is not
# applied in the reader callback but by the subscriber's task, in stretches of
# ``kv_index.STRETCH_BLOCKS`` blocks with the loop let run between them; the messages after it wait
# behind it, as behind a replay. Smaller ones (an engine step's events, tens of KB) take no more
# than a millisecond or two at once
STRETCH_BYTES = 64 << 10
# the backlog's mark for a catch-up (``Subscriber.catch_up``), where a message's sequence number goes
CATCH_UP = -2
# a malformed message is counted every time, and warned of at most once in this many seconds
BAD_LOG_EVERY_S = 10.0
# a stretch of a cleared endpoint's entries whose unlinking raised (a bug) is tried again at the
# next loop turn; while it keeps raising, once in this many seconds
DRAIN_RETRY_S = 1.0
# switchyard_kv_events_total's kinds, in the order of kv_index.Applied's counts, then the unknown events
_KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "orphan", "unknown")


class KVEventsMetrics:
    def __init__(self, registry: Any) -> None:
        self.events = Counter("switchyard_kv_events", "KV-cache events received, by kind", ["model", "kind"],
                              registry=registry)
        self.fallbacks = Counter("switchyard_kv_events_fallbacks",
                                 "Endpoints (or requests) routed on the approximate index instead of events",
                                 ["model", "reason"], registry=registry)
        self.replays = Counter("switchyard_kv_events_replays",
                               "Replays asked of an engine: after a gap, and at each connection of its publisher's "
                               "socket (catch-up)", ["model", "result"], registry=registry)
        self.replayed = Counter("switchyard_kv_events_replayed_batches",
                                "Event batches applied from an engine's replay socket (not heard live)", ["model"],
                                registry=registry)
        self.gaps = Counter("switchyard_kv_events_gaps",
                            "Sequence gaps seen on an engine's live stream (messages missed; replayed, or the "
                            "entries cleared)", ["model"], registry=registry)
        self.restarts = Counter("switchyard_kv_events_restarts",
                                "Engines seen restarting (sequence numbers started again); entries cleared",
                                ["model"], registry=registry)
        self.errors = Counter("switchyard_kv_events_decode_errors", "Messages that were not event batches",
                              ["model"], registry=registry)
        self.rank_routed = Counter("switchyard_kv_events_rank_routed",
                                   "Requests pinned to a data-parallel rank of their endpoint (X-data-parallel-rank): "
                                   "match = the rank holding the deepest prefix, load = none holds one, the "
                                   "rank with the fewest of this gateway's requests",
                                   ["model", "reason"], registry=registry)
        self.drain_errors = Counter("switchyard_kv_events_drain_errors",
                                    "Stretches of a cleared endpoint's (or rank's) old entries whose unlinking "
                                    "raised (bugs: the first of a run is logged with its traceback); tried again",
                                    registry=registry)
        self.off_loop = Counter("switchyard_kv_events_tokenized_off_loop",
                                "Prompt segments tokenized in the tokenizer threads (not on the event loop)",
                                ["model"], registry=registry)
        self.answers = Counter("switchyard_kv_events_answers",
                               "Chat answers relayed whole and tokenized ahead of the next turn: tokenized, "
                               "cached (already), unknown_form (the chat template's form for an assistant "
                               "message was not recognized), not_text (a tool call, no text), too_long "
                               "(over 256 KiB of text), paused (not collected: the model's last next turns "
                               "found their answers held by no engine)",
                               ["model", "outcome"], registry=registry)
        self._children: dict[tuple[str, ...], Any] = {}     # per-request counters' children, looked up once

    def off_loop_of(self, model: str) -> Any:
        c = self._children.get(("off_loop", model))
        if c is None:
            c = self._children[("off_loop", model)] = self.off_loop.labels(model)
        return c

    def answer(self, model: str, outcome: str) -> None:
        c = self._children.get(("answers", model, outcome))
        if c is None:
            c = self._children[("answers", model, outcome)] = self.answers.labels(model, outcome)
        c.inc()


class _IndexCollector(Collector):
    def __init__(self, index: EventIndex, served: Callable[[str], bool]) -> None:
        self.index = index
        self.served = served        # whether the gateway serves a model (``KVEventsManager.serves``)

    def collect(self):
        blocks = GaugeMetricFamily("switchyard_kv_events_index_blocks",
                                   "Engine KV blocks in the event index, by model", labels=["model"])
        live = GaugeMetricFamily("switchyard_kv_events_endpoint_live",
                                 "1 while an endpoint's events are trusted, 0 on the approximate index",
                                 labels=["model", "endpoint"])
        per_model: dict[str, int] = {}
        for row in self.index.snapshot():
            per_model[row["model"]] = per_model.get(row["model"], 0) + row["blocks"]
            live.add_metric([row["model"], row["endpoint"]], 1.0 if row["live"] else 0.0)
        for model, n in per_model.items():
            blocks.add_metric([model], n)
        unreached = CounterMetricFamily(
            "switchyard_kv_events_requests_unreached",
            "Requests keyed only as far as some engine's cache reaches: the segments past it were "
            "probed, not tokenized", labels=["model"])
        for model, n in self.index.unreached.items():
            unreached.add_metric([model], n)
        renders = CounterMetricFamily(
            "switchyard_kv_events_chat_renders",
            "Chats keyed on events, by how their prompt was made: shape (put together from the pieces "
            "the chat template rendered once for their sequence of roles), template (rendered), "
            "mismatch (a check found the shape's prompt different; shapes then off for the model)",
            labels=["model", "how"])
        met = CounterMetricFamily(
            "switchyard_kv_events_answers_met",
            "Answers tokenized ahead, met again in the conversation's next turn, by whether an engine held "
            "(or was about to hold) the block with the answer's first generated tokens: held, not_held",
            labels=["model", "outcome"])
        fast = GaugeMetricFamily(
            "switchyard_kv_events_fast_tokenizer",
            "1 while the model's prompts are encoded by tiktoken, 0 by the tokenizers library", labels=["model"])
        checks = CounterMetricFamily(
            "switchyard_kv_events_fast_tokenizer_checks",
            "Segments encoded by tiktoken and checked against the tokenizers library (the first 32, then one "
            "in 256), by outcome: agreed, differed (tiktoken then off for the model)", labels=["model", "outcome"])
        # the gauge of a tokenizer no served model uses goes (a reload removed them):
        # a fact about prompts no longer encoded; its counters stay, as every counter does
        used = {id(tok) for model, tok in self.index.tokenizers.items() if self.served(model)}
        for model, tok in _first_names(self.index.tokenizers).items():
            if id(tok) in used:
                fast.add_metric([model], 1.0 if tok.fast else 0.0)
            for outcome, n in tok.fast_checks.items():
                checks.add_metric([model, outcome], n)
            for how, n in tok.renders.items():
                renders.add_metric([model, how], n)
            for outcome, n in tok.answers_met.items():
                met.add_metric([model, outcome], n)
        yield blocks
        yield live
        yield unreached
        yield renders
        yield met
        yield fast
        yield checks


class Subscriber:
    """One endpoint's SUB socket (and replay DEALER) feeding the index; with data parallelism, one
    rank's (``rank`` set: its ports are offset by it, and what it clears is that rank's only)."""

    def __init__(self, manager: KVEventsManager, st: EndpointState, rank: int | None = None) -> None:
        self.m = manager
        self.st = st
        self.rank = rank
        self.expected: int | None = None
        # when (unix seconds) this stream was last taken up as an engine's new one: its first contact,
        # or a sequence going back; an engine that started before then is the one it follows
        self.fresh_at: float | None = None
        self.task: asyncio.Task | None = None
        self.decoder = BatchDecoder()              # remembers which typed decoder this engine's batches fit
        self._counted: dict[str, Any] = {}         # kind -> its switchyard_kv_events_total child
        self._sock: Any = None
        # messages for the task: a replay is due or under way, or a large message is applied in stretches
        self._backlog: deque[tuple[int, bytes]] = deque()
        self._epoch = 0                            # taken up again as at first contact (engine_restarted)
        self._overflowed = False                   # the backlog overflowed: dropped, started again
        self._bad_logged_at = -float("inf")        # the last "bad message" warning (time.monotonic)
        self._bad_since = 0                         # bad messages since, not warned of one by one
        self._wake: asyncio.Future | None = None
        self._last: bytes | None = None            # the payload of message expected - 1, once applied
        self._catch_up_queued = False
        s = st.settings
        host = st.ep.host
        self.ipv6 = ":" in host
        h = f"[{host}]" if self.ipv6 else host
        off = rank or 0
        self.pub_addr = f"tcp://{h}:{s.port + off}"
        self.replay_addr = f"tcp://{h}:{s.replay_port + off}" if s.replay_port else None
        self.name = st.ep.name if rank is None else f"{st.ep.name} rank {rank}"

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run(), name=f"kv-events {self.name}")

    def clear(self) -> None:
        """Forget what this publisher reported: the endpoint's entries, or its rank's."""
        if self.rank is None:
            self.m.index.clear(self.st)
        else:
            self.m.index.clear_rank(self.st, self.rank)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    async def run(self) -> None:
        """The SUB socket is a plain (not asyncio) socket read by a reader callback on its file
        descriptor (``_readable``), which applies every message already there in one go: no future
        and no task switch per message. Only a message that needs a replay first (the first one, a
        gap) or is too large to apply at once (``STRETCH_BYTES``) goes to this task, with every
        message after it until the backlog is worked off, so the order is kept."""
        import zmq

        sock = zmq.Socket(self.m.zctx, zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SUBSCRIBE, self.st.settings.topic.encode())
        # watched before it connects: its first connection is caught up as every later one is
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(self.pub_addr)
        loop = asyncio.get_running_loop()
        fd = sock.getsockopt(zmq.FD)
        self._sock = sock
        self._wake = loop.create_future()
        loop.add_reader(fd, self._readable)
        rejoin = loop.create_task(self._rejoin(sock, monitor), name=f"kv-events rejoin {self.name}")
        log.info("kv events subscribed", endpoint=self.st.ep.name, model=self.st.ep.model, address=self.pub_addr,
                 rank=self.rank)
        try:
            self._readable()              # the descriptor signals changes only: read what is there already
            while True:
                await self._wake
                self._wake = loop.create_future()
                backlog = self._backlog
                while backlog:
                    seq, payload = backlog[0]
                    try:
                        if seq == CATCH_UP:
                            await self.catch_up()
                        else:
                            await self.on_message(seq, payload)
                    except WireError as e:
                        self._bad(e)
                    except Exception:
                        self._failed(None if seq == CATCH_UP else seq)
                    if self._overflowed:        # what came meanwhile was dropped: take it up again
                        self._overflowed = False
                        backlog.clear()
                        self._catch_up_queued = False
                        self.clear()
                        self.expected = None
                        break
                    backlog.popleft()
                self._readable()
        finally:
            rejoin.cancel()
            loop.remove_reader(fd)
            self._sock = None
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    async def _rejoin(self, sock: Any, monitor: Any) -> None:
        """Connect again after each disconnect: libzmq reconnects by itself after a connection
        error (the engine went away), not after a protocol error, which a message over
        ``MAX_MESSAGE_BYTES`` is; without this, one such message ended the stream for good. Each
        connection made (the first, and every one after) asks the engine's replay socket for what
        this subscriber has not heard (``catch_up``): an idle engine publishes nothing that would
        show a gap or a first contact."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.ask_catch_up()
                continue
            with contextlib.suppress(zmq.ZMQError):
                sock.disconnect(self.pub_addr)
            sock.connect(self.pub_addr)

    def ask_catch_up(self) -> None:
        """Queue a catch-up (``catch_up``) behind the messages already held, the messages arriving
        meanwhile held behind it, so the order is kept."""
        if self.replay_addr is None or self._catch_up_queued:
            return
        if len(self._backlog) >= BACKLOG_MAX:
            self._overflow()
            return
        self._catch_up_queued = True
        self._backlog.append((CATCH_UP, b""))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _readable(self) -> None:
        """Receive and apply what the socket holds (at most ``_DRAIN`` messages, then again soon)."""
        import zmq

        sock = self._sock
        if sock is None:
            return
        # plain ints: pyzmq's flag enums cost a Python-level enum operation per use
        events, pollin, noblock = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
        backlog = self._backlog
        n = 0
        while sock.getsockopt(events) & pollin:
            if n == _DRAIN:               # let the loop run: the rest on its next turn
                asyncio.get_running_loop().call_soon(self._readable)
                return
            n += 1
            try:
                frames = sock.recv_multipart(noblock)
            except zmq.Again:
                return
            except zmq.ZMQError as e:         # not expected on a SUB socket; the next signal tries again
                log.warning("kv events: receive failed", endpoint=self.st.ep.name, rank=self.rank, error=str(e))
                return
            seq = None
            try:
                if len(frames) != 3:
                    raise WireError(f"{len(frames)} frames, expected 3 (topic, seq, payload)")
                seq = seq_of(frames[1])
                if seq < 0:                   # engines number their batches from 0
                    raise WireError(f"sequence number {seq}")
                payload = frames[2]
                if backlog or len(payload) > STRETCH_BYTES or self._replay_first(seq):
                    if len(backlog) >= BACKLOG_MAX:
                        self._overflow()
                        continue
                    backlog.append((seq, payload))
                    if self._wake is not None and not self._wake.done():
                        self._wake.set_result(None)
                    continue
                self._accept(seq, payload)
            except WireError as e:
                self._bad(e)
            except Exception:
                self._failed(seq)

    def _overflow(self) -> None:
        if not self._overflowed:
            self._overflowed = True
            self.m.metrics.errors.labels(self.st.ep.model).inc()
            log.warning("kv events: too many messages wait for a replay; dropped, entries cleared",
                        endpoint=self.st.ep.name, rank=self.rank, held=len(self._backlog))

    def _bad(self, e: WireError) -> None:
        self.m.metrics.errors.labels(self.st.ep.model).inc()
        # a publisher sending nothing but such messages would write a line each: one per
        # BAD_LOG_EVERY_S, with how many came since
        now = time.monotonic()
        if now - self._bad_logged_at < BAD_LOG_EVERY_S:
            self._bad_since += 1
            return
        log.warning("kv events: bad message", endpoint=self.st.ep.name, rank=self.rank, error=str(e),
                    bad_since_last=self._bad_since)
        self._bad_logged_at, self._bad_since = now, 0

    def _failed(self, seq: int | None) -> None:
        """A message that could not be applied (a bug, not the wire): what this publisher reported
        may be half updated, so it is cleared, and the stream goes on after the message."""
        self.m.metrics.errors.labels(self.st.ep.model).inc()
        log.exception("kv events: message not applied; entries cleared", endpoint=self.st.ep.name, rank=self.rank,
                      seq=seq)
        self.clear()
        if seq is not None:
            self.expected = seq + 1

    def _replay_first(self, seq: int) -> bool:
        """Whether message ``seq`` needs a replay before it (see ``on_message``)."""
        if self.expected is None or seq < self.expected:
            return seq > 0 and self.replay_addr is not None
        return seq > self.expected

    async def on_message(self, seq: int, payload: bytes) -> None:
        if self.expected is not None and 0 < seq < self.expected and self.replay_addr:
            # a sequence going back: a new engine, first heard past its first batch (published before
            # the socket connected again); cleared as a restart, then taken up as at first contact
            self._renew(seq)
            self.expected = None
        if self.expected is None:
            if seq > 0 and self.replay_addr:        # learn what the engine cached before we listened
                await self.replay(0, seq, first=True)
        elif seq > self.expected:
            self.m.metrics.gaps.labels(self.st.ep.model).inc()
            await self.replay(self.expected, seq)
        if len(payload) <= STRETCH_BYTES:
            self._accept(seq, payload)
            return
        if seq != self.expected:
            self._renew(seq)
        self.expected = seq + 1
        self._last = payload
        await self.apply_stretched(self.decoder.decode(payload, self.rank))

    def _accept(self, seq: int, payload: bytes) -> None:
        """Message ``seq``, whatever had to be replayed before it done: a restart, then the batch."""
        if seq != self.expected:
            self._renew(seq)
        self.expected = seq + 1     # received: one that does not decode is skipped, not a gap
        self._last = payload
        self.apply(self.decoder.decode(payload, self.rank))

    def _renew(self, seq: int) -> None:
        """Message ``seq`` is not the one expected: a first contact, or a restart (a sequence going
        back) whose entries are cleared; one after a gap was replayed before it."""
        if self.expected is None:
            self.fresh_at = time.time()
        elif seq < self.expected:
            log.warning("kv events: engine restarted (sequence started again)", endpoint=self.st.ep.name,
                        rank=self.rank, seq=seq, expected=self.expected)
            self.m.metrics.restarts.labels(self.st.ep.model).inc()
            self.clear()
            self.fresh_at = time.time()

    def apply(self, batch: Batch) -> None:
        self._count(batch, self.m.index.apply(self.st, batch, self.rank))

    async def apply_stretched(self, batch: Batch) -> None:
        """``apply`` a large batch in stretches (``EventIndex.stretches``), the event loop let run
        between them; the rest is left when the stream is taken up again meanwhile (the engine
        restarted, the backlog overflowed: cleared either way) or the endpoint left the pool."""
        index, st, epoch = self.m.index, self.st, self._epoch
        steps = index.stretches(st, batch, self.rank)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                self._count(batch, stop.value)
                return
            await asyncio.sleep(0)
            if self._epoch != epoch or self._overflowed or index.states.get(st.ep) is not st:
                steps.close()
                return

    def _count(self, batch: Batch, done: Applied) -> None:
        counted = self._counted
        for kind, n in zip(_KINDS, (*done, batch.unknown), strict=True):
            if n:
                child = counted.get(kind)
                if child is None:
                    child = counted[kind] = self.m.metrics.events.labels(self.st.ep.model, kind)
                child.inc(n)

    async def replay(self, start: int, until: int, first: bool = False) -> None:
        """Fetch and apply batches ``start .. until-1`` from the replay socket; on failure clear."""
        model = self.st.ep.model
        if not self.replay_addr:
            if not first:
                self.m.metrics.replays.labels(model, "no_replay_port").inc()
                log.warning("kv events: gap, no replay port; entries cleared", endpoint=self.st.ep.name,
                            rank=self.rank, missed_from=start, to=until)
                self.clear()
            return
        got, result = await self._fetch(start, until, contiguous_from=None if first else start)
        complete = result == "ok" and bool(got) and got[0][0] == start and got[-1][0] == until - 1
        if not complete and result == "ok":
            result = "incomplete"
        if not complete and not first:
            self.clear()       # what was missed is unknown: start from what comes next
            log.warning("kv events: replay could not fill the gap; entries cleared", endpoint=self.st.ep.name,
                        rank=self.rank, missed_from=start, to=until, result=result)
        if complete or first:
            await self._apply_replayed(got)
        self.m.metrics.replays.labels(model, result).inc()

    async def _fetch(self, start: int, until: int | None, contiguous_from: int | None,
                     newest: bool = False) -> tuple[list[tuple[int, bytes]], str]:
        """Ask the replay socket for the batches from ``start`` (below ``until`` when given): the
        ``(seq, payload)`` kept, in order, each once, and how it went (``ok``, ``failed``,
        ``too_large``). The first kept must be ``contiguous_from`` when given, else any from
        ``start`` on (the engine sends what its buffer still holds, from where it begins). Over
        ``REPLAY_MAX_BYTES`` or ``REPLAY_MAX_FRAMES``, ``newest`` drops the oldest kept instead of
        stopping (a catch-up: the newest batches tell what the engine holds now)."""
        import zmq

        sock = self.m.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(self.replay_addr)
        # what else comes is not kept. Bounded in frames, bytes and time: frames already received
        # resolve ``recv`` without a loop turn, so the deadline is checked here, and the loop let run
        got: deque[tuple[int, bytes]] = deque()
        result = "ok"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.st.settings.replay_timeout_s
        nxt = contiguous_from              # the seq the next kept frame must have
        end = until if until is not None else 1 << 63
        size = n = 0
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.st.settings.replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    n += 1
                    if n % 256 == 0:
                        if loop.time() > deadline:
                            raise TimeoutError
                        await asyncio.sleep(0)
                    seq = seq_of(frames[-2])
                    if seq == END_SEQ:
                        break
                    if not start <= seq < end or (nxt is not None and seq != nxt):
                        continue                    # out of range, repeated or out of order
                    got.append((seq, frames[-1]))
                    nxt = seq + 1
                    size += len(frames[-1])
                    if newest:
                        while size > REPLAY_MAX_BYTES or len(got) > REPLAY_MAX_FRAMES:
                            size -= len(got.popleft()[1])
                    if len(got) > REPLAY_MAX_FRAMES or size > REPLAY_MAX_BYTES:
                        result = "too_large"
                        break
        except (TimeoutError, WireError, IndexError):
            result = "failed"
        finally:
            sock.close(0)
        return list(got), result

    async def _apply_replayed(self, got: list[tuple[int, bytes]]) -> None:
        """Apply replayed batches in order; other requests' turns between stretches of about
        STRETCH_BYTES of them (at most 256), as a live message over that size is applied in stretches."""
        size = k = 0
        for _, payload in got:
            try:
                if len(payload) <= STRETCH_BYTES:
                    self.apply(self.decoder.decode(payload, self.rank))
                else:
                    await self.apply_stretched(self.decoder.decode(payload, self.rank))
            except WireError as e:          # skipped as a live one is, and counted
                self._bad(e)
            size += len(payload)
            k += 1
            if size >= STRETCH_BYTES or k == 256:
                size = k = 0
                await asyncio.sleep(0)
        if got:
            self._last = got[-1][1]
            self.m.metrics.replayed.labels(self.st.ep.model).inc(len(got))

    async def catch_up(self) -> None:
        """At each connection of the SUB socket (``_rejoin``), learn from the replay socket what was
        not heard: an engine publishes only when its cache changes, so a gateway started (or
        reconnected) beside an idle engine otherwise knew nothing of it until its next batch.

        * At first contact: every batch the engine's buffer holds, applied in order; the stream goes
          on after the last.
        * Later (a reconnect): from the last batch applied, ``expected - 1``. The engine sending it
          back alike is the same engine: what came after it is applied. Anything else (no such batch,
          another payload, a buffer that moved on past it) is a new engine or a history that cannot be
          joined: the entries are cleared and the stream taken up as at first contact.
        * A replay that fails (no answer in ``replay_timeout_s``) changes nothing: the next message
          shows a gap or a first contact, as before.

        The messages held meanwhile that the replay brought already are dropped (each is applied
        once); any other goes on as it would have."""
        self._catch_up_queued = False
        model, name = self.st.ep.model, self.st.ep.name
        epoch = self._epoch
        first = self.expected is None
        start = 0 if first else self.expected - 1
        got, result = await self._fetch(start, None, contiguous_from=None, newest=True)
        if self._epoch != epoch or self._overflowed:
            return                              # taken up again meanwhile: this answer is stale
        if result != "ok":
            self.m.metrics.replays.labels(model, result).inc()
            log.warning("kv events: catch-up replay failed", endpoint=name, rank=self.rank, start=start,
                        result=result)
            return
        replayed = dict(got)
        if not first:
            if got and got[0][0] == start and self._last is not None and got[0][1] == self._last:
                got = got[1:]
            elif got and got[0][0] > start:
                # the buffer moved on past the last batch heard (or a new engine's did): what came
                # between is unknown; what the buffer holds is taken up as at first contact
                log.warning("kv events: reconnected past the replay's buffer; entries cleared", endpoint=name,
                            rank=self.rank, expected=self.expected, replay_from=got[0][0])
                self.clear()
                self.expected = None
                self._last = None
                self.fresh_at = time.time()
                first = True
            else:
                log.warning("kv events: engine restarted (its replay does not hold the last batch heard)",
                            endpoint=name, rank=self.rank, expected=self.expected,
                            replay_from=got[0][0] if got else None)
                self.m.metrics.restarts.labels(model).inc()
                self.clear()
                self.expected = None
                self._last = None
                self.fresh_at = time.time()
                first = True
                got, result = await self._fetch(0, None, contiguous_from=None, newest=True)
                if self._epoch != epoch or self._overflowed:
                    return
                replayed = dict(got)
                if result != "ok":
                    self.m.metrics.replays.labels(model, result).inc()
                    return
        if first and got and self.fresh_at is None:
            self.fresh_at = time.time()
        if got:
            self.expected = got[-1][0] + 1
            await self._apply_replayed(got)
        whole = not first or not got or got[0][0] == 0
        self.m.metrics.replays.labels(model, "ok" if whole else "incomplete").inc()
        if got:
            log.info("kv events: caught up", endpoint=name, rank=self.rank, first=first,
                     replay_from=got[0][0], batches=len(got), expected=self.expected)
        # the messages held behind the catch-up that the replay brought: heard already
        backlog = self._backlog
        if len(backlog) > 1 and replayed:
            head = backlog.popleft()
            kept = [(seq, p) for seq, p in backlog if replayed.get(seq) != p]
            backlog.clear()
            backlog.append(head)
            backlog.extend(kept)


class KVEventsManager:
    """The subscribers, the event index, and the router-facing view of them."""

    def __init__(self, settings: Callable[[str], KVEventsConfig | None], pool: EndpointPool, registry: Any,
                 tokenizers: dict[str, ModelTokenizer], clock: Callable[[], float] = time.monotonic,
                 tokenize_threads: int = 1) -> None:
        self.settings = settings
        self.pool = pool
        self.tokenizers = tokenizers
        self.metrics = KVEventsMetrics(registry)
        self.index = EventIndex(tokenizers, settings, clock, self._fallback)
        self.index.on_retired = self._drain_soon
        self._drain_task: asyncio.Task | None = None
        # the models of the running config (None: those it started with, every tokenizer's)
        self.listed: frozenset[str] | None = None
        registry.register(_IndexCollector(self.index, self.serves))
        self.subscribers: dict[Endpoint, list[Subscriber]] = {}     # one per data-parallel rank
        self._refused: set[Endpoint] = set()
        self._sync_task: asyncio.Task | None = None
        self._zctx: Any = None
        self.tokenize_threads = tokenize_threads
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: set[asyncio.Future] = set()   # tokenizing what a chat's next turn will need
        self._closed = False
        self._answer_hooks: dict[str, Callable[..., None]] = {}   # model → its ``answered``
        self._forms_told: set[str] = set()         # models whose template's answer form was logged
        self._answers_paused: set[str] = set()     # models whose answers are not tokenized ahead (logged)
        for model, tok in _first_names(tokenizers).items():
            tok.on_mismatch = partial(self._shapes_differ, model)
            tok.on_fast_differs = partial(self._fast_differs, model)
            log.info("kv events: tokenizer loaded", model=model, encoder="tiktoken" if tok.fast else "tokenizers",
                     why=None if tok.fast else tok.fast_why)

    @property
    def zctx(self) -> Any:
        if self._zctx is None:
            import zmq.asyncio

            self._zctx = zmq.asyncio.Context()
        return self._zctx

    def _fallback(self, model: str, endpoint: str, reason: str) -> None:
        self.metrics.fallbacks.labels(model, reason).inc()
        if endpoint:
            log.warning("kv events: endpoint on the approximate index", model=model, endpoint=endpoint,
                        reason=reason)

    @staticmethod
    def _fast_differs(model: str) -> None:
        log.warning("kv events: tiktoken encoded a segment differently from the tokenizer's library; the "
                    "model's prompts are tokenized by the library from now on, and its cached tokens were dropped",
                    model=model)

    @staticmethod
    def _shapes_differ(model: str) -> None:
        log.warning("kv events: a chat put together from its shape differed from the chat template's "
                    "rendering; every chat of this model is now rendered with the template", model=model)

    def endpoint_settings(self, ep: Endpoint) -> KVEventsConfig | None:
        base = self.settings(ep.model)
        note = ep.extra.get("kv_events") if ep.extra else None
        if note is not None:
            try:
                return (base or KVEventsConfig()).with_annotation(dict(note))
            except ValueError as e:          # the annotation's ports and the model's ranks do not fit
                if ep not in self._refused:
                    self._refused.add(ep)
                    self.metrics.fallbacks.labels(ep.model, "bad_annotation").inc()
                    log.warning("kv events refused", endpoint=ep.name, model=ep.model, reason=str(e))
                return None
        return base if base is not None and base.enabled else None

    # -- life --------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.sync()
        self._sync_task = asyncio.get_running_loop().create_task(self._sync_loop(), name="kv-events sync")

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            try:
                self.sync()
            except Exception:
                log.exception("kv events sync failed")

    def sync(self) -> None:
        """Subscribers for the pool's endpoints that publish events, none for the others."""
        want: dict[Endpoint, KVEventsConfig] = {}
        eps = self.pool.endpoints()
        for ep in eps:
            if ep.extra.get("kv_events_error") and ep not in self._refused:   # a bad pod annotation, counted once
                self._refused.add(ep)
                self.metrics.fallbacks.labels(ep.model, "bad_annotation").inc()
            s = self.endpoint_settings(ep)
            if s is not None and ep.model in self.tokenizers:
                want[ep] = s
        self._refused.intersection_update(eps)
        for ep in [ep for ep in self.subscribers if ep not in want]:
            for sub in self.subscribers.pop(ep):
                asyncio.get_running_loop().create_task(sub.stop())
            self.index.forget(ep)
        for ep, s in want.items():
            if ep not in self.subscribers:
                st = self.index.track(ep, s)
                n = s.data_parallel_size
                subs = [Subscriber(self, st)] if n == 1 else [Subscriber(self, st, r) for r in range(n)]
                self.subscribers[ep] = subs
                for sub in subs:
                    sub.start()

    def _drain_soon(self) -> None:
        """A cleared endpoint's old entries are to be unlinked from the index (``EventIndex.drain``):
        by a task, a stretch of ``CLEAR_STRETCH`` entries a loop turn (at once without a loop)."""
        if self._drain_task is not None and not self._drain_task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            while self.index.drain(1 << 62):
                pass
            return
        self._drain_task = loop.create_task(self._drain(), name="kv-events clear")

    async def _drain(self) -> None:
        """Unlink the cleared entries a stretch a loop turn until none is left. A stretch that
        raises (a bug) is counted, the first of a run of them logged with its traceback, and tried
        again at the next turn, then once in ``DRAIN_RETRY_S`` while it keeps raising: the entries
        are not left to a later clear's task, and the loop is not held."""
        drain = self.index.drain
        failed = 0
        while True:
            try:
                more = drain(CLEAR_STRETCH)
            except Exception:
                failed += 1
                self.metrics.drain_errors.inc()
                if failed == 1:
                    log.exception("kv events: a stretch of a cleared endpoint's entries could not be unlinked; "
                                  "tried again", retiring=self.index.retiring)
                await asyncio.sleep(0 if failed == 1 else DRAIN_RETRY_S)
                continue
            if failed:
                log.info("kv events: cleared entries unlinked again", failures=failed)
                failed = 0
            if not more:
                return
            await asyncio.sleep(0)

    async def close(self) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain_task
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task
        for subs in list(self.subscribers.values()):
            for sub in subs:
                await sub.stop()
        self.subscribers.clear()
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None
        for fut in list(self._ahead):         # what lands after this is not stored
            if not fut.done():
                fut.set_result(0)
        self._closed = True                   # no executor made again for a late answer or turn
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def engine_restarted(self, ep: Endpoint) -> None:
        """``ep``'s engine restarted (its scraped start time changed, ``gateway.upstream.monitor``):
        its entries are cleared and its streams taken up again as at first contact, unless every one
        of them already began anew after the engine's new start (the new engine's first events came
        first, a sequence going back: cleared then, and what came since is the new engine's)."""
        subs = self.subscribers.get(ep)
        st = self.index.states.get(ep)
        if not subs or st is None:
            return
        started = ep.metrics.start_time if ep.metrics is not None else None
        if started is not None and all(sub.fresh_at is not None and sub.fresh_at >= started for sub in subs):
            return
        log.info("kv events: engine restarted (its start time changed); entries cleared", endpoint=ep.name,
                 model=ep.model)
        self.index.clear(st)
        for sub in subs:
            sub.expected = None        # its next message is a first contact: replayed from 0, not a restart
            sub.fresh_at = None
            sub._epoch += 1            # a large message being applied is left
            sub.ask_catch_up()         # what the new engine published before now (an idle one: nothing)

    def follow(self, config: Any) -> None:
        """A reload was applied: the models it lists (what subscribes is set at start)."""
        self.listed = frozenset(m.name for m in config.models)

    def serves(self, model: str) -> bool:
        """Whether ``model`` is still served: the running config lists it, or it has endpoints."""
        return self.listed is None or model in self.listed or self.pool.has_model(model)

    # -- sibling workers (gateway.view.service) ----------------------------------------------------

    def on_tokens(self, hook: Callable[[str, str, list[int]], None] | None) -> None:
        """``hook(model, segment, ids)`` for each segment one of the tokenizers tokenizes and caches
        (``None``: no more). A tokenizer shared by several models names the first of them."""
        for model, tok in _first_names(self.tokenizers).items():
            tok.on_store = None if hook is None else partial(hook, model)

    def adopt_tokens(self, model: str, segment: str, ids: list[int]) -> bool:
        """A sibling's tokenized segment, cached here; whether it was new (an unknown model: no)."""
        tok = self.tokenizers.get(model)
        return tok is not None and tok.adopt(segment, ids)

    # -- the router's view (routers.prefix_cache.PreciseIndex) --------------------------------------

    def covers(self, req: InferenceRequest) -> bool:
        # embeddings and the pass-through endpoints (``/detokenize``, rerank, ...) are not keyed:
        # they are routed on the approximate index, no tokenizer error
        return req.model in self.tokenizers and bool(self.index.states) and req.path not in NOT_KEYED

    @property
    def executor(self) -> ThreadPoolExecutor | None:
        if self._executor is None and self.tokenize_threads > 0 and not self._closed:
            self._executor = ThreadPoolExecutor(self.tokenize_threads, thread_name_prefix="tokenize")
        return self._executor

    async def prepare(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        """Render the request and tokenize its long uncached segments in the executor (the match
        then finds them cached). Errors are left to ``match``, which falls back and counts them."""
        model = candidates[0].model if candidates else req.model
        tok = self.tokenizers.get(model)
        if tok is None or self.tokenize_threads <= 0 or req.multimodal or req.path == RESPONSES:   # not keyed
            return
        try:
            segments, lead = self.index.segments(req, tok)
        except Exception:
            return
        if segments is None:
            return
        st = self.settings(model)
        inline = st.tokenize_inline_chars if st is not None else INLINE_CHARS
        bs = self.index.block_size(candidates)
        if bs is None:                       # no live events among the candidates: nothing to match
            return
        root = request_root(req, model, bs)
        if root is None:
            return
        index, executor = self.index, self.executor
        # walk the request's keys; a long uncached segment that some engine's cache reaches is
        # tokenized in the executor, then the walk goes on (usually no hop, or one)
        for _ in range(len(segments)):
            try:
                need = index.request_keys(req, tok, model, root, bs, defer_chars=inline)
            except Exception:
                return
            if not isinstance(need, int):
                return
            seg = segments[need]
            n = await tok.prepare([seg], executor, inline)
            if n:
                self.metrics.off_loop_of(model).inc(n)
            index.rendered(req, segments, lead)       # another request may have rendered meanwhile
            if not tok.is_cached(seg):                 # an encode error: left to the match, which counts it
                return

    def match(self, req: InferenceRequest, candidates: Sequence[Endpoint]
              ) -> tuple[dict[Endpoint, int], int, list[Endpoint]] | None:
        return self.index.match(req, candidates)

    def routed(self, req: InferenceRequest, ep: Endpoint) -> None:
        self.index.routed(req, ep)
        if "messages" in req.data and self.tokenize_threads > 0:
            left = self.index.left(req)
            if left:
                self._tokenize_ahead(ep.model, left, _final_text(req.data["messages"]))
            st = self.settings(ep.model)
            # a chat completion's answer, of one choice (``n`` above 1: several answers, none sent back whole)
            if req.path == CHAT and (st is None or st.tokenize_answers) and req.data.get("n") in (None, 1) \
                    and self._answers_wanted(ep.model, st):
                hook = self._answer_hooks.get(ep.model)
                if hook is None:
                    hook = self._answer_hooks[ep.model] = partial(self.answered, ep.model)
                req.answered = hook

    def _answers_wanted(self, model: str, st: KVEventsConfig | None) -> bool:
        """Whether this chat's answer is to be collected and tokenized ahead: not while the model's
        next turns keep finding their answers held by no engine (``ModelTokenizer.answers_paused``),
        but for one in ``ANSWER_SAMPLE`` (counted ``paused``); the pause and its end are logged."""
        tok = self.tokenizers.get(model)
        if tok is None:
            return True
        limit = st.answers_unheld_limit if st is not None else ANSWERS_UNHELD
        paused = tok.answers_paused(limit)
        if paused != (model in self._answers_paused):
            if paused:
                self._answers_paused.add(model)
                log.info("kv events: answers no longer tokenized ahead: the last next turns found no engine "
                         "holding their answer's first generated block", model=model, turns=limit,
                         sample=f"1 in {ANSWER_SAMPLE}")
            else:
                self._answers_paused.discard(model)
                log.info("kv events: answers tokenized ahead again: a next turn found its answer held", model=model)
        if tok.answers_wanted(limit):
            return True
        self.metrics.answer(model, "paused")
        return False

    def answered(self, model: str, text: str | None, why: str = "not_text") -> None:
        """A chat request routed here got its whole answer, ``text`` (``None``: not one text, e.g. tool
        calls): the conversation's next turn sends it back as an assistant message behind blocks the
        engine then holds, and would tokenize it on its way to the engine (on the loop, or awaiting
        the tokenizer thread for a long one). So the segment the chat template makes of it is
        tokenized now, in the tokenizer threads, while the client reads and writes its next message.
        Without a text, ``why`` is counted (``not_text``, ``too_long``)."""
        tok = self.tokenizers.get(model)
        if tok is None or self.executor is None:
            return
        seg = tok.answer_segment(text) if text else None
        if text and model not in self._forms_told:    # once a model: what its template's answers look like
            self._forms_told.add(model)
            form = tok.answer_form
            if form is None:
                log.warning("kv events: the chat template's form for an assistant message was not recognized; "
                            "answers are not tokenized ahead of the next turn", model=model)
            else:
                log.info("kv events: answers tokenized ahead of the next turn", model=model,
                         before=form[0], after=form[1], trimmed=form[2])
        if seg is None:
            self.metrics.answer(model, why if not text else "unknown_form")
            return
        if not tok.needs_tokens(seg):
            tok.expect_answer(seg)
            self.metrics.answer(model, "cached")
            return
        if self._submit_ahead(model, tok, [seg]):
            tok.expect_answer(seg)
            self.metrics.answer(model, "tokenized")

    def _tokenize_ahead(self, model: str, segments: list[str], final: str | None = None) -> None:
        """A chat request keyed only as far as some engine's cache reaches left its new segments
        (the new user message, a pasted text, a system prompt this gateway has not seen an engine
        hold yet) untokenized: no engine could match them. The next request that resends them (the
        next turn, another chat on the same system prompt) meets them behind blocks an engine will
        then hold, and would tokenize them on its own way to the engine: on the event loop, or
        awaiting the tokenizer thread for a long one. So they are tokenized now, in the tokenizer
        threads, while the engine prefills: those shorter than ``AHEAD_CHARS`` (a chat message), and
        longer ones that come before the chat's final message (``final``, its text: a system prompt,
        a conversation's history, which a next request resends), not the final message itself when
        it is long (a pasted document that may never come back). The keys are the same either way."""
        tok = self.tokenizers.get(model)
        if tok is None or self.executor is None:
            return
        todo = [s for s in segments if (len(s) < AHEAD_CHARS or (final is not None and final not in s))
                and tok.needs_tokens(s)]
        if todo:
            self._submit_ahead(model, tok, todo)

    def _submit_ahead(self, model: str, tok: ModelTokenizer, todo: list[str]) -> bool:
        """``todo`` to the tokenizer threads, cached when done; whether anything went."""
        executor = self.executor
        if executor is None:
            return False
        try:
            fut = tok.ahead(todo, executor)
        except RuntimeError:                 # no event loop (a synchronous caller): nothing ahead
            return False
        if fut is None:
            return False
        self._ahead.add(fut)
        fut.add_done_callback(partial(self._ahead_done, model))
        return True

    def _ahead_done(self, model: str, fut: asyncio.Future) -> None:
        self._ahead.discard(fut)
        n = 0 if fut.cancelled() else fut.result()
        if n:
            self.metrics.off_loop_of(model).inc(n)


def _first_names(tokenizers: dict[str, ModelTokenizer]) -> dict[str, ModelTokenizer]:
    """Each tokenizer once, under the first model that names it."""
    out: dict[str, ModelTokenizer] = {}
    seen: set[int] = set()
    for model, tok in tokenizers.items():
        if id(tok) not in seen:
            seen.add(id(tok))
            out[model] = tok
    return out


def _final_text(messages: Any) -> str | None:
    """The text of a chat's final message when it is one string (None otherwise: then no long
    segment is tokenized ahead, as any of them may be that message)."""
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        if isinstance(content, str) and content:
            return content
    return None


def build_kv_events(config: Any, pool: EndpointPool, registry: Any) -> KVEventsManager | None:
    """The manager when a model has a tokenizer and subscribes (config, or Kubernetes annotations
    with ``kubernetes.enabled``); ``None`` otherwise, so routing is exactly as without events."""
    from gateway.kv.tokenization import load_tokenizers

    dirs = {m.name: m.tokenizer for m in config.models if m.tokenizer}
    wanted = any(m.wants_kv_events for m in config.models)
    if not dirs or not (wanted or config.kubernetes.enabled):
        return None
    by_model = {m.name: m.kv_events for m in config.models}
    threads = max((s.tokenize_threads for s in by_model.values() if s is not None), default=1)
    tokenizers = load_tokenizers(dirs, {m for m, s in by_model.items() if s is not None and not s.fast_tokenizer})
    for model, tok in tokenizers.items():          # a tokenizer shared by models: off if any says so
        s = by_model.get(model)
        if s is not None and not s.chat_shapes:
            tok.shapes_off = True
    return KVEventsManager(lambda model: by_model.get(model), pool, registry, tokenizers,
                           tokenize_threads=threads)
