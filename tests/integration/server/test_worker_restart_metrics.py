"""``--workers 2``: a worker killed outright (SIGKILL) and started again by the parent. The gateway's
counters and histograms never fall (Prometheus would read a fall as a reset, and ``rate()`` and
``increase()`` would count everything the other workers counted again), whichever worker answers
each scrape, nor does when each of their series started (``_created``); the dead worker's gauges
leave with it; the status page's counts since start do not
fall, and hold what the dead worker last reported to a scrape, as /metrics does (its requests with
latency objectives too); and the counts a restarted worker carries do not bring back an endpoint removed since."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.view.service import watcher_of
from tests.integration.server.test_workers import children_of, own_metrics, sibling_sockets
from tests.support.gateway_process import gateway_process, get_new, post_new
from tests.support.metrics import metric, sample_map
from tests.support.ports import listen_port
from tests.support.waiting import sigstop

COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}


def counts(page: str) -> dict[tuple, float]:
    """Every counter, histogram and summary sample of a page (not ``_created``)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(page) if fam.type in ("counter", "histogram", "summary")
            for s in fam.samples if not s.name.endswith("_created")}


class Pages:
    """The scrapes seen so far; each one's counts at least the previous one's, series by series."""

    def __init__(self) -> None:
        self.last: dict[tuple, float] = {}

    def saw(self, page: str) -> str:
        now = counts(page)
        fell = {k: (self.last[k], v) for k, v in now.items() if k in self.last and v < self.last[k]}
        assert not fell, f"counters fell from one scrape to the next: {sorted(fell.items())[:8]}"
        self.last = now
        return page


class Worker:
    """A kept-alive connection that reached one worker (the kernel keeps a connection with the
    worker that accepted it): ``pid`` is that worker's."""

    def __init__(self, session: aiohttp.ClientSession, pid: int, base: str) -> None:
        self.session, self.pid, self.base = session, pid, base

    async def get(self, path: str) -> str:
        async with self.session.get(self.base + path) as r:
            assert r.status == 200
            return await r.text()

    async def status(self) -> dict:
        async with self.session.get(self.base + "/status.json") as r:
            return await r.json()


async def connections(port: int, n: int, stack: contextlib.AsyncExitStack, *pids: int) -> list[Worker]:
    """``n`` kept-alive connections, to different workers when ``pids`` is empty, else one to each of ``pids``."""
    base = f"http://127.0.0.1:{port}"
    found: dict[int, Worker] = {}
    wanted = set(pids)
    async with asyncio.timeout(20):
        while len(found) < n:
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            async with s.get(base + "/status.json") as r:
                pid = (await r.json())["gateway"]["pid"]
            if pid in found or (wanted and pid not in wanted):
                await s.close()
                continue
            found[pid] = Worker(await stack.enter_async_context(s), pid, base)
    return [found[p] for p in pids] if pids else list(found.values())


def config(path: Path, port: int, urls: list[str], model: str = "") -> Path:
    """``model``: more of the model's block (``, slo: {...}``)."""
    path.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                    "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning, removed_endpoint_series_s: 0.5}\n"
                    "routing: {strategy: round-robin}\n"
                    "health: {interval_s: 0.2}\n"
                    f"models: [{{name: m, engine: vllm, endpoints: [{', '.join(repr(u) for u in urls)}]{model}}}]\n")
    return path


async def restarted(proc, victim: int, port: int, pages: Pages) -> str:
    """Scrapes on fresh connections until the parent started the victim again and both workers
    answer; each scrape checked against the one before. A connection the kernel queued on the
    killed worker's socket is reset (docs/deployment.md), and is tried again."""
    async with asyncio.timeout(30):
        while True:
            try:
                status, text = await get_new(port, "/metrics")
            except (aiohttp.ClientConnectionError, ConnectionResetError):
                await asyncio.sleep(0.05)
                continue
            assert status == 200
            pages.saw(text)
            now = children_of(proc.pid)
            if victim not in now and len(now) == 2 and metric(text, "switchyard_workers_scraped") == 2:
                return text
            await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
async def test_counts_never_fall_when_the_worker_that_answered_last_is_killed(sims, tmp_path):
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, [sim.url])
    pages = Pages()
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        for _ in range(10):
            assert (await post_new(port, "/v1/completions", COMPLETION))[0] == 200
        survivor, victim = await connections(port, 2, stack)
        (stream_on_victim,) = await connections(port, 1, stack, victim.pid)
        # a stream in flight on the victim, as its sibling sees it when it answers a scrape
        body = {**COMPLETION, "max_tokens": 2000, "stream": True}
        async with stream_on_victim.session.post(stream_on_victim.base + "/v1/completions", json=body) as streaming:
            assert streaming.status == 200
            await streaming.content.readline()
            page = pages.saw(await survivor.get("/metrics"))
            assert metric(page, "switchyard_in_flight_requests", model="m") == 1
            # more traffic, then the victim answers the last scrape and the status page itself
            for _ in range(10):
                assert (await post_new(port, "/v1/completions", COMPLETION))[0] == 200
            # a series only the victim has: a request for a model nobody serves
            async with victim.session.post(victim.base + "/v1/completions", json={**COMPLETION, "model": "nope"}) as r:
                assert r.status == 404
            before = pages.saw(await victim.get("/metrics"))
            assert metric(before, "switchyard_requests_total", status="200") == 20
            created = {k: v for k, v in sample_map(before).items() if k[0].endswith("_created")}
            only_victim = ("switchyard_requests_created", (("model", "-"), ("status", "404"), ("strategy", "")))
            assert only_victim in created
            assert (await victim.status())["totals"]["requests_since_start"] == 21
            os.kill(victim.pid, signal.SIGKILL)
            with contextlib.suppress(aiohttp.ClientError):
                await streaming.read()

        # the survivor answers for the gateway: the victim's counts as it last reported them, not
        # as the survivor last heard them; none of what it held (its stream)
        page = pages.saw(await survivor.get("/metrics"))
        assert metric(page, "switchyard_requests_total", status="200") == 20
        assert metric(page, "switchyard_in_flight_requests", model="m") == 0
        assert (await survivor.status())["totals"]["requests_since_start"] == 21
        # when each series started (``_created``, which OpenMetrics gives a counter's and a
        # histogram's series) stays when the victim started it: it neither goes nor moves later
        assert {k: v for k, v in sample_map(page).items() if k in created} == created

        await restarted(proc, victim.pid, port, pages)
        for _ in range(6):
            assert (await post_new(port, "/v1/completions", COMPLETION))[0] == 200
        for _ in range(6):          # whichever worker answers, the new one counting on from its predecessor
            page = pages.saw((await get_new(port, "/metrics"))[1])
            assert metric(page, "switchyard_requests_total", status="200") == 26
            assert metric(page, "switchyard_e2e_request_latency_seconds_count", model="m") == 26
            assert {k: v for k, v in sample_map(page).items() if k in created} == created
            doc = (await get_new(port, "/status.json"))[1]
            assert doc["totals"]["requests_since_start"] == 27


@pytest.mark.timeout(120)
async def test_a_restarted_worker_does_not_bring_back_a_removed_endpoint(sims, tmp_path):
    a, b = await sims("vllm", "m"), await sims("vllm", "m")
    gone = b.url.removeprefix("http://")
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, [a.url, b.url])
    pages = Pages()
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        for _ in range(20):         # round-robin: both engines, from both workers
            assert (await post_new(port, "/v1/completions", COMPLETION))[0] == 200
        victim, survivor = await connections(port, 2, stack)
        pages.saw(await survivor.get("/metrics"))        # both report their counts of both engines
        page = pages.saw(await victim.get("/metrics"))
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=gone) > 0
        os.kill(victim.pid, signal.SIGKILL)
        page = await restarted(proc, victim.pid, port, pages)
        assert metric(page, "switchyard_upstream_outcomes_total", endpoint=gone) > 0    # carried on

        # B leaves the pool; its series go 0.5 s later, each worker's on a sweep of its own, all
        # at once for a scraper, whichever worker answers: one on a kept-alive connection (as
        # Prometheus scrapes) and one on new connections, in turn
        (scraper,) = await connections(port, 1, stack)
        config(cfg, port, [a.url])
        proc.send_signal(signal.SIGHUP)
        async with asyncio.timeout(20):
            went = False
            for turn in itertools.count():
                page = pages.saw(await scraper.get("/metrics") if turn % 2 else (await get_new(port, "/metrics"))[1])
                assert not went or gone not in page, "a removed endpoint's series came back"
                went = gone not in page
                if went and turn > 40:
                    break
                await asyncio.sleep(0.02)
        for _ in range(6):
            assert (await post_new(port, "/v1/completions", COMPLETION))[0] == 200
            page = pages.saw(await scraper.get("/metrics"))
            assert gone not in page
            assert metric(page, "switchyard_requests_total", status="200") >= 20


@pytest.mark.timeout(120)
async def test_the_status_page_keeps_what_a_killed_worker_last_reported_to_a_scrape(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, [sim.url])
    pages = Pages()
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        survivor, victim = await connections(port, 2, stack)
        # requests the victim serves and then reports to a scrape, with nobody reading the page since
        for _ in range(10):
            async with victim.session.post(victim.base + "/v1/completions", json=COMPLETION) as r:
                assert r.status == 200
                await r.read()
        page = pages.saw(await victim.get("/metrics"))
        assert metric(page, "switchyard_requests_total", status="200") == 10
        os.kill(victim.pid, signal.SIGKILL)

        # the page counts them as /metrics does, now and once the victim's successor carries them
        page = pages.saw(await survivor.get("/metrics"))
        assert metric(page, "switchyard_requests_total", status="200") == 10
        assert (await survivor.status())["totals"]["requests_since_start"] == 10
        await restarted(proc, victim.pid, port, pages)
        for _ in range(4):          # whichever worker answers
            assert (await get_new(port, "/status.json"))[1]["totals"]["requests_since_start"] == 10


@pytest.mark.timeout(120)
async def test_a_restarted_worker_says_when_the_gateway_started(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, [sim.url])
    pages = Pages()
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        survivor, victim = await connections(port, 2, stack)
        started = (await survivor.status())["gateway"]["started_at"]
        assert (await victim.status())["gateway"]["started_at"] == started
        os.kill(victim.pid, signal.SIGKILL)
        await restarted(proc, victim.pid, port, pages)      # at least a second later (the restart's delay)
        (successor,) = await connections(port, 1, stack, *(set(children_of(proc.pid)) - {survivor.pid}))
        gateway = (await successor.status())["gateway"]
        assert gateway["started_at"] == started
        assert gateway["uptime_s"] < gateway["now"] - started       # its own, as documented


def slo_counts(doc: dict) -> dict:
    (m,) = [row for row in doc["models"] if row["name"] == "m"]
    return (m["admission"] or {}).get("slo") or {}


@pytest.mark.timeout(120)
async def test_the_status_page_keeps_a_killed_workers_requests_with_objectives(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, [sim.url], ", slo: {ttft_ms: 60000}")
    pages = Pages()
    met = {"ttft": {"met": 10, "missed": 0, "shed": 0}}
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        survivor, victim = await connections(port, 2, stack)
        for _ in range(10):         # streamed: a TTFT to hold to its objective
            async with victim.session.post(victim.base + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
                assert r.status == 200
                await r.read()
        page = pages.saw(await victim.get("/metrics"))
        assert metric(page, "switchyard_slo_requests_total", objective="ttft", outcome="met") == 10
        assert slo_counts(await survivor.status()) == met       # the victim's part, added once
        os.kill(victim.pid, signal.SIGKILL)

        # the page counts them as /metrics does, now and once the victim's successor carries them
        page = pages.saw(await survivor.get("/metrics"))
        assert metric(page, "switchyard_slo_requests_total", objective="ttft", outcome="met") == 10
        assert slo_counts(await survivor.status()) == met
        await restarted(proc, victim.pid, port, pages)
        for _ in range(4):          # whichever worker answers
            assert slo_counts((await get_new(port, "/status.json"))[1]) == met



@pytest.mark.timeout(120)
@pytest.mark.parametrize("counts", ["bus", "redis"])
async def test_a_restarted_watchers_first_scrape_does_not_count_its_siblings_requests_as_other_gateways(
        sims, tmp_path, request, counts):
    """The worker that scrapes an engine for all (its watcher) tells the others the snapshot with
    the gateway's in-flight requests there as it knew them, so each can tell the engine's count of
    other gateways' requests from its own. A restarted watcher scrapes at its start, before it has
    heard of its siblings' requests (over the workers' bus, or through Redis with
    ``state.redis_url``): the survivor then took its own two streams for two more of other
    gateways', and its fleet load (what prefix-cache's guards, pd and latency read) said 4 where
    the engine ran 2, until the next scrape."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    state = ""
    if counts == "redis":
        state = f"state: {{redis_url: '{request.getfixturevalue('redis_server').url}', sync_interval_s: 0.1}}\n"
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                   "scrape: {interval_s: 60}\n"            # each worker's first round, then none within the test
                   f"{state}models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    watcher = watcher_of(f"m|{sim.url}", 2)
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        a, b = await connections(port, 2, stack)
        by_index = {(await w.status())["gateway"]["workers"]["answered"]: w for w in (a, b)}
        victim, survivor = by_index[watcher], by_index[1 - watcher]
        (path,) = sibling_sockets([survivor.pid]).values()
        applied = "switchyard_view_facts_applied_total"
        before = metric(await own_metrics(path), applied, source="worker", kind="scrape")
        body = {**COMPLETION, "max_tokens": 5000, "stream": True}
        for _ in range(2):
            (w,) = await connections(port, 1, stack, survivor.pid)
            r = await stack.enter_async_context(w.session.post(w.base + "/v1/completions", json=body))
            assert r.status == 200
            await r.content.readline()
        os.kill(victim.pid, signal.SIGKILL)
        async with asyncio.timeout(30):         # the restarted watcher's first scrape reached the survivor
            while metric(await own_metrics(path), applied, source="worker", kind="scrape") <= before:
                await asyncio.sleep(0.05)
        assert victim.pid not in children_of(proc.pid)
        page = await own_metrics(path)
        assert metric(page, "switchyard_endpoint_in_flight_requests", model="m") == 2
        assert metric(page, "switchyard_engine_running_requests", model="m") == 2
        assert metric(page, "switchyard_endpoint_fleet_in_flight", model="m") == 2


@pytest.mark.timeout(120)
async def test_a_restarted_worker_counts_its_siblings_requests_from_its_first_answer(sims, tmp_path):
    """A worker tells its siblings its requests in flight as they start and end, and again every
    ``view.heartbeat_s`` while it has any. One started again had heard none of the streams its
    sibling had under way before it: it routed and reported as if the engine had nothing of this
    gateway's on it until that sibling's next heartbeat. It learns them with its sibling's whole
    view, which it asks for before it serves."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                   "view: {heartbeat_s: 20, peer_ttl_s: 40}\n"     # the next heartbeat far off
                   "scrape: {enabled: false}\n"      # the fleet load is then this gateway's requests alone
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        survivor, victim = await connections(port, 2, stack)
        body = {**COMPLETION, "max_tokens": 5000, "stream": True}
        for _ in range(2):
            (w,) = await connections(port, 1, stack, survivor.pid)
            r = await stack.enter_async_context(w.session.post(w.base + "/v1/completions", json=body))
            assert r.status == 200
            await r.content.readline()
        os.kill(victim.pid, signal.SIGKILL)
        async with asyncio.timeout(30):
            while len(kids := children_of(proc.pid)) < 2 or victim.pid in kids:
                await asyncio.sleep(0.05)
        (restarted,) = [p for p in kids if p != survivor.pid]
        (fresh,) = await connections(port, 1, stack, restarted)     # it serves
        (path,) = sibling_sockets([restarted]).values()
        page = await own_metrics(path)
        assert metric(page, "switchyard_endpoint_in_flight_requests", model="m") == 0
        assert metric(page, "switchyard_view_peers") == 1
        assert metric(page, "switchyard_endpoint_fleet_in_flight", model="m") == 2


@pytest.mark.timeout(120)
async def test_a_restarted_worker_slow_to_answer_shows_none_of_its_predecessors_gauges(sims, tmp_path):
    """A worker started again whose loop is held before it first answers a sibling (here stopped at
    once: a start-up that blocks it) is read from its report file, gauges included, as any slow
    worker is. Until it has reported, that file is its dead predecessor's: the requests it had in
    flight must not show as the gateway's."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, [sim.url])
    cfg.write_text(cfg.read_text().replace("removed_endpoint_series_s: 0.5", "worker_stall_timeout_s: 0"))
    pages = Pages()
    stopped = None
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        survivor, victim = await connections(port, 2, stack)
        (on_victim,) = await connections(port, 1, stack, victim.pid)
        body = {**COMPLETION, "max_tokens": 2000, "stream": True}
        async with on_victim.session.post(on_victim.base + "/v1/completions", json=body) as streaming:
            assert streaming.status == 200
            await streaming.content.readline()
            page = pages.saw(await survivor.get("/metrics"))      # the victim reports its stream
            assert metric(page, "switchyard_in_flight_requests", model="m") == 1
            os.kill(victim.pid, signal.SIGKILL)
            with contextlib.suppress(aiohttp.ClientError):
                await streaming.read()
        try:
            async with asyncio.timeout(30):     # its successor listens to its siblings: held there
                while True:
                    kids = [k for k in children_of(proc.pid) if k not in (victim.pid, survivor.pid)]
                    if kids and sibling_sockets(kids):
                        break
                    await asyncio.sleep(0.01)
            await sigstop(kids[0])
            stopped = kids[0]
            page = pages.saw(await survivor.get("/metrics"))
            assert metric(page, "switchyard_workers_scraped") == 1
            assert metric(page, "switchyard_requests_total", status="200") == 0
            assert metric(page, "switchyard_in_flight_requests", model="m") == 0
            assert metric(page, "switchyard_endpoint_in_flight_requests", model="m") == 0
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
        page = await restarted(proc, victim.pid, port, pages)
        assert metric(page, "switchyard_in_flight_requests", model="m") == 0
