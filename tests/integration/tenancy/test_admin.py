"""The admin API and its CLI: users and keys created, read, updated and deleted at run time."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json

import aiohttp
import msgspec
import openai
import pytest

from gateway.admin_cli import main as cli
from gateway.config.schema import config_from_dict
from gateway.server.app import RELOAD_KEY
from tests.support.factories import model_block
from tests.support.http import openai_client, sim_state
from tests.support.metrics import metric
from tests.support.tenancy import ALICE, CHAT

TOKEN = "admin-secret-token"
CONFIG = {"auth": {"api_keys": [{"key": ALICE, "user": "alice"}], "admin_token": TOKEN},
          "limits": {"users": {"alice": {"rpm": 100}}, "default_user": {"rpm": 50}}}


@pytest.fixture
async def gw(sims, gateway):
    sim = await sims("vllm", "m")
    return await gateway([model_block("m", "vllm", [sim.url])], **CONFIG)


class Admin:
    def __init__(self, gw, token=TOKEN):
        self.url, self.token = gw.url, token

    async def __call__(self, method: str, path: str, body=None) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.request(
                method, self.url + path, json=body, headers={"Authorization": f"Bearer {self.token}"}) as r:
            return r.status, await r.json()


async def test_admin_needs_its_own_token(gw):
    for token in ("wrong", ALICE):              # an API key is not an admin token
        status, body = await Admin(gw, token)("GET", "/admin/users")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/users") as r:
        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"


async def test_every_admin_answer_is_kept_by_no_cache_and_not_sniffed(gw):
    """The answer to POST /admin/keys shows the key once; no admin answer (a key, the users and
    their usage, a refusal) may be kept by a browser's or a proxy's cache, nor read as another type."""
    asks = [("POST", "/admin/keys", {"user": "dora"}, TOKEN, 201), ("GET", "/admin/keys", None, TOKEN, 200),
            ("GET", "/admin/users/alice", None, TOKEN, 200), ("POST", "/admin/users", [], TOKEN, 400),
            ("GET", "/admin/keys/nope", None, TOKEN, 404), ("GET", "/admin/reload", None, TOKEN, 405),
            ("POST", "/admin/reload", None, TOKEN, 409), ("GET", "/admin/users", None, "wrong", 401)]
    async with aiohttp.ClientSession() as s:
        for method, path, body, token, status in asks:
            async with s.request(method, gw.url + path, json=body, headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == status, (method, path, await r.text())
                assert r.content_type == "application/json" and r.charset in (None, "utf-8"), (method, path)
                assert r.headers.get("Cache-Control") == "no-store", (method, path, dict(r.headers))
                assert r.headers.get("X-Content-Type-Options") == "nosniff", (method, path, dict(r.headers))


async def test_no_admin_token_no_admin_api(sims, gateway):
    sim = await sims("vllm", "m")
    g = await gateway([model_block("m", "vllm", [sim.url])], auth={"api_keys": [{"key": ALICE, "user": "a"}]})
    assert (await Admin(g)("GET", "/admin/users"))[0] == 404


async def test_users_crud(gw):
    admin = Admin(gw)
    status, body = await admin("GET", "/admin/users")
    assert status == 200 and body["default_user"] == {"rpm": 50, "tpm": 0, "max_concurrent": 0, "models": None,
                                                     "priority": None}
    assert body["data"] == [{"name": "alice", "rpm": 100, "tpm": 0, "max_concurrent": 0, "models": None,
                             "priority": None, "source": "config", "overrides_config": False}]

    status, bob = await admin("POST", "/admin/users", {"name": "bob", "rpm": 2, "tpm": 1000})
    assert status == 201 and (bob["rpm"], bob["tpm"], bob["max_concurrent"], bob["source"]) == (2, 1000, 0, "store")
    assert bob["usage"]["requests"] == 0 and bob["keys"] == []
    assert (await admin("POST", "/admin/users", {"name": "bob"}))[0] == 409
    assert (await admin("POST", "/admin/users", {"name": "alice"}))[0] == 409    # configured: use PUT

    status, bob = await admin("PATCH", "/admin/users/bob", {"max_concurrent": 3})
    assert status == 200 and (bob["rpm"], bob["tpm"], bob["max_concurrent"]) == (2, 1000, 3)
    status, bob = await admin("PUT", "/admin/users/bob", {"rpm": 7})
    assert status == 200 and (bob["rpm"], bob["tpm"], bob["max_concurrent"]) == (7, 0, 0)
    status, carol = await admin("PUT", "/admin/users/carol", {"tpm": 5})
    assert status == 201 and carol["tpm"] == 5

    # a store record overrides a config user; deleting it falls back to the config
    status, alice = await admin("PATCH", "/admin/users/alice", {"rpm": 1})
    assert status == 200 and alice["rpm"] == 1 and alice["overrides_config"] is True
    status, gone = await admin("DELETE", "/admin/users/alice")
    assert status == 200 and gone["now"]["rpm"] == 100 and gone["now"]["source"] == "config"
    assert (await admin("DELETE", "/admin/users/alice"))[0] == 409           # config: not deletable here

    status, body = await admin("GET", "/admin/users")
    assert [u["name"] for u in body["data"]] == ["alice", "bob", "carol"]
    assert (await admin("DELETE", "/admin/users/bob"))[0] == 200
    assert (await admin("GET", "/admin/users/bob"))[0] == 404
    assert (await admin("PATCH", "/admin/users/bob", {"rpm": 1}))[0] == 404
    assert (await admin("DELETE", "/admin/users/bob"))[0] == 404


@pytest.mark.parametrize("method,path,body,param", [
    ("POST", "/admin/users", {"name": "x", "rpm": -1}, "rpm"),
    ("POST", "/admin/users", {"name": "x", "rpm": "10"}, "rpm"),
    ("POST", "/admin/users", {"name": "x", "rpm": True}, "rpm"),
    ("POST", "/admin/users", {"name": "x", "rps": 1}, "rps"),
    ("POST", "/admin/users", {"name": "bad name"}, "name"),
    ("POST", "/admin/users", {}, "name"),
    ("PUT", "/admin/users/x", {"tpm": 1.5}, "tpm"),
    ("PUT", "/admin/users/x", {"tpm": 2**63}, "tpm"),
    ("PATCH", "/admin/users/alice", {"rpm": 2**53}, "rpm"),
    ("PATCH", "/admin/users/alice", {"name": "bob", "rpm": 1}, "name"),    # not a rename
    ("PUT", "/admin/users/x", {"name": "y", "rpm": 1}, "name"),
    ("POST", "/admin/keys", {"name": "k"}, "user"),
    ("POST", "/admin/keys", {"user": "u", "key": "short"}, "key"),
    ("POST", "/admin/keys", {"user": "u", "key": "sk-nul-0123456789\u0000x"}, "key"),     # no client can send these
    ("POST", "/admin/keys", {"user": "u", "key": "sk-esc-0123456789\u001bx"}, "key"),
    ("POST", "/admin/keys", {"user": "u", "key": "sk-\u00e9\u00e9\u00e9-0123456789"}, "key"),
    ("POST", "/admin/keys", {"user": "u", "key": "sk-" + "k" * 1022}, "key"),
    ("POST", "/admin/keys", {"user": "u", "expires": 1}, "expires"),
    ("POST", "/admin/keys", {"user": "u", "key": TOKEN}, "key"),      # an API key is not the admin token
])
async def test_bad_admin_input_is_a_400_naming_the_field(gw, method, path, body, param):
    status, err = await Admin(gw)(method, path, body)
    assert status == 400 and err["error"]["param"] == param, err


async def test_keys_crud_and_effect_on_requests(gw):
    admin = Admin(gw)
    status, body = await admin("GET", "/admin/keys")
    assert status == 200 and [(k["user"], k["source"]) for k in body["data"]] == [("alice", "config")]
    assert "key" not in body["data"][0]                                     # never shown again

    status, made = await admin("POST", "/admin/keys", {"user": "dora", "name": "laptop"})
    assert status == 201 and made["key"].startswith("sk-sy-") and made["user"] == "dora"
    key, kid = made["key"], made["id"]
    r = await openai_client(gw, key).chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=1)
    assert r.headers["x-ratelimit-limit-requests"] == "50"                  # dora: default_user limits

    status, own = await admin("POST", "/admin/keys", {"user": "erin", "key": "my-own-long-key-123"})
    assert status == 201 and own["key"] == "my-own-long-key-123"
    assert (await admin("POST", "/admin/keys", {"user": "x", "key": "my-own-long-key-123"}))[0] == 409

    status, body = await admin("GET", "/admin/keys?user=dora")
    assert [k["id"] for k in body["data"]] == [kid]
    status, got = await admin("GET", f"/admin/keys/{kid}")
    assert status == 200 and got == {"id": kid, "user": "dora", "name": "laptop", "created": made["created"],
                                     "source": "store"}
    status, moved = await admin("PATCH", f"/admin/keys/{kid}", {"user": "alice"})
    assert status == 200 and moved["user"] == "alice"
    r = await openai_client(gw, key).chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=1)
    assert r.headers["x-ratelimit-limit-requests"] == "100"                 # now alice's limits

    config_kid = next(k["id"] for k in (await admin("GET", "/admin/keys"))[1]["data"] if k["source"] == "config")
    assert (await admin("DELETE", f"/admin/keys/{config_kid}"))[0] == 409
    assert (await admin("PATCH", f"/admin/keys/{config_kid}", {"user": "x"}))[0] == 409

    status, _ = await admin("DELETE", f"/admin/keys/{kid}")
    assert status == 200
    with pytest.raises(openai.AuthenticationError):
        await openai_client(gw, key).chat.completions.create(model="m", messages=CHAT, max_tokens=1)
    assert (await admin("GET", f"/admin/keys/{kid}"))[0] == 404

    # deleting a user revokes their store keys
    await admin("PUT", "/admin/users/erin", {"rpm": 5})
    status, gone = await admin("DELETE", "/admin/users/erin")
    assert status == 200 and gone["keys_deleted"] == 1
    with pytest.raises(openai.AuthenticationError):
        await openai_client(gw, "my-own-long-key-123").chat.completions.create(model="m", messages=CHAT, max_tokens=1)


async def test_a_key_names_its_user_and_needs_no_user_record(gw):
    """A user is a name that keys and limits refer to, not a record that must come first: as a
    configured key may name a user with no ``limits.users`` entry, POST /admin/keys takes any valid
    name, and the key's requests are that user's, under ``limits.default_user``. Such a user has no
    record to read, list or delete (404), so its keys stay until revoked one by one; a record made
    later is the user's, and deleting that record revokes them."""
    admin = Admin(gw)
    status, made = await admin("POST", "/admin/keys", {"user": "hana", "name": "laptop"})
    assert status == 201 and made["user"] == "hana"
    assert (await admin("GET", "/admin/users/hana"))[0] == 404
    assert "hana" not in [u["name"] for u in (await admin("GET", "/admin/users"))[1]["data"]]
    assert [k["id"] for k in (await admin("GET", "/admin/keys?user=hana"))[1]["data"]] == [made["id"]]
    client = openai_client(gw, made["key"])
    r = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=1)
    assert r.headers["x-ratelimit-limit-requests"] == "50"                  # default_user's
    assert (await admin("DELETE", "/admin/users/hana"))[0] == 404           # no record: the key stays
    assert (await client.chat.completions.create(model="m", messages=CHAT, max_tokens=1)).choices

    status, hana = await admin("PUT", "/admin/users/hana", {"rpm": 7})
    assert status == 201 and hana["keys"] == [made["id"]]
    r = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=1)
    assert r.headers["x-ratelimit-limit-requests"] == "7"
    status, gone = await admin("DELETE", "/admin/users/hana")
    assert status == 200 and gone["keys_deleted"] == 1
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="m", messages=CHAT, max_tokens=1)


async def test_cli(gw, monkeypatch):
    monkeypatch.delenv("SWITCHYARD_ADMIN_TOKEN", raising=False)

    async def run(*argv, token=TOKEN) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        args = ["--url", gw.url] + (["--token", token] if token else []) + list(argv)
        code = await asyncio.to_thread(cli, args, out, err)
        return code, out.getvalue(), err.getvalue()

    code, out, _ = await run("users", "create", "fred", "--rpm", "3", "--max-concurrent", "2")
    assert code == 0 and json.loads(out)["rpm"] == 3 and json.loads(out)["max_concurrent"] == 2
    code, out, _ = await run("users", "update", "fred", "--tpm", "900")
    assert code == 0 and (json.loads(out)["rpm"], json.loads(out)["tpm"]) == (3, 900)
    code, out, _ = await run("users", "set", "fred", "--tpm", "10")
    assert code == 0 and (json.loads(out)["rpm"], json.loads(out)["tpm"]) == (0, 10)
    code, out, _ = await run("users", "list")
    assert code == 0 and [u["name"] for u in json.loads(out)["data"]] == ["alice", "fred"]
    code, out, _ = await run("keys", "create", "--user", "fred", "--name", "ci")
    made = json.loads(out)
    assert code == 0 and made["key"].startswith("sk-sy-")
    assert (await openai_client(gw, made["key"]).chat.completions.create(model="m", messages=CHAT, max_tokens=1)).choices
    code, out, _ = await run("keys", "list", "--user", "fred")
    assert code == 0 and [k["id"] for k in json.loads(out)["data"]] == [made["id"]]
    code, out, _ = await run("keys", "update", made["id"], "--name", "ci-2")
    assert code == 0 and json.loads(out)["name"] == "ci-2"
    code, out, _ = await run("keys", "get", made["id"])
    assert code == 0 and json.loads(out)["name"] == "ci-2"
    code, out, _ = await run("keys", "delete", made["id"])
    assert code == 0 and json.loads(out) == {"deleted": made["id"]}
    code, out, _ = await run("users", "get", "fred")
    assert code == 0 and json.loads(out)["keys"] == []
    code, _, err = await run("users", "get", "nobody")
    assert code == 1 and "404" in err and "not found" in err
    code, _, err = await run("users", "list", token="wrong")
    assert code == 1 and "401" in err
    code, _, err = await run("users", "list", token=None)
    assert code == 2 and "no admin token" in err
    code, _, _ = await run("users", "delete", "fred")
    assert code == 0


async def test_concurrent_changes_of_one_user_all_land(gw):
    """Fifty PATCHes of one user at once, each setting one field, and a DELETE racing key creates:
    every field ends set by one of its PATCHes, and the delete's count and the keys left add up."""
    admin = Admin(gw)
    fields = ("rpm", "tpm", "max_concurrent")
    assert (await admin("PATCH", "/admin/users/alice", {}))[1]["source"] == "config"     # nothing written
    got = await asyncio.gather(*(admin("PATCH", "/admin/users/alice", {fields[i % 3]: 100 + i}) for i in range(50)))
    assert {status for status, _ in got} == {200}
    status, final = await admin("GET", "/admin/users/alice")
    for i, f in enumerate(fields):
        assert final[f] in {100 + j for j in range(i, 50, 3)}, final

    await admin("PUT", "/admin/users/gus", {"rpm": 1})
    made = [admin("POST", "/admin/keys", {"user": "gus"}) for _ in range(20)]
    got = await asyncio.gather(*made[:10], admin("DELETE", "/admin/users/gus"), *made[10:])
    assert all(status == 201 for status, _ in got[:10] + got[11:])
    status, gone = got[10]
    status, left = await admin("GET", "/admin/keys?user=gus")
    assert gone["keys_deleted"] + len(left["data"]) == 20
    assert (await admin("PATCH", "/admin/users/gus", {"rpm": 2}))[0] == 404
    assert (await admin("DELETE", "/admin/users/gus"))[0] == 404


async def test_every_admin_call_has_a_log_line_and_is_counted(gw):
    """An audit trail: each admin call, a refused token's included, is one request line naming the
    action, the credential by its id (never the token), the object changed (never a created key)
    and the status, and counts in switchyard_admin_requests_total{action,result}."""
    admin = Admin(gw)
    token_id = hashlib.sha256(TOKEN.encode()).hexdigest()[:16]
    with gw.gw.request_log.capture() as lines:
        status, key = await admin("POST", "/admin/keys", {"user": "erin", "name": "laptop"})
        assert status == 201
        assert (await admin("DELETE", f"/admin/keys/{key['id']}"))[0] == 200
        assert (await admin("PUT", "/admin/users/erin", {"rpm": 5}))[0] == 201
        assert (await admin("GET", "/admin/keys/nope"))[0] == 404
        assert (await Admin(gw, "wrong-guess")("DELETE", "/admin/users/erin"))[0] == 401
        async with aiohttp.ClientSession() as s, s.post(gw.url + "/admin/reload") as r:
            assert r.status == 401                      # no Authorization at all
        assert (await admin("POST", "/admin/reload"))[0] == 409      # started without a config file
    got = [(ln["method"], ln["path"], ln["status"], ln["admin_action"], ln["admin_token"], ln.get("admin_object"))
           for ln in lines]
    wrong_id = hashlib.sha256(b"wrong-guess").hexdigest()[:16]
    assert got == [("POST", "/admin/keys", 201, "create_key", token_id, key["id"]),
                   ("DELETE", f"/admin/keys/{key['id']}", 200, "revoke_key", token_id, key["id"]),
                   ("PUT", "/admin/users/erin", 201, "replace_user", token_id, "erin"),
                   ("GET", "/admin/keys/nope", 404, "get_key", token_id, "nope"),
                   ("DELETE", "/admin/users/erin", 401, "delete_user", wrong_id, "erin"),
                   ("POST", "/admin/reload", 401, "reload", None, None),
                   ("POST", "/admin/reload", 409, "reload", token_id, None)], got
    text = json.dumps(lines)
    assert TOKEN not in text and "wrong-guess" not in text and key["key"] not in text
    assert all(ln["request_id"] for ln in lines)
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        page = await r.text()
    assert metric(page, "switchyard_admin_requests_total", action="create_key", result="ok") == 1
    assert metric(page, "switchyard_admin_requests_total", action="revoke_key", result="ok") == 1
    assert metric(page, "switchyard_admin_requests_total", action="get_key", result="not_found") == 1
    assert metric(page, "switchyard_admin_requests_total", action="delete_user", result="unauthorized") == 1
    assert metric(page, "switchyard_admin_requests_total", action="reload", result="unauthorized") == 1
    assert metric(page, "switchyard_admin_requests_total", action="reload", result="conflict") == 1


async def test_an_admin_call_after_a_reload_removed_the_token_keeps_one_line_with_its_action(gw):
    """A reload that removes the admin token turns the API off (404): the call's one line (the
    error answer's) names its action and credential, and it is counted."""
    reloader = gw.runner.app[RELOAD_KEY]
    raw = msgspec.to_builtins(reloader.live.config)
    raw["auth"]["admin_token"] = None
    assert reloader.reload("test", config_from_dict(raw, source="<test>")).result == "ok"
    with gw.gw.request_log.capture() as lines:
        status, _ = await Admin(gw)("GET", "/admin/keys/abc")
        assert status == 404
    assert [(ln["status"], ln["admin_action"], ln["admin_object"], ln["error_class"]) for ln in lines] == \
        [(404, "get_key", "abc", "http")], lines
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        assert metric(await r.text(), "switchyard_admin_requests_total", action="get_key", result="not_found") == 1


async def test_a_users_admission_class_is_kept_by_a_patch_and_set_by_the_api(sims, gateway):
    """A configured user's ``priority`` (its admission class) survives a PATCH of another limit
    (the store's record starts from the configured one), shows in the user's view, and is set or
    cleared (null: ``admission.default_priority``) by POST, PUT and PATCH like the other fields.
    The class a request was admitted in is read from the engine priority it was sent with."""
    sim = await sims("vllm", "m", scheduling_policy="priority")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       admission={"enabled": True, "engine_priority": {"critical": -1, "standard": 0, "sheddable": 1}},
                       auth={"api_keys": [{"key": ALICE, "user": "alice"}], "admin_token": TOKEN},
                       limits={"users": {"alice": {"rpm": 100, "priority": "critical"}}})
    admin = Admin(gw)
    classes = {-1: "critical", 0: "standard", 1: "sheddable"}

    async def served_class() -> str:
        assert (await openai_client(gw, ALICE).chat.completions.create(model="m", messages=CHAT,
                                                                         max_tokens=1)).choices
        received = [x["body"] for x in (await sim_state(sim.url))["received"] if x["path"] == "/v1/chat/completions"]
        return classes[received[-1]["priority"]]

    assert await served_class() == "critical"
    status, user = await admin("PATCH", "/admin/users/alice", {"rpm": 120})
    assert status == 200 and user["rpm"] == 120
    assert await served_class() == "critical"
    assert user["priority"] == "critical", user
    status, user = await admin("PATCH", "/admin/users/alice", {"priority": "sheddable"})
    assert status == 200 and user["priority"] == "sheddable" and user["rpm"] == 120, user
    assert await served_class() == "sheddable"
    status, user = await admin("PATCH", "/admin/users/alice", {"priority": None})
    assert status == 200 and user["priority"] is None
    assert await served_class() == "standard"             # admission.default_priority
    status, dora = await admin("POST", "/admin/users", {"name": "dora", "priority": "critical"})
    assert status == 201 and dora["priority"] == "critical"
    status, dora = await admin("PUT", "/admin/users/dora", {"rpm": 1})
    assert status == 200 and dora["priority"] is None       # a whole record: no class given
    for bad in ("urgent", 1, True, ["critical"]):
        status, err = await admin("PATCH", "/admin/users/alice", {"priority": bad})
        assert status == 400 and err["error"]["param"] == "priority", (bad, err)
