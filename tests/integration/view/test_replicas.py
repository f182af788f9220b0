"""Two gateway replicas sharing Redis route on one view: each turn of a conversation, sent to
either replica, goes to the engine of its previous turns; a replica started later catches up;
losing Redis is counted and costs no client an error, and the view converges again once it is back.

Real ``python -m gateway`` processes and a real ``redis-server`` (the ``redis_server`` fixture).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from tests.integration.view.test_workers import SYSTEM, responses_chains
from tests.support.enginesim import restart_sim
from tests.support.gateway_process import gateway_process, get_new, metric_total, per_worker, post_new
from tests.support.ports import listen_port
from tests.support.waiting import until


def config(port: int, urls: list[str], redis_url: str) -> str:
    eps = ", ".join(f"'{u}'" for u in urls)
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
            "health: {interval_s: 0.5}\n"
            "routing: {strategy: prefix-cache, prefix_block_chars: 64}\n"
            f"state: {{redis_url: '{redis_url}'}}\n"
            "view: {retry_s: 0.1, read_block_s: 0.2}\n"
            f"models: [{{name: m, engine: vllm, endpoints: [{eps}]}}]\n")


async def turn(port: int, messages: list[dict], text: str) -> str:
    messages.append({"role": "user", "content": text})
    status, head, body = await post_new(port, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 4})
    assert status == 200, body
    messages.append(body["choices"][0]["message"])
    return head["target-pod"]


def opening(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"{tag}: {SYSTEM}"}]


async def redis_up(port: int) -> bool:
    return metric_total((await get_new(port, "/metrics"))[1], "switchyard_view_redis_up") == 1


@pytest.mark.timeout(180)
async def test_two_replicas_send_each_turn_to_the_engine_of_the_conversation(sims, tmp_path, redis_server):
    engines = [await sims("vllm", "m") for _ in range(4)]
    urls = [e.url for e in engines]
    pa, pb, pc = listen_port(), listen_port(), listen_port()
    for name, port in (("a", pa), ("b", pb), ("c", pc)):
        (tmp_path / f"{name}.yaml").write_text(config(port, urls, redis_server.url))
    async with gateway_process(tmp_path / "a.yaml", pa), gateway_process(tmp_path / "b.yaml", pb):
        await until(lambda: redis_up(pa), timeout=20)
        await until(lambda: redis_up(pb), timeout=20)
        # conversations whose turns alternate between the replicas
        same = total = 0
        for c in range(8):
            messages = opening(f"conversation {c}")
            first = await turn(pa if c % 2 else pb, messages, "turn 0: where to?")
            for t in range(1, 6):
                total += 1
                same += await turn((pa, pb)[t % 2], messages, f"turn {t}: and then? " * 3) == first
        assert same >= 0.95 * total, f"{same} of {total} turns on the conversation's engine"

        # a replica started later catches up on what the others learned
        later = [opening(f"later {c}") for c in range(4)]
        heard = await inserts_from_replicas(pb)
        workers = (await get_new(pb, "/status.json"))[1]["gateway"]["workers"]["count"]
        firsts = [await turn(pa, m, "turn 0: where to?") for m in later]
        # the first turns' insertions are in the stream (b read them there) before c starts, so its
        # start's catch-up holds them: written after each answer, one could land after c read the tail
        await until(lambda: _at_least(inserts_from_replicas(pb), heard + len(later) * workers), timeout=20)
        async with gateway_process(tmp_path / "c.yaml", pc, ready_workers=workers) as proc:
            # every worker of c has read and applied the stream's tail: each marks itself up once
            # its catch-up ended (read from each worker's own page: a merged one leaves out a
            # sibling slow to answer)
            await until(lambda: every_worker_up(proc.pid, pc, workers), timeout=20)
            caught = [await turn(pc, m, "turn 1: and then? " * 3) for m in later]
            assert caught == firsts
            page = (await get_new(pc, "/metrics"))[1]
            assert metric_total(page, "switchyard_view_facts_applied_total", source="replica", kind="insert") >= 4

        # Redis lost: no client error, the loss counted, the local view goes on
        redis_server.kill()
        outage = [opening(f"outage {c}") for c in range(3)]
        for m in outage:
            await turn(pa, m, "turn 0: where to?")
            await turn(pb, m, "turn 1: and then? " * 3)
        for port in (pa, pb):
            await until(lambda port=port: _lost(port), timeout=20)

        # Redis back (empty): the replicas reconnect and the view converges again
        redis_server.start()
        await until(lambda: redis_up(pa), timeout=20)
        await until(lambda: redis_up(pb), timeout=20)
        same = total = 0
        workers = (await get_new(pa, "/status.json"))[1]["gateway"]["workers"]["count"]
        for c in range(4):
            messages = opening(f"after {c}")
            heard = await inserts_from_replicas(pa)
            first = await turn(pb, messages, "turn 0: where to?")
            # every worker of a has b's insertion of the first turn before a routes the next: sent the
            # moment b answered, that turn could reach a before the fact did and go to any engine
            await until(lambda h=heard: _at_least(inserts_from_replicas(pa), h + workers), timeout=20)
            for t in range(1, 4):
                total += 1
                same += await turn((pb, pa)[t % 2], messages, f"turn {t}: and then? " * 3) == first
        assert same >= 0.95 * total, f"{same} of {total} turns on the conversation's engine after Redis came back"


@pytest.mark.timeout(120)
async def test_sessions_both_replicas_routed_while_redis_was_away_end_on_one_engine_once_it_is_back(
        sims, tmp_path, redis_server):
    """While Redis is away each replica routes on its own view: a session's turn on one replica and
    its next on the other may go to two engines. Once Redis is back each hears the other's entry,
    and both keep the later, where each took the other's and every turn after went to the engine
    the other replica had chosen, back and forth."""
    engines = [await sims("vllm", "m") for _ in range(4)]
    urls = [e.url for e in engines]
    pa, pb = listen_port(), listen_port()
    for name, port in (("a", pa), ("b", pb)):
        (tmp_path / f"{name}.yaml").write_text(config(port, urls, redis_server.url))

    async def say(port: int, session: str, text: str) -> str:
        # shorter than a prefix block: only the session map keeps a session's turns together
        status, head, body = await post_new(port, "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}, {"x-session-key": session})
        assert status == 200, body
        return head["target-pod"]

    async def heard(port: int, n: int) -> bool:
        page = (await get_new(port, "/metrics"))[1]
        return metric_total(page, "switchyard_view_facts_applied_total", source="replica", kind="session") >= n

    sessions = [f"agent-{i}" for i in range(8)]
    async with gateway_process(tmp_path / "a.yaml", pa, "--workers", "1"), \
            gateway_process(tmp_path / "b.yaml", pb, "--workers", "1"):
        await until(lambda: redis_up(pa), timeout=20)
        await until(lambda: redis_up(pb), timeout=20)
        redis_server.kill()
        for port in (pa, pb):
            await until(lambda port=port: _lost(port), timeout=20)
        for s in sessions:
            await say(pa, s, "turn 0")
            await say(pb, s, "turn 1")
        redis_server.start()
        for port in (pa, pb):
            await until(lambda port=port: heard(port, len(sessions)), timeout=20)
        moved = []
        for s in sessions:
            served = [await say((pa, pb)[t % 2], s, f"turn {t}") for t in range(2, 8)]
            if len(set(served)) > 1:
                moved.append((s, served))
        assert moved == []


async def _lost(port: int) -> bool:
    page = (await get_new(port, "/metrics"))[1]
    return metric_total(page, "switchyard_view_redis_lost_total") >= 1 and \
        metric_total(page, "switchyard_view_redis_up") == 0


@pytest.mark.timeout(120)
async def test_a_responses_chain_in_gateway_state_stays_on_its_engine_across_replicas(sims, tmp_path, redis_server):
    """Gateway state: any engine could serve a follow-up (the gateway expands the history); the
    shared session map sends each one where the chain's cache is, whichever replica it reaches."""
    engines = [await sims("vllm", "m") for _ in range(4)]
    urls = [e.url for e in engines]
    pa, pb = listen_port(), listen_port()
    for name, port in (("a", pa), ("b", pb)):
        (tmp_path / f"{name}.yaml").write_text(config(port, urls, redis_server.url) + "responses: {state: gateway}\n")
    async with gateway_process(tmp_path / "a.yaml", pa), gateway_process(tmp_path / "b.yaml", pb):
        await until(lambda: redis_up(pa), timeout=20)
        await until(lambda: redis_up(pb), timeout=20)
        await responses_chains([pa, pb], 4, 6)
        pages = [(await get_new(p, "/metrics"))[1] for p in (pa, pb)]
    kept = sum(metric_total(page, "switchyard_routing_session_total", outcome="kept") for page in pages)
    assert kept == 4 * 5


@pytest.mark.timeout(120)
async def test_a_replica_started_after_an_engine_restarted_takes_none_of_its_old_conversations(
        sims, tmp_path, redis_server):
    """The stream's retained tail holds what the replicas routed before an engine restarted. A
    replica that starts later (or a worker restarted) reads it: the engine's insertions from before
    its new start are of a cache that is gone, and are not taken, while the other engine's are."""
    engines = [await sims("vllm", "m") for _ in range(2)]
    urls = [e.url for e in engines]
    pa, pc = listen_port(), listen_port()
    for name, port in (("a", pa), ("c", pc)):
        (tmp_path / f"{name}.yaml").write_text(config(port, urls, redis_server.url) + "scrape: {interval_s: 0.2}\n")
    restarted = None
    try:
        async with gateway_process(tmp_path / "a.yaml", pa):
            await until(lambda: redis_up(pa), timeout=20)
            # conversations until each engine holds some: a first turn matches no prefix, and its
            # engine is the least loaded, random among equals, so six all land on one in 1 run of 32
            chats: list[list[dict]] = []
            firsts: list[str] = []
            while len(chats) < 6 or len(set(firsts)) < 2:
                assert len(chats) < 40, firsts
                chats.append(opening(f"before {len(chats)}"))
                firsts.append(await turn(pa, chats[-1], "turn 0: where to?"))
            victim = next(e for e in engines if firsts[0].endswith(f":{e.port}"))
            restarted = await restart_sim(victim)
            gone = sum(1 for f in firsts if f == firsts[0])

            async def seen_restart() -> bool:
                page = (await get_new(pa, "/metrics"))[1]
                return metric_total(page, "switchyard_engine_restarts_total") == 1
            await until(seen_restart, timeout=20)
            async with gateway_process(tmp_path / "c.yaml", pc):
                await until(lambda: redis_up(pc), timeout=20)

                async def scraped() -> bool:
                    page = (await get_new(pc, "/metrics"))[1]
                    return metric_total(page, "switchyard_engine_scrapes_total", result="ok") >= 4
                await until(scraped, timeout=20)
                before = metric_total((await get_new(pc, "/metrics"))[1], "switchyard_routing_fallbacks_total",
                                      reason="no_match")
                nexts = [await turn(pc, m, "turn 1: and then? " * 3) for m in chats]
                page = (await get_new(pc, "/metrics"))[1]
                # the restarted engine's conversations are no match anywhere; the other's stay on it
                assert metric_total(page, "switchyard_routing_fallbacks_total", reason="no_match") == before + gone
                assert [n for n, f in zip(nexts, firsts, strict=True) if f != firsts[0]] == \
                    [f for f in firsts if f != firsts[0]]
                assert metric_total(page, "switchyard_view_facts_applied_total", source="replica",
                                    kind="before_start") >= gone
    finally:
        if restarted is not None:
            await restarted.close()


class HeldMetrics:
    """In front of an engine: everything passed through, but ``/metrics`` held (no answer) while
    ``hold`` is set: a gateway that reads the engine through it learns the engine's start when the
    test says so."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.released = asyncio.Event()
        self.released.set()
        self.port = listen_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> HeldMetrics:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.released.set()
        await self.runner.cleanup()
        await self.session.close()

    def hold(self) -> None:
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    async def forward(self, request: web.Request) -> web.Response:
        if request.path == "/metrics":
            await self.released.wait()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with self.session.request(request.method, self.target + request.path_qs, headers=headers,
                                        data=await request.read()) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)


@pytest.mark.timeout(120)
async def test_a_replica_that_reads_the_tail_before_its_first_scrape_still_drops_a_restarted_engines_conversations(
        sims, tmp_path, redis_server):
    """The order the test above leaves to chance, forced: replica c catches up on the stream's
    tail while it knows neither engine's start yet (their /metrics held), so it takes every fact
    and checks them at its first scrape. The restarted engine's conversations from before its
    start then match nothing, each of them counted as from before the start; those it took after
    its start stay on it, and so do the other engine's."""
    engines = [await sims("vllm", "m") for _ in range(2)]
    pa, pc = listen_port(), listen_port()
    restarted = None
    async with HeldMetrics(engines[0].url) as f0, HeldMetrics(engines[1].url) as f1:
        fronts = [f0, f1]
        urls = [f.url for f in fronts]
        for name, port in (("a", pa), ("c", pc)):
            (tmp_path / f"{name}.yaml").write_text(
                config(port, urls, redis_server.url) + "scrape: {interval_s: 0.2, timeout_s: 0.5}\n")
        try:
            async with gateway_process(tmp_path / "a.yaml", pa, "--workers", "1"):
                await until(lambda: redis_up(pa), timeout=20)
                chats: list[list[dict]] = []
                firsts: list[str] = []
                while len(chats) < 6 or len(set(firsts)) < 2:
                    assert len(chats) < 40, firsts
                    chats.append(opening(f"before {len(chats)}"))
                    firsts.append(await turn(pa, chats[-1], "turn 0: where to?"))
                victim = next(e for e, f in zip(engines, fronts, strict=True) if firsts[0].endswith(f":{f.port}"))
                restarted = await restart_sim(victim)
                gone = sum(1 for f in firsts if f == firsts[0])

                async def seen_restart() -> bool:
                    page = (await get_new(pa, "/metrics"))[1]
                    return metric_total(page, "switchyard_engine_restarts_total") == 1
                await until(seen_restart, timeout=20)
                # conversations the restarted engine took after its start: its cache holds them
                fresh: list[list[dict]] = []
                fresh_firsts: list[str] = []
                while firsts[0] not in fresh_firsts:
                    assert len(fresh) < 40, fresh_firsts
                    fresh.append(opening(f"after {len(fresh)}"))
                    fresh_firsts.append(await turn(pa, fresh[-1], "turn 0: where to?"))

                for f in fronts:
                    f.hold()
                # one worker: each counts the facts it reads
                async with gateway_process(tmp_path / "c.yaml", pc, "--workers", "1"):
                    await until(lambda: redis_up(pc), timeout=20)

                    async def caught_up() -> bool:
                        page = (await get_new(pc, "/metrics"))[1]
                        return metric_total(page, "switchyard_view_facts_applied_total", source="replica",
                                            kind="insert") >= len(chats) + len(fresh)
                    await until(caught_up, timeout=20)
                    page = (await get_new(pc, "/metrics"))[1]
                    # every fact taken before c knew an engine's start
                    assert metric_total(page, "switchyard_engine_scrapes_total", result="ok") == 0
                    assert metric_total(page, "switchyard_view_facts_applied_total", source="replica",
                                        kind="before_start") == 0
                    for f in fronts:
                        f.release()

                    async def scraped() -> bool:
                        page = (await get_new(pc, "/metrics"))[1]
                        return all(metric_total(page, "switchyard_engine_scrapes_total", result="ok",
                                                endpoint=f"127.0.0.1:{f.port}") >= 2 for f in fronts)
                    await until(scraped, timeout=20)
                    before = metric_total((await get_new(pc, "/metrics"))[1], "switchyard_routing_fallbacks_total",
                                          reason="no_match")
                    nexts = [await turn(pc, m, "turn 1: and then? " * 3) for m in chats]
                    fresh_nexts = [await turn(pc, m, "turn 1: and then? " * 3) for m in fresh]
                    page = (await get_new(pc, "/metrics"))[1]
                    assert metric_total(page, "switchyard_routing_fallbacks_total", reason="no_match") == before + gone
                    assert [n for n, f in zip(nexts, firsts, strict=True) if f != firsts[0]] == \
                        [f for f in firsts if f != firsts[0]]
                    assert fresh_nexts == fresh_firsts
                    assert metric_total(page, "switchyard_view_facts_applied_total", source="replica",
                                        kind="before_start") == gone
        finally:
            if restarted is not None:
                await restarted.close()


@pytest.mark.timeout(120)
async def test_a_restarted_engine_keeps_neither_the_sessions_nor_the_gateway_held_responses_chains_it_served(
        sims, tmp_path, redis_server):
    """An engine that restarts has lost the cache of every conversation it served: its sessions are
    dropped by both replicas (of two workers each), whatever names them, a session header or, with
    gateway state, a Responses chain (any engine can continue one, so its lineage is a session like
    any other). Each one's next turn is routed as a prompt no engine holds, through the openai SDK
    with no client error, and the turn after that stays where it went."""
    import openai

    engines = [await sims("vllm", "m") for _ in range(3)]
    urls = [e.url for e in engines]
    pa, pb = listen_port(), listen_port()
    for name, port in (("a", pa), ("b", pb)):
        (tmp_path / f"{name}.yaml").write_text(config(port, urls, redis_server.url)
                                               + "responses: {state: gateway}\nscrape: {interval_s: 0.2}\n")
    clients = [openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="x", max_retries=0,
                                  default_headers={"Connection": "close"}) for p in (pa, pb)]

    async def chat(t: int, session: str) -> str:
        # shorter than a prefix block: only the session map keeps its turns together
        raw = await clients[t % 2].chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": f"turn {t}"}], max_tokens=2,
            extra_headers={"x-session-key": session})
        return raw.headers["target-pod"]

    async def respond(t: int, chain: int, prev: str | None) -> tuple[str, str]:
        raw = await clients[t % 2].responses.with_raw_response.create(
            model="m", input=f"chain {chain} step {t}: where to?", max_output_tokens=4,
            **({"previous_response_id": prev} if prev else {}))
        return raw.parse().id, raw.headers["target-pod"]

    async def counted() -> tuple[float, float]:
        pages = [(await get_new(p, "/metrics"))[1] for p in (pa, pb)]
        return (sum(metric_total(page, "switchyard_routing_session_total", outcome="kept") for page in pages),
                sum(metric_total(page, "switchyard_routing_session_total") for page in pages))

    restarted = None
    try:
        async with gateway_process(tmp_path / "a.yaml", pa, "--workers", "2", ready_workers=2), \
                gateway_process(tmp_path / "b.yaml", pb, "--workers", "2", ready_workers=2):
            for port in (pa, pb):
                await until(lambda port=port: redis_up(port), timeout=20)
            sessions = [f"agent-{i}" for i in range(6)]
            at = {s: await chat(i, s) for i, s in enumerate(sessions)}
            prev: dict[int, str] = {}
            for c in range(6):
                prev[c], at[c] = await respond(c, c, None)
            for t in (1, 2):
                for s in sessions:
                    assert await chat(t, s) == at[s]
                for c in range(6):
                    prev[c], pod = await respond(t, c, prev[c])
                    assert pod == at[c]
            victim = next(e for e in engines if at[0].endswith(f":{e.port}"))
            lost = [k for k, pod in at.items() if pod == at[0]]       # the victim's sessions and chains
            restarted = await restart_sim(victim)
            for port in (pa, pb):
                async def seen_restart(port: int = port) -> bool:
                    page = (await get_new(port, "/metrics"))[1]
                    return metric_total(page, "switchyard_engine_restarts_total") == 1
                await until(seen_restart, timeout=20)

            kept, total = await counted()
            after: dict[str | int, str] = {}
            for s in sessions:
                after[s] = await chat(3, s)
            for c in range(6):
                prev[c], after[c] = await respond(3, c, prev[c])
            kept_now, total_now = await counted()
            # only the sessions of the engines that kept their cache were kept; the victim's named no endpoint
            assert (kept_now - kept, total_now - total) == (len(at) - len(lost), len(at) - len(lost))
            # the turn after goes where the one before went, and is kept there
            for s in sessions:
                assert await chat(4, s) == after[s]
            for c in range(6):
                prev[c], pod = await respond(4, c, prev[c])
                assert pod == after[c]
            assert await counted() == (kept_now + len(at), total_now + len(at))
    finally:
        for cl in clients:
            await cl.close()
        if restarted is not None:
            await restarted.close()


@pytest.mark.timeout(120)
async def test_an_engine_state_chain_goes_on_after_redis_restarted_empty(sims, tmp_path, redis_server):
    """Engine state with the affinity map in Redis, two replicas of two workers, the openai SDK: while
    Redis is away a follow-up is the documented 503 (x-error-state-unavailable) and a new response
    is answered (its record not written). Redis back, empty: both chains go on, on the engine that
    holds them, found in the routing view's lineage every replica shares, where the map lost them."""
    import openai

    engines = [await sims("vllm", "m", enable_responses_store=True) for _ in range(3)]
    urls = [e.url for e in engines]
    pa, pb = listen_port(), listen_port()
    for name, port in (("a", pa), ("b", pb)):
        (tmp_path / f"{name}.yaml").write_text(config(port, urls, redis_server.url) + "responses: {state: engine}\n")
    clients = [openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="x", max_retries=0,
                                  default_headers={"Connection": "close"}) for p in (pa, pb)]

    async def respond(c: int, text: str, prev: str | None) -> tuple[str, str]:
        raw = await clients[c].responses.with_raw_response.create(
            model="m", input=text, max_output_tokens=4, **({"previous_response_id": prev} if prev else {}))
        return raw.parse().id, raw.headers["target-pod"]

    try:
        async with gateway_process(tmp_path / "a.yaml", pa, "--workers", "2", ready_workers=2), \
                gateway_process(tmp_path / "b.yaml", pb, "--workers", "2", ready_workers=2):
            for port in (pa, pb):
                await until(lambda port=port: redis_up(port), timeout=20)
            prev, holder = await respond(0, "step 0", None)
            for t in (1, 2):
                prev, pod = await respond(t % 2, f"step {t}", prev)
                assert pod == holder
            redis_server.kill()
            with pytest.raises(openai.InternalServerError) as ei:
                await respond(1, "step 3", prev)
            assert ei.value.status_code == 503
            assert ei.value.response.headers["x-error-state-unavailable"] == "true"
            fresh, fresh_holder = await respond(0, "begun while Redis was away", None)
            redis_server.start()
            for port in (pa, pb):
                await until(lambda port=port: redis_up(port), timeout=20)
            for t in (3, 4, 5):
                prev, pod = await respond(t % 2, f"step {t}", prev)
                assert pod == holder
            assert (await clients[1].responses.retrieve(prev)).id == prev
            fresh, pod = await respond(0, "and then?", fresh)
            assert pod == fresh_holder
            pages = [(await get_new(p, "/metrics"))[1] for p in (pa, pb)]
        # each chain's first follow-up after Redis came back; the records of the answers since are in Redis
        assert sum(metric_total(page, "switchyard_responses_state_lookups_total", kind="affinity",
                                result="shared_view") for page in pages) == 2
    finally:
        for cl in clients:
            await cl.close()


@pytest.mark.timeout(120)
async def test_a_session_whose_engine_another_replica_loaded_moves_counted_overloaded_and_stays_where_it_went(
        sims, tmp_path, redis_server):
    """An Anthropic SDK conversation (its session metadata.user_id) over two replicas of two workers:
    requests stuck on its engine through replica a, which b hears of through the shared in-flight
    counts, make b send the next turn elsewhere, counted overloaded; the turns after, on either
    replica, are kept on the engine that now holds the whole conversation."""
    import anthropic

    from routers.session import encode_session_id

    engines = [await sims("vllm", "m") for _ in range(3)]
    urls = [e.url for e in engines]
    pa, pb = listen_port(), listen_port()
    for name, port in (("a", pa), ("b", pb)):
        (tmp_path / f"{name}.yaml").write_text(config(port, urls, redis_server.url).replace(
            "prefix_block_chars: 64", "prefix_block_chars: 64, prefix_imbalance_abs: 2"))
    clients = [anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{p}", api_key="x", max_retries=0,
                                        default_headers={"Connection": "close"}) for p in (pa, pb)]
    messages: list[dict] = []

    async def turn(c: int, text: str) -> str:
        messages.append({"role": "user", "content": text})
        raw = await clients[c].messages.with_raw_response.create(
            model="m", max_tokens=4, messages=messages, metadata={"user_id": "agent-session-7"})
        messages.append({"role": "assistant", "content": (await raw.parse()).content[0].text})
        return raw.headers["target-pod"]

    async def remote(port: int, pod: str) -> set[int]:
        """What each worker of the gateway on ``port`` counts in flight on ``pod`` by other processes."""
        pages = await per_worker(port, 2, "/status.json")
        return {next(ep["remote_in_flight"] for ep in page["endpoints"] if ep["name"] == pod) for page in pages.values()}

    async def counted(outcome: str) -> float:
        pages = [(await get_new(p, "/metrics"))[1] for p in (pa, pb)]
        return sum(metric_total(page, "switchyard_routing_session_total", outcome=outcome) for page in pages)

    async def from_replicas(port: int, source: str = "replica") -> float:
        """The session facts the gateway on ``port`` applied from other replicas (``worker``: from
        its other worker), its workers summed."""
        return metric_total((await get_new(port, "/metrics"))[1], "switchyard_view_facts_applied_total",
                            source=source, kind="session")

    stuck: list[asyncio.Task] = []
    try:
        async with gateway_process(tmp_path / "a.yaml", pa, "--workers", "2", ready_workers=2), \
                gateway_process(tmp_path / "b.yaml", pb, "--workers", "2", ready_workers=2):
            for port in (pa, pb):
                await until(lambda port=port: redis_up(port), timeout=20)
            holder = await turn(0, "Where is train 7?")
            assert [await turn(t % 2, f"And train {t}?") for t in (1, 2)] == [holder, holder]
            pin = {"routing-strategy": "session-affinity", "x-session-id": encode_session_id(holder),
                   "x-sim-fault": "stall_before_first=inf"}
            stuck = [asyncio.create_task(post_new(pa, "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": f"hold {i}"}], "max_tokens": 2}, pin))
                for i in range(4)]
            await until(lambda: _equals(remote(pb, holder), {4}), timeout=20)
            heard, sibling = await from_replicas(pa), await from_replicas(pb, "worker")
            moved = await turn(1, "And train 3?")
            assert moved != holder
            # a's two workers hear from b where the conversation went before a routes a turn of it,
            # and so does b's other worker (the turns on b go to either: each connection is closed)
            await until(lambda: _at_least(from_replicas(pa), heard + 2), timeout=20)
            await until(lambda: _at_least(from_replicas(pb, "worker"), sibling + 1), timeout=20)
            assert (await counted("overloaded"), await counted("kept")) == (1, 2)
            for t in stuck:
                t.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
            await until(lambda: _equals(remote(pb, holder), {0}), timeout=20)
            assert [await turn(t % 2, f"And train {t}?") for t in range(4, 8)] == [moved] * 4
            assert (await counted("overloaded"), await counted("kept")) == (1, 6)
    finally:
        for t in stuck:
            t.cancel()
        for cl in clients:
            await cl.close()


async def _equals(value, expected) -> bool:
    return await value == expected


async def every_worker_up(pid: int, port: int, workers: int) -> bool:
    """Whether every worker of the gateway process ``pid`` has its replica link up."""
    from tests.integration.server.test_workers import children_of, own_metrics, sibling_sockets

    if workers == 1:
        return await redis_up(port)
    sockets = sibling_sockets(children_of(pid))
    try:
        pages = [await own_metrics(path) for path in sockets.values()]
    except (OSError, ValueError, asyncio.IncompleteReadError):     # a socket not answering yet
        return False
    return len(pages) == workers and all(metric_total(p, "switchyard_view_redis_up") == 1 for p in pages)


async def inserts_from_replicas(port: int) -> float:
    """The prefix insertions the gateway on ``port`` applied from other replicas, its workers summed."""
    return metric_total((await get_new(port, "/metrics"))[1], "switchyard_view_facts_applied_total",
                        source="replica", kind="insert")


async def _at_least(value, least: float) -> bool:
    return await value >= least


@pytest.mark.timeout(120)
async def test_a_redis_restart_mid_conversation_is_one_outage_per_replica_and_costs_no_turn(sims, tmp_path, redis_server):
    """Conversations spread over two replicas of two workers go on while Redis is away and after it
    came back empty: every turn answered; each replica counts the outage once in both counters
    (whichever of its workers met it); once it is back the turns of each conversation reach one
    engine again, and the replicas' lag is of what was sent since, not of the outage."""
    engines = [await sims("vllm", "m") for _ in range(4)]
    urls = [e.url for e in engines]
    pa, pb = listen_port(), listen_port()
    for name, port in (("a", pa), ("b", pb)):
        (tmp_path / f"{name}.yaml").write_text(config(port, urls, redis_server.url))
    async with gateway_process(tmp_path / "a.yaml", pa, "--workers", "2", ready_workers=2), \
            gateway_process(tmp_path / "b.yaml", pb, "--workers", "2", ready_workers=2):
        for port in (pa, pb):
            await until(lambda port=port: redis_up(port), timeout=20)
        chats = [opening(f"conversation {c}") for c in range(6)]
        for c, m in enumerate(chats):
            await turn((pa, pb)[c % 2], m, "turn 0: where to?")
        redis_server.kill()
        down = time.monotonic()
        for t in (1, 2):
            for c, m in enumerate(chats):
                await turn((pa, pb)[(c + t) % 2], m, f"turn {t}: and then? " * 3)
        for port in (pa, pb):
            await until(lambda port=port: _lost(port), timeout=20)
            await until(lambda port=port: _state_is(port, 0), timeout=20)
        for c, m in enumerate(chats):
            await turn((pa, pb)[(c + 3) % 2], m, "turn 3: and then? " * 3)
        redis_server.start()
        outage = time.monotonic() - down
        for port in (pa, pb):
            await until(lambda port=port: redis_up(port), timeout=20)
        served = [[await turn((pa, pb)[(c + t) % 2], m, f"turn {t}: and then? " * 3) for t in range(4, 8)]
                  for c, m in enumerate(chats)]
        assert sum(s.count(s[0]) - 1 for s in served) >= 0.95 * len(chats) * 3, served
        for port in (pa, pb):
            # the shared state's sync probes again with a backoff of up to 2 s
            await until(lambda port=port: _state_is(port, 1), timeout=20)
            page = (await get_new(port, "/metrics"))[1]
            assert metric_total(page, "switchyard_view_redis_lost_total") == 1
            assert metric_total(page, "switchyard_state_outages_total") == 1
            # a bound by cause: no batch read since Redis came back waited out the outage
            assert metric_total(page, "switchyard_view_lag_recent_seconds", source="replica", percentile="99") < outage


async def _state_is(port: int, up: int) -> bool:
    """switchyard_state_up is ``up`` (0: down) in every worker of the gateway on ``port`` (the smallest counts)."""
    return metric_total((await get_new(port, "/metrics"))[1], "switchyard_state_up") == up
