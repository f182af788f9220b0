"""``RoutingView``: one routing view for every worker of a gateway and every replica.

What a process learns while routing, it tells the others; what they tell it, it applies to its
own view, without telling anyone again:

* prefix-index insertions (``PrefixIndex.on_insert`` → ``apply_insert``): a conversation whose
  previous turn another worker routed is found on this one;
* sessions (``SessionMap.on_put`` → ``apply``), Responses lineage included;
* in-flight counts, between workers, when Redis does not carry them (no ``state.redis_url``, or
  ``state.share_in_flight: false``): each worker's absolute per-endpoint counts, at each routing
  decision's loop turn and at least every ``view.load_interval_s`` when changed (and every
  ``view.heartbeat_s`` regardless); the siblings' sum is each endpoint's ``remote_in_flight``, as
  the replicas' is through Redis. A sibling silent for ``view.peer_ttl_s`` no longer counts.
  With Redis sharing in-flight counts, every worker publishes there as a replica of its own, so
  the bus does not carry them: no request is counted twice;
* between workers, with KV-events routing (``view.share_tokens``), the token ids of the prompt
  segments a worker tokenized (``KVEventsManager.on_tokens`` → ``adopt_tokens``): a conversation
  whose next turn the kernel gives the other worker, or a system prompt the other worker meets
  first, is not tokenized again there. They are not urgent (the next turn is seconds away), so they
  ride with the next batch, or leave within ``view.load_interval_s``;
* between workers, circuit breakers' ejections and closes (``Breakers.on_change`` →
  ``adopt_open`` / ``adopt_close``): a sick engine is ejected in every worker once one has seen
  enough faults;
* between workers, with ``view.share_monitoring``, health probes, engine scrapes and LoRA
  adapter lists: each endpoint has one watcher among the workers (a hash of its key), which
  probes, scrapes and asks it and sends every outcome, snapshot and list (``told_probe``,
  ``told_scrape``, ``told_models`` → the siblings' ``Monitor.adopt_probe``, ``adopt_scrape``,
  ``Lora.adopt_models``); the others skip it while they hear from the watcher, and do the reads
  themselves when they have not for two intervals plus the timeout (the watcher restarting).
  Every worker also tells the others of the LoRA adapters it loads and unloads, as it does, and
  of those it used, at each idle pass (``told_adapters``, ``told_used`` → ``Lora.adopt_change``,
  ``adopt_use``), and, as a count goes from none to one or back, of all the adapters it has
  requests in flight for on each endpoint (``told_busy`` → ``sibling_busy``, which the LoRA stage
  asks before it unloads one; re-sent every ``view.heartbeat_s`` while there are any, dropped
  after ``view.peer_ttl_s`` of silence or at the sender's restart), and of each load that failed,
  with its cooldown's end (``told_load_failed`` → ``Lora.adopt_load_failed``: the sibling does not
  ask that endpoint for that adapter until then either); each load it starts is told at once, and
  again every ``view.heartbeat_s`` while it is under way, and its end (``told_load_started``,
  ``told_load_ended`` → ``Lora.adopt_load_started``, ``adopt_load_ended``): a sibling that needs
  the adapter meanwhile waits for that end rather than loading it too. A snapshot carries the
  in-flight requests its sender knew of at the scrape, so each worker can tell its own requests
  from other gateways' in the engine's counts (``EngineMetrics.gateway_in_flight``);
* between workers, an interactive request routed to an endpoint with no free slot
  (``tell_preempt``): the worker that runs batches stops its newest batch lines there
  (``on_preempt``), as it does for its own requests (``gateway.batch``);
* between workers, with batches on, the models whose requests wait in the worker's admission
  queue (``told_queued`` → ``sibling_queued``), all of them, as one's queue fills or empties and
  every ``view.heartbeat_s`` while any holds some: the worker that runs batches starts no line of
  those, as for its own queue (dropped after ``view.peer_ttl_s`` of silence or at the sender's
  restart).

Catching up, between workers: a count heals with the next batch, an insertion or a session is sent
once. So a worker that starts (a restart after a crash or a stalled loop) asks its siblings for
their whole view (``snapshot``, over the siblings' stream socket: ``ask_sibling``) before it serves,
with what each has in flight (its counts, its LoRA adapters: said as they change and on the
heartbeat only, so a restarted worker routed and unloaded without them until the next one) and the
endpoints its breakers keep out (said once, at the ejection: a restarted worker sent its first
requests to an engine its siblings had ejected),
and one that missed a sibling's batches (its receive queue was full: the worker was stopped or
busy; the batches with insertions, sessions or breakers' ejections and closes are numbered,
``wire.Batch.seq``) asks that sibling once it notices the gap, and takes the ejections it missed
and closes those it holds that the sibling closed meanwhile. A
sender whose batch a sibling refused sends its number again every ``view.heartbeat_s`` until one
gets through, so the gap is noticed even when nothing more happens. What is merged keeps its time
(``time.monotonic``, the same clock in every worker): nothing newer is overwritten, and nothing
lives longer than its TTL.

Nothing waits: a decision appends its facts to this process's outbox and the batch leaves once per
event-loop turn (``loop.call_soon``), to the siblings over the local bus (``gateway.view.bus``)
and to the replicas over a Redis stream (``gateway.view.replicas``). With one worker and no Redis,
the view is this process's own and nothing is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from gateway.config.schema import Config
from gateway.endpoints import Endpoint, EndpointPool, EngineMetrics
from gateway.observability.metrics import GatewayMetrics
from gateway.request import InferenceRequest
from gateway.resilience.breaker import CLOSED
from gateway.view.bus import LocalBus
from gateway.view.metrics import ViewMetrics
from gateway.view.replicas import ReplicaLink
from gateway.view.wire import (
    LOAD_ENDED,
    LOAD_FAILED,
    LOAD_OK,
    LOAD_STARTED,
    LOADED,
    MESSAGE_MAX,
    UNCOUNTED,
    UNLOADED,
    USED,
    Batch,
    Eject,
    Insert,
    LoraLoad,
    Probe,
    Scrape,
    Served,
    Session,
    Tokens,
    ViewSnapshot,
    decode,
    decode_snapshot,
    encode_numbered,
    encode_snapshot,
    encode_view,
    endpoint_key,
    tokens_size,
    view_parts,
)
from routers.base import Decision, RouterContext
from routers.latency import LatencyModel
from routers.prefix_index import PrefixIndex
from routers.session_map import RESPONSE, SessionMap

log = structlog.get_logger("switchyard.view")

# endpoints are looked up by key from a map rebuilt at most this often (endpoints come and go)
_RESOLVE_EVERY_S = 1.0
# catching up: how long a sibling's whole view may take to come, and how often one sibling is asked
CATCH_UP_TIMEOUT_S = 2.0
CATCH_UP_EVERY_S = 10.0   # a sibling asked again no sooner: a whole view costs both ends 0.1-0.3 s of CPU at full size
VIEW_PART = 2000          # entries in a part of a whole view: made, and merged, one part a loop turn
# replica facts taken of an endpoint whose engine's start is not known yet: batches told apart (by
# their send time) until it is, each a few dozen bytes; past it, a batch is counted with the last
UNVETTED_BATCHES = 4096
# and the prefix-index insertions of the endpoint meanwhile (of the stream, the siblings and this
# process), kept to be applied again if the endpoint is forgotten at the start: up to this many keys
# (a reference each to what the index holds); past it, none are
UNVETTED_KEYS = 65_536


class _Unvetted:
    """An endpoint's facts taken while its engine's start was not known (``RoutingView._vet``)."""

    __slots__ = ("batches", "inserts", "keys")

    def __init__(self) -> None:
        self.batches: list[list[float]] = []     # a replica's batch: [send time (unix seconds), facts]
        self.inserts: list[tuple[float, Sequence[int]]] | None = []   # (sent, keys); None: past UNVETTED_KEYS
        self.keys = 0

    def keep(self, sent: float, keys: Sequence[int]) -> None:
        if self.inserts is None:
            return
        self.keys += len(keys)
        if self.keys > UNVETTED_KEYS:
            self.inserts = None
        else:
            self.inserts.append((sent, keys))


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """This process's place among ``--workers N``: its index, the count, the parent's bus
    directory, and the gateway's group name (the same in every worker: chosen before the fork)."""

    index: int
    count: int
    bus_dir: str
    group: str


def new_group() -> str:
    return secrets.token_hex(4)


def watcher_of(key: str, workers: int) -> int:
    """The index of the worker, of ``workers``, that watches the endpoint named ``key``
    (``wire.endpoint_key``): a hash of the name, so every worker agrees without talking."""
    return zlib.crc32(key.encode()) % workers


class RoutingView:
    """The shared view of one process (see the module docstring)."""

    def __init__(self, config: Config, pool: EndpointPool, metrics: GatewayMetrics,
                 slot: WorkerSlot | None = None) -> None:
        self.cfg = cfg = config.view
        self.pool = pool
        self.m = ViewMetrics(metrics)
        r = config.routing
        self.sessions = SessionMap(r.session_ttl_s, r.session_max_entries, user_share=r.session_user_share)
        # with gateway-held Responses state any engine continues a chain: its lineage is a session,
        # forgotten with the others when its engine restarts; with engine state the engine holds it
        self.lineage_is_session = config.responses.state == "gateway"
        self.group = slot.group if slot is not None else new_group()
        self.worker_index = slot.index if slot is not None else 0
        self.worker_count = slot.count if slot is not None else 1
        self.sender = f"{self.group}/{slot.index if slot is not None else 0}"
        self.bus: LocalBus | None = None
        if slot is not None and slot.count > 1 and cfg.workers:
            self.bus = LocalBus(slot.bus_dir, slot.index, slot.count, self._on_bus, self._bus_drop,
                                cfg.max_datagram_bytes)
        st = config.state
        self.bus_load = self.bus is not None and not (st.redis_url and st.share_in_flight)
        self.link: ReplicaLink | None = None
        if st.redis_url and cfg.replicas:
            skip = f"{self.group}/" if self.bus is not None else None   # siblings' facts come by the bus
            self.link = ReplicaLink(st, cfg, self.sender, skip, self._on_stream, self.m)
        self.shared = self.bus is not None or self.link is not None
        self._index: PrefixIndex | None = None
        self._latency: LatencyModel | None = None   # the routing context's latency models (slo), kept per engine
        self._kv: Any = None                 # the KV-events manager whose tokenizers are shared
        self.share_tokens = self.bus is not None and cfg.share_tokens
        self._tokens: list[Tokens] = []
        self._tokens_timer: asyncio.TimerHandle | None = None
        self._breakers: Any = None           # this process's circuit breakers (gateway.resilience.breaker)
        self._ejects: list[Eject] = []
        self._monitor: Any = None            # this process's prober and scraper (gateway.upstream.monitor)
        self.share_monitoring = self.bus is not None and cfg.share_monitoring
        self._probes: list[Probe] = []
        self._scrapes: list[Scrape] = []
        self._served: list[Served] = []
        self._preempts: list[str] = []
        self._lora_loads: list[LoraLoad] = []
        self._loading: dict[tuple[str, str], LoraLoad] = {}     # this worker's loads under way, said again each heartbeat
        self._loading_told_at = 0.0
        self.on_preempt: Callable[[Endpoint], Any] | None = None   # a sibling asks for a batch line's slot here
        self._batches_changed = False        # this worker's Batch API created or cancelled a batch
        self.on_batches: Callable[[], Any] | None = None     # a sibling's did: the runner reads the job store
        self._lora: Any = None               # this process's LoRA stage, whose discovery is shared
        self._heard_watcher: dict[tuple[str, str], float] = {}   # ("probe" | "scrape" | "models", endpoint key) → heard at
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inserts: list[Insert] = []
        self._sessions: list[Session] = []
        self._scheduled = False
        self._keys: dict[Endpoint, str] = {}              # endpoint → its key (identity map)
        self._by_key: dict[str, Endpoint] = {}
        self._left: list[Endpoint] = []                   # left the pool this loop turn (``_drop_left``)
        self._session_walk = False                        # their sessions being dropped (``_drop_sessions``)
        self._session_walk_again = False                  # more left meanwhile: walk again once it ends
        pool.removal_listeners.append(self._forget)       # pods come and go: nothing kept of a gone one
        pool.replacement_listeners.append(self._replaced)  # but an engine declared anew keeps its conversations
        self._resolved_at = -1e9
        self._peers: dict[str, tuple[dict[str, int], float]] = {}   # sibling → (counts, heard at)
        # when this worker will have listened to its siblings for peer_ttl_s (their in-flight
        # counts known: each re-sends them every heartbeat_s while it has any), monotonic; None:
        # not listening yet (the bus not open)
        self._heard_from: float | None = None
        self._sent_load: dict[str, int] | None = None
        self._sent_load_at = 0.0
        # LoRA adapters in flight (``told_busy``): this worker's, as last sent, and its siblings'
        self._busy_changed: set[Endpoint] = set()
        self._sent_busy: dict[str, list[str]] = {}
        self._sent_busy_at = 0.0
        self._sibling_busy: dict[str, tuple[int, dict[str, list[str]], float]] = {}   # sibling → (run, busy, heard at)
        # the models this worker's admission queue holds requests of (``told_queued``): read from
        # ``queued_source`` as they change, as last sent, and its siblings'
        self.queued_source: Callable[[], list[str]] | None = None
        self._queued_changed = False
        self._sent_queued: list[str] = []
        self._sent_queued_at = 0.0
        self._sibling_queued: dict[str, tuple[int, list[str], float]] = {}   # sibling → (run, models, heard at)
        self._flushed_at = -1e9              # loop time of the last message to the siblings
        self._tick_at: asyncio.Handle | None = None
        self._tick_when = 0.0       # when ``_tick_at`` fires (uvloop's handle for a delay under half a
                                    # millisecond is a plain ``Handle``, without ``when()``)
        # catching up (workers): this process's batches are numbered; a gap in a sibling's is noticed
        self.run = secrets.randbits(31) | 1               # this process among its index's incarnations
        self._seq = 0                                     # batches with insertions, sessions or breakers sent
        self._owe = False                                 # a sibling refused one: its number is sent again
        self._heard_seq: dict[str, tuple[int, int]] = {}  # sibling → (run, seq) heard or caught up to
        # asks sibling ``index`` one question with a timeout (gateway/server/siblings.py); None: alone
        self.ask_sibling: Callable[[int, str, float], Awaitable[bytes | None]] | None = None
        self._pulls: dict[int, asyncio.Task] = {}
        self._want_pull: dict[int, str] = {}
        self._pull_after: dict[int, float] = {}
        # endpoint → the facts applied of it while its engine's start was not known yet: checked
        # against the start once scraped (``_vet``)
        self._unvetted: dict[Endpoint, _Unvetted] = {}
        self._scraping = config.scrape.enabled

    # -- wiring --------------------------------------------------------------------------------

    def attach(self, ctx: RouterContext) -> None:
        """A generation's routing context: its index is the one remote insertions go to, and
        its insertions are published (the last attached wins: a reload's new context)."""
        if self._index is not None and self._index is not ctx.prefix_index:
            self._index.on_insert = None
        self._index = ctx.prefix_index
        self._latency = ctx.latency
        if self._loop is not None and self.shared:
            self._index.on_insert = self._on_insert
        kv = ctx.precise_index if hasattr(ctx.precise_index, "on_tokens") else None
        if self._kv is not None and self._kv is not kv:
            self._kv.on_tokens(None)
        self._kv = kv
        if kv is not None and self._loop is not None and self.share_tokens:
            kv.on_tokens(self._on_tokens)

    def attach_breakers(self, breakers: Any) -> None:
        """This process's circuit breakers: their opens and closes go to the siblings, the
        siblings' are adopted."""
        self._breakers = breakers
        breakers.index = self.worker_index
        if self._loop is not None and self.bus is not None:
            breakers.on_change = self._on_breaker

    def attach_monitor(self, monitor: Any) -> None:
        """This process's health prober and scraper: with ``share_monitoring``, it probes and
        scrapes the endpoints this worker watches (``watches``), tells the siblings, and adopts
        their outcomes for the others."""
        self._monitor = monitor
        if self.share_monitoring:
            monitor.share = self
        if self.link is not None:       # a replica's fact from before an engine's start learnt later
            monitor.listeners.append(self._vet)

    def attach_lora(self, lora: Any) -> None:
        """This process's LoRA stage: with ``share_monitoring``, its discovery reads ``/v1/models``
        of the endpoints this worker watches, and adopts the siblings' reads of the others."""
        self._lora = lora
        if self.share_monitoring:
            lora.share = self

    def watcher(self, ep: Endpoint) -> int:
        """The worker that probes, scrapes and asks ``ep`` (the same in every worker)."""
        return watcher_of(self._key(ep), self.worker_count)

    def _watching(self, ep: Endpoint) -> bool:
        return self.watcher(ep) == self.worker_index

    def watches(self, ep: Endpoint, kind: str, stale_after: float) -> bool:
        """Whether this worker probes (``kind`` "probe"), scrapes ("scrape") or asks for the
        adapters of ("models") ``ep`` now: it is the endpoint's watcher, or it has not heard the
        watcher's outcome for ``stale_after`` s."""
        if self._watching(ep):
            return True
        heard = self._heard_watcher.get((kind, self._key(ep)))
        return heard is None or time.monotonic() - heard > stale_after

    def told_probe(self, ep: Endpoint, ok: bool) -> None:
        """This worker probed ``ep``: the siblings learn the outcome if it is the watcher."""
        if self._watching(ep):
            self._probes.append(Probe(self._key(ep), ok))
            self._later()

    def told_scrape(self, ep: Endpoint, snapshot: EngineMetrics | None, known: int) -> None:
        """This worker scraped ``ep`` (``snapshot`` None: the scrape failed), knowing of ``known``
        in-flight requests on it: the siblings learn it if this is the watcher. Within
        ``view.peer_ttl_s`` of its start it may not have heard of its siblings' requests yet (a
        sibling with requests in flight says so every ``heartbeat_s``, or with ``state.redis_url``
        publishes them every ``state.sync_interval_s``): the count goes as ``UNCOUNTED``, and each
        sibling takes its own requests there as its share of the engine's count (``adopt_scrape``),
        where the count sent would have made it take its own for other gateways'. Needed at a
        gateway's start as well as at a worker's restart: the workers start at different moments,
        one serves before another's bus is open, and each makes its first scrape round before its
        own bus opens."""
        if self._watching(ep):
            if not self.heard_siblings():
                known = UNCOUNTED
            self._scrapes.append(Scrape(self._key(ep), known, encode_snapshot(snapshot) if snapshot is not None else b""))
            self._later()

    def heard_siblings(self) -> bool:
        """Whether this worker's ``remote_in_flight`` holds its siblings' requests for sure: it has
        listened on the bus for ``view.peer_ttl_s`` (its start's catch-up, which brings their
        counts too, and its first read of Redis's may come after its first scrape)."""
        return self._heard_from is not None and time.monotonic() >= self._heard_from

    def told_models(self, ep: Endpoint, asked: float, adapters: dict[str, str] | None,
                    max_model_len: int | None = None) -> None:
        """This worker read ``ep``'s LoRA adapters (None: no answer) and its model's context length:
        the siblings learn them if it is the watcher."""
        if self._watching(ep):
            self._served.append(Served(self._key(ep), asked, adapters, max_model_len=max_model_len))
            self._later()

    def told_adapters(self, ep: Endpoint, at: float, adapters: dict[str, str], loaded: bool) -> None:
        """This worker loaded ``adapters`` on ``ep`` at ``at`` (``loaded``), or unloaded them or
        found them gone: the siblings learn it at the end of this turn, so they neither load one
        again nor send requests for one to an engine without it."""
        self._served.append(Served(self._key(ep), at, adapters, LOADED if loaded else UNLOADED))
        self._soon()

    def told_load_failed(self, ep: Endpoint, adapter: str, model: str, until: float, message: str) -> None:
        """This worker's load of ``adapter`` on ``ep`` failed, and it asks that endpoint for it no
        more until ``until`` (``failure_cooldown_s``): the siblings learn it at the end of this turn
        and do the same, rather than each asking the failing engine once per cooldown."""
        key = self._key(ep)
        self._loading.pop((key, adapter), None)
        self._lora_loads.append(LoraLoad(key, adapter, model, LOAD_FAILED, until, message[:MESSAGE_MAX]))
        self._soon()

    def told_load_started(self, ep: Endpoint, adapter: str, model: str) -> None:
        """This worker starts loading ``adapter`` on ``ep``: the siblings learn it at the end of this
        turn (not held by ``flush_delay_s``: a request for it may reach them any moment), and again
        every ``heartbeat_s`` while it is under way (so they tell a slow load from a stopped worker);
        one that needs the adapter meanwhile waits for the load's end rather than loading it too."""
        key = self._key(ep)
        fact = self._loading[(key, adapter)] = LoraLoad(key, adapter, model, LOAD_STARTED)
        self._lora_loads.append(fact)
        self._soon()
        self._arm(self.cfg.heartbeat_s)

    def told_load_ended(self, ep: Endpoint, adapter: str, model: str, at: float | None) -> None:
        """This worker's load of ``adapter`` on ``ep`` ended: loaded at ``at``, or (None) neither
        loaded nor failed (refused as full, cut short; a failure is ``told_load_failed``). The
        siblings waiting for it learn it at the end of this turn."""
        key = self._key(ep)
        self._loading.pop((key, adapter), None)
        self._lora_loads.append(LoraLoad(key, adapter, model, LOAD_OK if at is not None else LOAD_ENDED, at or 0.0))
        self._soon()

    def told_used(self, ep: Endpoint, at: float, adapters: dict[str, str]) -> None:
        """This worker last used ``adapters`` on ``ep`` at ``at``: the siblings count it when they
        unload by use (idle, least recently used); it rides with the next batch."""
        self._served.append(Served(self._key(ep), at, adapters, USED))
        self._later()

    def told_busy(self, ep: Endpoint) -> None:
        """An adapter's count of requests in flight on ``ep`` went from 0 to 1 or back to 0 in this
        worker (``AdapterInFlight``): the siblings learn every adapter it has in flight, and where,
        with the next batch (and every ``heartbeat_s`` while it has any), so none unloads one of
        them from under its requests."""
        self._busy_changed.add(ep)
        self._later()

    def sibling_busy(self, ep: Endpoint, adapter: str) -> bool:
        """Whether a sibling, heard within ``peer_ttl_s``, has requests for ``adapter`` in flight on ``ep``."""
        if not self._sibling_busy:
            return False
        key, cut = self._key(ep), time.monotonic() - self.cfg.peer_ttl_s
        return any(heard >= cut and adapter in busy.get(key, ()) for _, busy, heard in self._sibling_busy.values())

    def _busy(self) -> dict[str, list[str]]:
        """The adapters in flight as last sent, with those of the endpoints changed since read again."""
        busy = dict(self._sent_busy)
        for ep in self._busy_changed:
            if ep.adapters.in_flight:
                busy[self._key(ep)] = sorted(ep.adapters.in_flight)
            else:
                busy.pop(self._key(ep), None)
        self._busy_changed = set()
        return busy

    def told_queued(self) -> None:
        """A model's admission queue in this worker filled or emptied: the siblings learn every model
        it holds requests of at the end of this turn (not held: the batch runner reads it before
        it starts a line), and every ``heartbeat_s`` while any."""
        if self.bus is not None and self.queued_source is not None:
            self._queued_changed = True
            self._soon()

    def sibling_queued(self, model: str) -> bool:
        """Whether a sibling, heard within ``peer_ttl_s``, holds requests of ``model`` in its admission queue."""
        if not self._sibling_queued:
            return False
        cut = time.monotonic() - self.cfg.peer_ttl_s
        return any(heard >= cut and model in models for _, models, heard in self._sibling_queued.values())

    def tell_preempt(self, ep: Endpoint) -> None:
        """An interactive request was routed to ``ep`` with no free slot: the siblings learn it at
        the end of this turn (not held: it waits in the engine's queue until a batch line stops)."""
        if self.bus is not None:
            self._preempts.append(self._key(ep))
            self._soon()

    def tell_batches(self) -> None:
        """This worker's Batch API created or cancelled a batch: the siblings learn it at the end of
        this turn (not held: a cancel's lines go on starting in the worker that runs them until it
        reads the job store), so that one reads it now, not at its next ``batch.poll_interval_s``."""
        if self.bus is not None:
            self._batches_changed = True
            self._soon()

    def _on_breaker(self, ep: Endpoint, open_for: float, ejections: int) -> None:
        self._ejects.append(Eject(self._key(ep), open_for, ejections))
        self._soon()

    def on_session(self, model: str, outcome: str) -> None:
        self.m.session(model, outcome)

    def on_decision(self, ireq: InferenceRequest, decision: Decision, fallbacks: Sequence, elapsed: float) -> None:
        """A decision claim (its charge follows in the same step): the load goes out this turn, or
        within ``flush_delay_s`` of the last message when one left less than that ago (``_later``),
        and the ticker runs at ``load_interval_s`` until the load is back to nothing."""
        if self._later() and self.bus_load:
            self._arm(self.cfg.load_interval_s)

    # -- publishing ----------------------------------------------------------------------------

    def _soon(self) -> bool:
        """The outbox leaves at the end of this loop turn; whether this call scheduled it."""
        if self._scheduled or self._loop is None:
            return False
        self._scheduled = True
        self._loop.call_soon(self._flush)
        return True

    def _later(self) -> bool:
        """The outbox leaves at the end of this loop turn, unless a message left less than
        ``flush_delay_s`` ago: then when that much time has passed (the ticker flushes), with
        whatever came meanwhile. A burst of decisions (a thousand streams starting at once) then
        costs each sibling a message every ``flush_delay_s``, not one a loop turn; a lone decision
        still leaves at once. For in-flight counts and monitoring facts; prefix-index insertions
        and sessions are not held (``_soon``): a fast agent's next turn may reach the sibling within
        the delay. Whether this call scheduled the flush this turn."""
        loop = self._loop
        if self._scheduled or loop is None:
            return False
        delay = self.cfg.flush_delay_s
        if delay:
            wait = self._flushed_at + delay - loop.time()
            if wait > 0:
                self._arm(wait)
                return False
        return self._soon()

    def _key(self, ep: Endpoint) -> str:
        k = self._keys.get(ep)
        if k is None:
            k = endpoint_key(ep)
            if not ep.removed:                  # a request still on a removed one: not kept again
                self._keys[ep] = k
        return k

    def _forget(self, ep: Endpoint) -> None:
        """``ep`` left the pool: its key, when its watcher was last heard of, and (``_drop_left``)
        its prefix-index entries."""
        self._left.append(ep)
        if len(self._left) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._drop_left)
            except RuntimeError:            # no loop (a pool changed outside the server): at once
                self._drop_left()
        k = self._keys.pop(ep, None) or endpoint_key(ep)
        self._unvetted.pop(ep, None)
        if not self.pool.has_url(ep.url, ep.model):     # not back under its key (its model and URL)
            for kind in ("probe", "scrape", "models"):
                self._heard_watcher.pop((kind, k), None)

    def _drop_left(self) -> None:
        """The prefix-index entries and the sessions of the endpoints that left the pool, from the
        end of the loop turn they left in: a reload that declared one again as another endpoint
        (``_replaced``, right after its removal) gave them to that one first. Each worker and each
        replica drops an endpoint that leaves its own pool (each reloads and discovers on its own),
        so nothing is sent. The sessions go a part (``VIEW_PART`` keys) a loop turn
        (``_drop_sessions``): a full map is a hundred thousand of them."""
        left, self._left = self._left, []
        gone = [ep for ep in left if ep.removed]            # not one added back meanwhile
        if self._index is not None:
            self._index.drop(gone)
        if gone and len(self.sessions):
            if self._session_walk:
                self._session_walk_again = True             # the walk under way may have passed them
            else:
                self._session_walk = True
                self._drop_sessions(self.sessions.key_set(), 0, 0)

    def _drop_sessions(self, keys: list[str], at: int, dropped: int) -> None:
        """One part of a walk of the session map (``keys``, as it was when the walk started; entries
        made since are of endpoints in the pool) for the entries of endpoints that left it, the next
        part in the next loop turn."""
        dropped += self.sessions.drop_removed(keys[at:at + VIEW_PART])
        at += VIEW_PART
        if at < len(keys):
            try:
                asyncio.get_running_loop().call_soon(self._drop_sessions, keys, at, dropped)
                return
            except RuntimeError:            # no loop (a pool changed outside the server): at once
                self._drop_sessions(keys, at, dropped)
                return
        if self._session_walk_again:
            self._session_walk_again = False
            self._drop_sessions(self.sessions.key_set(), 0, dropped)
            return
        self._session_walk = False
        if dropped:
            log.info("shared routing view: the sessions of endpoints that left the pool dropped", sessions=dropped)

    def _replaced(self, old: Endpoint, new: Endpoint) -> None:
        """A reload declared ``old``'s engine again at its URL with other settings, as ``new``: the
        engine still holds its conversations, so its sessions (the Responses lineage with them) and
        its prefix-index entries are ``new``'s, and so are the latency models learnt of it (``slo``).
        Nothing is sent: the other processes name it by its key, which has not changed (each worker
        reloads too)."""
        moved = self.sessions.rebind(old, new)
        if self._index is not None:
            self._index.rebind(old, new)
        if self._latency is not None:
            self._latency.rebind(old, new)
        log.info("shared routing view: an endpoint declared anew keeps its engine's sessions", endpoint=new.name,
                 model=new.model, sessions=moved)

    def endpoint_retired(self, ep: Endpoint) -> None:
        """``ep`` left the pool, its last request ended and its metric series went
        (``RetiredSeries``): the latency models learnt of it go too, so a fleet whose pods come and
        go keeps none of a gone one. Not before: the requests still on it observe it when they
        end, and an engine a reload declared anew took its models over when it was
        (``_replaced``), which leaves nothing here of it."""
        if self._latency is not None:
            self._latency.forget(ep)

    def engine_restarted(self, ep: Endpoint) -> None:
        """``ep``'s engine restarted (the monitor saw its start time change) and its cache is gone:
        this process's prefix index and sessions forget it, and its latency models the largest
        batch it ran (the new process may have room for fewer). Each worker and each replica does so on
        its own scrape or on the one its watcher sent it, as each drops an endpoint that left the
        pool, so nothing is sent; a whole view a sibling sends later brings back nothing of it from
        before (``PrefixIndex.merge``)."""
        if self._index is not None:
            self._index.forget(ep)
        if self._latency is not None:
            self._latency.engine_restarted(ep)
        dropped = self.sessions.forget(ep, lineage=self.lineage_is_session)
        log.info("shared routing view: a restarted engine forgotten", endpoint=ep.name, model=ep.model,
                 sessions=dropped)

    def _before_start(self, ep: Endpoint, sent: float) -> bool:
        """Whether a replica's fact of ``ep`` sent at ``sent`` (its wall clock) predates the engine
        running there now: the replica learnt it of an engine since restarted (this one catching up
        on the stream's retained tail, a worker restarted, or a replica that has not scraped the
        restart yet), whose cache is gone. With the start not known yet, the fact is taken and
        checked once it is (``_vet``): kept track of until the endpoint's first scrape that answers
        (an engine that does not tell its start then never does)."""
        started = ep.metrics.start_time if ep.metrics is not None else None
        if started is None:
            if ep.metrics is not None or not self._scraping:
                return False
            u = self._unvetted.get(ep)
            if u is None:
                u = self._unvetted[ep] = _Unvetted()
            held = u.batches
            if not held:
                held.append([sent, 1])
            elif held[-1][0] == sent:           # the same batch
                held[-1][1] += 1
            elif len(held) < UNVETTED_BATCHES:
                held.append([sent, 1])
            else:                               # past the bound: counted with the last, from the earlier time
                last = held[-1]
                last[0] = min(last[0], sent)
                last[1] += 1
            return False
        return sent < started

    def _keep(self, ep: Endpoint, sent: float, keys: Sequence[int]) -> None:
        """An insertion of ``ep`` applied before its first scrape (with replicas: the stream may
        have brought facts from before its engine's start), kept to be applied again should
        ``_vet`` forget the endpoint."""
        if self.link is None or ep.metrics is not None or not self._scraping:
            return
        u = self._unvetted.get(ep)
        if u is None:
            u = self._unvetted[ep] = _Unvetted()
        u.keep(sent, keys)

    def _vet(self, ep: Endpoint) -> None:
        """The monitor's word on ``ep`` (a scrape, a health change): once its engine's start is known,
        replica facts taken of it before, sent before that start, are of an engine since restarted:
        they are counted as ``before_start`` and forgotten. The prefix index does not tell them from
        the others, so it forgets the endpoint and the insertions kept meanwhile that were sent after
        the start are applied again; the sessions recorded before the start go."""
        if not self._unvetted or ep not in self._unvetted:
            return
        started = ep.metrics.start_time if ep.metrics is not None else None
        if started is None:
            if ep.metrics is not None:      # scraped, without its start: no scrape will tell it
                del self._unvetted[ep]
            return
        u = self._unvetted.pop(ep)
        stale = sum(int(n) for sent, n in u.batches if sent < started)
        if stale:
            self.m.gm.child(self.m.applied, "replica", "before_start").inc(stale)
            index = self._index
            kept = 0
            if index is not None:
                index.forget(ep)
                for sent, keys in u.inserts or ():
                    if sent >= started:
                        index.apply_insert(keys, ep)
                        kept += 1
            dropped = self.sessions.forget(ep, before=started, lineage=self.lineage_is_session)
            log.info("shared routing view: replica facts from before an engine's start forgotten",
                     endpoint=ep.name, model=ep.model, facts=stale, sessions=dropped, insertions_kept=kept,
                     insertions_lost=u.inserts is None)

    def _on_insert(self, keys: list[int], ep: Endpoint) -> None:
        self._inserts.append(Insert(self._key(ep), keys))
        if self.link is not None and ep.metrics is None:     # with replicas, before the endpoint's first scrape
            self._keep(ep, time.time(), keys)
        self._soon()        # not held by flush_delay_s: an agent's next turn may come within it

    def _on_put(self, key: str, ep: Endpoint, tag: str | None, at: float) -> None:
        self._sessions.append(Session(key, self._key(ep), tag, at))
        if key.startswith(RESPONSE):
            # recorded as the answer goes out: sent now, before the client can ask a sibling for more
            self._flush()
        else:
            self._soon()    # at the end of this turn, not held: an agent's next turn may come within the delay

    def _on_tokens(self, model: str, segment: str, ids: list[int]) -> None:
        if tokens_size(model, segment, ids) > self.cfg.max_datagram_bytes - 256:
            self.m.gm.child(self.m.dropped, "worker", "too_large").inc()     # a datagram of its own, too big
            return
        self._tokens.append(Tokens(model, segment, ids))
        if not self._scheduled and self._tokens_timer is None:
            self._tokens_timer = self._loop.call_later(self.cfg.load_interval_s, self._flush)  # type: ignore[union-attr]

    def _load(self) -> dict[str, int]:
        key = self._key
        return {key(ep): ep.in_flight for ep in self.pool.endpoints() if ep.in_flight}

    def _flush(self, heartbeat: bool = False) -> None:
        self._scheduled = False
        inserts, sessions, tokens, ejects = self._inserts, self._sessions, self._tokens, self._ejects
        if ejects:
            self._ejects = []
        if inserts:
            self._inserts = []
        if sessions:
            self._sessions = []
        if tokens:
            self._tokens = []
        probes, scrapes = self._probes, self._scrapes
        if probes:
            self._probes = []
        if scrapes:
            self._scrapes = []
        served = self._served
        if served:
            self._served = []
        preempt = self._preempts
        if preempt:
            self._preempts = []
        batches, self._batches_changed = self._batches_changed, False
        lora_loads = self._lora_loads
        if lora_loads:
            self._lora_loads = []
        if self._loading:           # loads under way: said again every heartbeat_s
            now = time.monotonic()
            if now - self._loading_told_at >= self.cfg.heartbeat_s - 0.01:
                lora_loads = [*lora_loads, *(f for f in self._loading.values() if f not in lora_loads)]
                self._loading_told_at = now
        if self._tokens_timer is not None:
            self._tokens_timer.cancel()
            self._tokens_timer = None
        load = None
        if self.bus_load:
            now = time.monotonic()
            snap = self._load()
            # changed, or the heartbeat of counts the siblings hold (none at rest: "nothing" was said once)
            if snap != self._sent_load or (snap and now - self._sent_load_at >= self.cfg.heartbeat_s - 0.01):   # (a timer may fire a hair early)
                load, self._sent_load, self._sent_load_at = snap, snap, now
        busy = None
        if self._busy_changed or self._sent_busy:
            now = time.monotonic()
            due = bool(self._sent_busy) and now - self._sent_busy_at >= self.cfg.heartbeat_s - 0.01
            if self._busy_changed or due:
                snap = self._busy()
                if due or snap != self._sent_busy:
                    busy, self._sent_busy, self._sent_busy_at = snap, snap, now
                    if snap:
                        self._arm(self.cfg.heartbeat_s)      # said again until nothing is in flight
        queued = None
        if (self._queued_changed or self._sent_queued) and self.queued_source is not None:
            now = time.monotonic()
            due = bool(self._sent_queued) and now - self._sent_queued_at >= self.cfg.heartbeat_s - 0.01
            if self._queued_changed or due:
                self._queued_changed = False
                snap = sorted(self.queued_source())
                if due or snap != self._sent_queued:
                    queued, self._sent_queued, self._sent_queued_at = snap, snap, now
                    if snap:
                        self._arm(self.cfg.heartbeat_s)      # said again until no queue holds any
        bus = self.bus
        if bus is not None and (inserts or sessions or tokens or ejects or probes or scrapes or served or preempt
                                or batches or lora_loads or load is not None or busy is not None or queued is not None
                                or (heartbeat and self._owe)):
            payloads, self._seq = encode_numbered(self.sender, time.time(), inserts, sessions, load,
                                                  self.cfg.max_datagram_bytes, tokens, ejects, probes, scrapes, served,
                                                  preempt, self.run, self._seq, busy, lora_loads, queued, batches)
            self.m.gm.child(self.m.sent, "worker").inc(bus.send(payloads))
            if bus.refused:
                # a sibling missed facts, or the number that tells it so: say it again on the heartbeat
                if inserts or sessions or ejects or self._owe:
                    self._owe = True
                    self._arm(self.cfg.heartbeat_s)
            else:
                self._owe = False
            if self._loop is not None:
                self._flushed_at = self._loop.time()
        if self.link is not None and (inserts or sessions):
            self.link.queue([*inserts, *sessions])

    def _arm(self, delay: float) -> None:
        """The next tick within ``delay`` (an earlier one already armed stands)."""
        loop = self._loop
        if loop is None:
            return
        when = loop.time() + delay
        h = self._tick_at
        if h is not None:
            if self._tick_when <= when:
                return
            h.cancel()
        self._tick_when = when
        self._tick_at = loop.call_at(when, self._tick)

    def on_request(self, rec: Any, duration: float) -> None:
        """A request ended (the pipeline's record observer), its charges released: its load goes
        out within ``load_interval_s``, the only change to the load a decision does not announce."""
        self._arm(self.cfg.load_interval_s)

    def _tick(self) -> None:
        """Workers: the load when it changed without a decision (requests ending), the heartbeat,
        and silent siblings forgotten. Armed within ``load_interval_s`` by a decision and by a
        request's end, else every ``heartbeat_s`` while there are counts to keep alive (this
        worker's, sent, or a sibling's, held): a worker whose requests are in flight with nothing
        starting or ending (a thousand slow streams) wakes four times a second, not fifty, and a
        gateway at rest not at all (with N workers the heartbeats were N x (N - 1) messages a
        second times four)."""
        self._tick_at = None
        try:
            if not self._scheduled:
                self._flush(heartbeat=True)
            self._expire_peers()
        except Exception:     # never let the ticker die: the siblings would see this one go silent
            log.exception("shared routing view: tick failed")
        if (self.bus_load and (self._sent_load or self._peers)) or self._owe or self._sent_busy or self._sibling_busy \
                or self._loading or self._sent_queued or self._sibling_queued:
            self._arm(self.cfg.heartbeat_s)

    # -- applying ------------------------------------------------------------------------------

    def _resolve(self, key: str) -> Endpoint | None:
        ep = self._by_key.get(key)
        if ep is not None and ep.removed:      # it left the pool since: perhaps declared anew under its key
            self._resolved_at = -1e9
            ep = None
        now = time.monotonic()
        if now - self._resolved_at >= _RESOLVE_EVERY_S or (ep is None and now - self._resolved_at >= 0.05):
            self._by_key = {endpoint_key(e): e for e in self.pool.endpoints()}
            self._resolved_at = now
            ep = self._by_key.get(key)
        return ep

    def _on_bus(self, data: bytes) -> None:
        self._apply(data, "worker", True)

    def _on_stream(self, data: bytes, live: bool) -> None:
        self._apply(data, "replica", live)

    def _bus_drop(self, reason: str) -> None:
        self.m.gm.child(self.m.dropped, "worker", reason).inc()

    def _apply(self, data: bytes, source: str, live: bool) -> None:
        m = self.m
        try:
            batch: Batch = decode(data)
        except (msgspec.DecodeError, ValueError):
            m.gm.child(m.dropped, source, "undecodable").inc()
            return
        m.gm.child(m.received, source).inc()
        if live:
            m.observe_lag(source, max(0.0, time.time() - batch.sent))
        if batch.run and source == "worker":
            self._check_seq(batch)
            held = self._sibling_busy.get(batch.sender) if self._sibling_busy else None
            if held is not None and held[0] != batch.run:      # the sibling restarted: nothing in flight of before
                del self._sibling_busy[batch.sender]
            was = self._sibling_queued.get(batch.sender) if self._sibling_queued else None
            if was is not None and was[0] != batch.run:        # nor anything queued
                del self._sibling_queued[batch.sender]
            if self._lora is not None and self.share_monitoring:
                self._lora.sibling_run(batch.sender, batch.run)    # nor any load under way
        unknown = stale = expired = 0
        index = self._index
        vet = source == "replica"          # siblings scrape the engines with this worker
        # the stream's retained tail (a replica starting) and a backlog after an outage hold facts of
        # any age: one older than its TTL was forgotten by the process that recorded it, and is not
        # taken back here as if new (the sender's wall clock: a session's when it was told)
        now = time.time()
        if batch.inserts and index is not None:
            if now - batch.sent > index.idle_ttl_ms / 1000.0:
                expired += len(batch.inserts)
            else:
                n = 0
                for ins in batch.inserts:
                    ep = self._resolve(ins.ep)
                    if ep is None:
                        unknown += 1
                        continue
                    if vet and self._before_start(ep, batch.sent):
                        stale += 1
                        continue
                    index.apply_insert(ins.keys, ep)
                    self._keep(ep, batch.sent, ins.keys)
                    n += 1
                m.gm.child(m.applied, source, "insert").inc(n)
        if batch.sessions:
            n = 0
            ttl = self.sessions.ttl_s
            for s in batch.sessions:
                if now - (s.at or batch.sent) > ttl:
                    expired += 1
                    continue
                ep = self._resolve(s.ep)
                if ep is None:
                    unknown += 1
                    continue
                # a Responses lineage stays (an engine that stores responses is where they are asked
                # for), unless the gateway holds them: then it is a session like any other
                if vet and (self.lineage_is_session or not s.key.startswith(RESPONSE)) \
                        and self._before_start(ep, batch.sent):
                    stale += 1
                    continue
                self.sessions.apply(s.key, ep, s.tag, s.at or None)      # a later entry here stays
                n += 1
            m.gm.child(m.applied, source, "session").inc(n)
        if stale:
            m.gm.child(m.applied, source, "before_start").inc(stale)
        if expired:
            m.gm.child(m.applied, source, "expired").inc(expired)
        if batch.breakers and self._breakers is not None and source == "worker":
            n = 0
            index = batch.sender.rpartition("/")[2]
            # a sender before this worker: its ejection is kept over one this worker decided at once
            first = index.isdigit() and int(index) < self.worker_index
            for f in batch.breakers:
                ep = self._resolve(f.ep)
                if ep is None:
                    unknown += 1
                elif f.open_for > 0:
                    n += self._breakers.adopt_open(ep, f.open_for, f.ejections, sender_first=first,
                                                   owner=int(index) if index.isdigit() else -1)
                else:
                    n += self._breakers.adopt_close(ep)
            m.gm.child(m.applied, source, "breaker").inc(n)
        if (batch.probes or batch.scrapes or batch.served) and self.share_monitoring and source == "worker":
            unknown += self._adopt_monitoring(batch)
        if unknown:
            m.gm.child(m.applied, source, "unknown_endpoint").inc(unknown)
        if batch.tokens and self._kv is not None and source == "worker":
            adopt = self._kv.adopt_tokens
            n = 0
            for t in batch.tokens:
                n += adopt(t.model, t.segment, t.ids)
            m.gm.child(m.applied, source, "tokens").inc(n)
        if batch.load is not None and self.bus_load and source == "worker":
            if batch.load:
                self._peers[batch.sender] = (batch.load, time.monotonic())
                if self._tick_at is None:          # held counts expire if their sender goes silent
                    self._arm(self.cfg.heartbeat_s)
            else:                                  # nothing in flight there: nothing to hold or expire
                self._peers.pop(batch.sender, None)
            m.gm.child(m.applied, source, "load").inc()
            self._sum_peers()
        if batch.busy is not None and self.share_monitoring and source == "worker":
            if batch.busy:
                self._sibling_busy[batch.sender] = (batch.run, batch.busy, time.monotonic())
                if self._tick_at is None:          # held marks expire if their sender goes silent
                    self._arm(self.cfg.heartbeat_s)
            else:
                self._sibling_busy.pop(batch.sender, None)
            m.gm.child(m.applied, source, "busy").inc()
        if batch.queued is not None and source == "worker":
            if batch.queued:
                self._sibling_queued[batch.sender] = (batch.run, batch.queued, time.monotonic())
                if self._tick_at is None:          # held marks expire if their sender goes silent
                    self._arm(self.cfg.heartbeat_s)
            else:
                self._sibling_queued.pop(batch.sender, None)
            m.gm.child(m.applied, source, "queued").inc()
        if batch.loads and self.share_monitoring and self._lora is not None and source == "worker":
            n = 0
            for f in batch.loads:
                ep = self._resolve(f.ep)
                if ep is None:
                    m.gm.child(m.applied, source, "unknown_endpoint").inc()
                elif f.state == LOAD_FAILED:
                    self._lora.adopt_load_failed(ep, f.adapter, f.model, f.at, f.message)
                    n += 1
                elif f.state == LOAD_STARTED:
                    self._lora.adopt_load_started(ep, f.adapter, batch.sender, batch.run)
                    n += 1
                elif f.state in (LOAD_OK, LOAD_ENDED):
                    self._lora.adopt_load_ended(ep, f.adapter, f.model, f.at if f.state == LOAD_OK else None)
                    n += 1
            m.gm.child(m.applied, source, "lora_load").inc(n)
        if batch.preempt and self.on_preempt is not None and source == "worker":
            n = 0
            for key in batch.preempt:       # after the load: the sender's request is counted here
                ep = self._resolve(key)
                if ep is None:
                    m.gm.child(m.applied, source, "unknown_endpoint").inc()
                elif self.on_preempt(ep):
                    n += 1
            m.gm.child(m.applied, source, "preempt").inc(n)
        if batch.batches and self.on_batches is not None and source == "worker":
            self.on_batches()
            m.gm.child(m.applied, source, "batches").inc()

    # -- catching up --------------------------------------------------------------------------

    def _check_seq(self, batch: Batch) -> None:
        """A sibling's batch number: a jump means batches with insertions, sessions or breakers were lost on
        the way here (this worker's queue was full), so the sibling is asked for its whole view."""
        facts = 1 if batch.inserts or batch.sessions or batch.breakers else 0
        heard = self._heard_seq.get(batch.sender)
        if heard is not None and heard[0] == batch.run:
            if batch.seq <= heard[1]:        # sent before what a catch-up brought
                return
            missed = batch.seq > heard[1] + facts
        else:                                # first heard of this incarnation: had it sent any before?
            missed = batch.seq > facts
        self._heard_seq[batch.sender] = (batch.run, batch.seq)
        if missed:
            index = batch.sender.rpartition("/")[2]
            if index.isdigit() and int(index) != self.worker_index:
                self._pull(int(index), "gap")

    def _pull(self, index: int, reason: str) -> None:
        """Sibling ``index``'s whole view, asked for in the background (once every ``CATCH_UP_EVERY_S`` at most)."""
        if self.ask_sibling is None or self._loop is None or index >= self.worker_count:
            return
        self._want_pull[index] = reason
        task = self._pulls.get(index)
        if task is None or task.done():
            self._pulls[index] = self._loop.create_task(self._puller(index))

    async def _puller(self, index: int) -> None:
        while index in self._want_pull:
            wait = self._pull_after.get(index, 0.0) - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            reason = self._want_pull.pop(index, "gap")
            self._pull_after[index] = time.monotonic() + CATCH_UP_EVERY_S
            await self.catch_up(index, reason)

    async def catch_up(self, index: int, reason: str) -> bool:
        """Sibling ``index``'s sessions and prefix index merged into this view (each entry kept
        unless this view knows a later one); whether it answered."""
        ask = self.ask_sibling
        if ask is None:
            return False
        data = await ask(index, "view", CATCH_UP_TIMEOUT_S)
        if data is None:                     # not there (yet): nothing to learn, nothing lost
            return False
        try:
            merged = await self._merge(view_parts(data), f"{self.group}/{index}", reason) if data else False
        except (msgspec.DecodeError, ValueError):
            merged = False
        self.m.gm.child(self.m.catch_ups, reason, "applied" if merged else "failed").inc()
        return merged

    async def _merge(self, parts: Iterator[ViewSnapshot], sender: str, reason: str = "gap") -> bool:
        """A sibling's whole view merged as its parts are decoded, one part (at most ``VIEW_PART``
        entries) per loop turn: a full view is a few hundred thousand, and the requests in flight
        here go on meanwhile. False when it had no part; a part that does not decode raises."""
        head = next(parts, None)
        if head is None:
            return False
        self._adopt_held(head, sender, reason == "start")
        eps = [self._resolve(k) for k in head.eps]
        slots = {slot: ep for slot, ep in ((s, self._resolve(k)) for s, k in head.slots.items()) if ep is not None}
        merge_session = self.sessions.merge
        n = blocks = 0
        part: ViewSnapshot | None = head
        while part is not None:
            for key, i, tag, touched in part.sessions:
                ep = eps[i] if 0 <= i < len(eps) else None
                if ep is not None and merge_session(key, ep, tag, touched):
                    n += 1
            index = self._index          # a reload may have attached another meanwhile
            if index is not None and part.blocks:
                blocks += index.merge(part.blocks, slots)
            await asyncio.sleep(0)
            part = next(parts, None)
        heard = self._heard_seq.get(sender)
        if heard is None or heard[0] != head.run or heard[1] < head.seq:
            self._heard_seq[sender] = (head.run, head.seq)
        log.info("shared routing view: caught up with a sibling", sibling=sender, sessions=n, blocks=blocks)
        return True

    def _adopt_held(self, head: ViewSnapshot, sender: str, start: bool = False) -> None:
        """A sibling's requests and LoRA adapters in flight as its whole view gave them, unless a
        batch of its own told of them already (each change is told as it happens, so that is as new)."""
        now = time.monotonic()
        if head.load and self.bus_load and sender not in self._peers:
            self._peers[sender] = (head.load, now)
            self.m.gm.child(self.m.applied, "worker", "load").inc()
            self._sum_peers()
        if head.busy and self.share_monitoring and sender not in self._sibling_busy:
            self._sibling_busy[sender] = (head.run, head.busy, now)
            self.m.gm.child(self.m.applied, "worker", "busy").inc()
        if (head.load or head.busy) and self._tick_at is None:     # held until their sender goes silent
            self._arm(self.cfg.heartbeat_s)
        if self._breakers is not None and self.bus is not None:
            self._adopt_ejections(head, sender, start)

    def _adopt_ejections(self, head: ViewSnapshot, sender: str, start: bool) -> None:
        """A sibling's ejections, as its whole view gave them, for what is left of them, where this
        worker's breaker is closed (it just started, or missed the batch that told it): the trials
        stay the sibling's (``adopt_open``), or the worker's whose ejection the sibling holds; one
        that this worker's predecessor decided is this worker's, trials and all. After a gap, an
        ejection of the sibling's that this worker holds and the sibling no longer has was closed
        by the sibling's trials, in a batch missed: closed here too."""
        index = sender.rpartition("/")[2]
        by_sender = int(index) if index.isdigit() else -1
        n = 0
        # the closes first: an ejection the sibling's view lists may need the room one of them held
        heard = self._heard_seq.get(sender)
        if not start and by_sender >= 0 and (heard is None or heard[0] != head.run or heard[1] <= head.seq):
            # (a batch of the sibling's newer than its view may have told of an ejection since: then not)
            listed = {f.ep for f in head.breakers}
            # (and one refused here is over: the sibling's next ejection of it is another refusal)
            for ep in self._breakers.held_for(by_sender):
                if self._key(ep) not in listed:
                    n += self._breakers.adopt_close(ep)
        if head.breakers:
            for f in head.breakers:
                ep = self._resolve(f.ep)
                mine = f.by == self.worker_index
                # one of this worker's own told back after a gap: it closed it since (the sibling missed that)
                if ep is None or self._breakers.state(ep) != CLOSED or (mine and not start):
                    continue
                n += self._breakers.adopt_open(ep, f.open_for, f.ejections, owner=by_sender if f.by < 0 else f.by,
                                               own=mine, counted=not start)
        if n:
            self.m.gm.child(self.m.applied, "worker", "breaker").inc(n)

    async def snapshot(self) -> bytes:
        """This worker's whole view for a sibling catching up (``catch_up``): its batch number, then
        its live sessions and prefix-index blocks with their times, ``VIEW_PART`` entries a part
        and a loop turn (what changes meanwhile reaches the sibling in the batches after that
        number too, and the merge keeps the later of two times). O(view size), once per ask."""
        live = [ep for ep in self.pool.endpoints() if not ep.removed]
        pos = {ep: i for i, ep in enumerate(live)}
        get = pos.get
        index = self._index
        slots = {slot: self._key(ep) for slot, ep in index.slots().items() if ep in pos} if index is not None else {}
        # what it has in flight, as its batches tell it (the asker has missed those sent before it
        # listened: a restarted worker would otherwise unload an adapter from under these requests
        # or route as if none were here until the next heartbeat)
        load = self._load() if self.bus_load else {}
        busy = ({self._key(ep): sorted(ep.adapters.in_flight) for ep in live if ep.adapters.in_flight}
                if self.share_monitoring else {})
        # and the endpoints its breakers keep out: a restarted worker would otherwise send its first
        # requests to an engine its siblings ejected, until faults of its own tripped its breaker
        ejected = ([Eject(self._key(ep), left, n, self.worker_index if by is None else by)
                    for ep, left, n, by in self._breakers.ejected_now() if ep in pos]
                   if self._breakers is not None and self.bus is not None else [])
        out = bytearray(encode_view(ViewSnapshot(self.run, self._seq, [self._key(ep) for ep in live], [], slots,
                                                 load=load, busy=busy, breakers=ejected)))
        keys = self.sessions.keys()
        for at in range(0, len(keys), VIEW_PART):
            await asyncio.sleep(0)
            rows = [(key, get(ep, -1), tag, touched)
                    for key, ep, tag, touched in self.sessions.export(keys[at:at + VIEW_PART])]
            if rows:
                out += encode_view(ViewSnapshot(0, 0, sessions=rows))
        blocks = index.block_keys() if index is not None else []
        for at in range(0, len(blocks), VIEW_PART):
            await asyncio.sleep(0)
            rows = index.export(blocks[at:at + VIEW_PART])[1]      # type: ignore[union-attr]
            if rows:
                out += encode_view(ViewSnapshot(0, 0, blocks=rows))
        return bytes(out)

    def _adopt_monitoring(self, batch: Batch) -> int:
        """A watcher's probes, scrapes and adapter lists, adopted (each endpoint's watcher then
        counts as heard); returns how many named an unknown endpoint."""
        m, mon, lora, heard = self.m, self._monitor, self._lora, self._heard_watcher
        now = time.monotonic()
        unknown = 0
        for kind, facts, adopt in (("probe", batch.probes if mon is not None else (), self._adopt_probe),
                                   ("scrape", batch.scrapes if mon is not None else (), self._adopt_scrape),
                                   ("models", batch.served if lora is not None else (), self._adopt_served)):
            n = 0
            for fact in facts:
                ep = self._resolve(fact.ep)
                if ep is None:
                    unknown += 1
                    continue
                if kind != "models" or not fact.change:      # a load or an unload is any worker's
                    heard[(kind, fact.ep)] = now
                n += adopt(ep, fact)
            if n:
                m.gm.child(m.applied, "worker", kind).inc(n)
        return unknown

    def _adopt_probe(self, ep: Endpoint, p: Probe) -> int:
        self._monitor.adopt_probe(ep, p.ok)
        return 1

    def _adopt_scrape(self, ep: Endpoint, sc: Scrape) -> int:
        if sc.snapshot:                      # empty: the watcher's scrape failed (heard all the same)
            try:
                snap = decode_snapshot(sc.snapshot)
            except (msgspec.DecodeError, ValueError):
                self.m.gm.child(self.m.dropped, "worker", "undecodable").inc()
                return 0
            self._monitor.adopt_scrape(ep, snap, sc.known)
        return 1

    def _adopt_served(self, ep: Endpoint, sv: Served) -> int:
        if sv.change == USED:
            self._lora.adopt_use(ep, sv.asked, sv.adapters or {})
        elif sv.change:
            self._lora.adopt_change(ep, sv.asked, sv.adapters or {}, sv.change == LOADED)
        elif sv.adapters is not None:        # None: the endpoint did not answer the watcher
            ep.max_model_len = sv.max_model_len
            self._lora.adopt_models(ep, sv.asked, sv.adapters)
        return 1

    def _sum_peers(self) -> None:
        totals: dict[str, int] = {}
        for counts, _ in self._peers.values():
            for k, n in counts.items():
                totals[k] = totals.get(k, 0) + n
        key = self._key
        for ep in self.pool.endpoints():
            ep.remote_in_flight = totals.get(key(ep), 0)
        self.m.peers = len(self._peers)

    def _expire_peers(self) -> None:
        cut = time.monotonic() - self.cfg.peer_ttl_s
        if self._sibling_busy:
            for s in [s for s, (_, _, heard) in self._sibling_busy.items() if heard < cut]:
                del self._sibling_busy[s]
        if self._sibling_queued:
            for s in [s for s, (_, _, heard) in self._sibling_queued.items() if heard < cut]:
                del self._sibling_queued[s]
        if not self._peers:
            return
        silent = [s for s, (_, heard) in self._peers.items() if heard < cut]
        if silent:
            for s in silent:
                del self._peers[s]
            self._sum_peers()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.shared:
            return
        self.sessions.on_put = self._on_put
        if self._index is not None:
            self._index.on_insert = self._on_insert
        if self._kv is not None and self.share_tokens:
            self._kv.on_tokens(self._on_tokens)
        if self.bus is not None:
            if self._breakers is not None:
                self._breakers.on_change = self._on_breaker
            self.bus.open()
            self._heard_from = time.monotonic() + self.cfg.peer_ttl_s
            if self.bus_load:
                self._arm(self.cfg.load_interval_s)
            if self.ask_sibling is not None:
                # a restarted worker knows the sessions and prefixes its siblings know before it serves
                # (at the gateway's start there is nothing to learn, and a sibling not up yet refuses at once)
                await asyncio.gather(*(self.catch_up(i, "start") for i in range(self.worker_count)
                                       if i != self.worker_index))
        if self.link is not None:
            self.link.start()
        log.info("shared routing view", workers_bus=self.bus is not None, bus_load=self.bus_load,
                 replicas=self.link is not None, sender=self.sender, share_monitoring=self.share_monitoring)

    async def stop(self) -> None:
        self._want_pull.clear()
        for task in self._pulls.values():
            task.cancel()
        for task in self._pulls.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._pulls.clear()
        if self._tick_at is not None:
            self._tick_at.cancel()
            self._tick_at = None
        if self.bus is not None:
            self.bus.close()
        if self.link is not None:
            await self.link.stop()
        if self._index is not None:
            self._index.on_insert = None
        if self._kv is not None:
            self._kv.on_tokens(None)
        if self._breakers is not None:
            self._breakers.on_change = None
        if self._monitor is not None:
            self._monitor.share = None
        if self._lora is not None:
            self._lora.share = None
        if self._tokens_timer is not None:
            self._tokens_timer.cancel()
            self._tokens_timer = None
        self._tokens = []
        self.sessions.on_put = None
        self._loop = None

    def describe(self) -> dict[str, Any]:
        """For the status page and tests: how this process shares its view, and the recent lag."""
        return {"sender": self.sender, "workers_bus": self.bus is not None, "bus_load": self.bus_load,
                "replicas": self.link is not None, "redis_up": bool(self.link is not None and self.link.up),
                "siblings_heard": len(self._peers), "sessions": len(self.sessions),
                "share_monitoring": self.share_monitoring,
                "watching": sum(1 for ep in self.pool.endpoints() if self._watching(ep))
                if self.share_monitoring else None,
                "lag": {s: self.m.lag_quantiles(s) for s in ("worker", "replica")}}
