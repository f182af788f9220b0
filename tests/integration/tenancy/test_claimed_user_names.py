"""A user name a client claims (without auth: the ``user`` header, else the body's ``user``, or
``metadata.user_id`` on ``/v1/messages``) longer than 128 characters is keyed by its SHA-256
(``sha256:`` and 64 hex digits) wherever the gateway keeps or shows it: the tenancy counters, in
memory and in Redis, ``vtc-basic``'s token counts, the status page, a 429's message. One client
keeps counting as one user, and a name of a megabyte keeps 71 characters."""

from __future__ import annotations

import hashlib

import aiohttp
import redis.asyncio as aioredis

from tests.support.factories import model_block
from tests.support.http import chat_body, post
from tests.support.metrics import metric
from tests.support.status import CHAT
from tests.support.waiting import wait_for


def digest(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


async def test_a_long_claimed_name_is_keyed_by_its_digest_everywhere_it_is_kept(sims, gateway):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url], strategy="vtc-basic")],
                       limits={"default_user": {"rpm": 2}})
    body_name, header_name, edge = "u" * 100_000, "h" * 1_000, "e" * 128
    assert (await post(gw, chat_body(CHAT, user=body_name))).status == 200
    assert (await post(gw, chat_body(CHAT, user=body_name))).status == 200
    assert (await post(gw, chat_body(CHAT), headers={"user": header_name})).status == 200
    assert (await post(gw, chat_body(CHAT, user=edge))).status == 200            # 128: kept as it is
    messages = {"model": "m", "max_tokens": 4, "messages": CHAT, "metadata": {"user_id": "m" * 300}}
    assert (await post(gw, messages, path="/v1/messages")).status == 200

    over = await post(gw, chat_body(CHAT, user=body_name))       # the same client, over its RPM
    assert over.status == 429
    message = over.json()["error"]["message"]
    assert message == f"user: {digest(body_name)} has exceeded RPM: 2", message[:200]

    windows = gw.gw.tenancy.state._windows
    assert {name for kind, name in windows if kind == "rpm"} == {
        digest(body_name), digest(header_name), edge, digest("m" * 300)}
    assert windows[("rpm", digest(body_name))][0] == 2          # one client, one user

    vtc = gw.gw.routing.registry.get("vtc-basic")
    assert set(vtc._users) == {digest(body_name), digest(header_name), edge, digest("m" * 300)}

    async with aiohttp.ClientSession() as s, s.get(gw.url + "/status.json") as r:
        page = await r.json()
    rows = {u["name"]: u for u in page["tenants"]["users"]}
    assert set(rows) == {digest(body_name), digest(header_name), edge, digest("m" * 300)}, [n[:80] for n in rows]
    assert rows[digest(body_name)]["usage"]["requests"] == 2


async def test_redis_keeps_a_long_claimed_names_counters_under_its_digest(sims, gateway, redis_server):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits={"default_user": {"rpm": 10, "tpm": 100_000}},
                       state={"redis_url": redis_server.url, "sync_interval_s": 0.05, "replica_ttl_s": 5.0})
    name = "u" * 100_000
    assert (await post(gw, chat_body(CHAT, user=name))).status == 200
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        async def tpm_written():        # the tokens are charged after the answer
            keys = [k.decode() async for k in r.scan_iter(count=1000)]
            return keys if any(":tpm:" in k for k in keys) else None
        keys = await wait_for(tpm_written, timeout=10)
        assert keys, "no TPM window written"
        [rpm], [tpm] = [k for k in keys if ":rpm:" in k], [k for k in keys if ":tpm:" in k]
        assert rpm.endswith(":rpm:" + digest(name)) and tpm.endswith(":tpm:" + digest(name)), (rpm[:80], tpm[:80])
        assert max(len(k) for k in keys) < 200 and int(await r.get(rpm)) == 1
    finally:
        await r.aclose()


async def test_a_long_configured_user_is_named_by_its_digest_in_the_log_metrics_and_status(sims, gateway):
    """A key's user from the config (and its ``limits.users`` entry) longer than 128 characters is
    named as a claimed one is, by its digest: the request log cut it at 1,024 characters while the
    metrics and the status page had it whole."""
    sim = await sims("vllm", "m")
    long = "k" * 2000
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       auth={"api_keys": [{"key": "sk-long-user-key", "user": long}], "admin_token": "admin-token-1"},
                       limits={"users": {long: {"rpm": 1}}})
    key = {"Authorization": "Bearer sk-long-user-key"}
    with gw.gw.request_log.capture() as lines:
        assert (await post(gw, chat_body(CHAT), key)).status == 200
        assert (await post(gw, chat_body(CHAT, model="nope"), key)).status == 404
        over = await post(gw, chat_body(CHAT), key)
        assert await wait_for(lambda: len(lines) == 3, timeout=10.0)
    assert over.status == 429 and over.json()["error"]["message"] == f"user: {digest(long)} has exceeded RPM: 1"
    assert [line["user"] for line in lines] == [digest(long)] * 3
    page = await gw.metrics_text()
    assert metric(page, "switchyard_user_tokens_total", user=digest(long), kind="prompt") > 0
    assert long not in page
    admin = {"Authorization": "Bearer admin-token-1"}
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/status.json", headers=admin) as r:
        status = await r.json()
    assert {u["name"] for u in status["tenants"]["users"]} == {digest(long)}
    assert {e["user"] for e in status["errors"]["recent"]} == {digest(long)}, status["errors"]


async def test_without_auth_a_long_users_entry_limits_the_client_claiming_that_name(sims, gateway):
    sim = await sims("vllm", "m")
    long = "u" * 300
    gw = await gateway([model_block("m", "vllm", [sim.url])], limits={"users": {long: {"rpm": 1}}})
    assert (await post(gw, chat_body(CHAT, user=long))).status == 200
    over = await post(gw, chat_body(CHAT, user=long))
    assert over.status == 429 and over.json()["error"]["message"] == f"user: {digest(long)} has exceeded RPM: 1"
