"""What an operator and a client are told when Redis answers but refuses the gateway: its ACL user
may not run the gateway's commands (NOPERM), or a key of the gateway's names holds another type
(WRONGTYPE); against a real redis-server with an ACL user of its own."""

from __future__ import annotations

import aiohttp
import redis.asyncio as aioredis
import structlog.testing

from tests.integration.tenancy.test_redis import FAST_STATE, chat
from tests.support.factories import model_block
from tests.support.ports import listen_port
from tests.support.tenancy import ALICE, BOB, KEYS

PASSWORD = "acl-secret-31415"
ADMIN = "admin-token-1"


async def _refusing_url(server, refusal: str) -> str:
    """A URL to ``server`` that Redis will refuse as ``refusal`` says: an ACL user that may run
    anything but scripts (the gateway's limit checks and heartbeat are scripts), a replicas key
    another application wrote as a string (and alice's request window as a hash, which the check of
    her limits reads whether or not another call, the directory's notices read at start, found Redis
    answering first), or a port nothing listens on."""
    if refusal == "unreachable":
        return f"redis://gw:{PASSWORD}@127.0.0.1:{listen_port()}/0"
    r = aioredis.Redis.from_url(server.url)
    try:
        if refusal == "noperm":
            await r.execute_command("ACL", "SETUSER", "gw", "on", f">{PASSWORD}", "~*", "&*", "+@all",
                                    "-@scripting")
        else:
            await r.execute_command("ACL", "SETUSER", "gw", "on", f">{PASSWORD}", "~*", "&*", "+@all")
            await r.set("switchyard:replicas", "another application's value")
            await r.hset("switchyard:rpm:alice", "field", "another application's value")
    finally:
        await r.aclose()
    return f"redis://gw:{PASSWORD}@127.0.0.1:{server.port}/0"


async def test_the_start_and_fail_open_warnings_say_what_redis_answered(sims, gateway, redis_server, monkeypatch):
    """A Redis whose ACL user may not run the gateway's scripts is reachable: the start-up warning
    and the fail-open warning say that it refuses the gateway's commands and why, not that it is
    unreachable (which sends an operator to the network); a key of another type is said to be one;
    a Redis nobody answers for is unreachable. No line holds the URL's password."""
    from gateway.tenants import service

    monkeypatch.setattr(service, "START_RETRY_S", 0.2)
    sim = await sims("vllm", "m")
    said = {"noperm": "ACL", "wrongtype": "another type", "unreachable": "unreachable"}
    for refusal, words in said.items():
        url = await _refusing_url(redis_server, refusal)
        with structlog.testing.capture_logs() as logs:
            gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                               limits={"users": {"alice": {"rpm": 100}}},
                               state={**FAST_STATE, "redis_url": url, "timeout_s": 0.5, "sync_interval_s": 5.0,
                                      "replica_ttl_s": 10.0})
            assert (await chat(gw)).choices
        at_start = [x for x in logs if "at start" in x["event"]]
        served = [x for x in logs if x["event"].startswith("serving without rate limits")]
        assert len(at_start) == 1 and len(served) == 1, logs
        for line in at_start + served:
            assert words in line["event"] and line.get("reason") == refusal, line
            if refusal != "unreachable":
                assert "unreachable" not in line["event"], line
        assert PASSWORD not in repr(logs)


async def test_the_admin_apis_503_says_the_state_store_is_unavailable_not_what_redis_said(
        sims, gateway, redis_server, monkeypatch):
    """The admin API of a gateway whose Redis refuses it answers 503 in OpenAI's shape, saying that
    the state store is unavailable; Redis's own words (its error class, the command refused, a
    script's digest) are for the log, which has them."""
    from gateway.tenants import service

    monkeypatch.setattr(service, "START_RETRY_S", 0.2)
    sim = await sims("vllm", "m")
    url = await _refusing_url(redis_server, "noperm")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={**KEYS, "admin_token": ADMIN},
                       state={**FAST_STATE, "redis_url": url, "sync_interval_s": 5.0, "replica_ttl_s": 10.0})
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession() as s:
            for method, path in (("GET", "/admin/users"), ("POST", "/admin/keys")):
                async with s.request(method, gw.url + path, headers={"Authorization": f"Bearer {ADMIN}"},
                                     json={"user": "carol"}) as r:
                    body = await r.json()
                    assert r.status == 503 and r.headers["Retry-After"] == "1", body
                    assert set(body) == {"error"} and body["error"]["code"] == "service_unavailable", body
                    assert body["error"]["message"] == "the shared state is unavailable", body
    told = [x for x in logs if x["event"].startswith("admin API: shared state")]
    assert told and told[0]["reason"] == "noperm" and "evalsha" in told[0]["error"], logs


async def test_a_users_window_of_another_type_leaves_its_usage_unknown_not_zero_nor_a_503(
        sims, gateway, redis_server):
    """Another application wrote a hash where alice's RPM window is. Her usage cannot be read: the
    admin API's view of her, and the status page's, say so (``usage: null``) instead of counting
    none, and a change to her limits, which lands, is answered as the change it is, not with a 503
    that a client would take for a change that failed. Bob's window reads as before."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={**KEYS, "admin_token": ADMIN},
                       limits={"users": {"alice": {"rpm": 5}, "bob": {"rpm": 5}}},
                       state={**FAST_STATE, "redis_url": redis_server.url})
    assert (await chat(gw, BOB)).choices
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await r.hset("switchyard:rpm:alice", "owner", "another application")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        async with aiohttp.ClientSession(headers=admin) as s:
            async with s.get(gw.url + "/admin/users/alice") as got:
                assert got.status == 200, await got.text()
                view = await got.json()
            assert view["usage"] is None and view["rpm"] == 5 and len(view["keys"]) == 1, view
            async with s.put(gw.url + "/admin/users/alice", json={"rpm": 7}) as put:
                assert put.status == 200, await put.text()
                assert (await put.json())["rpm"] == 7
            async with s.get(gw.url + "/status.json") as page:
                users = {u["name"]: u["usage"] for u in (await page.json())["tenants"]["users"]}
        assert users["alice"] is None and users["bob"]["requests"] == 1, users
    finally:
        await r.aclose()


async def test_a_password_in_the_urls_query_is_in_no_log_line(sims, gateway, redis_server, monkeypatch):
    """``redis://host:port/db?password=...`` is a form the Redis client takes (the one way to give
    a ``unix://`` socket's password in its URL): the lines that name the URL, the state reachable at
    start and unreachable at start, show it without the password."""
    from gateway.tenants import service

    monkeypatch.setattr(service, "START_RETRY_S", 0.2)
    sim = await sims("vllm", "m")
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await r.config_set("requirepass", PASSWORD)
    finally:
        await r.aclose()
    blocks = {"auth": KEYS, "limits": {"users": {"alice": {"rpm": 100}}}}
    with structlog.testing.capture_logs() as logs:
        for port in (redis_server.port, listen_port()):
            url = f"redis://127.0.0.1:{port}/0?password={PASSWORD}"
            await gateway([model_block("m", "vllm", [sim.url])], **blocks,
                          state={**FAST_STATE, "redis_url": url, "sync_interval_s": 5.0, "replica_ttl_s": 10.0})
    named = [x["redis_url"] for x in logs if "redis_url" in x]
    assert len(named) == 2 and "password=***" in named[0], logs
    assert PASSWORD not in repr(logs)


async def test_a_closed_policys_503_says_the_state_is_unavailable_whatever_redis_answered(
        sims, gateway, redis_server, monkeypatch):
    """With ``failure_policy: closed`` a Redis that refuses the gateway's commands is met with a 503
    that says the shared state is unavailable, in the API's shape: not that it is unreachable,
    which it is not, and nothing of what Redis said."""
    from gateway.tenants import service

    monkeypatch.setattr(service, "START_RETRY_S", 0.2)
    sim = await sims("vllm", "m")
    url = await _refusing_url(redis_server, "noperm")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS, limits={"users": {"alice": {"rpm": 100}}},
                       state={**FAST_STATE, "redis_url": url, "failure_policy": "closed", "sync_interval_s": 5.0,
                              "replica_ttl_s": 10.0})
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    async with aiohttp.ClientSession() as s:
        for path, key, message in (
                ("/v1/chat/completions", ALICE, "rate limits cannot be checked: the shared state is unavailable"),
                ("/v1/chat/completions", "sk-nobody-0123456789", "the API key cannot be verified: the shared state "
                                                                "is unavailable"),
                ("/v1/messages", ALICE, "rate limits cannot be checked: the shared state is unavailable")):
            async with s.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                got = await r.json()
                assert r.status == 503 and r.headers["x-error-state-unavailable"] == "true", got
                error = got["error"]
                assert error["message"] == message, got
                if path == "/v1/messages":
                    # not overload (Anthropic's 529): the gateway's shared state failed it
                    assert got["type"] == "error" and error["type"] == "api_error", got
                else:
                    assert error["code"] == "service_unavailable", got


async def test_a_start_against_a_redis_that_refuses_the_gateways_commands_gives_up_at_once(
        sims, gateway, redis_server, monkeypatch):
    """The start-up retry is for a Redis restarting or failing over; one whose ACL user may not run
    the gateway's scripts (NOPERM), or whose replicas key holds another type (WRONGTYPE), refuses
    the next try as it did the first: the start makes one sync and says why, where it used to spend
    the whole retry asking again."""
    from gateway.tenants import service

    monkeypatch.setattr(service, "START_RETRY_S", 3.0)       # a retry would be seen, not timed
    tries: list[str] = []
    sync_once = service.Tenancy.sync_once

    async def counted(self):
        ok = await sync_once(self)
        tries.append(self._sync_reason if not ok else "ok")
        return ok

    monkeypatch.setattr(service.Tenancy, "sync_once", counted)
    sim = await sims("vllm", "m")
    for refusal in ("noperm", "wrongtype"):
        url = await _refusing_url(redis_server, refusal)
        tries.clear()
        with structlog.testing.capture_logs() as logs:
            gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                               limits={"users": {"alice": {"rpm": 100}}},
                               state={**FAST_STATE, "redis_url": url, "sync_interval_s": 30.0,
                                      "replica_ttl_s": 60.0})
        assert tries == [refusal], tries
        at_start = [x for x in logs if "at start" in x["event"]]
        assert len(at_start) == 1 and at_start[0]["reason"] == refusal, logs
        assert (await chat(gw)).choices


async def test_a_wrong_or_missing_password_is_said_to_be_one_not_an_unreachable_redis(
        sims, gateway, redis_server, monkeypatch):
    """A Redis that requires a password, given a wrong one or none, answers: the start makes one
    sync (a second try meets the same refusal), its warning and the fail-open warning say the state
    refuses the gateway's credentials (``reason`` ``auth``, counted so), and a Responses lookup's 503
    says so too, where each said "unreachable" (after trying again for the start's whole second)
    and sent an operator looking at the network."""
    import openai

    from gateway.tenants import service
    from tests.support.http import openai_client
    from tests.support.metrics import metric

    monkeypatch.setattr(service, "START_RETRY_S", 3.0)       # a retry would be seen, not timed
    tries: list[str] = []
    sync_once = service.Tenancy.sync_once

    async def counted(self):
        ok = await sync_once(self)
        tries.append(self._sync_reason if not ok else "ok")
        return ok

    monkeypatch.setattr(service.Tenancy, "sync_once", counted)
    sim = await sims("vllm", "m")
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await r.config_set("requirepass", PASSWORD)
    finally:
        await r.aclose()
    for url in (f"redis://:not-{PASSWORD}@127.0.0.1:{redis_server.port}/0", f"redis://127.0.0.1:{redis_server.port}/0"):
        tries.clear()
        with structlog.testing.capture_logs() as logs:
            gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                               limits={"users": {"alice": {"rpm": 100}}}, responses={"state": "gateway"},
                               state={**FAST_STATE, "redis_url": url, "sync_interval_s": 30.0,
                                      "replica_ttl_s": 60.0})
            assert (await chat(gw)).choices
            try:
                await openai_client(gw, ALICE).responses.retrieve("resp_0123456789abcdef0123456789abcdef")
                raise AssertionError("a lookup in a store that refuses the gateway was answered")
            except openai.InternalServerError as e:
                assert e.status_code == 503
                assert "credentials" in e.message and "unreachable" not in e.message, e.message
        assert tries == ["auth"], tries
        at_start = [x for x in logs if "at start" in x["event"]]
        served = [x for x in logs if x["event"].startswith("serving without rate limits")]
        assert len(at_start) == 1 and len(served) == 1, logs
        for line in at_start + served:
            assert "credentials" in line["event"] and "unreachable" not in line["event"], line
            assert line["reason"] == "auth", line
        page = await gw.metrics_text()
        assert metric(page, "switchyard_state_unavailable_total", policy="open", reason="auth") == 1, page
        assert PASSWORD not in repr(logs).replace(f"not-{PASSWORD}", "")
