"""Workers share health probes and engine scrapes (``view.share_monitoring``): two workers in one
event loop over real Unix datagram sockets, each with its own monitor, in front of four simulated
engines that record every request they get."""

from __future__ import annotations

import asyncio
import contextlib
import time

from enginesim.server import RECEIVED_KEY
from gateway.config.schema import config_from_dict
from gateway.observability.metrics import GatewayMetrics
from gateway.server.rundir import RunDirectory
from gateway.upstream.monitor import Monitor
from gateway.upstream.upstream import make_session
from gateway.view.service import RoutingView, WorkerSlot
from tests.support.gateway_process import metric_total
from tests.support.waiting import until


def _config(urls, share=True, interval=0.1, timeout=5.0):
    return config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": urls}],
                             "health": {"interval_s": interval, "timeout_s": timeout},
                             "scrape": {"interval_s": interval, "timeout_s": timeout},
                             "view": {"share_monitoring": share, "heartbeat_s": 0.05, "peer_ttl_s": 0.5,
                                      "load_interval_s": 0.01}}, source="<t>")


class Worker:
    def __init__(self, cfg, index: int, bus_dir: str) -> None:
        from gateway.server.app import pool_from_config
        self.pool = pool_from_config(cfg)
        self.metrics = GatewayMetrics()
        self.view = RoutingView(cfg, self.pool, self.metrics, WorkerSlot(index, 2, bus_dir, "g"))
        self.session = make_session(cfg.upstream)
        self.monitor = Monitor(self.pool, self.session, self.metrics, cfg.health, cfg.scrape)
        self.view.attach_monitor(self.monitor)

    async def start(self) -> None:
        await self.view.start()
        self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()
        await self.view.stop()
        await self.session.close()

    def eps(self):
        return self.pool.endpoints("m")

    def made(self, kind: str, ep) -> float:
        """Probes (``kind`` "probe") or scrapes this worker made of ``ep``."""
        name = "switchyard_health_probes_total" if kind == "probe" else "switchyard_engine_scrapes_total"
        return metric_total(self.metrics.render().decode(), name, endpoint=ep.name)


@contextlib.asynccontextmanager
async def _workers(cfg):
    d = RunDirectory()
    ws = [Worker(cfg, i, d.path) for i in range(2)]
    try:
        for w in ws:
            await w.start()
        yield ws
    finally:
        for w in ws:
            with contextlib.suppress(Exception):
                await w.stop()
        d.close()


def _scrapes_received(sim) -> int:
    return sum(1 for r in sim.app[RECEIVED_KEY] if r["path"] == "/metrics")


async def _engines(sims, n=4):
    return [await sims("vllm", "m") for _ in range(n)]


async def test_each_engine_is_scraped_and_probed_by_its_watcher_alone_and_both_workers_see_it(sims):
    engines = await _engines(sims)
    cfg = _config([e.url for e in engines])
    async with _workers(cfg) as (a, b):
        watcher = {ep.url: a.view.watcher(ep) for ep in a.eps()}
        assert watcher == {ep.url: b.view.watcher(ep) for ep in b.eps()}       # the same in every worker
        # the first round is everyone's; then each worker adopts the watcher's
        assert all(w.view.describe()["share_monitoring"] for w in (a, b))
        await until(lambda: all(ep.metrics is not None for w in (a, b) for ep in w.eps()), timeout=5)
        workers, kinds = (a, b), ("probe", "scrape")
        stale = 2 * 0.1 + 5.0                   # a watcher unheard this long is replaced (_config)
        # each worker has heard every engine's watcher (none makes its own rounds of them now) ...
        await until(lambda: all(w.view.watches(ep, kind, stale) == (watcher[ep.url] == i)
                                for i, w in enumerate(workers) for ep in w.eps() for kind in kinds), timeout=10)

        def counts() -> dict:
            return {(i, kind, ep.url): w.made(kind, ep) for i, w in enumerate(workers) for ep in w.eps()
                    for kind in kinds}

        def watchers_grew(since: dict, n: int) -> bool:
            return all(w.made(kind, ep) - since[(i, kind, ep.url)] >= n
                       for i, w in enumerate(workers) for ep in w.eps() for kind in kinds if watcher[ep.url] == i)
        # ... and a round one began before it heard (a loopback request) has ended: rounds are
        # counted, not waited for by the clock, so a stalled process makes the test no less sure
        mark = counts()
        await until(lambda: watchers_grew(mark, 2), timeout=15)
        before = counts()
        for e in engines:
            e.app[RECEIVED_KEY].clear()
        started = time.monotonic()
        await until(lambda: watchers_grew(before, 3) and all(
            ep.metrics is not None and ep.metrics.scraped_at >= started for w in workers for ep in w.eps()),
            timeout=15)
        for i, w in enumerate((a, b)):
            for ep in w.eps():
                for kind in ("probe", "scrape"):
                    grew = w.made(kind, ep) - before[(i, kind, ep.url)]
                    if watcher[ep.url] == i:
                        assert grew >= 3, (i, kind, ep.url, grew)
                    else:
                        assert grew == 0, (i, kind, ep.url, grew)      # its sibling watches it
                # every worker holds a fresh snapshot of every engine, its own or adopted
                assert ep.metrics is not None and ep.metrics.scraped_at >= started
        # the engines saw one scraper each: as many scrapes as the watchers made, not twice that
        made = sum(w.made("scrape", ep) - before[(i, "scrape", ep.url)]
                   for i, w in enumerate((a, b)) for ep in w.eps())
        received = sum(_scrapes_received(e) for e in engines)
        assert abs(received - made) <= 4, (received, made)
        # a worker that watches some engine but not all adopts its sibling's probes of the rest
        # (the watchers come from a hash of the engines' random ports: one worker may watch all)
        for i, w in enumerate((a, b)):
            applied = metric_total(w.metrics.render().decode(), "switchyard_view_facts_applied_total",
                                   kind="probe")
            if any(owner != i for owner in watcher.values()):
                assert applied > 0, (i, watcher)


async def test_without_sharing_every_worker_scrapes_every_engine(sims):
    engines = await _engines(sims, 2)
    cfg = _config([e.url for e in engines], share=False)
    async with _workers(cfg) as (a, b):
        await until(lambda: all(w.made("scrape", ep) >= 3 for w in (a, b) for ep in w.eps()), timeout=5)
        assert a.monitor.share is None and a.view.describe()["watching"] is None


async def test_a_sibling_tells_each_worker_its_own_share_of_the_engines_count(sims):
    engines = await _engines(sims, 2)
    cfg = _config([e.url for e in engines])
    async with _workers(cfg) as (a, b):
        ep_a = a.eps()[0]
        w = a.view.watcher(ep_a)
        watcher, other = (a, b) if w == 0 else (b, a)
        ep_w = next(ep for ep in watcher.eps() if ep.url == ep_a.url)
        ep_o = next(ep for ep in other.eps() if ep.url == ep_a.url)
        ep_w.in_flight, ep_o.in_flight = 3, 2          # the in-flight counts travel on the bus
        await until(lambda: ep_w.remote_in_flight == 2 and ep_o.remote_in_flight == 3)
        # a scrape by the watcher after that: it counted 3 of its own and 2 of its sibling's
        # (the watcher's snapshot, adopted: the same scrape time; the next scrape is 0.1 s away)
        await until(lambda: ep_w.metrics is not None and ep_w.metrics.gateway_in_flight == 3
                    and ep_o.metrics is not None and ep_o.metrics.gateway_in_flight == 2
                    and ep_o.metrics.scraped_at == ep_w.metrics.scraped_at, timeout=5)
        ep_w.in_flight = ep_o.in_flight = 0


async def test_a_watchers_first_scrape_at_a_start_gives_each_sibling_its_own_share_of_the_engines_count(sims):
    """A gateway's workers start at different moments, and each makes its first scrape round as it
    starts, before its bus is open: the watcher cannot know yet what its siblings have in flight
    (one that began serving first may have sent it its counts before it listened), so its first
    snapshot carries no count (``UNCOUNTED``). A sibling adopting it knows its own share of the
    engine's count, as it does at its own scrape: its requests there now. It takes that, where it
    took none (``gateway_in_flight`` None) and read no other gateways' requests from the engine
    until the watcher's next scrape, a whole ``scrape.interval_s`` after the start."""
    engine = (await _engines(sims, n=1))[0]
    cfg = _config([engine.url], interval=60.0)      # the first round only, within the test
    d = RunDirectory()
    ws = [Worker(cfg, i, d.path) for i in range(2)]
    watcher = ws[ws[0].view.watcher(ws[0].eps()[0])]
    other = ws[1] if watcher is ws[0] else ws[0]
    ep = other.eps()[0]
    ep.in_flight = 2                                # the sibling serves already: two requests on the engine

    def adopted() -> float:
        return metric_total(other.metrics.render().decode(), "switchyard_view_facts_applied_total", kind="scrape")
    try:
        await other.start()                         # its own first round: its own share, 2
        await until(lambda: ep.metrics is not None and ep.metrics.gateway_in_flight == 2, timeout=5)
        await watcher.start()                       # the watcher's first round reaches the sibling
        await until(lambda: adopted() >= 1, timeout=5)
        assert ep.metrics.scraped_at == watcher.eps()[0].metrics.scraped_at       # the watcher's snapshot
        assert ep.metrics.gateway_in_flight == 2
    finally:
        ep.in_flight = 0
        for w in ws:
            with contextlib.suppress(Exception):
                await w.stop()
        d.close()


async def test_a_silent_watcher_is_replaced_by_its_sibling_until_it_is_heard_again(sims):
    engines = await _engines(sims)
    cfg = _config([e.url for e in engines], timeout=1.0)      # silent after 2 x 0.1 + 1.0 s
    async with _workers(cfg) as (a, b):
        # the worker that watches some endpoint goes away; its sibling takes those over
        gone, left = (a, b) if any(a.view.watcher(ep) == 0 for ep in a.eps()) else (b, a)
        theirs = [ep for ep in left.eps() if left.view.watcher(ep) != left.view.worker_index]
        assert theirs
        await until(lambda: all(left.made("scrape", ep) >= 1 for ep in theirs), timeout=5)
        await asyncio.sleep(0.3)
        quiet = {ep.url: left.made("scrape", ep) for ep in theirs}
        await asyncio.sleep(0.25)
        # while the watcher is heard, the sibling made at most the one round it may have started
        assert all(left.made("scrape", ep) - quiet[ep.url] <= 1 for ep in theirs)
        await gone.stop()
        took = {ep.url: left.made("scrape", ep) for ep in theirs}
        await until(lambda: all(left.made("scrape", ep) >= took[ep.url] + 3 for ep in theirs), timeout=5)
        await until(lambda: all(left.made("probe", ep) >= 1 for ep in theirs), timeout=5)


async def test_one_failed_round_probed_by_both_workers_counts_once(sims):
    """At start every worker probes every engine, and a non-watcher adopts its watcher's outcome of
    the same round as well: one failed round must not count twice and take the engine out with
    ``unhealthy_threshold: 2``. Two failed rounds do."""
    engine = (await _engines(sims, n=1))[0]
    engine.engine.dead = True                   # /health answers 503
    cfg = _config([engine.url], interval=3.0, timeout=0.5)      # the next round 3 s later
    async with _workers(cfg) as (a, b):
        watcher, other = (a, b) if a.view.watcher(a.eps()[0]) == 0 else (b, a)
        ep = other.eps()[0]

        def adopted() -> float:
            return metric_total(other.metrics.render().decode(), "switchyard_view_facts_applied_total", kind="probe")
        # the first round: the non-watcher's own probe and the watcher's, both failed
        await until(lambda: watcher.made("probe", watcher.eps()[0]) >= 1 and other.made("probe", ep) >= 1
                    and adopted() >= 1, timeout=2.5)
        assert ep.consecutive_failures == 1 and ep.healthy
        assert watcher.eps()[0].consecutive_failures == 1 and watcher.eps()[0].healthy
        # the watcher's next round fails too: two rounds in a row take it out in both workers
        await until(lambda: not ep.healthy and not watcher.eps()[0].healthy, timeout=5)
        assert other.made("probe", ep) == 1       # the non-watcher probed once: at start, before it heard
