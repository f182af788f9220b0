"""slo through the gateway: after a warm-up on engines of very different speed, a tight TTFT
objective goes to the fast engine and a loose one is packed on the slow one."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import aiohttp
import orjson

from enginesim.server import start_sim
from tests.support.factories import model_block, pd_model, pd_pair, roleset
from tests.support.waiting import until


async def _stream(s: aiohttp.ClientSession, url: str, text: str, headers: dict[str, str],
                  max_tokens: int = 4) -> tuple[int, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": True}
    async with s.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                      headers={"Content-Type": "application/json", **headers}) as r:
        await r.read()
        return r.status, r.headers.get("target-pod", "")


async def test_a_tight_ttft_goes_to_the_fast_engine_once_the_gateway_has_learnt_them(sims, gateway):
    fast = await sims("vllm", "m", ttft_base_ms=5, prefill_ms_per_token=0.05, itl_ms=2)
    slow = await sims("vllm", "m", ttft_base_ms=200, prefill_ms_per_token=1.0, itl_ms=20)
    gw = await gateway([model_block("m", "vllm", [fast.url, slow.url], strategy="slo")],
                       routing={"slo_min_samples": 4, "slo_exploration": 0.0})
    fast_pod, slow_pod = (e.url.removeprefix("http://") for e in (fast, slow))
    words = " ".join(f"w{i}" for i in range(150))
    async with aiohttp.ClientSession() as s:
        # warm-up: round-robin traffic; the latency models learn from every strategy's requests
        for i in range(10):
            status, _ = await _stream(s, gw.url, f"{i} warm-up {words}", {"routing-strategy": "round-robin"})
            assert status == 200
        model = gw.gw.routing.ctx.latency
        assert all(model.samples(ep)[0] >= 4 for ep in gw.gw.pool.endpoints("m"))
        for i in range(6):
            status, pod = await _stream(s, gw.url, f"{i} tight {words}", {"x-slo-ttft-ms": "120"})
            assert (status, pod) == (200, fast_pod)
        for i in range(3):
            status, pod = await _stream(s, gw.url, f"{i} loose {words}", {"x-slo-ttft-ms": "5000"})
            assert (status, pod) == (200, slow_pod)                 # packed: the fast engine stays free
        status, _ = await _stream(s, gw.url, "bad", {"x-slo-ttft-ms": "soon"})
        assert status == 400
    text = await gw.metrics_text()
    assert 'switchyard_slo_routing_decisions_total{model="m",reason="slo_feasible"} 9.0' in text
    assert 'switchyard_slo_routing_requests_total{model="m",result="met",strategy="slo"} 9.0' in text
    assert 'switchyard_slo_routing_prediction_error_ratio_count{model="m",objective="ttft"}' in text


async def test_an_engine_seen_slow_a_while_ago_is_judged_by_what_it_shows_now(sims, gateway):
    """a stalls 0.2 s before its first token while the gateway learns it, then stops. Its two slow
    observations are ten half-lives old when a fresh one shows it fast: spread sends the next
    request to a (about 5 ms), not to b (120 ms) on what a showed before."""
    a = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2)
    b = await sims("vllm", "m", ttft_base_ms=120, itl_ms=2)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="slo")],
                       routing={"slo_min_samples": 2, "slo_exploration": 0.0, "slo_select": "spread",
                                "slo_half_life_s": 0.04})
    a_pod, b_pod = (e.url.removeprefix("http://") for e in (a, b))
    rr = {"routing-strategy": "round-robin"}
    async with aiohttp.ClientSession() as s:
        async with s.post(a.url + "/_sim/config", json={"fault": "stall_before_first=0.2"}) as r:
            assert r.status == 200
        for i in range(4):                      # two observations of each
            assert (await _stream(s, gw.url, f"{i} warm-up", rr))[0] == 200
        assert await _stream(s, gw.url, "slow a", {"x-slo-ttft-ms": "2000"}) == (200, b_pod)
        async with s.post(a.url + "/_sim/config", json={"fault": "none"}) as r:
            assert r.status == 200
        await asyncio.sleep(0.4)
        pods = {(await _stream(s, gw.url, f"{i} after", rr))[1] for i in range(2)}     # one more of each
        assert pods == {a_pod, b_pod}
        assert await _stream(s, gw.url, "fast a", {"x-slo-ttft-ms": "2000"}) == (200, a_pod)


async def test_an_engine_no_request_observes_is_sent_one_to_see_it_again(sims, gateway):
    """Without exploration and with every request carrying objectives, nothing but the model's own
    choices reaches an engine: a, seen slow, would never be sent a request again after it recovers.
    Once neither has been observed for slo_reobserve_s, the next request goes to the one observed
    longest ago (a), the one after to b, and a's fresh observation then outweighs what it showed
    before: it is predicted the faster of the two."""
    a = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2)
    b = await sims("vllm", "m", ttft_base_ms=120, itl_ms=2)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="slo")],
                       routing={"slo_min_samples": 2, "slo_exploration": 0.0, "slo_select": "spread",
                                "slo_half_life_s": 0.04, "slo_reobserve_s": 0.5})
    a_pod, b_pod = (e.url.removeprefix("http://") for e in (a, b))
    slo = {"x-slo-ttft-ms": "2000"}
    async with aiohttp.ClientSession() as s:
        async with s.post(a.url + "/_sim/config", json={"fault": "stall_before_first=0.2"}) as r:
            assert r.status == 200
        for i in range(4):                      # two observations of each
            assert (await _stream(s, gw.url, f"{i} warm-up", {"routing-strategy": "round-robin"}))[0] == 200
        assert await _stream(s, gw.url, "slow a", slo) == (200, b_pod)
        async with s.post(a.url + "/_sim/config", json={"fault": "none"}) as r:
            assert r.status == 200
        await asyncio.sleep(0.6)
        pods = [(await _stream(s, gw.url, f"{i} after", slo))[1] for i in range(3)]
        # a, observed longest ago; then b; then a, re-observed or now predicted the faster
        assert pods == [a_pod, b_pod, a_pod]
    model = gw.gw.routing.ctx.latency
    ep_a, ep_b = sorted(gw.gw.pool.endpoints("m"), key=lambda e: e.url != a.url)
    ttft_a = model.predict(ep_a, model.features(10, ep_a, 0.0))[0]
    ttft_b = model.predict(ep_b, model.features(10, ep_b, 0.0))[0]
    assert ttft_a is not None and ttft_b is not None and ttft_a < 60 < ttft_b
    text = await gw.metrics_text()
    assert 'switchyard_slo_routing_decisions_total{model="m",reason="slo_reobserve"}' in text


async def _occupy(s: aiohttp.ClientSession, url: str, n: int) -> list[asyncio.Task]:
    """``n`` streams sent to the engine at ``url`` itself (another gateway's), each held after its first token."""
    async def one(i: int) -> None:
        with contextlib.suppress(aiohttp.ClientError):
            await _stream(s, url, f"held {i}", {"x-sim-fault": "stall_after=1:inf"}, max_tokens=50)
    return [asyncio.create_task(one(i)) for i in range(n)]


async def test_a_restarted_engine_is_not_judged_by_the_batch_it_ran_before(sims, gateway):
    """a ran 8 requests at once before it was restarted with room for 2. Once the gateway has
    scraped it running 2 with 2 waiting (another gateway's), a request sent there would wait for
    three slots to free, each at a's service time (about 0.3 s): spread sends it to b (about 0.15 s
    to its first token), not to a on the batch of 8 its previous process ran, under which the 4
    would all be running and a predicted as fast as when idle."""
    a = await sims("vllm", "m", ttft_base_ms=5, itl_ms=25, max_num_seqs=16)
    b = await sims("vllm", "m", ttft_base_ms=150, itl_ms=2)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="slo")],
                       routing={"slo_min_samples": 2, "slo_exploration": 0.0, "slo_select": "spread"})
    b_pod = b.url.removeprefix("http://")
    ep_a = next(e for e in gw.gw.pool.endpoints("m") if e.url == a.url)
    restarted = None
    held: list[asyncio.Task] = []
    async with aiohttp.ClientSession() as s:
        try:
            held = await _occupy(s, a.url, 8)
            await until(lambda: ep_a.metrics is not None and ep_a.metrics.running == 8)
            for i in range(4):          # two observations of each, a's streams 0.3 s from first token to last
                status, _ = await _stream(s, gw.url, f"{i} warm-up", {"routing-strategy": "round-robin"},
                                          max_tokens=12)
                assert status == 200
            for t in held:
                t.cancel()
            await until(lambda: time.time() - a.engine.started_at > 1.5, timeout=5)  # a start told apart
            await a.close()
            restarted = await start_sim(dataclasses.replace(a.cfg, port=a.port, max_num_seqs=2))
            held = await _occupy(s, a.url, 4)
            await until(lambda: ep_a.metrics.start_time == restarted.engine.started_at
                        and ep_a.metrics.running == 2 and ep_a.metrics.waiting == 2)
            try:
                routed = await asyncio.wait_for(_stream(s, gw.url, "now", {"x-slo-ttft-ms": "2000"}), 5)
            except TimeoutError:
                routed = (0, "a: waiting behind the held streams, which never end")
            assert routed == (200, b_pod)
        finally:
            for t in held:
                t.cancel()
            if restarted is not None:
                await restarted.close()


async def test_a_client_that_leaves_mid_stream_is_counted_cancelled_not_failed(sims, gateway):
    """A client that closes its stream after the first chunk says nothing of whether the engine met
    the objective: counted ``cancelled``, as the gateway's other outcomes name a client's departure,
    not ``failed`` (an error answer)."""
    sim = await sims("vllm", "m", ttft_base_ms=5, itl_ms=50)
    gw = await gateway([model_block("m", "vllm", [sim.url], strategy="slo")])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", "x-slo-ttft-ms": "5000"})
        assert r.status == 200
        assert await r.content.readany()
        r.close()                                                   # the client leaves mid-stream

    async def counted() -> str | None:
        text = await gw.metrics_text()
        return text if "switchyard_slo_routing_requests_total{" in text else None

    text = await until(counted, timeout=10)
    assert 'switchyard_slo_routing_requests_total{model="m",result="cancelled",strategy="slo"} 1.0' in text
    assert 'result="failed"' not in text


async def test_a_client_that_leaves_after_its_first_tokens_teaches_the_ttft_it_saw(sims, gateway):
    """A stream whose client leaves after its first token had a real time to first token: the
    engine's latency model learns it, though not a time per token from that one token. A stream
    left after 12 tokens teaches both: its TPOT, from its first token to the last one relayed, is
    as meaningful as a whole answer's. Before, a stream its client left taught nothing."""
    sim = await sims("vllm", "m", ttft_base_ms=5, itl_ms=5)
    gw = await gateway([model_block("m", "vllm", [sim.url], strategy="slo")])
    model = gw.gw.routing.ctx.latency
    ep = gw.gw.pool.endpoints("m")[0]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}

    async def left_after(s: aiohttp.ClientSession, tokens: int, cancelled: int) -> None:
        r = await s.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", "x-slo-ttft-ms": "5000",
                                  "x-sim-fault": f"stall_after={tokens}:inf"})
        assert r.status == 200
        seen = 0
        while seen < tokens:                                        # the engine then stalls
            line = await r.content.readline()
            seen += b'"content":"' in line and b'"content":""' not in line    # a token (not the role's chunk)
        r.close()                                                   # the client leaves

        async def counted() -> bool:
            return f'result="cancelled",strategy="slo"}} {cancelled}.0' in await gw.metrics_text()
        await until(counted, timeout=10)

    async with aiohttp.ClientSession() as s:
        await left_after(s, 1, 1)
        assert model.samples(ep) == (1, 0)
        await left_after(s, 12, 2)
        assert model.samples(ep) == (2, 1)


async def test_an_engine_whose_reobserving_request_it_refused_is_sent_the_next_one(sims, gateway):
    """a, seen slow, is sent a request to observe it once slo_reobserve_s has passed; a refuses it
    (429: busy), and the retry takes it to b. a was observed no more than before, so the next
    request with objectives goes to a again. Before, a was passed over for another slo_reobserve_s,
    as if it had been observed, and the next request went to b on a's old prediction."""
    a = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2)
    b = await sims("vllm", "m", ttft_base_ms=120, itl_ms=2)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="slo")],
                       routing={"slo_min_samples": 2, "slo_exploration": 0.0, "slo_select": "spread",
                                "slo_half_life_s": 0.04, "slo_reobserve_s": 0.5})
    a_pod, b_pod = (e.url.removeprefix("http://") for e in (a, b))
    slo = {"x-slo-ttft-ms": "2000"}
    async with aiohttp.ClientSession() as s:
        async def sim(url: str, fault: str) -> None:
            async with s.post(url + "/_sim/config", json={"fault": fault}) as r:
                assert r.status == 200
        await sim(a.url, "stall_before_first=0.2")
        for i in range(4):                      # two observations of each
            assert (await _stream(s, gw.url, f"{i} warm-up", {"routing-strategy": "round-robin"}))[0] == 200
        assert await _stream(s, gw.url, "slow a", slo) == (200, b_pod)
        await sim(a.url, "status=429")
        await asyncio.sleep(0.6)
        assert await _stream(s, gw.url, "refused by a", slo) == (200, b_pod)     # a's 429, retried on b
        await sim(a.url, "none")
        assert await _stream(s, gw.url, "next", slo) == (200, a_pod)
    text = await gw.metrics_text()
    assert 'switchyard_retries_total{' in text


async def test_a_stream_its_engine_cut_after_its_first_token_teaches_the_ttft_it_saw(sims, gateway):
    """A stream whose engine breaks it after its first token (the connection reset, an in-stream
    error event, the idle watchdog's fire) had a real time to first token: the endpoint's latency
    model learns it, and a time per token from 8 tokens on, up to the last one relayed (not the
    stall the watchdog ended). That the engine breaks streams is its breaker's business. Before,
    such a stream taught nothing."""
    sim = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2)
    gw = await gateway([model_block("m", "vllm", [sim.url], strategy="slo")],
                       watchdog={"aggregated": True, "idle_timeout_s": 0.5})
    model = gw.gw.routing.ctx.latency
    ep = gw.gw.pool.endpoints("m")[0]
    async with aiohttp.ClientSession() as s:
        for fault, samples in (("drop_after=12", (1, 1)), ("error_after=1", (2, 1)), ("stall_after=10:inf", (3, 2))):
            status, _ = await _stream(s, gw.url, fault, {"x-slo-ttft-ms": "5000", "x-sim-fault": fault},
                                      max_tokens=20)
            assert status == 200
            await until(lambda samples=samples: model.samples(ep) == samples, timeout=5)
    text = await gw.metrics_text()
    assert 'switchyard_slo_routing_requests_total{model="m",result="failed",strategy="slo"} 3.0' in text


async def test_a_stream_continued_on_another_engine_teaches_the_first_engine_its_ttft(sims, gateway):
    """A stream whose engine broke after 4 tokens goes on on another (migration_limit). Its first
    token came from the first engine, whose model learns that TTFT; not a time per token, which the
    two engines' tokens and the gap between them make; the engine that continued it learns nothing
    (its first token was not the answer's). Before, the continuation's decision took the place of
    the first leg's, its TTFT came out negative and was dropped: neither learnt anything."""
    a = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2, fault="drop_after=4")
    b = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="round-robin", migration_limit=1)])
    model = gw.gw.routing.ctx.latency
    ep_a, ep_b = sorted(gw.gw.pool.endpoints("m"), key=lambda e: e.url != a.url)
    async with aiohttp.ClientSession() as s:
        assert await _stream(s, gw.url, "broken on a", {"x-slo-ttft-ms": "5000"}, max_tokens=12) == (
            200, a.url.removeprefix("http://"))                     # the head came from a
    await until(lambda: model.samples(ep_a) == (1, 0), timeout=5)
    assert model.samples(ep_b) == (0, 0)
    assert 'switchyard_migrations_total{model="m",outcome="continued",reason="broken"} 1.0' in await gw.metrics_text()



async def test_a_disaggregated_request_is_counted_by_its_objectives_and_teaches_neither_endpoint(sims, gateway):
    """A P/D pair's latency is two endpoints': neither learns anything from a disaggregated
    request, nor from one the pd strategy ran whole on the decode (a short prompt), nor from one
    whose decode broke and which another pair continued (and which broke again: the limit). Each
    request with objectives is counted by what its client saw, as every strategy's. Before, a
    request the pd strategy routed was never counted in switchyard_slo_routing_requests_total."""
    p1, d1 = await pd_pair(sims, "vllm", ttft_base_ms=5, itl_ms=2)
    p2, d2 = await pd_pair(sims, "vllm", ttft_base_ms=5, itl_ms=2)
    gw = await gateway([pd_model("vllm", [roleset("vllm", p1, d1), roleset("vllm", p2, d2, name="rs-2")],
                                 migration_limit=1, pd={"disaggregate_min_prompt_tokens": 100})])
    words = " ".join(f"w{i}" for i in range(150))
    slo = {"x-slo-ttft-ms": "5000"}
    async with aiohttp.ClientSession() as s:
        for text, headers in ((words, slo), ("short", slo),
                              (f"broken {words}", {**slo, "x-sim-fault": "decode.drop_after=3"})):
            assert (await _stream(s, gw.url, text, headers, max_tokens=8))[0] == 200

    async def counted() -> str | None:
        text = await gw.metrics_text()
        return text if 'switchyard_slo_routing_requests_total{model="m",result="failed",strategy="pd"}' in text else None

    text = await until(counted, timeout=5)
    assert 'switchyard_slo_routing_requests_total{model="m",result="met",strategy="pd"} 2.0' in text
    assert 'switchyard_slo_routing_requests_total{model="m",result="failed",strategy="pd"} 1.0' in text
    assert 'switchyard_pd_decisions_total{mode="decode",model="m",reason="short_prompt"} 1.0' in text
    assert 'switchyard_migrations_total{model="m",outcome="continued",reason="broken"} 1.0' in text
    model = gw.gw.routing.ctx.latency
    assert [model.samples(ep) for ep in gw.gw.pool.endpoints("m")] == [(0, 0)] * 4
    assert not gw.gw.routing.slo.pending


async def test_a_stream_no_other_engine_would_continue_teaches_as_its_engine_cut_it(sims, gateway):
    """The engine that was to continue a broken stream refused it (503): the stream ended on its
    first leg, cut by its engine after 12 tokens, and teaches that endpoint its TTFT and its time
    per token, as any stream its engine cut. Before, the refused continuation's decision kept it
    from teaching a time per token."""
    a = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2, fault="drop_after=12")
    b = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2, fault="status=503")
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="round-robin", migration_limit=1)])
    model = gw.gw.routing.ctx.latency
    ep_a, ep_b = sorted(gw.gw.pool.endpoints("m"), key=lambda e: e.url != a.url)
    async with aiohttp.ClientSession() as s:
        assert (await _stream(s, gw.url, "broken on a", {"x-slo-ttft-ms": "5000"}, max_tokens=20))[0] == 200
    await until(lambda: model.samples(ep_a) != (0, 0), timeout=5)
    assert model.samples(ep_a) == (1, 1) and model.samples(ep_b) == (0, 0)
    assert 'switchyard_migrations_total{model="m",outcome="failed",reason="broken"} 1.0' in await gw.metrics_text()


async def test_two_requests_giving_one_x_request_id_are_each_counted_by_their_own_objectives(sims, gateway):
    """A request id is the client's to give (``x-request-id``), and two clients may give the same
    one: each request is still counted, and learnt from, as itself. Here a held stream and a short
    one share an id; the short one ends first, the held one when its client leaves."""
    sim = await sims("vllm", "m", ttft_base_ms=5, itl_ms=2)
    gw = await gateway([model_block("m", "vllm", [sim.url], strategy="slo")])
    same = {"x-request-id": "dup-1", "x-slo-ttft-ms": "5000"}
    body = {"model": "m", "messages": [{"role": "user", "content": "held"}], "max_tokens": 50, "stream": True}
    async with aiohttp.ClientSession() as s:
        held = await s.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Content-Type": "application/json", "x-sim-fault": "stall_after=1:inf", **same})
        assert held.status == 200
        assert await held.content.readany()                         # decided, its first token relayed
        assert (await _stream(s, gw.url, "short", same))[0] == 200  # decided after it, ended before it
        held.close()                                                # its client leaves

    async def counted() -> str | None:
        text = await gw.metrics_text()
        return text if 'result="cancelled"' in text else None

    text = await until(counted, timeout=10)
    assert 'switchyard_slo_routing_requests_total{model="m",result="met",strategy="slo"} 1.0' in text
    assert 'switchyard_slo_routing_requests_total{model="m",result="cancelled",strategy="slo"} 1.0' in text
