"""The view of one process, over real Unix datagram sockets: two workers in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from types import SimpleNamespace

from gateway.config.schema import config_from_dict
from gateway.endpoints import EndpointPool
from gateway.observability.metrics import GatewayMetrics
from gateway.server.rundir import RunDirectory
from gateway.view.bus import LocalBus, sibling_paths
from gateway.view.service import RoutingView, WorkerSlot
from routers.base import RouterContext
from tests.support.factories import inference_request
from tests.support.gateway_process import metric_total
from tests.support.loops import on_both_loops
from tests.support.waiting import until

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def _config(**view):
    return config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": URLS}],
                             "routing": {"prefix_block_chars": 8}, "view": view}, source="<t>")


def _worker(cfg, index: int, bus_dir: str) -> tuple[RoutingView, RouterContext, EndpointPool]:
    from gateway.server.app import pool_from_config
    pool = pool_from_config(cfg)
    view = RoutingView(cfg, pool, GatewayMetrics(), WorkerSlot(index, 2, bus_dir, "g"))
    ctx = RouterContext(settings=cfg.routing, sessions=view.sessions)
    view.attach(ctx)
    return view, ctx, pool


@contextlib.asynccontextmanager
async def _running(d: RunDirectory, *views: RoutingView):
    """The views started, then stopped with their run directory, however the test ends."""
    try:
        for v in views:
            await v.start()
        yield
    finally:
        for v in views:
            await v.stop()
        d.close()


async def test_insertions_sessions_and_loads_reach_the_sibling_and_are_not_sent_back():
    d = RunDirectory()
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
    cfg = _config(heartbeat_s=0.05, peer_ttl_s=0.2, load_interval_s=0.01)
    (a, actx, apool), (b, bctx, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    async with _running(d, a, b):
        assert [p.name for p in sibling_paths(d.path)] == ["w0.sock", "w1.sock"]
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        req = inference_request("You are a helpful switchyard assistant. " * 2)
        actx.prefix_index.insert(req, ea[1])
        actx.sessions.put("m\0s:agent", ea[0])
        ea[1].in_flight = 3
        await until(lambda: bctx.prefix_index.holders(req) == 1 and bctx.sessions.get("m\0s:agent") is eb[0]
                    and eb[1].remote_in_flight == 3)
        assert bctx.prefix_index.depths(req, eb)[0] == {eb[1]: len(req.prompt_text) // 8}
        # applied facts are not published again: a's view learns nothing back, b sent only load
        await asyncio.sleep(0.05)
        page = a.m.gm.render().decode()
        assert metric_total(page, "switchyard_view_facts_applied_total", kind="insert") == 0
        assert metric_total(page, "switchyard_view_facts_applied_total", kind="session") == 0
        assert metric_total(b.m.gm.render().decode(), "switchyard_view_facts_applied_total", kind="insert") == 1
        assert len(actx.prefix_index) == len(bctx.prefix_index)
        assert ea[1].remote_in_flight == 0
        # b's counts expire once a goes silent (stopped)
        await a.stop()
        await until(lambda: eb[1].remote_in_flight == 0, timeout=5)
        assert b.describe()["siblings_heard"] == 0
    assert not os.path.exists(d.path)


async def test_a_session_two_workers_recorded_at_once_ends_on_one_endpoint_in_both():
    """Two workers route a new session's first requests in the same moment (an agent's parallel
    calls, each on its own connection), each to an endpoint of its own, and each hears the other's
    choice: both keep the later one, where each took the other's and the session went back and
    forth between the two engines with the worker each turn landed on."""
    d = RunDirectory()
    cfg = _config(heartbeat_s=0.05, peer_ttl_s=0.2, load_interval_s=0.01)
    (a, actx, apool), (b, bctx, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        actx.sessions.put("m\0s:agent", ea[0])
        bctx.sessions.put("m\0s:agent", eb[1])           # in the same loop turn: neither has heard yet

        def heard(view):
            return metric_total(view.m.gm.render().decode(), "switchyard_view_facts_applied_total", kind="session")

        await until(lambda: heard(a) == 1 and heard(b) == 1)
        assert actx.sessions.get("m\0s:agent").url == bctx.sessions.get("m\0s:agent").url == URLS[1]


async def test_a_missing_or_full_sibling_costs_a_counted_drop_never_a_wait():
    d = RunDirectory()
    drops: list[str] = []
    got: list[bytes] = []
    try:
        bus = LocalBus(d.path, 0, 2, got.append, drops.append, 60_000)
        bus.open()
        assert bus.send([b"x"]) == 0 and drops == ["peer_down"]       # w1 is not there
        peer = LocalBus(d.path, 1, 2, lambda data: None, drops.append, 60_000)
        peer.open()
        asyncio.get_running_loop().remove_reader(peer.sock.fileno())    # a sibling that never reads
        sent = sum(bus.send([b"y" * 1000]) for _ in range(10_000))
        assert 0 < sent < 10_000 and "peer_full" in drops
        peer.close()
        bus.close()
    finally:
        d.close()


async def test_one_worker_without_redis_shares_nothing():
    cfg = _config()
    from gateway.server.app import pool_from_config
    view = RoutingView(cfg, pool_from_config(cfg), GatewayMetrics())
    ctx = RouterContext(settings=cfg.routing, sessions=view.sessions)
    view.attach(ctx)
    await view.start()
    try:
        assert not view.shared and ctx.prefix_index.on_insert is None and view.sessions.on_put is None
    finally:
        await view.stop()


def _kv_worker(cfg, index: int, bus_dir: str):
    """A worker with KV-events routing: its own manager and tokenizer (the tiny one), as each
    worker process has."""
    from prometheus_client import CollectorRegistry

    from enginesim.tiny_tokenizer import TINY_DIR
    from gateway.kv.events import KVEventsManager
    from gateway.kv.settings import KVEventsConfig
    from gateway.kv.tokenization import ModelTokenizer

    view, _, pool = _worker(cfg, index, bus_dir)
    kv = KVEventsManager(lambda model: KVEventsConfig(enabled=True), pool, CollectorRegistry(),
                         {"m": ModelTokenizer(TINY_DIR)})
    ctx = RouterContext(settings=cfg.routing, sessions=view.sessions, precise_index=kv)
    view.attach(ctx)
    return view, kv


async def test_a_segment_one_worker_tokenized_is_cached_in_the_sibling_and_not_sent_back():
    d = RunDirectory()
    cfg = _config(load_interval_s=0.01)
    (a, akv), (b, bkv) = _kv_worker(cfg, 0, d.path), _kv_worker(cfg, 1, d.path)
    ta, tb = akv.tokenizers["m"], bkv.tokenizers["m"]
    system = "You are the switchyard assistant; answer in one line. " * 40
    async with _running(d, a, b):
        ids = ta.encode(system)                  # worker a tokenizes a system prompt (and "x", too short)
        ta.encode("x")
        assert not tb.is_cached(system)
        await until(lambda: tb.is_cached(system))
        misses = tb.segment_misses
        assert tb.encode(system) == ids and tb.segment_misses == misses      # found, not tokenized again
        assert not tb.is_cached("x")                                          # short ones are not sent
        await asyncio.sleep(0.05)
        assert metric_total(b.m.gm.render().decode(), "switchyard_view_facts_applied_total", kind="tokens") == 1
        # adopted, not told again: a hears nothing back
        assert metric_total(a.m.gm.render().decode(), "switchyard_view_facts_applied_total", kind="tokens") == 0
        # a segment too large for one datagram stays where it was tokenized, counted
        huge = "switchyard " * 8000
        ta.encode(huge)
        await asyncio.sleep(0.05)
        assert not tb.is_cached(huge)
        assert metric_total(a.m.gm.render().decode(), "switchyard_view_messages_dropped_total",
                            reason="too_large") == 1
    assert ta.on_store is None and tb.on_store is None


async def test_share_tokens_off_sends_no_tokens():
    d = RunDirectory()
    cfg = _config(load_interval_s=0.01, share_tokens=False)
    (a, akv), (b, bkv) = _kv_worker(cfg, 0, d.path), _kv_worker(cfg, 1, d.path)
    async with _running(d, a, b):
        assert akv.tokenizers["m"].on_store is None
        akv.tokenizers["m"].encode("A system prompt long enough to be shared. " * 10)
        await asyncio.sleep(0.1)
        assert len(bkv.tokenizers["m"]._segments) == 0


async def test_a_worker_ticks_at_the_heartbeat_unless_a_request_starts_or_ends_which_is_heard_at_once():
    d = RunDirectory()
    cfg = _config(heartbeat_s=0.2, peer_ttl_s=4.0, load_interval_s=0.01)
    (a, _, apool), (b, _, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    async with _running(d, a, b):
        await asyncio.sleep(0.1)
        ticks = []
        expire = a._expire_peers
        a._expire_peers = lambda: (ticks.append(1), expire())      # once a tick
        await asyncio.sleep(0.6)
        assert ticks == []                         # at rest, nothing in flight anywhere: no tick at all
        assert a._tick_at is None and b._tick_at is None
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        ea[0].in_flight = 1                        # a request routed: its decision arms the short interval
        a.on_decision(None, None, (), 0.0)
        await until(lambda: eb[0].remote_in_flight == 1, timeout=5)
        ticks.clear()
        await asyncio.sleep(0.6)                   # in flight, nothing starting or ending: the heartbeat
        assert 1 <= len(ticks) <= 5 and eb[0].remote_in_flight == 1
        ea[0].in_flight = 0                        # it ends, with no decision: heard within the interval
        a.on_request(None, 0.0)                    # (the pipeline's record observer)
        # its tick armed within load_interval_s, not at the next heartbeat (a clock read, not a
        # latency: a loaded machine may deliver the message later than any short bound)
        assert a._tick_when <= asyncio.get_running_loop().time() + cfg.view.load_interval_s
        await until(lambda: eb[0].remote_in_flight == 0, timeout=5)
        # both at rest again: the sibling drops what it held, and neither wakes any more
        await until(lambda: a._tick_at is None and b._tick_at is None and b.describe()["siblings_heard"] == 0,
                    timeout=5)
        ticks.clear()
        await asyncio.sleep(0.5)
        assert ticks == []


async def test_a_burst_of_decisions_leaves_in_one_message_per_flush_delay_and_a_lone_one_at_once():
    d = RunDirectory()
    cfg = _config(heartbeat_s=2.0, peer_ttl_s=4.0, load_interval_s=1.0, flush_delay_s=0.3)
    (a, actx, apool), (b, bctx, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        await asyncio.sleep(0.05)
        sent = lambda: metric_total(a.m.gm.render().decode(), "switchyard_view_messages_sent_total")  # noqa: E731
        loop, delay = asyncio.get_running_loop(), cfg.view.flush_delay_s
        for base in range(0, 100, 20):
            # a burst is held only while the last message is younger than flush_delay_s: a round in
            # which the loop stalled that long (a busy machine) proves nothing and is run again
            started = loop.time()                  # at or before the lone message leaves
            before = sent()
            ea[0].in_flight = base + 1             # a lone decision: its message leaves this turn
            a.on_decision(None, None, (), 0.0)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert sent() == before + 1
            await until(lambda base=base: eb[0].remote_in_flight == base + 1, timeout=5)
            for i in range(2, 12):                 # a burst, one decision a loop turn
                ea[0].in_flight = base + i
                a.on_decision(None, None, (), 0.0)
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)
            # the held flush's tick is due flush_delay_s after the lone message (a timer's
            # millisecond rounding aside): not run yet while this is true
            if loop.time() < started + delay - 0.05:
                break
            await until(lambda base=base: eb[0].remote_in_flight == base + 11, timeout=5)
            await asyncio.sleep(delay)             # the next round's lone message leaves at once
        else:
            raise AssertionError("the loop stalled for flush_delay_s in every round")
        assert sent() == before + 1                # held: less than flush_delay_s since the last
        assert eb[0].remote_in_flight == base + 1
        await until(lambda: eb[0].remote_in_flight == base + 11, timeout=5)
        assert sent() == before + 2                # everything the burst made, in one message
        # an insertion or a session is not held: a conversation's next turn may come within the delay
        # and reach the sibling; the load held meanwhile rides with it
        before = sent()
        ea[0].in_flight = base + 12
        a.on_decision(None, None, (), 0.0)         # held (a message just left)
        actx.prefix_index.insert(inference_request("A burst of agents shares this prompt. " * 2), ea[1])
        actx.sessions.put("m\0s:agent-fast", ea[1])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sent() == before + 1                # one message, at the end of the turn (not the delay's)
        await until(lambda: len(bctx.prefix_index) == len(actx.prefix_index) and eb[0].remote_in_flight == base + 12
                    and bctx.sessions.get("m\0s:agent-fast") is eb[1], timeout=5)
        assert sent() == before + 1                # and nothing was left to go at the delay


@on_both_loops
async def test_a_tick_armed_a_hair_ahead_is_moved_by_the_next_request_without_an_error():
    """uvloop hands back a plain ``Handle``, without ``when()``, for a timer less than half a
    millisecond ahead: a burst's decision lands there when the last message left almost exactly
    ``flush_delay_s`` ago. The next request's end then failed in its record observer (and a
    decision in its claim), with a traceback each, until the tick ran."""
    d = RunDirectory()
    cfg = _config(heartbeat_s=2.0, peer_ttl_s=4.0, load_interval_s=0.02)
    (a, _, apool), (b, _, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    async with _running(d, a, b):
        a._arm(1e-9)
        apool.endpoints("m")[0].in_flight = 1
        a.on_request(None, 0.0)                 # arms the tick within load_interval_s
        a.on_decision(None, None, (), 0.0)
        await until(lambda: bpool.endpoints("m")[0].remote_in_flight == 1, timeout=2.0)


async def test_an_ejection_in_one_worker_ejects_the_endpoint_in_its_sibling_and_a_close_closes_it():

    from gateway.resilience.breaker import CLOSED, OPEN, BreakerConfig
    from gateway.resilience.outcome import Outcome

    d = RunDirectory()
    a, b, apool, bpool, abr, bbr = _breaker_pair(d, _config(),
                                                  BreakerConfig(consecutive_faults=3, base_ejection_s=30.0))
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        for _ in range(3):                                  # worker a sees the faults
            abr.record(ea[0], Outcome.FAULT)
        assert abr.state(ea[0]) == OPEN and ea[0].ejected
        await until(lambda: bbr.state(eb[0]) == OPEN)       # b ejects it without a fault of its own
        assert eb[0].ejected and not eb[1].ejected
        assert bbr.breaker(eb[0]).open_for == abr.breaker(ea[0]).open_for == 30.0
        # the last ready endpoint is never ejected, by a sibling either
        for _ in range(3):
            abr.record(ea[1], Outcome.FAULT)
        await asyncio.sleep(0.05)
        assert bbr.state(eb[1]) == CLOSED and not eb[1].ejected
        # a's trials pass: b closes too, before its own ejection time is over
        abr._close(ea[0], abr.breaker(ea[0]), abr.clock())
        await until(lambda: bbr.state(eb[0]) == CLOSED)
        assert not eb[0].ejected
        page = b.m.gm.render().decode()
        assert metric_total(page, "switchyard_view_facts_applied_total", kind="breaker") == 2
        # adopted, not told back: a heard nothing
        assert metric_total(a.m.gm.render().decode(), "switchyard_view_facts_applied_total", kind="breaker") == 0
    assert abr.on_change is None and bbr.on_change is None


async def test_a_siblings_session_reaches_the_endpoint_a_reload_declared_anew_in_its_place():
    """A reload declares the endpoints again with other settings (new endpoints of the pool, the same
    engines): a session a sibling records right after it is this worker's on the endpoint in the old
    one's place, not on the one that left, where its next turn would count it gone."""
    from gateway.server.reload import sync_pool
    d = RunDirectory()
    cfg = _config(heartbeat_s=0.05, peer_ttl_s=0.2, load_interval_s=0.01)
    (a, actx, apool), (b, bctx, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    async with _running(d, a, b):
        ea = apool.endpoints("m")
        actx.sessions.put("m\0s:first", ea[0])
        await until(lambda: bctx.sessions.get("m\0s:first") is not None)
        changed = config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": [
            {"url": u, "max_prompt_tokens": 100_000} for u in URLS]}], "routing": {"prefix_block_chars": 8},
            "view": {"heartbeat_s": 0.05, "peer_ttl_s": 0.2, "load_interval_s": 0.01}}, source="<t>")
        added, removed = sync_pool(bpool, changed)
        assert len(added) == len(removed) == 2 and bctx.sessions.get("m\0s:first") is bpool.endpoints("m")[0]
        actx.sessions.put("m\0s:second", ea[1])
        await until(lambda: bctx.sessions.get("m\0s:second") is not None)
        assert bctx.sessions.get("m\0s:second") is bpool.endpoints("m")[1]


def test_an_endpoint_that_left_the_pool_is_not_kept_by_the_view():
    """Pods come and go for months: the view's endpoint keys and watcher times of a gone one go
    with it, and a request still on it when it left does not bring its key back."""
    import time

    from gateway.server.app import pool_from_config
    cfg = _config()
    pool = pool_from_config(cfg)
    view = RoutingView(cfg, pool, GatewayMetrics())
    ep, kept = pool.endpoints("m")[:2]
    for e in (ep, kept):
        view._heard_watcher[("probe", view._key(e))] = time.monotonic()
    pool.remove(ep)
    view._key(ep)                           # its last request, ending
    assert list(view._keys) == [kept] and [k for _, k in view._heard_watcher] == [view._key(kept)]


async def test_a_worker_that_missed_batches_notices_the_gap_and_catches_up_from_the_sender():
    """b stops reading its bus (a stopped or stuck worker): a's batches beyond its queue are refused
    and lost. Once b reads again, a's next number (sent again on the heartbeat, though nothing else
    happens) shows the gap, and b asks a for its whole view."""
    d = RunDirectory()
    cfg = _config(heartbeat_s=0.05, peer_ttl_s=0.2, load_interval_s=0.01)
    (a, actx, apool), (b, bctx, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    asked = []

    async def ask(view, index, kind, timeout):      # the siblings' stream socket (gateway/server/siblings.py)
        asked.append((index, kind))
        return await view.snapshot()

    a.ask_sibling = lambda index, kind, timeout: ask(b, index, kind, timeout)
    b.ask_sibling = lambda index, kind, timeout: ask(a, index, kind, timeout)
    async with _running(d, a, b):
        assert asked == [(1, "view"), (0, "view")]       # each asked the other at start
        asked.clear()
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        loop = asyncio.get_running_loop()
        loop.remove_reader(b.bus.sock.fileno())          # b reads nothing: its queue fills
        reqs = [inference_request(f"conversation {i}: you are a helpful switchyard assistant.") for i in range(300)]
        for i, req in enumerate(reqs):
            actx.prefix_index.insert(req, ea[i % 2])
            actx.sessions.put(f"m\0s:agent {i}", ea[i % 2])
            await asyncio.sleep(0)                        # a batch each
        await until(lambda: metric_total(a.m.gm.render().decode(), "switchyard_view_messages_dropped_total",
                                         reason="peer_full") > 0)
        assert asked == []
        loop.add_reader(b.bus.sock.fileno(), b.bus._readable)     # b runs again
        # the catch-up is counted once the merge's last part is in (sessions come before blocks)
        await until(lambda: metric_total(b.m.gm.render().decode(), "switchyard_view_catch_ups_total",
                                         reason="gap", result="applied") == 1, timeout=5)
        assert all(bctx.sessions.get(f"m\0s:agent {i}") is eb[i % 2] for i in range(300))
        def depths(ctx, eps, req):
            return {eps.index(ep): n for ep, n in ctx.prefix_index.depths(req, eps)[0].items()}

        assert all(depths(bctx, eb, req) == depths(actx, ea, req) and depths(bctx, eb, req)[i % 2] == len(req.prompt_text) // 8
                   for i, req in enumerate(reqs))
        assert asked == [(0, "view")]
        # caught up: the next batches are in sequence, nothing more is asked
        actx.sessions.put("m\0s:later", ea[0])
        await until(lambda: bctx.sessions.get("m\0s:later") is eb[0])
        await asyncio.sleep(0.2)
        assert asked == [(0, "view")] and not a._owe


async def test_a_sibling_that_is_not_there_is_not_a_failed_catch_up_and_one_that_does_not_answer_is():
    d = RunDirectory()
    cfg = _config()
    (a, _, _) = _worker(cfg, 0, d.path)
    answers = iter([None, None, b""])      # at start, then twice here

    async def ask(index, kind, timeout):
        return next(answers)

    a.ask_sibling = ask
    async with _running(d, a):
        assert not await a.catch_up(1, "gap")
        page = a.m.gm.render().decode()
        assert metric_total(page, "switchyard_view_catch_ups_total") == 0
        assert not await a.catch_up(1, "gap")
        page = a.m.gm.render().decode()
        assert metric_total(page, "switchyard_view_catch_ups_total", reason="gap", result="failed") == 1


async def test_a_whole_view_is_made_and_merged_a_part_per_loop_turn():
    """A full view is a few hundred thousand entries: the worker that answers a sibling's catch-up,
    and the one that merges it, go on serving between its parts (made whole, 100,000 sessions and
    131,072 blocks held the answering worker's loop for 0.3 s, long enough for the bus queue of the
    asker to fill and for each to ask the other again)."""
    from gateway.view.service import VIEW_PART
    from gateway.view.wire import view_parts

    d = RunDirectory()
    cfg = _config()
    (a, actx, apool), (b, bctx, _) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    eps = apool.endpoints("m")
    n = 3 * VIEW_PART + 7
    for i in range(n):
        a.sessions.put(f"m\0s:session-{i}", eps[i % len(eps)], None)
    for c in range(n // 64 + 1):
        actx.prefix_index.apply_insert([(c * 64 + j) * 2654435761 % 2**64 for j in range(64)], eps[c % len(eps)])
    turns = 0

    async def ticker():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    try:
        await asyncio.sleep(0)
        turns = 0
        data = await a.snapshot()
        made = turns
        parts = list(view_parts(data))
        assert all(len(p.sessions) + len(p.blocks) <= VIEW_PART for p in parts) and len(parts) >= 7
        turns = 0
        assert await b._merge(iter(parts), "g/0")
        merged = turns
    finally:
        tick.cancel()
        d.close()
    assert made >= 6 and merged >= 6, (made, merged)
    assert len(b.sessions) == n and len(bctx.prefix_index) == len(actx.prefix_index)


def _replica_view(scrape: bool = True, monitor: bool = True, responses_state: str = "engine"):
    """A view of one model on two endpoints with replicas on (a Redis URL nothing is asked of), its
    router context attached and, with ``monitor``, a stand-in monitor whose ``listeners`` the test
    calls as a scrape would: (view, ctx, endpoint, other endpoint, monitor)."""
    from gateway.server.app import pool_from_config

    cfg = config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": URLS}],
                            "routing": {"prefix_block_chars": 8}, "scrape": {"enabled": scrape},
                            "state": {"redis_url": "redis://127.0.0.1:1/0"},
                            "responses": {"state": responses_state}}, source="<t>")
    pool = pool_from_config(cfg)
    view = RoutingView(cfg, pool, GatewayMetrics())
    ctx = RouterContext(settings=cfg.routing, sessions=view.sessions)
    view.attach(ctx)
    mon = None
    if monitor:
        class Monitor:
            listeners: list = []
            share = None
        mon = Monitor()
        view.attach_monitor(mon)
    ep, other = pool.endpoints("m")
    return view, ctx, ep, other, mon


def test_replica_facts_from_before_an_engine_started_are_dropped_when_its_start_is_learnt():
    """A replica that catches up on the stream before its first scrape of an engine (down then, or
    slow) takes the engine's facts; once the scrape says the engine started after they were sent,
    they were of a cache since gone and are forgotten, the Responses lineage kept. A fact read with
    the start known is vetted as it comes."""
    import time

    from gateway.endpoints import EngineMetrics
    from gateway.view.service import endpoint_key
    from gateway.view.wire import Insert, Session, encode
    from routers.session_map import RESPONSE

    view, ctx, ep, other, mon = _replica_view()
    req = inference_request("You are a helpful switchyard assistant. " * 2)
    keys = ctx.prefix_index.keys(req)
    sent = time.time() - 60

    def held() -> set:
        return {e for e, pct in ctx.prefix_index.match(req, [ep, other]).items() if pct}

    def stream(*eps):
        facts = [Insert(endpoint_key(e), keys) for e in eps]
        sessions = [Session(f"s{i}", endpoint_key(e), None, sent) for i, e in enumerate(eps)] + \
            [Session(f"{RESPONSE}resp_{i}", endpoint_key(e), None, sent) for i, e in enumerate(eps)]
        for payload in encode("other/0", sent, facts, sessions, None, 1 << 20):
            view._on_stream(payload, False)

    stream(ep, other)
    assert held() == {ep, other}
    other.metrics = EngineMetrics(scraped_at=time.monotonic(), start_time=sent - 3600)   # up all along
    ep.metrics = EngineMetrics(scraped_at=time.monotonic(), start_time=sent + 30)        # restarted since
    for listener in mon.listeners:
        listener(other)
        listener(ep)
    assert held() == {other}
    assert view.sessions.get("s0") is None and view.sessions.get("s1") is other
    assert view.sessions.get(f"{RESPONSE}resp_0") is ep
    from prometheus_client import generate_latest

    def before_start() -> float:
        return metric_total(generate_latest(view.m.gm.registry).decode(), "switchyard_view_facts_applied_total",
                            source="replica", kind="before_start")
    assert before_start() == 2          # the engine's insertion and session, found out at the scrape
    # the start known: the engine's old facts are not taken at all, the other's are
    view.sessions.forget(other)
    stream(ep, other)
    assert held() == {other}
    assert view.sessions.get("s0") is None and view.sessions.get("s1") is other
    assert before_start() == 4


def test_replica_facts_older_than_their_ttl_are_not_taken():
    """The stream's retained tail (what a replica reads at start) and a backlog sent after an outage
    hold facts of any age: a session not seen for ``routing.session_ttl_s``, or a prefix untouched for
    ``routing.prefix_idle_ttl_s``, is forgotten by every process that recorded it, and one that
    starts does not take it back as if new (counted ``expired``); younger ones are taken."""
    import time

    from prometheus_client import generate_latest

    from gateway.view.service import endpoint_key
    from gateway.view.wire import Insert, Session, encode

    view, ctx, ep, other, _ = _replica_view(monitor=False)
    req = inference_request("You are a helpful switchyard assistant. " * 2)
    keys = ctx.prefix_index.keys(req)
    now = time.time()
    old, recent = now - 3 * 3600, now - 60          # the defaults: sessions 30 min, prefixes 20 min
    for sent, e, name in ((old, ep, "old"), (recent, other, "recent")):
        for payload in encode("other/0", sent, [Insert(endpoint_key(e), keys)],
                              [Session(name, endpoint_key(e), None, sent)], None, 1 << 20):
            view._on_stream(payload, False)
    assert view.sessions.get("old") is None and view.sessions.get("recent") is other
    assert {e for e, pct in ctx.prefix_index.match(req, [ep, other]).items() if pct} == {other}
    page = generate_latest(view.m.gm.registry).decode()
    assert metric_total(page, "switchyard_view_facts_applied_total", source="replica", kind="expired") == 2
    assert metric_total(page, "switchyard_view_facts_applied_total", source="replica", kind="session") == 1
    assert metric_total(page, "switchyard_view_facts_applied_total", source="replica", kind="insert") == 1


def test_with_gateway_held_responses_a_lineage_from_before_an_engines_start_goes_with_its_sessions():
    """Gateway state: any engine continues a Responses chain, so the lineage of a response an engine
    answered before its start is a session of a cache since gone: forgotten once the start is
    learnt, not taken once it is known, and dropped at a restart the view is told of."""
    import time

    from gateway.endpoints import EngineMetrics
    from gateway.view.service import endpoint_key
    from gateway.view.wire import Session, encode
    from routers.session_map import RESPONSE

    view, _ctx, ep, other, mon = _replica_view(responses_state="gateway")
    sent = time.time() - 60

    def stream(tag: str) -> None:
        sessions = [Session(f"{RESPONSE}{tag}_{i}", endpoint_key(e), None, sent) for i, e in enumerate((ep, other))]
        for payload in encode("other/0", sent, [], sessions, None, 1 << 20):
            view._on_stream(payload, False)

    stream("taken")
    other.metrics = EngineMetrics(scraped_at=time.monotonic(), start_time=sent - 3600)   # up all along
    ep.metrics = EngineMetrics(scraped_at=time.monotonic(), start_time=sent + 30)        # restarted since
    for listener in mon.listeners:
        listener(other)
        listener(ep)
    assert view.sessions.get(f"{RESPONSE}taken_0") is None and view.sessions.get(f"{RESPONSE}taken_1") is other
    stream("known")
    assert view.sessions.get(f"{RESPONSE}known_0") is None and view.sessions.get(f"{RESPONSE}known_1") is other
    view.sessions.put(f"{RESPONSE}new", ep)
    view.engine_restarted(ep)
    assert view.sessions.get(f"{RESPONSE}new") is None and view.sessions.get(f"{RESPONSE}known_1") is other


def test_facts_taken_before_an_engines_start_was_known_count_only_those_sent_before_it():
    """Of the facts a replica took of an engine while its start was unknown, those sent before the
    start are counted as ``before_start`` once it is known and forgotten, not those sent after, nor
    what this process routed there meanwhile; and what is kept of them is bounded however long the
    start stays unknown."""
    import time

    from prometheus_client import generate_latest

    from gateway.endpoints import EngineMetrics
    from gateway.view.service import UNVETTED_BATCHES, UNVETTED_KEYS, endpoint_key
    from gateway.view.wire import Insert, Session, encode

    view, ctx, ep, other, mon = _replica_view()
    index = ctx.prefix_index
    index.on_insert = view._on_insert
    reqs = [inference_request(f"{name}: you are a helpful switchyard assistant. " * 2)
            for name in ("Alpha", "Bravo", "Charlie")]
    keys = index.keys(reqs[0])
    start = time.time() - 100

    def stream(sent: float, n: int, e=ep, keys=keys) -> None:
        facts = [Insert(endpoint_key(e), keys)] * n
        for payload in encode("other/0", sent, facts, [Session(f"s{sent}", endpoint_key(e), None, sent)],
                              None, 1 << 20):
            view._on_stream(payload, False)

    def held(req) -> bool:
        return bool(index.match(req, [ep, other]).get(ep))

    def before_start() -> float:
        return metric_total(generate_latest(view.m.gm.registry).decode(), "switchyard_view_facts_applied_total",
                            source="replica", kind="before_start")

    stream(start - 50, 2)                           # three facts from before the start
    stream(start + 10, 3, keys=index.keys(reqs[1]))  # four after it, another batch
    stream(start - 40, 1, other)                    # of another engine: vetted on its own
    index.insert(reqs[2], ep)                       # this process routed there meanwhile
    view.sessions.put("own", ep)
    assert all(held(r) for r in reqs)
    ep.metrics = EngineMetrics(scraped_at=time.monotonic(), start_time=start)
    for listener in mon.listeners:
        listener(ep)
    assert before_start() == 3
    assert other in view._unvetted and ep not in view._unvetted
    assert [held(r) for r in reqs] == [False, True, True]
    assert view.sessions.get(f"s{start - 50}") is None
    assert view.sessions.get(f"s{start + 10}") is ep and view.sessions.get("own") is ep

    # a start that stays unknown: what is kept of the facts stays bounded
    n = max(UNVETTED_BATCHES, UNVETTED_KEYS // len(keys)) + 100
    for i in range(n):
        stream(start - 30 + i * 1e-3, 1, other)
    assert len(view._unvetted[other].batches) == UNVETTED_BATCHES
    assert view._unvetted[other].inserts is None          # past the keys kept: none are
    other.metrics = EngineMetrics(scraped_at=time.monotonic(), start_time=start + 3600)
    for listener in mon.listeners:
        listener(other)
    assert before_start() == 3 + 2 + 2 * n


async def test_adapters_in_flight_on_one_worker_are_never_unloaded_by_its_sibling_until_they_end_or_it_goes():
    """Worker a has a request for adapter x in flight on an endpoint: b, which has none, neither
    picks x to make room (capacity, error) nor unloads it (idle), once a's word arrives; it may
    again once a's request ends, or once a goes silent for peer_ttl_s (stopped, or restarted: a
    new run of a drops the marks of the old one at once)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from gateway.lora.adapters import Lora, LoraMetrics
    from gateway.pipeline.ledger import Charges

    d = RunDirectory()
    cfg = config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": URLS,
                                        "adapters": {"x": "org/x", "y": "org/y"}}],
                            "lora": {"max_adapters_per_endpoint": 2, "idle_unload_s": 1.0},
                            # a's marks outlive any stall of a loaded machine's loop between its heartbeats
                            "view": {"heartbeat_s": 0.05, "peer_ttl_s": 1.0, "load_interval_s": 0.01}}, source="<t>")
    (a, _, apool), (b, _, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    now = [1000.0]
    loras = [Lora(cfg, p, upstream=None, metrics=LoraMetrics(CollectorRegistry()), clock=lambda: now[0])
             for p in (apool, bpool)]
    a.attach_lora(loras[0])
    b.attach_lora(loras[1])
    lb = loras[1]

    def charge(ep):
        ctx = SimpleNamespace(ireq=SimpleNamespace(lora="x", model="m"), charges=Charges(),
                              decision=SimpleNamespace(endpoint=ep, prefill=None, strategy="lora-affinity",
                                                       reason="running"))
        loras[0].charge(ctx)
        return ctx.charges.adapter

    async with _running(d, a, b):
        ea, eb = apool.endpoints("m")[0], bpool.endpoints("m")[0]
        for ep in (ea, eb):
            ep.adapters.served = {"x": "m", "y": "m"}
        eb.adapters.recent = {"x": 1.0, "y": 2.0}           # x the least recently used in b
        lb._loaded_at[(id(eb), "x")] = 1.0                  # and loaded long ago: idle by b's clock
        assert lb._victim(eb, "z") == "x"
        held = charge(ea)
        await until(lambda: lb._victim(eb, "z") == "y")
        assert await lb.unload(eb, "x", "idle") is False and await lb.unload_idle() == 0
        assert eb.adapters.served == {"x": "m", "y": "m"}
        second = charge(ea)                                 # 1 → 2: nothing new to tell
        held.release()
        await asyncio.sleep(0.15)                           # heartbeats: still in flight there
        assert lb._victim(eb, "z") == "y"
        second.release()                                    # 1 → 0: told
        await until(lambda: lb._victim(eb, "z") == "x")
        assert not b._sibling_busy and not b.sibling_busy(eb, "x")
        # a goes silent with x in flight: its marks go after peer_ttl_s
        held = charge(ea)
        await until(lambda: lb._victim(eb, "z") == "y")
        a.bus.close()
        await until(lambda: lb._victim(eb, "z") == "x", timeout=10)
        held.release()
    page = b.m.gm.render().decode()
    assert metric_total(page, "switchyard_view_facts_applied_total", kind="busy") >= 3


async def test_a_restarted_sibling_drops_the_adapters_its_last_run_had_in_flight():
    """A worker restarted (killed as stalled) under the same name: its first batch, whatever it
    carries, clears the marks of the run before, without waiting for peer_ttl_s."""
    from gateway.view.wire import encode_numbered, endpoint_key

    d = RunDirectory()
    cfg = _config(heartbeat_s=5.0, peer_ttl_s=10.0)
    b, _, bpool = _worker(cfg, 1, d.path)
    async with _running(d, b):
        eb = bpool.endpoints("m")[0]
        (old,), _ = encode_numbered("g/0", 0.0, [], [], None, 60_000, run=11, busy={endpoint_key(eb): ["x"]})
        (new,), _ = encode_numbered("g/0", 0.0, [], [], {}, 60_000, run=13)
        b._apply(old, "worker", True)
        assert b.sibling_busy(eb, "x") and not b.sibling_busy(eb, "y")
        b._apply(new, "worker", True)
        assert not b.sibling_busy(eb, "x")


async def test_a_load_under_way_is_told_at_once_said_again_each_heartbeat_and_its_end_reaches_the_sibling():
    """Worker a starts loading adapter x: b hears it at once (a request for x there waits for the
    load), hears it again every heartbeat while it is under way (a slow load is not a stopped
    worker), and hears its end: x is then served there in b's view too, and nothing more is said."""
    import time

    from prometheus_client import CollectorRegistry

    from gateway.lora.adapters import Lora, LoraMetrics

    d = RunDirectory()
    cfg = config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": URLS,
                                        "adapters": {"x": "org/x"}}],
                            "view": {"heartbeat_s": 0.05, "peer_ttl_s": 0.3, "load_interval_s": 0.01}}, source="<t>")
    (a, _, apool), (b, _, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    la, lb = (Lora(cfg, p, upstream=None, metrics=LoraMetrics(CollectorRegistry())) for p in (apool, bpool))
    a.attach_lora(la)
    b.attach_lora(lb)
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m")[0], bpool.endpoints("m")[0]
        a.told_load_started(ea, "x", "m")
        await until(lambda: (id(eb), "x") in lb._sibling_loads)
        heard = lb._sibling_loads[(id(eb), "x")].heard
        await until(lambda: lb._sibling_loads[(id(eb), "x")].heard > heard)
        a.told_load_ended(ea, "x", "m", time.monotonic())
        await until(lambda: not lb._sibling_loads)
        assert eb.adapters.served == {"x": "m"} and not a._loading
    page = b.m.gm.render().decode()
    assert metric_total(page, "switchyard_view_facts_applied_total", kind="lora_load") >= 3


def test_nothing_is_kept_to_vet_where_no_start_will_be_learnt():
    """An engine scraped that does not tell its start, or scraping off: no scrape will tell the
    start, so the facts are taken and nothing is kept of them for it."""
    import time

    from gateway.endpoints import EngineMetrics
    from gateway.view.service import endpoint_key
    from gateway.view.wire import Insert, Session, encode

    for scrape in (True, False):
        view, ctx, ep, other, _ = _replica_view(scrape, monitor=False)
        ctx.prefix_index.on_insert = view._on_insert
        ep.metrics = EngineMetrics(scraped_at=time.monotonic())         # answered, without a start
        req = inference_request("You are a helpful switchyard assistant. " * 2)
        keys = ctx.prefix_index.keys(req)
        eps = (ep,) if scrape else (ep, other)
        for payload in encode("other/0", time.time() - 60, [Insert(endpoint_key(e), keys) for e in eps],
                              [Session(f"s{i}", endpoint_key(e)) for i, e in enumerate(eps)], None, 1 << 20):
            view._on_stream(payload, False)
        for e in eps:
            ctx.prefix_index.insert(req, e)
        assert view._unvetted == {}
        assert {e for e, pct in ctx.prefix_index.match(req, [ep, other]).items() if pct} == set(eps)


def test_what_was_kept_to_vet_goes_when_the_first_scrape_answers_without_the_engines_start():
    """Facts a replica took of an engine before its first scrape are kept to be vetted against its
    start; a first scrape that answers without one means no scrape will tell it: what was kept goes
    (it is not held for as long as the endpoint lives), and the facts stay applied."""
    import time

    from gateway.endpoints import EngineMetrics
    from gateway.view.service import endpoint_key
    from gateway.view.wire import Insert, Session, encode

    view, ctx, ep, other, mon = _replica_view()
    index = ctx.prefix_index
    index.on_insert = view._on_insert
    req = inference_request("You are a helpful switchyard assistant. " * 2)
    for payload in encode("other/0", time.time() - 60, [Insert(endpoint_key(ep), index.keys(req))],
                          [Session("s", endpoint_key(ep))], None, 1 << 20):
        view._on_stream(payload, False)
    assert ep in view._unvetted
    ep.metrics = EngineMetrics(scraped_at=time.monotonic())        # answered, without a start
    for listener in mon.listeners:
        listener(ep)
    assert ep not in view._unvetted
    assert index.match(req, [ep, other]).get(ep) and view.sessions.get("s") is ep


async def test_two_workers_that_eject_an_endpoint_at_once_agree_on_one_ejection_and_one_set_of_trials():
    """Both workers see a fault that ejects the endpoint in the same loop turn, before either hears
    of the other's ejection (their batches cross). They keep one: worker 0's. Worker 1 holds it and
    leaves the trials to worker 0, so once the engine is back (its probes found it down, then up)
    only worker 0 routes to it, and its trial's success closes the breaker in both. Before, each
    kept its own ejection and sent trials of its own: ``half_open_trials`` per worker."""

    from gateway.resilience.breaker import CLOSED, HALF_OPEN, OPEN
    from gateway.resilience.outcome import Outcome

    d = RunDirectory()
    cfg = _config()
    bcfg = _ejecting_at_once(half_open_trials=1, success_threshold=1)
    a, b, apool, bpool, abr, bbr = _breaker_pair(d, cfg, bcfg)
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m")[0], bpool.endpoints("m")[0]
        abr.record(ea, Outcome.FAULT)            # in one loop turn: neither has heard the other
        bbr.record(eb, Outcome.FAULT)
        assert abr.state(ea) == bbr.state(eb) == OPEN
        await until(lambda: bbr.breaker(eb).held, timeout=2)
        assert not abr.breaker(ea).held
        for ep, br in ((ea, abr), (eb, bbr)):    # the engine went down and came back
            ep.healthy = False
            br.on_health(ep)
            ep.healthy = True
            br.on_health(ep)
        assert abr.state(ea) == bbr.state(eb) == HALF_OPEN
        assert ea.ready and not eb.ready         # one trial in the gateway, worker 0's
        abr.on_decision(None, SimpleNamespace(endpoint=ea, prefill=None), (), 0.0)
        abr.record(ea, Outcome.SUCCESS)
        await until(lambda: bbr.state(eb) == CLOSED, timeout=2)
        assert abr.state(ea) == CLOSED and eb.ready
        for br in (abr, bbr):                    # each counts one ejection, one trial, one close
            moves = {(s.labels["from_state"], s.labels["to_state"]): s.value
                     for fam in br.metrics.transitions.collect() for s in fam.samples if s.name.endswith("_total")}
            assert moves == {("closed", "open"): 1, ("open", "half_open"): 1, ("half_open", "closed"): 1}


async def test_two_workers_that_eject_two_endpoints_at_once_past_the_cap_keep_the_lower_workers():
    """Two endpoints, ``max_ejection_percent: 50``: one may be out. Worker 0 ejects the first and
    worker 1 the second in the same loop turn, each within the cap by what it knew. Once each hears
    of the other's, both keep worker 0's ejection and the second endpoint serves in both: worker 1
    undoes its own (its breaker closes, and says so), and the refused ejection is counted once, by
    the worker whose ejection it was. Before, each kept its own and refused the other's, so each
    worker routed everything to the endpoint the other had ejected, and both counted the refusal."""

    from gateway.resilience.breaker import CLOSED, OPEN
    from gateway.resilience.outcome import Outcome

    d = RunDirectory()
    a, b, apool, bpool, abr, bbr = _breaker_pair(d, _config(), _ejecting_at_once())
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        abr.record(ea[0], Outcome.FAULT)         # in one loop turn: neither has heard the other
        bbr.record(eb[1], Outcome.FAULT)
        assert abr.state(ea[0]) == bbr.state(eb[1]) == OPEN

        def heard(view, sibling) -> bool:
            return view._heard_seq.get(sibling.sender, (0, 0))[1] >= 1
        await until(lambda: heard(a, b) and heard(b, a), timeout=2)
        assert [abr.state(e) for e in ea] == [bbr.state(e) for e in eb] == [OPEN, CLOSED]
        assert bbr.breaker(eb[0]).held and bbr.breaker(eb[0]).owner == 0
        assert [e.ready for e in ea] == [e.ready for e in eb] == [False, True]
        capped = [sum(s.value for fam in br.metrics.capped.collect() for s in fam.samples
                      if s.name.endswith("_total")) for br in (abr, bbr)]
        assert capped == [0, 1]


async def test_a_restarted_worker_takes_on_the_ejection_its_predecessor_decided_and_its_trials():
    """Worker 1 ejects an endpoint and worker 0 holds that ejection, leaving it the trials; worker 1
    is killed and started again. The new worker 1 learns the ejection from worker 0's whole view as
    the one its predecessor decided: it keeps the endpoint out for what is left of it, then sends
    the trials itself, while worker 0 still waits for its word. Held in both, the ejection would get
    no trial until each had waited ``base_ejection_s`` more, and then one set from each."""

    from gateway.resilience.breaker import CLOSED, HALF_OPEN, OPEN
    from gateway.resilience.outcome import Outcome

    d = RunDirectory()
    cfg = _config()
    bcfg = _ejecting_at_once(half_open_trials=1, success_threshold=1)
    a, b, apool, bpool, abr, bbr = _breaker_pair(d, cfg, bcfg)
    (b2, _, b2pool) = _worker(cfg, 1, d.path)
    b2br = _with_breakers(b2, b2pool, bcfg)

    async def ask(index, kind, timeout):
        return await a.snapshot()

    b2.ask_sibling = ask
    try:
        await a.start()
        await b.start()
        ea = apool.endpoints("m")[0]
        bbr.record(bpool.endpoints("m")[0], Outcome.FAULT)     # worker 1 ejects it; worker 0 holds it
        await until(lambda: abr.breaker(ea).held, timeout=2)
        await b.stop()                                          # killed
        await b2.start()                                        # and started again: it catches up first
        eb2 = b2pool.endpoints("m")[0]
        assert b2br.state(eb2) == OPEN and not eb2.ready
        assert 29 < b2br.breaker(eb2).open_for <= 30            # what was left of worker 1's ejection
        # not counted again: the predecessor counted it, and the new worker carries its counts on
        assert not [s for fam in b2br.metrics.transitions.collect() for s in fam.samples]
        for ep, br in ((ea, abr), (eb2, b2br)):                 # the engine went down and came back
            ep.healthy = False
            br.on_health(ep)
            ep.healthy = True
            br.on_health(ep)
        assert abr.state(ea) == b2br.state(eb2) == HALF_OPEN
        assert eb2.ready and not ea.ready                       # the trial is the new worker 1's
        b2br.on_decision(None, SimpleNamespace(endpoint=eb2, prefill=None), (), 0.0)
        b2br.record(eb2, Outcome.SUCCESS)
        await until(lambda: abr.state(ea) == CLOSED, timeout=2)  # its close closes worker 0's
    finally:
        for v in (a, b, b2):
            await v.stop()
        d.close()



def _with_breakers(view, pool, bcfg):
    """``view`` (a worker's routing view) with breakers of ``bcfg`` over ``pool``: the breakers."""
    from prometheus_client import CollectorRegistry

    from gateway.resilience.breaker import Breakers

    br = Breakers(pool, lambda _m: bcfg, CollectorRegistry())
    view.attach_breakers(br)
    return br


def _breaker_pair(d: RunDirectory, cfg, bcfg, ask: bool = False):
    """Two workers of one run directory with breakers of ``bcfg``, each asking the other for its
    whole view when ``ask``: ``(a, b, a's pool, b's pool, a's breakers, b's)``."""
    (a, _, apool), (b, _, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    abr, bbr = _with_breakers(a, apool, bcfg), _with_breakers(b, bpool, bcfg)
    if ask:
        async def snapshot(view, index, kind, timeout):
            return await view.snapshot()

        a.ask_sibling = lambda index, kind, timeout: snapshot(b, index, kind, timeout)
        b.ask_sibling = lambda index, kind, timeout: snapshot(a, index, kind, timeout)
    return a, b, apool, bpool, abr, bbr


def _ejecting_at_once(**knobs):
    """Breakers that eject an endpoint at its first fault, for 30 s."""
    from gateway.resilience.breaker import BreakerConfig

    return BreakerConfig(consecutive_faults=1, base_ejection_s=30.0, max_ejection_percent=50, **knobs)


async def test_a_worker_that_missed_its_siblings_ejection_learns_it_once_it_reads_again():
    """b stops reading its bus (a stall): a's batches of in-flight counts fill its queue, and the one
    that tells of a's ejection is refused. Once b reads again, a's number (said again on the
    heartbeat) shows the gap, b catches up from a, and ejects the endpoint for what is left of a's
    ejection. Before, a batch with only an ejection was not numbered: nothing showed b had missed
    it, and b routed to the ejected engine until faults of its own tripped its breaker."""
    from gateway.resilience.breaker import OPEN
    from gateway.resilience.outcome import Outcome

    d = RunDirectory()
    # peer_ttl_s well past a stall of the loop: b must not take a's silence for a's end meanwhile
    a, b, apool, bpool, abr, bbr = _breaker_pair(d, _config(heartbeat_s=0.05, peer_ttl_s=2.0, load_interval_s=0.01),
                                                  _ejecting_at_once(), ask=True)
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        loop = asyncio.get_running_loop()
        loop.remove_reader(b.bus.sock.fileno())          # b reads nothing: its queue fills
        for i in range(1, 100):
            ea[1].in_flight = i
            a._flush()
        assert metric_total(a.m.gm.render().decode(), "switchyard_view_messages_dropped_total", reason="peer_full") > 0
        abr.record(ea[0], Outcome.FAULT)                 # ejected; the batch that says so is refused
        assert abr.state(ea[0]) == OPEN
        await asyncio.sleep(0)
        ea[1].in_flight = 0
        loop.add_reader(b.bus.sock.fileno(), b.bus._readable)     # b reads again
        await until(lambda: bbr.state(eb[0]) == OPEN, timeout=10)
        assert bbr.breaker(eb[0]).held and 29 < bbr.breaker(eb[0]).open_for <= 30
        assert metric_total(b.m.gm.render().decode(), "switchyard_view_catch_ups_total",
                            reason="gap", result="applied") == 1


async def test_a_worker_that_missed_its_siblings_close_after_the_trials_closes_too(monkeypatch):
    """b holds a's ejection; b's queue is full when a's trials pass and a closes the breaker. Once b
    reads again it catches up, finds the ejection gone from a's view, and closes its breaker too,
    rather than keeping the endpoint out until its own trials after the ejection and base_ejection_s more."""

    import gateway.view.service as service
    from gateway.resilience.breaker import CLOSED, OPEN
    from gateway.resilience.outcome import Outcome

    monkeypatch.setattr(service, "CATCH_UP_EVERY_S", 0.0)
    d = RunDirectory()
    a, b, apool, bpool, abr, bbr = _breaker_pair(d, _config(heartbeat_s=0.05, peer_ttl_s=0.2, load_interval_s=0.01),
                                                  _ejecting_at_once(), ask=True)
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        abr.record(ea[0], Outcome.FAULT)
        await until(lambda: bbr.state(eb[0]) == OPEN and bbr.breaker(eb[0]).held, timeout=2)
        loop = asyncio.get_running_loop()
        loop.remove_reader(b.bus.sock.fileno())
        for i in range(1, 100):
            ea[1].in_flight = i
            a._flush()
        abr._close(ea[0], abr.breaker(ea[0]), abr.clock())     # the trials passed; the batch is refused
        await asyncio.sleep(0)
        ea[1].in_flight = 0
        loop.add_reader(b.bus.sock.fileno(), b.bus._readable)
        await until(lambda: bbr.state(eb[0]) == CLOSED, timeout=3)
        assert eb[0].ready


async def test_the_adapters_of_an_engine_serving_thousands_reach_the_sibling():
    """The watcher of an engine tells its siblings the adapters the engine lists: 3,000 of them
    named as hub ids make one fact of about 180 KB, which travels alone, past view.max_datagram_bytes
    (the socket takes it). The sibling takes it whole, so it need not read the engine itself."""
    import time

    from prometheus_client import CollectorRegistry

    from gateway.lora.adapters import Lora, LoraMetrics

    d = RunDirectory()
    cfg = _config(heartbeat_s=0.05, load_interval_s=0.01)
    (a, _, apool), (b, _, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    la, lb = (Lora(cfg, p, upstream=None, metrics=LoraMetrics(CollectorRegistry())) for p in (apool, bpool))
    a.attach_lora(la)
    b.attach_lora(lb)
    adapters = {f"customer-org/support-assistant-lora-adapter-rank16-{i:06d}": "m" for i in range(3000)}
    async with _running(d, a, b):
        ea = next(ep for ep in apool.endpoints("m") if a.watcher(ep) == 0)
        eb = next(ep for ep in bpool.endpoints("m") if ep.url == ea.url)
        a.told_models(ea, time.monotonic(), adapters)
        await until(lambda: len(eb.adapters.served) == 3000, timeout=5)
        assert eb.adapters.served == adapters
    page = b.m.gm.render().decode()
    assert metric_total(page, "switchyard_view_messages_dropped_total", reason="undecodable") == 0


async def test_the_context_length_an_engine_lists_reaches_the_sibling():
    """The watcher of an engine tells its siblings the ``max_model_len`` its ``/v1/models`` lists with
    its adapters: a sibling's vLLM P/D requests that cannot fit in that decode run whole there too."""
    import time

    from prometheus_client import CollectorRegistry

    from gateway.lora.adapters import Lora, LoraMetrics

    d = RunDirectory()
    cfg = _config(heartbeat_s=0.05, load_interval_s=0.01)
    (a, _, apool), (b, _, bpool) = _worker(cfg, 0, d.path), _worker(cfg, 1, d.path)
    la, lb = (Lora(cfg, p, upstream=None, metrics=LoraMetrics(CollectorRegistry())) for p in (apool, bpool))
    a.attach_lora(la)
    b.attach_lora(lb)
    async with _running(d, a, b):
        ea = next(ep for ep in apool.endpoints("m") if a.watcher(ep) == 0)
        eb = next(ep for ep in bpool.endpoints("m") if ep.url == ea.url)
        a.told_models(ea, time.monotonic(), {}, 4096)
        await until(lambda: eb.max_model_len == 4096, timeout=5)
        a.told_models(ea, time.monotonic(), None)          # no answer: what was listed stays
        a.told_models(ea, time.monotonic(), {"x": "m"})    # a list without it: unknown again
        await until(lambda: eb.max_model_len is None, timeout=5)
        assert eb.adapters.served == {"x": "m"}


async def test_a_siblings_ejection_refused_here_is_counted_once_though_a_catch_up_tells_it_again(monkeypatch):
    """a ejects the first endpoint; b refuses to follow, the other being down by its probes (one
    endpoint of a group stays ready), and counts that refused ejection. b's queue then fills and it
    catches up from a, whose whole view tells the same ejection again: still refused, and not a new
    refusal: ``switchyard_breaker_ejections_capped_total`` stays at 1. It counted 2 before."""
    import gateway.view.service as service
    from gateway.resilience.breaker import CLOSED, OPEN
    from gateway.resilience.outcome import Outcome

    monkeypatch.setattr(service, "CATCH_UP_EVERY_S", 0.0)
    d = RunDirectory()
    a, b, apool, bpool, abr, bbr = _breaker_pair(d, _config(heartbeat_s=0.05, peer_ttl_s=0.2, load_interval_s=0.01),
                                                  _ejecting_at_once(), ask=True)

    def capped(br) -> float:
        return sum(s.value for fam in br.metrics.capped.collect() for s in fam.samples if s.name.endswith("_total"))

    async with _running(d, a, b):
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        eb[1].healthy = False
        abr.record(ea[0], Outcome.FAULT)
        await until(lambda: capped(bbr) == 1, timeout=2)
        assert abr.state(ea[0]) == OPEN and bbr.state(eb[0]) == CLOSED
        loop = asyncio.get_running_loop()
        loop.remove_reader(b.bus.sock.fileno())          # b reads nothing: its queue fills
        for i in range(1, 100):
            ea[1].in_flight = i
            a._flush()
        for i in range(3):                               # numbered batches b misses: a gap
            a.sessions.put(f"m\0s:agent {i}", ea[1])
            await asyncio.sleep(0)
        ea[1].in_flight = 0
        loop.add_reader(b.bus.sock.fileno(), b.bus._readable)     # b reads again, and catches up

        def caught_up() -> bool:
            return metric_total(b.m.gm.render().decode(), "switchyard_view_catch_ups_total",
                                reason="gap", result="applied") == 1
        await until(caught_up, timeout=3)
        assert bbr.state(eb[0]) == CLOSED and capped(bbr) == 1 and capped(abr) == 0


async def test_a_worker_that_missed_its_siblings_close_and_next_ejection_takes_both_from_the_catch_up(
        monkeypatch):
    """Two endpoints, one of which may be out. b holds a's ejection of the first; b's queue is full
    when a's trials close it and a then ejects the second. b catches up from a's whole view, which
    lists the second and not the first: b closes the first and holds the second, as a does, and
    counts no refused ejection. Before, b weighed the second's ejection while it still held the
    first: refused (counted in switchyard_breaker_ejections_capped_total) and then the first
    closed, so b routed everything to the endpoint a had ejected."""
    import gateway.view.service as service
    from gateway.resilience.breaker import CLOSED, OPEN
    from gateway.resilience.outcome import Outcome

    monkeypatch.setattr(service, "CATCH_UP_EVERY_S", 0.0)
    d = RunDirectory()
    a, b, apool, bpool, abr, bbr = _breaker_pair(d, _config(heartbeat_s=0.05, peer_ttl_s=0.2, load_interval_s=0.01),
                                                  _ejecting_at_once(), ask=True)
    async with _running(d, a, b):
        ea, eb = apool.endpoints("m"), bpool.endpoints("m")
        abr.record(ea[0], Outcome.FAULT)
        await until(lambda: bbr.state(eb[0]) == OPEN and bbr.breaker(eb[0]).held, timeout=2)
        loop = asyncio.get_running_loop()
        loop.remove_reader(b.bus.sock.fileno())          # b reads nothing: its queue fills
        for i in range(1, 100):
            ea[1].in_flight = i
            a._flush()
        abr._close(ea[0], abr.breaker(ea[0]), abr.clock())     # the trials passed; the batch is refused
        ea[1].in_flight = 0
        abr.record(ea[1], Outcome.FAULT)                 # and the second is ejected: refused too
        assert abr.state(ea[1]) == OPEN
        await asyncio.sleep(0)
        loop.add_reader(b.bus.sock.fileno(), b.bus._readable)

        def caught_up() -> bool:
            return metric_total(b.m.gm.render().decode(), "switchyard_view_catch_ups_total",
                                reason="gap", result="applied") == 1
        await until(caught_up, timeout=3)
        assert (bbr.state(eb[0]), bbr.state(eb[1])) == (CLOSED, OPEN)
        assert eb[0].ready and not eb[1].ready and bbr.breaker(eb[1]).held
        assert not [s for fam in bbr.metrics.capped.collect() for s in fam.samples if s.name.endswith("_total")]


async def test_the_sessions_of_an_endpoint_that_left_the_pool_go_with_it_a_part_a_loop_turn():
    """Pods come and go: the sessions whose last turn went to one that left (a reload, a pod
    deleted) are dropped with it, the endpoint object with them, not kept (counted ``gone``) until
    ``session_ttl_s``; a walk of a large map is done a part a loop turn. Those of the others stay, and
    a turn that ends on the gone one later (a Responses answer) records nothing of it."""
    import time

    from gateway.server.app import pool_from_config
    cfg = _config()
    pool = pool_from_config(cfg)
    view = RoutingView(cfg, pool, GatewayMetrics())
    ep, kept = pool.endpoints("m")[:2]
    n = cfg.routing.session_max_entries - 2           # the map full, none evicted
    sessions = view.sessions
    for i in range(n):
        sessions.put(f"m\0s:{i}", ep if i % 2 else kept)
    sessions.put("r:resp_1", ep, "alice")               # the lineage of a response it answered
    sessions.put("m\0s:last", ep)
    for _ in range(3):
        await asyncio.sleep(0)                          # what the puts sent is out
    started = time.perf_counter()
    pool.remove(ep)
    longest, turns = 0.0, 0
    while any(sessions.get(k) is ep for k in ("m\0s:1", "r:resp_1", "m\0s:last")) and turns < 10_000:
        t = time.perf_counter()
        await asyncio.sleep(0)
        longest, turns = max(longest, time.perf_counter() - t), turns + 1
    print(f"{n} sessions: dropped in {turns} loop turns, {time.perf_counter() - started:.3f} s in all, "
          f"the longest turn {longest * 1000:.1f} ms")
    assert len(sessions) == n // 2 and all(sessions.get(f"m\0s:{i}") is kept for i in range(0, n, 2))
    sessions.put("r:resp_2", ep, "alice")               # answered on it after it left
    assert sessions.get("r:resp_2") is None
