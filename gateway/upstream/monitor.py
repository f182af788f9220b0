"""Background loops that keep the endpoint pool's live state current.

- The health prober polls each endpoint's health path and flips ``Endpoint.healthy`` after the
  configured number of consecutive failures / successes (passive marking on connect failures
  happens in the pipeline; the prober is what brings an endpoint back).
- The scraper polls each endpoint's ``/metrics`` into an ``EngineMetrics`` snapshot for routers.
  A snapshot whose ``start_time`` (the engine's ``process_start_time_seconds``) differs from the
  last one known of that endpoint, scraped or adopted, even after scrapes that failed while it was
  down, is a restarted engine: its cache is empty, so ``restart_listeners`` drop what the gateway
  believed it held (prefix index, KV-event entries, sessions). A start time first seen is none.

Both probe all endpoints concurrently each round, each endpoint's probe or scrape a task of its own
under its own timeout: a round waits for them at most an interval, so an engine that answers slowly
or never does not hold the others' (their snapshots stayed a whole timeout old), and an endpoint
whose last one still waits is not asked again until it ends (``EndpointRounds``).
With several workers sharing the routing view (``view.share_monitoring``), a worker probes and
scrapes only the endpoints it watches (``share.watches``), tells its siblings (``told_probe``,
``told_scrape``) and adopts theirs (``adopt_probe``, ``adopt_scrape``): each engine is probed and
scraped once per interval by the whole gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import structlog

from gateway.config.schema import HealthConfig, ScrapeConfig
from gateway.endpoints import Endpoint, EndpointPool, EngineMetrics
from gateway.observability.metrics import GatewayMetrics
from gateway.upstream.engine_metrics import parse_engine_metrics
from gateway.upstream.h1client import LOCAL_ERRNOS
from gateway.view.wire import UNCOUNTED

log = structlog.get_logger("switchyard.monitor")

HEALTH_PATH = {"vllm": "/health", "sglang": "/health"}
# a start time that moved by more than this is a restart: prometheus_client computes it from the
# kernel's boot time, which moves by a second when the clock is stepped, and an engine takes longer
# than that to restart and load a model
RESTART_MIN_S = 1.0


class EndpointRounds:
    """A periodic round's work on each endpoint (a probe, a scrape, a read of its adapters), each
    a task of its own: ``run`` waits for them at most ``wait`` (the round's interval), so one that
    takes longer (its own timeout bounds it) goes on alone while the next rounds take the other
    endpoints, and its endpoint is left out of them until it ended. Waiting for all of them, one
    engine that answered slowly or never held every other engine's for the whole timeout."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._running: dict[int, asyncio.Task] = {}     # by the endpoint's id: its task holds it

    async def run(self, eps: list[Endpoint], fn: Callable[[Endpoint], Awaitable[Any]], wait: float) -> None:
        started = []
        running = self._running
        for ep in eps:
            key = id(ep)
            if key in running:
                continue
            t = asyncio.create_task(self._one(fn, ep), name=f"switchyard-{self.what}")
            running[key] = t
            t.add_done_callback(lambda _, key=key: running.pop(key, None))
            started.append(t)
        if started:
            await asyncio.wait(started, timeout=wait)

    async def _one(self, fn: Callable[[Endpoint], Awaitable[Any]], ep: Endpoint) -> None:
        try:
            await fn(ep)
        except Exception:  # a bug in one endpoint's must not stop the rounds, nor go unlogged
            log.exception("monitor round failed", what=self.what, endpoint=ep.name)

    async def stop(self) -> None:
        tasks = list(self._running.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._running.clear()


class Monitor:
    def __init__(self, pool: EndpointPool, session: aiohttp.ClientSession, metrics: GatewayMetrics,
                 health: HealthConfig, scrape: ScrapeConfig) -> None:
        self.pool = pool
        self.session = session
        self.metrics = metrics
        self.health = health
        self.scrape = scrape
        self._tasks: list[asyncio.Task] = []
        # the probes and the scrapes under way: one of each per endpoint at a time
        self._probes, self._scrapes = EndpointRounds("probe"), EndpointRounds("scrape")
        # the shared routing view when the workers share monitoring (gateway/view/service.py), else None
        self.share: Any = None
        # told of an endpoint right after its snapshot or its health changed (admission control)
        self.listeners: list[Callable[[Endpoint], None]] = []
        # told of an endpoint whose engine restarted (its start time changed): what it cached is gone
        self.restart_listeners: list[Callable[[Endpoint], None]] = []

    def start(self) -> None:
        if self.health.enabled:
            self._tasks.append(asyncio.create_task(self._loop(self.health.interval_s, self.probe_all),
                                                   name="switchyard-health"))
        if self.scrape.enabled:
            self._tasks.append(asyncio.create_task(self._loop(self.scrape.interval_s, self.scrape_all),
                                                   name="switchyard-scrape"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        await self._probes.stop()
        await self._scrapes.stop()

    @staticmethod
    async def _loop(interval: float, fn) -> None:
        while True:
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not stop monitoring
                log.exception("monitor round failed")
            await asyncio.sleep(interval)

    # -- health ------------------------------------------------------------------------------

    async def probe_all(self) -> None:
        eps = self.pool.endpoints()
        share = self.share
        if share is not None:
            stale = 2 * self.health.interval_s + self.health.timeout_s
            eps = [ep for ep in eps if share.watches(ep, "probe", stale)]
        await self._probes.run(eps, self.probe, self.health.interval_s)

    async def probe(self, ep: Endpoint) -> bool:
        ok = False
        try:
            async with asyncio.timeout(self.health.timeout_s):
                async with self.session.get(ep.url + HEALTH_PATH.get(ep.engine, "/health")) as r:
                    await r.read()
                    ok = r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if isinstance(e, OSError) and e.errno in LOCAL_ERRNOS:
                # this process could make no socket (aiohttp's connect error carries the errno):
                # nothing was asked of the engine, so nothing is learned of it, nor told to siblings
                self.metrics.child(self.metrics.health_probes, ep.model, ep.name, "not_sent").inc()
                return False
            ok = False
        self.metrics.child(self.metrics.health_probes, ep.model, ep.name, "ok" if ok else "fail").inc()
        if self.share is None or self._counts(ep, ok, own=True):
            self.apply_probe(ep, ok)
        if self.share is not None:
            self.share.told_probe(ep, ok)
        return ok

    def adopt_probe(self, ep: Endpoint, ok: bool) -> None:
        """The outcome of a probe a sibling worker made of ``ep`` (it watches it)."""
        if self._counts(ep, ok, own=False):
            self.apply_probe(ep, ok)

    def _counts(self, ep: Endpoint, ok: bool, own: bool) -> bool:
        """Whether an outcome counts toward ``ep``'s thresholds, with workers sharing monitoring.

        A worker that has not heard ``ep``'s watcher (at start, or while the watcher is silent)
        probes it itself, and the watcher's outcome of the same round may come as well: two
        outcomes of one round, which must not count as two rounds in a row (one slow round would
        then take the endpoint out with ``unhealthy_threshold: 2``). An outcome from the other
        source than the last one, within a probe timeout plus half an interval of it, is of the
        same round: it counts only when it is a success after a failure (the engine answered one
        of them). Outcomes from one source are a round apart and always count."""
        now = time.monotonic()
        last = ep.last_probe
        if last is not None and last[0] != own \
                and now - last[2] < self.health.timeout_s + self.health.interval_s / 2 \
                and not (ok and not last[1]):
            return False
        ep.last_probe = (own, ok, now)
        return True

    def apply_probe(self, ep: Endpoint, ok: bool) -> None:
        was = ep.healthy
        if ok:
            ep.consecutive_failures = 0
            ep.consecutive_successes += 1
            if not ep.healthy and ep.consecutive_successes >= self.health.healthy_threshold:
                ep.healthy = True
        else:
            ep.consecutive_successes = 0
            ep.consecutive_failures += 1
            if ep.healthy and ep.consecutive_failures >= self.health.unhealthy_threshold:
                ep.healthy = False
        if was != ep.healthy:
            log.info("endpoint health changed", model=ep.model, endpoint=ep.name, healthy=ep.healthy)
            self._tell(ep)

    # -- engine metrics ----------------------------------------------------------------------

    async def scrape_all(self) -> None:
        eps = self.pool.endpoints()
        share = self.share
        if share is not None:
            stale = 2 * self.scrape.interval_s + self.scrape.timeout_s
            eps = [ep for ep in eps if share.watches(ep, "scrape", stale)]
        await self._scrapes.run(eps, self.scrape_one, self.scrape.interval_s)

    async def scrape_one(self, ep: Endpoint) -> None:
        snapshot, known = None, 0
        try:
            before = ep.in_flight
            async with asyncio.timeout(self.scrape.timeout_s):
                async with self.session.get(ep.extra.get("metrics_url") or ep.url + "/metrics") as r:
                    if r.status != 200:
                        raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
                    ours = max(before, ep.in_flight)
                    known = ours + ep.remote_in_flight
                    text = await r.text()
            prev = ep.metrics
            snapshot = ep.metrics = parse_engine_metrics(text, ep.engine, time.monotonic(), prev, model=ep.model)
            ep.metrics.gateway_in_flight = ours
            self._restarted(ep, prev, snapshot, own=True)
            self._tell(ep)
            result = "ok"
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, UnicodeDecodeError):
            result = "fail"
        self.metrics.child(self.metrics.scrapes, ep.model, ep.name, result).inc()
        if self.share is not None:
            self.share.told_scrape(ep, snapshot, known)

    def adopt_scrape(self, ep: Endpoint, snapshot: EngineMetrics, known: int) -> None:
        """A snapshot a sibling worker scraped of ``ep`` (it watches it), when it knew of ``known``
        in-flight requests there (its own and its ``remote_in_flight``, which counts this worker's):
        this worker's own share of them is what it does not count as remote now. ``UNCOUNTED`` (a
        sibling just started, at a gateway's start or a restart, not yet sure of the others'
        requests): this worker's share is its own requests there now, as its own scrape takes them
        (``scrape_one``), which needs nothing of the sender's; where it took none (None), and read
        no other gateways' requests from the engine's count until the sender's next scrape."""
        snapshot.gateway_in_flight = known - ep.remote_in_flight if known != UNCOUNTED else ep.in_flight
        prev = ep.metrics
        if snapshot.start_time is None and prev is not None:     # as parse_engine_metrics carries it
            snapshot.start_time = prev.start_time
        ep.metrics = snapshot
        self._restarted(ep, prev, snapshot, own=False)
        self._tell(ep)

    def _restarted(self, ep: Endpoint, prev: EngineMetrics | None, snapshot: EngineMetrics, own: bool) -> None:
        """Tell ``restart_listeners`` when ``snapshot`` names another start of the engine than
        ``prev`` did. Counted and logged by the worker that scraped it (``own``), so once for the
        gateway when the workers share monitoring; every worker drops its own view of the engine."""
        was = prev.start_time if prev is not None else None
        now = snapshot.start_time
        if was is None or now is None or abs(now - was) <= RESTART_MIN_S:
            return
        if own:
            self.metrics.child(self.metrics.engine_restarts, ep.model, ep.name).inc()
            log.warning("engine restarted; its cache is gone, what it held forgotten", model=ep.model,
                        endpoint=ep.name, started=now, was_started=was)
        for listener in self.restart_listeners:
            try:
                listener(ep)
            except Exception:   # a listener's bug must not stop monitoring
                log.exception("monitor restart listener failed", endpoint=ep.name)

    def _tell(self, ep: Endpoint) -> None:
        for listener in self.listeners:
            try:
                listener(ep)
            except Exception:   # a listener's bug must not stop monitoring
                log.exception("monitor listener failed", endpoint=ep.name)
