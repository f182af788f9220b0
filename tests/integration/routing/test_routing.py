"""Routing through the gateway: session headers round-trip, invalid strategies answer 400."""

from __future__ import annotations

import aiohttp
import orjson

from routers.session import decode_session_id
from tests.support.edge import assert_openai_error, exchange, request
from tests.support.factories import model_block, pd_model, pd_pair, roleset


async def test_session_header_round_trip_through_the_gateway(sims, gateway):
    engines = [await sims("vllm", "m") for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="session-affinity")])
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            sid, pod = r.headers["x-session-id"], r.headers["target-pod"]
        assert decode_session_id(sid) == pod
        for _ in range(5):
            async with s.post(gw.url + "/v1/completions", json=body, headers={"x-session-id": sid}) as r:
                assert r.status == 200 and r.headers["target-pod"] == pod and r.headers["x-session-id"] == sid
        pods = set()
        for _ in range(3):
            async with s.post(gw.url + "/v1/completions", json=body, headers={"x-session-key": "chat-9"}) as r:
                pods.add(r.headers["target-pod"])
        assert len(pods) == 1


async def test_invalid_strategy_is_400_through_the_gateway(sims, gateway):
    e = await sims("vllm", "m")
    f = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url, f.url])])
    async with aiohttp.ClientSession() as s:
        for spec in ("invalid-routing-strategy", "least-request:1,invalid-strategy:2"):
            async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                              headers={"routing-strategy": spec}) as r:
                assert r.status == 400 and r.headers["x-error-routing"] == "true"
        async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                          headers={"routing-strategy": "prefix-cache:3,least-request:2,least-kv-cache:2"}) as r:
            assert r.status == 200


async def test_a_weight_of_thousands_of_digits_is_an_invalid_strategy_not_a_gateway_error(sims, gateway):
    """A weight is an integer 0..1,000,000: one written with more digits than Python converts (4300)
    is as invalid as one past the bound, a 400 naming the header, and nothing is counted a gateway
    bug. Leading zeros keep a weight in bounds."""
    e = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url])])
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        for spec in ("prefix-cache:" + "9" * 5000, "least-request:1,prefix-cache:" + "1" * 4301,
                     "least-request:" + "0" * 4400 + "1000001"):
            async with s.post(gw.url + "/v1/completions", json=body, headers={"routing-strategy": spec}) as r:
                got = await r.json()
                assert r.status == 400 and r.headers["x-error-routing"] == "true", got
                assert got["error"]["param"] == "routing-strategy" and got["error"]["type"] == "invalid_request_error"
        async with s.post(gw.url + "/v1/completions", json=body,
                          headers={"routing-strategy": "least-request:" + "0" * 5000 + "2,prefix-cache:1"}) as r:
            assert r.status == 200, await r.text()
    assert "switchyard_internal_errors_total 0.0" in await gw.metrics_text()


def _label_values(page: str, metric: str) -> set[str]:
    return {line.split('strategy="')[1].split('"')[0] for line in page.splitlines() if line.startswith(metric + "{")}


async def test_every_spelling_of_a_strategy_is_one_log_value_and_one_header_and_its_names_one_label(sims, gateway):
    e = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url])])
    spellings = {"least-request": "least-request", "Least-Request": "least-request",
                 " LEAST-REQUEST ": "least-request", "least-request:7": "least-request",
                 "least-request,random:0": "least-request",
                 "Prefix-Cache:4, least-request:2": "prefix-cache:2,least-request",
                 "prefix-cache:2,least-request:1": "prefix-cache:2,least-request"}
    async with aiohttp.ClientSession() as s:
        for spec, canonical in spellings.items():
            async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                              headers={"routing-strategy": spec}) as r:
                assert r.status == 200 and r.headers["routing-strategy"] == canonical, spec
        async with s.get(gw.url + "/metrics") as r:
            page = await r.text()
    labels = _label_values(page, "switchyard_requests_total")
    assert labels == {"least-request", "least-request,prefix-cache"}
    assert _label_values(page, "switchyard_routing_decision_seconds_count") == labels


async def test_weights_and_order_a_client_varies_make_no_strategy_label_of_their_own(sims, gateway):
    e = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url])])
    specs = [f"prefix-cache:{i},least-request:{i + 1}" for i in range(1, 31)]
    specs += [f"least-request:{i + 1},prefix-cache:{i}" for i in range(1, 11)]
    seen = set()
    async with aiohttp.ClientSession() as s:
        for spec in specs:
            async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                              headers={"routing-strategy": spec, "x-slo-ttft-ms": "60000"}) as r:
                assert r.status == 200
                seen.add(r.headers["routing-strategy"])      # the answer still says which weights routed
        async with s.get(gw.url + "/metrics") as r:
            page = await r.text()
    assert len(seen) == len(specs)
    for metric in ("switchyard_requests_total", "switchyard_routing_decision_seconds_count",
                   "switchyard_slo_routing_requests_total"):
        assert _label_values(page, metric) == {"least-request,prefix-cache"}, metric


async def test_the_log_line_says_why_a_decision_kept_a_session(sims, gateway):
    """A decision with a reason of its own (a session kept on the endpoint of its last turn) names it
    in the request's log line, ``route_reason``; a plain decision adds nothing."""
    e, f = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url, f.url])], routing={"strategy": "prefix-cache"})
    body = {"model": "m", "prompt": "a turn of a conversation", "max_tokens": 1}
    with gw.gw.request_log.capture() as logs:
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(gw.url + "/v1/completions", json=body, headers={"x-session-key": "chat-1"}) as r:
                    assert r.status == 200
            async with s.post(gw.url + "/v1/completions", json=body, headers={"routing-strategy": "random"}) as r:
                assert r.status == 200
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("route_reason") for x in lines] == [None, "session", "session", None]


async def test_a_whole_request_strategy_named_for_a_prefill_decode_model_is_400(sims, gateway):
    """A model whose endpoints are all prefill and decode ones is routed only by pd: a header that
    names another strategy is the client's error, a 400 naming the header (an SDK does not retry
    it), not a 503 with Retry-After that no retry would ever get past."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        for spec in ("least-request", "prefix-cache:2,least-request"):
            async with s.post(gw.url + "/v1/completions", json=body, headers={"routing-strategy": spec}) as r:
                got = await r.json()
                assert r.status == 400 and r.headers["x-error-routing"] == "true", got
                assert "Retry-After" not in r.headers
                assert got["error"]["code"] == "invalid_routing_strategy" and got["error"]["param"] == "routing-strategy"
                assert "pd" in got["error"]["message"]
        for headers in ({}, {"routing-strategy": "pd"}):
            async with s.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200 and r.headers["routing-strategy"] == "pd"


async def test_pd_spreads_requests_over_equal_prefills_and_decodes(sims, gateway):
    """Equal prefills and equal decodes (idle between requests, no prefix in common, the decodes
    scored by their running requests) are picked at random, as AIBrix's shuffled pod list does: one
    request at a time, every one went to the first prefill and the first decode listed."""
    p1, p2 = [await sims("vllm", "m", role="prefill") for _ in range(2)]
    d1, d2 = [await sims("vllm", "m", role="decode") for _ in range(2)]
    gw = await gateway([pd_model("vllm", [{"name": "rs-1", "prefill": [p1.url, p2.url], "decode": [d1.url, d2.url]}])],
                       pd={"decode_score_policy": "least_request"})
    prefills, decodes = set(), set()
    async with aiohttp.ClientSession() as s:
        for i in range(24):             # all on one prefill (or one decode) at random: 2 in 2^24
            body = {"model": "m", "prompt": f"request {i}", "max_tokens": 1}
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["routing-strategy"] == "pd"
                prefills.add(r.headers["prefill-target-pod"])
                decodes.add(r.headers["target-pod"])
    assert len(prefills) == 2 and len(decodes) == 2, (prefills, decodes)


async def test_a_routing_strategy_header_sent_twice_with_two_strategies_is_400_on_the_fast_lane_and_off_it(
        sims, gateway):
    """A request carrying two ``routing-strategy`` lines (a client's own and one a proxy added, say)
    that name two strategies is refused, a 400 naming the header, rather than routed by whichever
    line a reader takes first; lines that name one strategy (spelt alike or not, a weighted list in
    another order) route by it, as does one line beside an empty one; a model whose strategy is
    locked reads none of them. The
    same on the fast lane and on aiohttp's path (a query string leaves the request to it)."""
    e, f, g = await sims("vllm", "m"), await sims("vllm", "m"), await sims("vllm", "locked")
    gw = await gateway([model_block("m", "vllm", [e.url, f.url]),
                        model_block("locked", "vllm", [g.url], lock_strategy="round-robin")])
    edge = gw.runner.server.edge
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})

    def twice(target: str, first: str, second: str) -> bytes:
        raw = request("POST", target, body)
        return raw.replace(b"\r\n\r\n", f"\r\nrouting-strategy: {first}\r\nRouting-Strategy: {second}\r\n\r\n".encode(), 1)

    for target in ("/v1/chat/completions", "/v1/chat/completions?x=1"):
        for first, second in (("random", "least-request"), ("least-request", "random"),
                              ("prefix-cache:2,least-request", "least-request")):
            lane = edge.lane_requests
            ex = await exchange(gw.port, twice(target, first, second), until_close=False, responses=1)
            err = assert_openai_error(ex.first, 400)
            assert err["type"] == "invalid_request_error" and err["param"] == "routing-strategy", (target, err)
            assert err["code"] == "invalid_routing_strategy" and "routing-strategy" in err["message"], err
            assert ex.first.headers["x-error-routing"] == "true"
            assert (edge.lane_requests - lane) == (0 if "?" in target else 1), target
        for first, second, canonical in (("random", "random", "random"), ("Random", " random ", "random"),
                                         ("random", "", "random"),     # an empty line names none
                                         ("prefix-cache:4,least-request:2", "least-request,prefix-cache:2",
                                          "prefix-cache:2,least-request")):
            ex = await exchange(gw.port, twice(target, first, second), until_close=False, responses=1)
            assert ex.first.status == 200, ex.first.body
            assert ex.first.headers["routing-strategy"] == canonical, (target, first, second)
        # a model whose strategy is locked reads no header: its lines, however many, change nothing
        locked = body.replace(b'"model":"m"', b'"model":"locked"')
        for first, second in (("random", "least-request"), ("no-such-strategy", "random")):
            raw = twice(target, first, second).replace(body, locked).replace(
                f"Content-Length: {len(body)}".encode(), f"Content-Length: {len(locked)}".encode())
            ex = await exchange(gw.port, raw, until_close=False, responses=1)
            assert ex.first.status == 200 and ex.first.headers["routing-strategy"] == "round-robin", ex.first.body


async def test_a_caller_header_sent_twice_with_two_values_is_400_on_the_fast_lane_and_off_it(sims, gateway):
    """``user``, ``x-session-id``, ``x-session-key`` and ``x-aibrix-session-key`` name one caller or
    session each: two lines of one of them naming two values (a client's own and one a proxy
    added, say) are refused, a 400 naming the header, rather than routed and accounted by whichever
    line a reader takes first; the same value twice is served. On every API's parser, on the fast
    lane and on aiohttp's path (a query string leaves the request to it)."""
    e, f = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url, f.url], strategy="session-affinity")])
    edge = gw.runner.server.edge
    msgs = [{"role": "user", "content": "hi"}]
    bodies = {"/v1/chat/completions": {"model": "m", "messages": msgs, "max_tokens": 1},
              "/v1/messages": {"model": "m", "messages": msgs, "max_tokens": 1},
              "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 1}}

    def twice(target: str, body: bytes, name: str, first: str, second: str) -> bytes:
        raw = request("POST", target, body)
        return raw.replace(b"\r\n\r\n", f"\r\n{name}: {first}\r\n{name.title()}: {second}\r\n\r\n".encode(), 1)

    for path, data in bodies.items():
        body = orjson.dumps(data)
        for target in (path, path + "?x=1"):
            for name in ("user", "x-session-id", "x-session-key", "x-aibrix-session-key"):
                lane = edge.lane_requests
                ex = await exchange(gw.port, twice(target, body, name, "alice", "bob"), until_close=False,
                                    responses=1)
                assert ex.first.status == 400, (target, name, ex.first.status, ex.first.body[:300])
                err = orjson.loads(ex.first.body)["error"]      # Anthropic's shape nests it too
                assert err["type"] == "invalid_request_error", (target, name, err)
                assert name in err["message"], (target, err)
                if path != "/v1/messages":
                    assert err["param"] == name, (target, err)
                assert (edge.lane_requests - lane) == (0 if "?" in target else 1), target
                ex = await exchange(gw.port, twice(target, body, name, "alice", "alice"), until_close=False,
                                    responses=1)
                assert ex.first.status == 200, (target, name, ex.first.body[:300])


async def test_every_routing_strategy_400_echoes_the_strategy_it_refused(sims, gateway):
    """An unknown name, and lines naming different strategies, are each a 400 with
    ``x-error-routing: true`` and the refused strategy in the answer's ``routing-strategy``: for
    several lines, the first line's, spelt as routing spells it."""
    e = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [e.url])])
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/completions", json=body, headers={"routing-strategy": "bogus"}) as r:
            assert r.status == 400 and r.headers["routing-strategy"] == "bogus"
        lines = [("routing-strategy", "Prefix-Cache:2, least-request:4"), ("routing-strategy", "random")]
        async with s.post(gw.url + "/v1/completions", json=body, headers=lines) as r:
            got = await r.json()
            assert r.status == 400 and r.headers["x-error-routing"] == "true", got
            assert got["error"]["param"] == "routing-strategy" and "different strategies" in got["error"]["message"]
            assert r.headers.getall("routing-strategy") == ["prefix-cache,least-request:2"], dict(r.headers)
