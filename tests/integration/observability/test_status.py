"""``GET /status.json`` on a real gateway: its schema (docs/status.schema.json), what traffic does to
it, and who may read it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import aiohttp
import jsonschema
import redis.asyncio as aioredis
import structlog.testing

from tests.support.factories import model_block, pd_pair, roleset
from tests.support.http import chat_body, post
from tests.support.status import ADMIN, CHAT, chat
from tests.support.waiting import wait_for

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "docs" / "status.schema.json").read_text())
ALICE = "sk-alice-0123456789"


async def get(gw, path: str = "/status.json", token: str | None = None) -> tuple[int, dict, object]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.get(gw.url + path, headers=headers) as r:
        body = await r.read()
        data = json.loads(body) if r.content_type == "application/json" else body
        return r.status, dict(r.headers), data


async def status(gw, token: str | None = None) -> dict:
    code, headers, doc = await get(gw, token=token)
    assert code == 200, doc
    assert headers["Cache-Control"] == "no-store"
    jsonschema.validate(doc, SCHEMA)
    return doc


def by(items: list[dict], **match) -> dict:
    found = [i for i in items if all(i.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, items)
    return found[0]


async def test_the_document_follows_traffic_and_matches_its_schema(sims, gateway):
    a1, a2 = await sims("vllm", "llama"), await sims("vllm", "llama")
    q = await sims("sglang", "qwen")
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([model_block("llama", "vllm", [a1.url, a2.url]), model_block("qwen", "sglang", [q.url]),
                        {"name": "m", "engine": "vllm", "rolesets": [roleset("vllm", p, d)]}])
    doc = await status(gw)
    assert [m["name"] for m in doc["models"]] == ["llama", "qwen", "m"]
    assert {(e["model"], e["name"], e["role"]) for e in doc["endpoints"]} == {
        ("llama", a1.url[7:], "aggregated"), ("llama", a2.url[7:], "aggregated"), ("qwen", q.url[7:], "aggregated"),
        ("m", p.url[7:], "prefill"), ("m", d.url[7:], "decode")}
    assert doc["rolesets"] == [{"model": "m", "name": "rs-1", "prefill": [p.url[7:]], "decode": [d.url[7:]],
                                "combined": [], "ready": True}]
    assert by(doc["models"], name="m")["strategy"] == "pd" and by(doc["models"], name="m")["pd"]
    assert doc["totals"]["requests_since_start"] == 0 and doc["routing"]["recent"] == []

    for i in range(3):
        assert await chat(gw, "llama", stream=True, rid=f"llama-{i}") == 200
    assert await chat(gw, "qwen", rid="qwen-0") == 200
    assert await chat(gw, "m", stream=True, rid="pd-0") == 200
    assert await chat(gw, "llama", rid="vtc-0", headers={"routing-strategy": "vtc-basic"}) == 200
    assert await chat(gw, "no-such-model", rid="missing-0") == 404
    assert await chat(gw, "qwen", rid="fault-0", headers={"x-sim-fault": "status=500"}) == 500

    doc = await status(gw)
    llama = by(doc["models"], name="llama")
    assert llama["minute"]["requests"] == 4 and llama["minute"]["errors"] == 0
    assert llama["minute"]["ttft_count"] == 3 and 0 < llama["minute"]["ttft_p50_ms"] <= llama["minute"]["ttft_p99_ms"]
    assert llama["minute"]["e2e_p50_ms"] > 0 and llama["minute"]["rps"] > 0
    assert llama["minute"]["tokens_per_s"] > 0 and sum(llama["series"]) == 4 and len(llama["series"]) == 30
    assert by(doc["models"], name="qwen")["minute"] == {**by(doc["models"], name="qwen")["minute"], "requests": 2, "errors": 1}
    assert doc["totals"]["minute"]["requests"] == 8 and doc["totals"]["minute"]["errors"] == 2
    assert doc["totals"]["requests_since_start"] == 8

    recent = doc["routing"]["recent"]
    assert [r["request_id"] for r in recent][:2] == ["fault-0", "vtc-0"]      # newest first; no decision for a 404
    pd = by(recent, request_id="pd-0")
    assert pd["strategy"] == "pd" and pd["endpoint"] == d.url[7:] and pd["prefill_endpoint"] == p.url[7:]
    assert pd["uncached_tokens"] > 0
    assert by(recent, request_id="vtc-0")["fallbacks"] == [{"strategy": "vtc-basic", "reason": "no_user"}]
    assert by(recent, request_id="llama-0")["fallbacks"] == [] and by(recent, request_id="llama-0")["prefill_endpoint"] is None
    assert {"strategy": "vtc-basic", "reason": "no_user", "count": 1} in doc["routing"]["fallbacks"]

    errors = doc["errors"]["recent"]
    assert [e["request_id"] for e in errors] == ["fault-0", "missing-0"]
    assert errors[0]["status"] == 500 and errors[0]["error_class"] == "upstream_status"
    assert errors[0]["endpoint"] == q.url[7:]
    assert errors[1] == {**errors[1], "status": 404, "model": "no-such-model", "error_class": "model_not_found",
                         "endpoint": None}
    # the unknown model is counted in the totals, not given a row of its own
    assert "no-such-model" not in [m["name"] for m in doc["models"]]

    # the engines' own numbers arrive with the next scrape
    doc = await wait_for(lambda: _scraped(gw), timeout=5)
    em = by(doc["endpoints"], name=q.url[7:])["engine_metrics"]
    assert em["age_s"] >= 0 and em["stale"] is False and em["running"] is not None


async def _scraped(gw):
    doc = await status(gw)
    return doc if all(e["engine_metrics"] is not None for e in doc["endpoints"]) else None


async def test_in_flight_and_trackers_are_live(sims, gateway):
    p, d = await pd_pair(sims, "sglang", itl_ms=20.0)
    gw = await gateway([{"name": "m", "engine": "sglang", "rolesets": [roleset("sglang", p, d)]}])
    payload = {"model": "m", "messages": CHAT, "max_tokens": 20, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(gw.base_url + "/chat/completions", json=payload) as r:
        assert r.status == 200
        await r.content.readany()      # the first chunk: the request is decoding, its prefill's KV is held
        doc = await status(gw)
        assert doc["gateway"]["in_flight"] == 1 and by(doc["models"], name="m")["in_flight"] == 1
        assert by(doc["endpoints"], name=d.url[7:])["in_flight"] == 1
        assert by(doc["endpoints"], name=p.url[7:])["pd"]["token_kv"] > 0
        await r.read()
    doc = await wait_for(lambda: _idle(gw))
    assert by(doc["endpoints"], name=p.url[7:])["pd"]["token_kv"] == 0


async def _idle(gw):
    doc = await status(gw)
    return doc if doc["gateway"]["in_flight"] == 0 else None


async def test_open_without_auth_config(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    await status(gw)
    code, headers, html = await get(gw, "/status")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert b"<script>" in html and b"status.json" in html
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'sha256-" in csp and "connect-src 'self'" in csp
    assert "http" not in csp.replace("'self'", "")          # nothing from the network


async def test_with_auth_it_needs_the_admin_token(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       auth={"api_keys": [{"key": ALICE, "user": "alice"}], "admin_token": ADMIN})
    for token in (None, ALICE, "wrong-token-0123456789"):     # an API key is not an admin token
        code, headers, body = await get(gw, token=token)
        assert code == 401 and headers["WWW-Authenticate"] == "Bearer", body
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
        assert "admin token" in body["error"]["message"] and headers["request-id"]
    await status(gw, token=ADMIN)
    # the page itself holds no data: it loads, then asks for the token
    code, _, html = await get(gw, "/status")
    assert code == 200 and b"admin token" in html
    assert 'switchyard_status_requests_total{result="unauthorized"} 3.0' in await gw.metrics_text()


async def test_admin_token_alone_protects_it_and_keys_alone_lock_it(sims, gateway):
    sim = await sims("vllm", "m")
    only_admin = await gateway([model_block("m", "vllm", [sim.url])], auth={"admin_token": ADMIN})
    assert (await get(only_admin))[0] == 401
    await status(only_admin, token=ADMIN)
    only_keys = await gateway([model_block("m", "vllm", [sim.url])], auth={"api_keys": [{"key": ALICE, "user": "a"}]})
    code, _, body = await get(only_keys, token=ALICE)
    assert code == 401 and "auth.admin_token" in body["error"]["message"]


async def test_status_can_be_turned_off(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], status={"enabled": False})
    assert (await get(gw))[0] == 404 and (await get(gw, "/status"))[0] == 404
    assert await chat(gw, "m") == 200


async def test_tenants_against_their_limits_in_memory(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       auth={"api_keys": [{"key": ALICE, "user": "alice"}], "admin_token": ADMIN},
                       limits={"users": {"alice": {"rpm": 60, "tpm": 100000}, "bob": {"max_concurrent": 2}},
                               "models": {"m": {"rps": 50}}})
    for _ in range(3):
        assert await chat(gw, "m", key=ALICE) == 200
    t = (await status(gw, token=ADMIN))["tenants"]
    assert t["enabled"] and t["auth"] and t["backend"] == "memory" and t["state_up"] is True
    assert t["model_rps"] == {"m": 50} and t["truncated"] == 0
    alice = by(t["users"], name="alice")
    assert alice["source"] == "config" and alice["rpm"] == 60 and alice["tpm"] == 100000
    assert alice["usage"]["requests"] == 3 and alice["usage"]["tokens"] > 0 and alice["usage"]["concurrent"] == 0
    assert by(t["users"], name="bob")["usage"] == {"requests": 0, "tokens": 0, "concurrent": 0}


async def test_default_user_tenants_appear_while_active_and_the_list_is_bounded(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], status={"max_users": 2},
                       limits={"users": {"alice": {"rpm": 60}}, "default_user": {"rpm": 10}})
    for user in ("carol", "dave", "erin"):
        assert await chat(gw, "m", headers={"user": user}) == 200
    t = (await status(gw))["tenants"]
    assert not t["auth"] and t["default_user"] == {"rpm": 10, "tpm": 0, "max_concurrent": 0}
    assert [(u["name"], u["source"]) for u in t["users"]] == [("alice", "config"), ("carol", "default")]
    assert by(t["users"], name="carol")["usage"]["requests"] == 1


async def test_a_default_users_long_name_is_listed_as_its_digest(sims, gateway):
    """Without auth a client names its user (a body's ``user`` up to the body's limit): a name
    longer than 128 characters is kept as its SHA-256, and its row shows that, with its usage, so
    a hundred claimed names cannot make the document that every open page reads every two seconds
    hundreds of megabytes."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits={"default_user": {"rpm": 10}})
    long = "u" * 100_000
    assert (await post(gw, chat_body(CHAT, user=long))).status == 200
    [row] = (await status(gw))["tenants"]["users"]
    assert row["name"] == "sha256:" + hashlib.sha256(long.encode()).hexdigest(), row["name"][:80]
    assert row["source"] == "default" and row["usage"]["requests"] == 1


async def test_a_failed_requests_long_path_is_cut_in_the_errors_ring(sims, gateway):
    """The errors ring cuts what a client wrote (a model name at 128 characters, a message at
    300): a path that names a stored response, as long as a request line may be, is cut at 300
    characters as well, so that recent_errors of them do not pin megabytes nor make every page's
    document that large."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    path = "/v1/responses/resp_" + "a" * 12_000
    async with aiohttp.ClientSession() as s, s.get(gw.url + path) as r:
        assert r.status == 404
    [err] = (await status(gw))["errors"]["recent"]
    assert err["path"] == path[:300] + "…", len(err["path"])


async def test_tenants_with_redis(sims, gateway, redis_server):
    sim = await sims("vllm", "m")
    blocks = {"auth": {"api_keys": [{"key": ALICE, "user": "alice"}], "admin_token": ADMIN},
              "limits": {"users": {"alice": {"rpm": 60, "tpm": 100000}}},
              "state": {"redis_url": redis_server.url, "sync_interval_s": 0.05, "replica_ttl_s": 5.0}}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    assert await chat(a, "m", key=ALICE) == 200
    assert await chat(b, "m", key=ALICE) == 200
    t = (await status(a, token=ADMIN))["tenants"]
    assert t["backend"] == "redis" and t["state_up"] is True
    assert by(t["users"], name="alice")["usage"]["requests"] == 2      # both replicas' requests
    redis_server.kill()
    await wait_for(lambda: not a.gw.tenancy.state.up or None, timeout=5)
    t = (await status(a, token=ADMIN))["tenants"]
    assert t["state_up"] is False and by(t["users"], name="alice")["usage"] is None
    assert t["state_down_reason"] == "unreachable"


async def test_tenants_say_a_tls_url_got_no_handshake_answer(sims, gateway, redis_server):
    """A rediss:// URL for a Redis serving plain TCP: the page says the state is down for want of a
    TLS handshake answer (``no_tls``), not merely unreachable, and so does the start's log line."""
    sim = await sims("vllm", "m")
    with structlog.testing.capture_logs() as logs:
        gw = await gateway([model_block("m", "vllm", [sim.url])],
                           auth={"api_keys": [{"key": ALICE, "user": "alice"}], "admin_token": ADMIN},
                           state={"redis_url": f"rediss://127.0.0.1:{redis_server.port}/0", "timeout_s": 0.2})
    t = (await status(gw, token=ADMIN))["tenants"]
    assert t["state_up"] is False and t["state_down_reason"] == "no_tls"
    [line] = [x for x in logs if "at start" in x["event"]]
    assert "TLS" in line["event"] and line["reason"] == "no_tls", line
    assert line["error"].startswith(f"no TLS handshake answer from 127.0.0.1:{redis_server.port}"), line


async def test_tenants_say_why_a_redis_that_refuses_writes_is_down(sims, gateway, redis_server):
    """A Redis out of memory is down on the page, which says so; it still answers the usage read."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       auth={"api_keys": [{"key": ALICE, "user": "alice"}], "admin_token": ADMIN},
                       limits={"users": {"alice": {"rpm": 60}}},
                       state={"redis_url": redis_server.url, "sync_interval_s": 0.05})
    assert await chat(gw, "m", key=ALICE) == 200
    t = (await status(gw, token=ADMIN))["tenants"]
    assert t["state_up"] is True and t["state_down_reason"] is None
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", 1)
        assert await chat(gw, "m", key=ALICE) == 200           # failure_policy open: served, not counted

        async def down() -> dict | None:
            t = (await status(gw, token=ADMIN))["tenants"]
            return t if t["state_up"] is False else None
        t = await wait_for(down, timeout=5)
        assert t["state_down_reason"] == "oom" and by(t["users"], name="alice")["usage"]["requests"] == 1
        await r.config_set("maxmemory", 0)

        async def back() -> dict | None:
            t = (await status(gw, token=ADMIN))["tenants"]
            return t if t["state_up"] is True else None
        t = await wait_for(back, timeout=10)
        assert t["state_down_reason"] is None
    finally:
        await r.config_set("maxmemory", 0)
        await r.aclose()
