"""A user's model allowlist (``limits.users.<name>.models``): a model not on it is answered as a
model that does not exist, on every path, and is not listed by ``/v1/models``."""

from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import anthropic
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from gateway.admin_cli import main as cli
from tests.support.batch import jsonl, run_to_end
from tests.support.factories import model_block
from tests.support.http import anthropic_client, openai_client, sim_state
from tests.support.metrics import metric
from tests.support.tenancy import ALICE, BOB, CHAT
from tests.support.waiting import wait_for

TOKEN = "admin-secret-token"
CAROL = "sk-carol-0123456789"
CONFIG = {
    "auth": {"api_keys": [{"key": ALICE, "user": "alice"}, {"key": BOB, "user": "bob"},
                          {"key": CAROL, "user": "carol"}], "admin_token": TOKEN},
    "limits": {"users": {"alice": {"rpm": 3, "models": ["m", "chat"]}, "bob": {"rpm": 100}},
               "default_user": {"models": ["other"]}},
    "aliases": [{"name": "chat", "targets": [{"model": "m"}]}],
}


@pytest.fixture
async def gw(sims, gateway):
    m, other = await sims("vllm", "m"), await sims("vllm", "other")
    return await gateway([model_block("m", "vllm", [m.url]), model_block("other", "vllm", [other.url])], **CONFIG)


async def _post(gw, path: str, key: str, body: dict, **headers) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.post(gw.url + path, json=body,
                                                    headers={"Authorization": f"Bearer {key}", **headers}) as r:
        return r.status, await r.json(), dict(r.headers)


async def _admin(gw, method: str, path: str, body=None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.request(
            method, gw.url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        return r.status, await r.json()


async def test_a_model_not_allowed_is_answered_as_one_that_does_not_exist(gw):
    alice = openai_client(gw, ALICE)
    for name in ("m", "chat"):                    # the model and the alias alice's list names
        got = await alice.chat.completions.create(model=name, messages=CHAT, max_tokens=1)
        assert got.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as ei:
        await alice.chat.completions.create(model="other", messages=CHAT, max_tokens=1)
    assert ei.value.code == "model_not_found"
    # the same answer as a name that is no model (to a user without a list): nothing tells a
    # client the model exists
    for path, body in (("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
                       ("/tokenize", {"prompt": "hi"}),                      # a pass-through path
                       ("/v1/responses", {"input": "hi", "previous_response_id": "resp_x"})):
        s1, denied, h1 = await _post(gw, path, ALICE, {**body, "model": "other"})
        s2, unknown, h2 = await _post(gw, path, BOB, {**body, "model": "nope"})     # bob has no list
        assert (s1, s2) == (404, 404), (path, denied, unknown)
        assert denied["error"]["message"] == "The model `other` does not exist or you do not have access to it."
        assert denied == {"error": {**unknown["error"], "message": unknown["error"]["message"].replace("nope", "other")}}
        assert h1.get("x-error-no-model-backends") == "other" and h2.get("x-error-no-model-backends") == "nope"
    # Anthropic's shape on /v1/messages, as for an unknown model
    claude = anthropic_client(gw, ALICE)
    with pytest.raises(anthropic.NotFoundError) as ea:
        await claude.messages.create(model="other", max_tokens=1, messages=CHAT)
    assert ea.value.body["error"]["type"] == "not_found_error", ea.value.body
    # refused before the limits: alice's rpm of 3 was charged only by her two served requests
    got = await alice.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=1)
    assert got.headers["x-ratelimit-remaining-requests"] == "0"
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        page = await r.text()
    assert metric(page, "switchyard_auth_failures_total", reason="model_not_allowed") == 5
    # bob has no list; carol, with no entry, has default_user's
    bob = openai_client(gw, BOB)
    assert (await bob.chat.completions.create(model="other", messages=CHAT, max_tokens=1)).choices
    carol = openai_client(gw, CAROL)
    assert (await carol.chat.completions.create(model="other", messages=CHAT, max_tokens=1)).choices
    with pytest.raises(openai.NotFoundError):
        await carol.chat.completions.create(model="m", messages=CHAT, max_tokens=1)


async def test_models_lists_only_the_allowed_ones(gw):
    alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)
    assert [m.id async for m in alice.models.list()] == ["m", "chat"]
    assert [m.id async for m in bob.models.list()] == ["m", "other", "chat"]
    assert (await alice.models.retrieve("chat")).id == "chat"
    with pytest.raises(openai.NotFoundError) as ei:
        await alice.models.retrieve("other")
    with pytest.raises(openai.NotFoundError) as eu:
        await bob.models.retrieve("nope")
    assert ei.value.body == {**eu.value.body, "message": eu.value.body["message"].replace("nope", "other")}
    assert (await bob.models.retrieve("other")).id == "other"


async def test_the_admin_api_reads_sets_and_clears_the_list(gw):
    alice = openai_client(gw, ALICE)
    status, user = await _admin(gw, "GET", "/admin/users/alice")
    assert status == 200 and user["models"] == ["m", "chat"]
    status, body = await _admin(gw, "GET", "/admin/users")
    assert body["default_user"]["models"] == ["other"]
    status, user = await _admin(gw, "PATCH", "/admin/users/alice", {"models": ["other"]})
    assert status == 200 and user["models"] == ["other"] and user["rpm"] == 3
    assert (await alice.chat.completions.create(model="other", messages=CHAT, max_tokens=1)).choices
    with pytest.raises(openai.NotFoundError):
        await alice.chat.completions.create(model="m", messages=CHAT, max_tokens=1)
    assert [m.id async for m in alice.models.list()] == ["other"]
    status, user = await _admin(gw, "PATCH", "/admin/users/alice", {"models": None})
    assert status == 200 and user["models"] is None and user["rpm"] == 3
    assert [m.id async for m in alice.models.list()] == ["m", "other", "chat"]
    status, dave = await _admin(gw, "POST", "/admin/users", {"name": "dave", "models": ["m"]})
    assert status == 201 and dave["models"] == ["m"]
    status, dave = await _admin(gw, "PUT", "/admin/users/dave", {"rpm": 1})
    assert status == 200 and dave["models"] is None             # a whole record: no list, every model
    # a name with whitespace at its ends matches no request, and a control character in one breaks the
    # log lines and headers it goes into (a model so named is refused with the config)
    for bad in ([], [""], "m", [1], ["m", None], ["m "], ["m", "\tchat"], ["m\x01"], ["ch\nat"]):
        status, err = await _admin(gw, "PATCH", "/admin/users/alice", {"models": bad})
        assert status == 400 and err["error"]["param"] == "models", (bad, err)
    status, user = await _admin(gw, "GET", "/admin/users/alice")
    assert user["models"] is None


async def test_a_list_set_on_one_replica_applies_on_another_through_redis(sims, gateway, redis_server):
    """The list is kept in the store's record: a PATCH of another limit keeps it (the store's
    script merges the record), a PATCH of ``models: null`` removes it, and another replica applies
    each change as it applies any limit's. A record without the field (an older release's) is a
    user with every model."""
    m, other = await sims("vllm", "m"), await sims("vllm", "other")
    blocks = {"auth": {**CONFIG["auth"]},
              "state": {"redis_url": redis_server.url, "sync_interval_s": 0.05, "replica_ttl_s": 5.0, "timeout_s": 2.0}}
    models = [model_block("m", "vllm", [m.url]), model_block("other", "vllm", [other.url])]
    a, b = await gateway(models, **blocks), await gateway(models, **blocks)
    status, user = await _admin(a, "PUT", "/admin/users/alice", {"rpm": 100, "models": ["m"]})
    assert status == 201 and user["models"] == ["m"]
    status, user = await _admin(a, "PATCH", "/admin/users/alice", {"tpm": 5000})
    assert status == 200 and (user["models"], user["rpm"], user["tpm"]) == (["m"], 100, 5000)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        assert orjson.loads(await r.hget("switchyard:users", "alice")) == {
            "rpm": 100, "tpm": 5000, "max_concurrent": 0, "models": ["m"]}
        assert await wait_for(lambda: b.gw.tenancy.directory.models_for("alice") == ("m",), timeout=10)
        alice_b = openai_client(b, ALICE)
        with pytest.raises(openai.NotFoundError):
            await alice_b.chat.completions.create(model="other", messages=CHAT, max_tokens=1)
        assert [x.id async for x in alice_b.models.list()] == ["m"]
        status, user = await _admin(b, "PATCH", "/admin/users/alice", {"models": None})
        assert status == 200 and user["models"] is None and user["tpm"] == 5000
        assert orjson.loads(await r.hget("switchyard:users", "alice")) == {"rpm": 100, "tpm": 5000, "max_concurrent": 0}
        assert await wait_for(lambda: a.gw.tenancy.directory.models_for("alice") is None, timeout=10)
        alice_a = openai_client(a, ALICE)
        assert (await alice_a.chat.completions.create(model="other", messages=CHAT, max_tokens=1)).choices
        # the admission class is kept the same way: a string the script writes as JSON, null removes it
        status, user = await _admin(a, "PATCH", "/admin/users/alice", {"priority": "critical"})
        assert status == 200 and user["priority"] == "critical" and user["tpm"] == 5000
        assert orjson.loads(await r.hget("switchyard:users", "alice")) == {
            "rpm": 100, "tpm": 5000, "max_concurrent": 0, "priority": "critical"}
        assert await wait_for(lambda: b.gw.tenancy.directory.priority_for("alice") == "critical", timeout=10)
        status, user = await _admin(b, "PATCH", "/admin/users/alice", {"priority": None})
        assert status == 200 and user["priority"] is None
        assert orjson.loads(await r.hget("switchyard:users", "alice")) == {"rpm": 100, "tpm": 5000, "max_concurrent": 0}
    finally:
        await r.aclose()


async def test_a_batchs_lines_for_a_model_not_allowed_fail_as_for_one_that_does_not_exist(sims, gateway, tmp_path):
    """A batch runs as its creator: a line naming a model not on their list fails in the error
    file as a line naming no model does, and a batch whose lines all name one such model fails
    whole at validation, as one naming a model that does not exist."""
    m, other = await sims("vllm", "m"), await sims("vllm", "other")
    gw = await gateway([model_block("m", "vllm", [m.url]), model_block("other", "vllm", [other.url])],
                       auth=CONFIG["auth"], limits={"users": {"alice": {"models": ["m"]}}},
                       batch={"enabled": True, "dir": str(tmp_path / "batch"), "poll_interval_s": 0.05,
                              "retry_backoff_s": 0.05})
    c = openai_client(gw, ALICE)

    async def batch(models: list[str]):
        rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": name, "messages": CHAT, "max_tokens": 1}} for i, name in enumerate(models)]
        f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        return await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                           completion_window="24h")).id)

    b = await batch(["m", "other", "nope"])
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (1, 2), b
    err = {e["custom_id"]: e["response"] for e in (orjson.loads(x) for x in
                                                    (await c.files.content(b.error_file_id)).content.splitlines())}
    assert err["req-1"]["status_code"] == err["req-2"]["status_code"] == 404
    assert err["req-1"]["body"]["error"] == {**err["req-2"]["body"]["error"],
                                             "message": err["req-2"]["body"]["error"]["message"].replace("nope", "other")}
    denied, unknown = await batch(["other", "other"]), await batch(["nope", "nope"])
    assert denied.status == unknown.status == "failed", (denied, unknown)
    assert [(e.code, e.param, e.message) for e in denied.errors.data] == [
        (e.code, e.param, e.message.replace("nope", "other")) for e in unknown.errors.data]
    assert (await sim_state(other.url))["received"] == [] or all(
        r["path"] != "/v1/chat/completions" for r in (await sim_state(other.url))["received"])


async def test_the_cli_sets_and_clears_the_list(gw, monkeypatch):
    monkeypatch.delenv("SWITCHYARD_ADMIN_TOKEN", raising=False)

    async def run(*argv) -> tuple[int, dict]:
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(cli, ["--url", gw.url, "--token", TOKEN, *argv], out, err)
        return code, (json.loads(out.getvalue()) if code == 0 else {"err": err.getvalue()})

    code, fred = await run("users", "create", "fred", "--rpm", "3", "--models", "m", "chat")
    assert code == 0 and fred["models"] == ["m", "chat"] and fred["rpm"] == 3, fred
    code, fred = await run("users", "update", "fred", "--models", "other")
    assert code == 0 and fred["models"] == ["other"] and fred["rpm"] == 3, fred
    code, fred = await run("users", "update", "fred", "--all-models")
    assert code == 0 and fred["models"] is None and fred["rpm"] == 3, fred
    code, fred = await run("users", "set", "fred", "--tpm", "5", "--models", "m")
    assert code == 0 and (fred["models"], fred["rpm"], fred["tpm"]) == (["m"], 0, 5), fred
    code, fred = await run("users", "update", "fred", "--priority", "critical")
    assert code == 0 and fred["priority"] == "critical" and fred["models"] == ["m"], fred
    code, fred = await run("users", "update", "fred", "--priority", "default")
    assert code == 0 and fred["priority"] is None and fred["tpm"] == 5, fred
