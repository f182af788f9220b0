"""Reload without restart, in process: what a reload changes, what it refuses, and requests in
flight across it. (A SIGHUP to a real process under load, and every worker of ``--workers``
reloading, are in test_reload_process.py.)"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import msgspec
import openai
import orjson
import pytest
import structlog

from gateway.config.schema import config_from_dict, load_config
from gateway.server.app import DISCOVERY_KEY, RELOAD_KEY
from gateway.server.reload import Reloader
from routers.session import encode_session_id
from tests.support.factories import model_block, pd_model, pd_pair, roleset
from tests.support.http import openai_client, sim_state
from tests.support.metrics import metric, series
from tests.support.waiting import until, wait_for

CHAT = [{"role": "user", "content": "Reload me."}]
TOKEN = "admin-token-for-reload"


def reloader_of(gw) -> Reloader:
    return gw.runner.app[RELOAD_KEY]


class ConfigFile:
    """The running gateway's config as a file the reloader reads, edited as a dict."""

    def __init__(self, gw, path) -> None:
        self.path = path
        self.reloader = reloader_of(gw)
        self.data = msgspec.to_builtins(self.reloader.live.config)
        self.reloader.loader = lambda: load_config(path)

    def write(self, **changes) -> None:
        self.data.update(changes)
        self.path.write_text(orjson.dumps(self.data).decode())     # JSON is YAML

    def raw(self, text: str) -> None:
        self.path.write_text(text)


async def chat(client, model="m", **kw):
    return await client.chat.completions.create(model=model, messages=CHAT, max_tokens=kw.pop("max_tokens", 3), **kw)


async def test_a_reload_swaps_endpoints_and_adds_an_alias_while_a_stream_in_flight_finishes(sims, gateway, tmp_path):
    a = await sims("vllm", "m", itl_ms=20.0)
    b, c = await sims("vllm", "m"), await sims("vllm", "m")
    # round-robin: the first requests reach a for sure (least-request breaks ties at random, and all
    # four went to b in 1 run of 16)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="round-robin")])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    ep_a, ep_b = gw.gw.pool.endpoints("m")
    client = openai_client(gw)

    pool = gw.gw.upstream.pool
    gone = a.url.removeprefix("http://")

    def kept_to_a() -> bool:
        return any(conn.origin.host_header == gone for conn in pool._conns)

    for _ in range(4):
        await chat(client)
    assert kept_to_a()                   # a kept-alive connection to a

    # a long stream on a (the endpoint the reload removes), in flight across the reload
    ep_b.draining = True
    stream = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=40, stream=True)
    ep_b.draining = False
    first = await stream.__anext__()
    assert ep_a.in_flight == 1

    f.write(models=[model_block("m", "vllm", [b.url, c.url], strategy="round-robin")],
            aliases=[{"name": "chat", "targets": [{"model": "m", "weight": 1}]}])
    result = f.reloader.reload("test")
    assert (result.result, result.generation) == ("ok", 2)
    assert result.added == [f"m {c.url}"] and result.removed == [f"m {a.url}"]
    assert set(result.changed) == {"models", "aliases"}
    eps = gw.gw.pool.endpoints("m")
    assert eps[0] is ep_b and [e.url for e in eps] == [b.url, c.url]      # b kept as it was: same object
    assert ep_a.draining and ep_a not in eps

    # the stream goes on to its end on the endpoint it started on
    text = first.choices[0].delta.content or ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert len(text.split()) >= 30
    assert ep_a.in_flight == 0           # its lease released on the endpoint it was charged to
    # and no connection to a is kept (nor opened again to keep it warm) once its answers ended
    assert await wait_for(lambda: not kept_to_a(), timeout=3)

    before = (await sim_state(a.url))["counts"]["started"]
    for i in range(8):
        r = await client.chat.completions.with_raw_response.create(model="chat", messages=CHAT, max_tokens=2,
                                                                   user=f"u{i}")
        assert r.headers["x-served-model"] == "m"
        await chat(client)
    assert (await sim_state(a.url))["counts"]["started"] == before
    assert (await sim_state(c.url))["counts"]["started"] > 0
    assert "chat" in {m.id for m in (await client.models.list()).data}
    text = await gw.metrics_text()
    assert metric(text, "switchyard_config_reload_total", result="ok") == 1
    assert metric(text, "switchyard_config_generation") == 2
    await client.close()


async def test_a_reload_that_removes_a_prefill_counts_its_prefills_in_flight_as_draining(sims, gateway):
    """A prefill leg is not in its endpoint's in_flight (its decode's is): the reload's line counts
    it too, where a prefill removed with prefills running on it said draining_in_flight 0."""
    p, d = await pd_pair(sims, "vllm")
    p2 = await sims("vllm", "m", role="prefill")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    reloader = reloader_of(gw)
    ep_p = next(ep for ep in gw.gw.pool.endpoints("m") if ep.url == p.url)
    async with aiohttp.ClientSession() as s:
        held = asyncio.create_task(s.post(gw.url + "/v1/chat/completions",
                                          json={"model": "m", "messages": CHAT, "max_tokens": 3},
                                          headers={"x-sim-fault": "prefill.hang=inf"}))
        await until(lambda: ep_p.prefill_in_flight == 1)
        raw = msgspec.to_builtins(reloader.live.config)
        raw["models"] = [pd_model("vllm", [roleset("vllm", p2, d)])]
        with structlog.testing.capture_logs() as logs:
            result = reloader.reload("test", config_from_dict(raw, source="<test>"))
        assert result.removed == [f"m {p.url}"]
        line = next(e for e in logs if e["event"] == "config reloaded")
        assert line["draining_in_flight"] == 1
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
    assert await wait_for(lambda: ep_p.prefill_in_flight == 0, timeout=5)


async def test_an_invalid_config_is_refused_and_the_old_one_keeps_serving(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw)
    cases = [
        (dict(aliases=[{"name": "chat", "targets": [{"model": "gone"}]}]), "aliases[0].targets[0].model"),
        (dict(models=[model_block("m", "vllm", ["ftp://nope"])]), "models[0].endpoints[0].url"),
        (dict(routing={**f.data["routing"], "strategy": "fastest-please"}), "routing.strategy"),
        (dict(server={**f.data["server"], "max_body_bytes": 5}), "server.max_body_bytes"),
        (dict(listen={"host": "127.0.0.1", "port": 1}), "listen.port"),
        # a file whose models were lost in an edit: applied, it removed every endpoint
        (dict(models=[]), "models"),
    ]
    original = dict(f.data)
    for change, path in cases:
        f.data = dict(original)
        f.write(**change)
        result = f.reloader.reload("test")
        assert result.result != "ok" and result.key_path == path, result
        assert path in result.error
        assert (await chat(client)).choices[0].message.content       # the old config serves
    f.raw("models: [{name: m, endpoints: [")
    assert f.reloader.reload("test").key_path == "<yaml>"
    f.path.unlink()
    assert f.reloader.reload("test").key_path == "<file>"
    assert f.reloader.live.generation == 1 and gw.gw.pool.endpoints("m")[0].url == sim.url
    text = await gw.metrics_text()
    assert metric(text, "switchyard_config_reload_total", result="invalid") == 6
    assert metric(text, "switchyard_config_reload_total", result="restart_required") == 2
    assert metric(text, "switchyard_config_reload_total", result="ok") == 0
    assert metric(text, "switchyard_config_last_reload_successful") == 0
    f.data = dict(original)
    f.write()
    assert f.reloader.reload("test").result == "ok"
    assert metric(await gw.metrics_text(), "switchyard_config_last_reload_successful") == 1
    await client.close()


async def test_a_name_no_request_can_match_is_refused_at_a_reload_and_the_old_config_keeps_serving(
        sims, gateway, tmp_path):
    """A ``limits.users`` entry named with whitespace at its ends, and a control character inside
    a user's, a model's, an adapter's or an alias's name, are refused by a reload as by a start:
    one line naming the key, and the running config serves on."""
    sim = await sims("vllm", "m")
    keys = [{"key": "sk-reload-test-alice-0001", "user": "alice"}]
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={"api_keys": keys})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw, keys[0]["key"])
    original = dict(f.data)
    cases = [
        (dict(auth={**original["auth"], "api_keys": [{**keys[0], "user": "alice\r"}]}), "auth.api_keys[0].user"),
        (dict(limits={"users": {"alice ": {"rpm": 5}}}), "limits.users"),
        (dict(limits={"users": {"al\x1bice": {"rpm": 5}}}), "limits.users"),
        (dict(models=[model_block("m", "vllm", [sim.url]), model_block("m\x1f2", "vllm", [sim.url])]),
         "models[1].name"),
        (dict(models=[{**model_block("m", "vllm", [sim.url]), "adapters": {"lo\x00ra": "/a"}}]), "models[0].adapters"),
        (dict(aliases=[{"name": "ch\nat", "targets": [{"model": "m"}]}]), "aliases[0].name"),
    ]
    for change, path in cases:
        f.data = dict(original)
        f.write(**change)
        result = f.reloader.reload("test")
        assert (result.result, result.key_path) == ("invalid", path), result
        assert "\n" not in result.error, result.error
        assert (await chat(client)).choices[0].message.content       # the old config serves
    assert f.reloader.live.generation == 1
    assert metric(await gw.metrics_text(), "switchyard_config_reload_total", result="invalid") == len(cases)
    await client.close()


async def test_a_refused_reload_names_the_line_and_column_of_the_key_at_fault(sims, gateway, tmp_path):
    """A reload's error in what the file says names where in the file, then the key path, as
    --check-config and a start do; the key path is the result's, and the old config serves on."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    f.raw(f"models:\n  - name: m\n    endpoints:\n      - url: {sim.url}\n        engine: vlm\n")
    result = f.reloader.reload("test")
    assert (result.result, result.key_path) == ("invalid", "models[0].endpoints[0].engine"), result
    assert result.error.startswith(f"{f.path}:5:9: models[0].endpoints[0].engine: "), result.error
    f.raw(f"models:\n  - name: m\n    endpoints: ['{sim.url}']\n    strategy: fastest\n")
    result = f.reloader.reload("test")
    assert result.error.startswith(f"{f.path}:4:5: models[0].strategy: "), result.error
    client = openai_client(gw)
    assert (await chat(client)).choices[0].message.content       # the old config serves
    assert f.reloader.live.generation == 1
    await client.close()


async def test_strategy_watchdog_and_limits_apply_to_new_requests(sims, gateway, tmp_path):
    a, b = await sims("vllm", "m"), await sims("vllm", "m", ttft_base_ms=400.0)
    keys = [{"key": "sk-reload-test-alice-0001", "user": "alice"}]
    gw = await gateway([model_block("m", "vllm", [a.url])], auth={"api_keys": keys, "admin_token": TOKEN})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    alice = openai_client(gw, keys[0]["key"])
    assert (await chat(alice)).choices[0].message.content

    bob_key = "sk-reload-test-bob-00002"
    f.write(models=[model_block("m", "vllm", [b.url], lock_strategy="round-robin",
                                watchdog={"response_timeout_s": 0.1, "aggregated": True})],
            auth={**f.data["auth"], "api_keys": [{"key": bob_key, "user": "bob"}]},
            limits={"users": {"bob": {"rpm": 1}}})
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/admin/reload", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with s.post(gw.url + "/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            body = await r.json()
            assert r.status == 200 and body["result"] == "ok" and body["generation"] == 2
            assert set(body["changed"]) == {"models", "auth", "limits"}
    with pytest.raises(openai.AuthenticationError):             # alice's key is gone
        await chat(alice)
    bob = openai_client(gw, bob_key)
    with pytest.raises(openai.APIStatusError) as e:             # the new watchdog: b is slower than 0.1 s
        await chat(bob)
    assert e.value.status_code == 504
    with pytest.raises(openai.RateLimitError):                  # bob's new limit: 1 request a minute
        await chat(bob)
    for client in (alice, bob):
        await client.close()


async def test_admin_reload_answers_errors_with_the_key_path(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={"admin_token": TOKEN})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as s:
        f.write(aliases=[{"name": "m", "targets": [{"model": "m"}]}])
        async with s.post(gw.url + "/admin/reload", headers=hdr) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "config_invalid" and err["param"] == "aliases[0].name"
            assert "shadow a model" in err["message"]
        f.write(aliases=[], upstream={**f.data["upstream"], "connect_timeout_s": 1.0})
        async with s.post(gw.url + "/admin/reload", headers=hdr) as r:
            err = (await r.json())["error"]
            assert r.status == 409 and err["code"] == "restart_required"
            assert err["param"] == "upstream.connect_timeout_s"
        f.write(upstream=f.data["upstream"] | {"connect_timeout_s": 5.0}, auth={**f.data["auth"], "admin_token": "rotated-token"})
        async with s.post(gw.url + "/admin/reload", headers=hdr) as r:
            assert r.status == 200
        new_hdr = {"Authorization": "Bearer rotated-token"}
        for path in ("/status.json", "/admin/reload"):      # the rotated token, and only it, from now on
            async with s.request("GET" if path == "/status.json" else "POST", gw.url + path, headers=hdr) as r:
                assert r.status == 401
            async with s.request("GET" if path == "/status.json" else "POST", gw.url + path, headers=new_hdr) as r:
                assert r.status == 200
        f.reloader.loader = None
        async with s.post(gw.url + "/admin/reload", headers=new_hdr) as r:
            assert r.status == 409 and (await r.json())["error"]["code"] == "no_config_file"


async def test_turning_tenancy_on_needs_a_restart(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    f.write(auth={**f.data["auth"], "api_keys": [{"key": "sk-reload-test-carol-003", "user": "carol"}]})
    result = f.reloader.reload("test")
    assert (result.result, result.key_path) == ("restart_required", "auth")


async def test_routing_state_carries_over_unless_routing_settings_change(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    ctx = f.reloader.live.routing.ctx
    f.write(aliases=[{"name": "x", "targets": [{"model": "m"}]}])
    assert f.reloader.reload("test").result == "ok" and f.reloader.live.routing.ctx is ctx
    f.write(routing={**f.data["routing"], "strategy": "round-robin"})
    assert f.reloader.reload("test").result == "ok" and f.reloader.live.routing.ctx is not ctx
    assert f.reloader.live.routing.strategy_for("m", None) == "round-robin"


async def test_sessions_carry_over_a_reload_that_changes_the_routing_settings(sims, gateway, tmp_path):
    """The prefix index starts afresh with new routing settings; the session map does not (the engines
    still hold the conversations), so a session's next turn goes where its last one went."""
    sims_ = [await sims("vllm", "m") for _ in range(4)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in sims_])], routing={"strategy": "prefix-cache"})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw)

    async def turn(key: str) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT, max_tokens=1, extra_headers={"x-session-key": key})
        return raw.headers["target-pod"]

    before = {key: await turn(key) for key in ("a", "b", "c", "d", "e", "f")}
    ctx = f.reloader.live.routing.ctx
    f.write(routing={**f.data["routing"], "prefix_std_factor": 2.5})
    assert f.reloader.reload("test").result == "ok" and f.reloader.live.routing.ctx is not ctx
    assert {key: await turn(key) for key in before} == before
    assert metric(await gw.metrics_text(), "switchyard_routing_session_total", model="m", outcome="kept") == 6


async def test_a_reload_that_lowers_session_max_entries_trims_the_session_map_at_once(sims, gateway, tmp_path):
    """``routing.session_max_entries`` lowered by a reload bounds the session map from the reload on:
    the least recently seen sessions go at once (not when new ones push them out), and the others
    still go where their last turn went."""
    sims_ = [await sims("vllm", "m") for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in sims_])], routing={"strategy": "prefix-cache"})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw)

    async def turn(key: str) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT, max_tokens=1, extra_headers={"x-session-key": key})
        return raw.headers["target-pod"]

    before = {key: await turn(key) for key in ("a", "b", "c", "d", "e")}
    sessions = f.reloader.live.gen.services.view.sessions
    assert len(sessions) == 5
    f.write(routing={**f.data["routing"], "session_max_entries": 2})
    assert f.reloader.reload("test").result == "ok"
    assert len(sessions) == 2 and sessions.evictions == 3
    assert {key: await turn(key) for key in ("d", "e")} == {key: before[key] for key in ("d", "e")}
    assert metric(await gw.metrics_text(), "switchyard_routing_session_total", model="m", outcome="kept") == 2


async def test_sessions_and_prefixes_stay_on_an_engine_whose_endpoint_settings_a_reload_changed(sims, gateway, tmp_path):
    """An endpoint the new file declares with other settings (its ``max_prompt_tokens`` here) is a new
    endpoint of the pool, but the same engine at the same URL, still holding the conversations: the
    sessions and the prefix index's entries on it go to the endpoint that takes its place."""
    sims_ = [await sims("vllm", "m") for _ in range(4)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in sims_])], routing={"strategy": "prefix-cache"})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw)
    long_prompt = [{"role": "user", "content": "A question long enough to be indexed. " * 40}]

    async def turn(key: str | None) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT if key else long_prompt, max_tokens=1,
            extra_headers={"x-session-key": key} if key else None)
        return raw.headers["target-pod"]

    before = {key: await turn(key) for key in ("a", "b", "c", "d", "e", "f")}
    indexed = await turn(None)
    f.write(models=[model_block("m", "vllm", [{"url": s.url, "max_prompt_tokens": 100_000} for s in sims_])])
    result = f.reloader.reload("test")
    assert result.result == "ok" and len(result.removed) == len(result.added) == 4
    assert {key: await turn(key) for key in before} == before
    assert await turn(None) == indexed
    text = await gw.metrics_text()
    assert metric(text, "switchyard_routing_session_total", model="m", outcome="kept") == 6
    assert metric(text, "switchyard_routing_session_total", model="m", outcome="gone") == 0
    assert metric(text, "switchyard_routing_fallbacks_total", strategy="prefix-cache", reason="no_match") == 1


async def test_the_sessions_of_an_endpoint_a_reload_removed_go_with_it(sims, gateway, tmp_path):
    """An endpoint the new file leaves out takes its sessions with it: the map no longer holds them
    (nor the endpoint), and their next turns are routed as new sessions, not counted gone."""
    a, b = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [a.url, b.url])], routing={"strategy": "prefix-cache"})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw)

    async def turn(key: str) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT, max_tokens=1, extra_headers={"x-session-key": key})
        return raw.headers["target-pod"]

    pod_a, pod_b = a.url.removeprefix("http://"), b.url.removeprefix("http://")
    before: dict[str, str] = {}
    while len(before) < 4 or set(before.values()) != {pod_a, pod_b}:     # sessions on both
        assert len(before) < 64
        before[f"s{len(before)}"] = await turn(f"s{len(before)}")
    left = {k for k, pod in before.items() if pod == pod_b}
    sessions = f.reloader.live.gen.services.view.sessions
    f.write(models=[model_block("m", "vllm", [a.url])])
    assert f.reloader.reload("test").result == "ok"
    await until(lambda: len(sessions) == len(before) - len(left))
    assert all(sessions.get(f"m\0s:{k}") is None for k in left)
    assert {await turn(k) for k in before} == {pod_a}
    text = await gw.metrics_text()
    assert metric(text, "switchyard_routing_session_total", model="m", outcome="gone") == 0
    assert metric(text, "switchyard_routing_session_total", model="m", outcome="kept") == len(before) - len(left)


async def slo_gateway_that_learnt(sims, gateway, tmp_path, **settings):
    """Two engines behind an slo model whose latency models have seen both (four streams sent
    round-robin): (the engines, the gateway, its config file, a function that sends a stream).
    ``settings``: other sections of the gateway's config."""
    sims_ = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in sims_], strategy="slo")],
                       routing={"slo_min_samples": 2, "slo_exploration": 0.0}, **settings)
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw)

    async def stream(**headers: str) -> None:
        chunks = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=3, stream=True,
                                                      extra_headers=headers)
        async for _ in chunks:
            pass

    for _ in range(4):
        await stream(**{"routing-strategy": "round-robin"})
    return sims_, gw, f, stream


async def test_slo_keeps_what_it_learnt_of_an_engine_whose_endpoint_settings_a_reload_changed(sims, gateway, tmp_path):
    """The latency models are the engine's: an endpoint declared again with other settings keeps them,
    so a request with objectives is routed on its predictions at once, not as if nothing were known."""
    sims_, gw, f, stream = await slo_gateway_that_learnt(sims, gateway, tmp_path)
    await until(lambda: all(f.reloader.live.routing.ctx.latency.samples(ep)[0] >= 2
                            for ep in gw.gw.pool.endpoints("m")))
    f.write(models=[model_block("m", "vllm", [{"url": s.url, "max_prompt_tokens": 100_000} for s in sims_],
                                strategy="slo")])
    assert f.reloader.reload("test").result == "ok"
    await stream(**{"x-slo-ttft-ms": "600000"})      # feasible on whatever two samples predict
    text = await gw.metrics_text()
    assert metric(text, "switchyard_slo_routing_decisions_total", model="m", reason="slo_feasible") == 1
    assert metric(text, "switchyard_slo_routing_decisions_total", model="m", reason="slo_no_model") == 0


async def test_slo_keeps_what_it_learnt_of_the_engines_across_a_reload_that_changes_the_routing_settings(
        sims, gateway, tmp_path):
    """A reload that tunes slo (its margin here) starts the prefix index afresh, but the engines are
    the same: what the latency models learnt of them carries over (in the new settings), as the
    sessions do, so a request with objectives is routed on their predictions at once."""
    sims_, gw, f, stream = await slo_gateway_that_learnt(sims, gateway, tmp_path)
    ctx = f.reloader.live.routing.ctx
    await until(lambda: all(ctx.latency.samples(ep)[0] >= 2 for ep in gw.gw.pool.endpoints("m")))
    f.write(routing={**f.data["routing"], "slo_margin": 0.2, "slo_forgetting": 0.95})
    assert f.reloader.reload("test").result == "ok" and f.reloader.live.routing.ctx is not ctx
    await stream(**{"x-slo-ttft-ms": "600000"})      # feasible on whatever two samples predict
    text = await gw.metrics_text()
    assert metric(text, "switchyard_slo_routing_decisions_total", model="m", reason="slo_no_model") == 0
    assert metric(text, "switchyard_slo_routing_decisions_total", model="m", reason="slo_feasible") == 1
    latency = f.reloader.live.routing.ctx.latency
    await until(lambda: sum(latency.samples(ep)[0] for ep in gw.gw.pool.endpoints("m")) == 5)  # and learns on


async def test_slo_forgets_an_engine_a_reload_removed_when_its_series_go_and_keeps_one_declared_anew(
        sims, gateway, tmp_path):
    """A removed endpoint's latency models go with its metric series (``removed_endpoint_series_s``
    after it left and its last request ended), so a gateway whose engines come and go does not keep
    a model per engine it ever had; an engine declared again at its URL keeps what was learnt of it."""
    sims_, gw, f, stream = await slo_gateway_that_learnt(sims, gateway, tmp_path,
                                                         server={"removed_endpoint_series_s": 0.2})
    latency = f.reloader.live.routing.ctx.latency
    await until(lambda: all(latency.samples(ep)[0] >= 2 for ep in gw.gw.pool.endpoints("m")))
    gone = next(ep for ep in gw.gw.pool.endpoints("m") if ep.url == sims_[1].url)
    f.write(models=[model_block("m", "vllm", [{"url": sims_[0].url, "max_prompt_tokens": 100_000}],
                                strategy="slo")])
    assert f.reloader.reload("test").result == "ok"
    (kept,) = gw.gw.pool.endpoints("m")
    assert await wait_for(lambda: gw.gw.pool.retired == [], timeout=5)     # swept
    assert latency.samples(kept)[0] >= 2 and latency.samples(gone) == (0, 0) and len(latency) == 1


async def test_fallbacks_reach_the_decisions_after_a_reload_that_keeps_the_routing_state(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url], strategy="vtc-basic")])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    seen: list[tuple[str, tuple]] = []
    f.reloader.live.routing.observers.append(lambda ireq, d, fallbacks, s: seen.append((d.strategy, fallbacks)))
    client = openai_client(gw)
    await chat(client)                              # no user: vtc-basic falls back
    assert seen[-1] == ("vtc-basic", (("vtc-basic", "no_user"),))

    ctx = f.reloader.live.routing.ctx
    f.write(models=[model_block("m", "vllm", [sim.url], strategy="session-affinity")])
    assert f.reloader.reload("test").result == "ok" and f.reloader.live.routing.ctx is ctx
    await chat(client)                              # no session header: session-affinity falls back
    await wait_for(lambda: len(seen) == 2)
    assert seen[-1] == ("session-affinity", (("session-affinity", "no_session"),))


async def test_kubernetes_endpoints_keep_working_across_a_reload(emu, sims, gateway, tmp_path):
    from tests.support.factories import sim_pod

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    pod_sim, static = await sims("vllm", "llama"), await sims("vllm", "qwen")
    sim_pod(emu, "llama-0", pod_sim, "llama")
    gw = await gateway([model_block("qwen", "vllm", [static.url])],
                       kubernetes={"enabled": True, "kubeconfig": str(kubeconfig), "namespaces": ["llm"]})
    assert await wait_for(lambda: gw.gw.pool.ready("llama"))
    pod_ep = gw.gw.pool.endpoints("llama")[0]
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    f.write(models=[], aliases=[{"name": "chat", "targets": [{"model": "llama"}]}],
            kubernetes={**f.data["kubernetes"], "models": {"llama": {"max_prompt_tokens": 100000}}})
    result = f.reloader.reload("test")
    assert result.result == "ok" and result.removed == [f"qwen {static.url}"]
    assert gw.gw.pool.endpoints("llama") == [pod_ep] and pod_ep.ready
    disc = gw.runner.app[DISCOVERY_KEY]
    assert disc.kcfg.models["llama"].max_prompt_tokens == 100000
    # the pods are listed again with it: the pod's endpoint takes it, the same engine
    assert await wait_for(lambda: [e.max_prompt_tokens for e in gw.gw.pool.endpoints("llama")] == [100000])
    client = openai_client(gw)
    r = await client.chat.completions.with_raw_response.create(model="chat", messages=CHAT, max_tokens=2)
    assert r.headers["x-served-model"] == "llama" and r.headers["target-pod"] == "llama-0"
    sim_pod(emu, "llama-1", await sims("vllm", "llama"), "llama")     # discovery goes on after the reload
    assert await wait_for(lambda: len(gw.gw.pool.ready("llama")) == 2)
    assert (await asyncio.gather(*(chat(client, "chat") for _ in range(4))))[0].choices
    await client.close()


async def test_responses_stored_before_a_reload_are_continued_after_it(sims, gateway, tmp_path):
    sim = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw)
    first = await client.responses.create(model="m", input="Hello", max_output_tokens=3)
    other = await sims("vllm", "m", enable_responses_store=True)
    f.write(models=[model_block("m", "vllm", [sim.url, other.url])])
    assert f.reloader.reload("test").result == "ok"
    for _ in range(4):      # the id → endpoint map survived: every follow-up reaches the owner
        r = await client.responses.create(model="m", input="Go on", max_output_tokens=3,
                                          previous_response_id=first.id)
        assert r.status == "incomplete"
    f.write(responses={**f.data["responses"], "affinity_ttl_s": 5.0})
    result = f.reloader.reload("test")
    assert (result.result, result.key_path) == ("restart_required", "responses.affinity_ttl_s")
    await client.close()


async def test_a_model_a_reload_removed_leaves_the_in_flight_gauge_once_its_last_request_ended(
        sims, gateway, tmp_path):
    """``switchyard_in_flight_requests`` follows the models served, as the endpoints' gauges follow
    the pool: a model a reload removed counts its stream in flight until that stream ends, and then
    its series goes (a dashboard's "in flight by model" would otherwise draw a line at 0 for every
    model the gateway ever served)."""
    a, b = await sims("vllm", "m"), await sims("vllm", "gone", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [a.url]), model_block("gone", "vllm", [b.url])])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    client = openai_client(gw)
    await chat(client, model="gone")
    stream = await client.chat.completions.create(model="gone", messages=CHAT, max_tokens=30, stream=True)
    await stream.__anext__()
    f.write(models=[model_block("m", "vllm", [a.url])])
    assert f.reloader.reload("test").result == "ok"
    text = await gw.metrics_text()
    assert metric(text, "switchyard_in_flight_requests", model="gone") == 1     # its stream still counts
    async for _ in stream:
        pass
    await chat(client)
    in_flight = series(await gw.metrics_text(), "switchyard_in_flight_requests")
    assert in_flight == {'model="m"': 0.0}
    await client.close()


async def test_an_engine_declared_anew_counts_the_requests_it_still_runs(sims, gateway, tmp_path):
    """The requests a reload found on an endpoint declared again at its URL with other settings
    still run on the engine: the endpoint in its place counts them until they end, so the next
    requests go by the engine's real load instead of piling on the engine that looked idle."""
    sims_ = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in sims_], strategy="least-request")])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    busy = next(e for e in gw.gw.pool.endpoints() if e.url == sims_[0].url)
    pin = {"routing-strategy": "session-affinity", "x-session-id": encode_session_id(busy.address),
           "x-sim-fault": "stall_before_first=inf"}
    body = {"model": "m", "prompt": "hold", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async def hold() -> None:
            async with s.post(gw.url + "/v1/completions", json=body, headers=pin) as r:
                await r.read()
        stuck = [asyncio.create_task(hold()) for _ in range(2)]
        try:
            await until(lambda: busy.in_flight == 2)
            f.write(models=[model_block("m", "vllm", [{"url": u.url, "max_prompt_tokens": 100_000} for u in sims_],
                                        strategy="least-request")])
            assert f.reloader.reload("test").result == "ok"
            anew = next(e for e in gw.gw.pool.endpoints() if e.url == sims_[0].url)
            assert anew is not busy and anew.in_flight == 2
            async with s.post(gw.url + "/v1/completions", json={**body, "prompt": "go"}) as r:
                assert r.status == 200 and r.headers["target-pod"] == sims_[1].url.removeprefix("http://")
        finally:
            for t in stuck:
                t.cancel()
            for t in stuck:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
    await until(lambda: busy.in_flight == 0)
    assert anew.in_flight == 0


async def test_an_engine_removed_and_declared_again_counts_the_requests_it_still_runs(sims, gateway, tmp_path):
    """An endpoint one reload removes and a later one declares again, while requests from before
    still run on its engine: the new endpoint counts them until they end, as one declared anew in
    a single reload does."""
    sims_ = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in sims_], strategy="least-request")])
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    busy = next(e for e in gw.gw.pool.endpoints() if e.url == sims_[0].url)
    pin = {"routing-strategy": "session-affinity", "x-session-id": encode_session_id(busy.address),
           "x-sim-fault": "stall_before_first=inf"}
    body = {"model": "m", "prompt": "hold", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async def hold() -> None:
            async with s.post(gw.url + "/v1/completions", json=body, headers=pin) as r:
                await r.read()
        stuck = [asyncio.create_task(hold()) for _ in range(2)]
        try:
            await until(lambda: busy.in_flight == 2)
            f.write(models=[model_block("m", "vllm", [sims_[1].url], strategy="least-request")])
            assert f.reloader.reload("test").result == "ok"
            f.write(models=[model_block("m", "vllm", [s.url for s in sims_], strategy="least-request")])
            assert f.reloader.reload("test").result == "ok"
            back = next(e for e in gw.gw.pool.endpoints() if e.url == sims_[0].url)
            assert back is not busy and back.in_flight == 2
            async with s.post(gw.url + "/v1/completions", json={**body, "prompt": "go"}) as r:
                assert r.status == 200 and r.headers["target-pod"] == sims_[1].url.removeprefix("http://")
        finally:
            for t in stuck:
                t.cancel()
            for t in stuck:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
    await until(lambda: busy.in_flight == 0)
    assert back.in_flight == 0


async def test_prefill_and_decode_declared_anew_carry_the_pd_trackers_of_the_requests_they_still_run(
        sims, gateway):
    """A prefill and a decode a reload declares again at their URLs with other settings (and a
    prefill a later reload removes and the next declares again) count a P/D request still running
    on their engines in every tracker (prefills in flight, decodes pending, active and resident
    prompt tokens), as they count its request in flight, and give them back when it ends: the next
    pair is chosen by the engines' real load, not by endpoints that look idle."""
    p, d = await pd_pair(sims, "vllm")
    p2 = await sims("vllm", "m", role="prefill")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    reloader = reloader_of(gw)
    pool = gw.gw.pool

    def ep(url):
        return next(e for e in pool.endpoints("m") if e.url == url)

    def trackers(e):
        return (e.in_flight, e.prefill_in_flight, e.pending_decode, e.token_active, e.token_kv)

    def declare(*prefills):
        raw = msgspec.to_builtins(reloader.live.config)
        raw["models"] = [pd_model("vllm", [{"name": "rs-1", "prefill": [{"url": u, "max_prompt_tokens": 100_000 + i}
                                                                          for i, u in enumerate(prefills)],
                                            "decode": [{"url": d.url, "max_prompt_tokens": 100_000 + len(declared)}]}])]
        declared.append(prefills)
        assert reloader.reload("test", config_from_dict(raw, source="<test>")).result == "ok"

    declared: list = []
    first_p, first_d = ep(p.url), ep(d.url)
    async with aiohttp.ClientSession() as s:
        held = asyncio.create_task(s.post(gw.url + "/v1/chat/completions",
                                          json={"model": "m", "messages": CHAT, "max_tokens": 3},
                                          headers={"x-sim-fault": "prefill.hang=inf"}))
        try:
            await until(lambda: first_p.prefill_in_flight == 1)
            before_p, before_d = trackers(first_p), trackers(first_d)
            assert before_p[3] > 0 and before_p[4] > 0 and before_d[:3] == (1, 0, 1), (before_p, before_d)
            declare(p.url)                          # both declared anew
            anew_p, anew_d = ep(p.url), ep(d.url)
            assert anew_p is not first_p and anew_d is not first_d
            assert trackers(anew_p) == before_p and trackers(anew_d) == before_d
            declare(p2.url)                         # the prefill removed ...
            declare(p.url, p2.url)                  # ... and declared again
            back = ep(p.url)
            assert back is not anew_p and trackers(back) == before_p
        finally:
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held
    await until(lambda: first_p.prefill_in_flight == 0 and first_d.in_flight == 0)
    for e in (first_p, anew_p, back, first_d, anew_d, ep(d.url)):
        assert trackers(e) == (0, 0, 0, 0.0, 0.0), (e.url, trackers(e))


async def test_an_engine_declared_anew_keeps_what_the_probes_and_the_scrapes_knew_of_it(sims, gateway, tmp_path):
    """An endpoint a reload declares again at its URL with other settings is the same engine: one
    the health probes took out stays out until a probe finds it up (it joined ready, and requests
    went to an engine known to be down), and its last engine metrics stay its own until the next
    scrape (the load strategies read none meanwhile)."""
    up, down = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [up.url, down.url])],
                       health={"interval_s": 0.1, "timeout_s": 1.0}, scrape={"interval_s": 60.0})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    pool = gw.gw.pool

    def ep(url):
        return next(e for e in pool.endpoints("m") if e.url == url)

    await until(lambda: all(e.metrics is not None for e in pool.endpoints("m")))
    snapshots = {e.url: e.metrics for e in pool.endpoints("m")}
    await down.close()
    await until(lambda: not ep(down.url).healthy, timeout=10)
    f.write(models=[model_block("m", "vllm", [{"url": u, "max_prompt_tokens": 100_000} for u in (up.url, down.url)])])
    assert f.reloader.reload("test").result == "ok"
    anew_up, anew_down = ep(up.url), ep(down.url)
    assert anew_down.source == "static" and not anew_down.healthy and not anew_down.ready
    assert anew_up.healthy and anew_up.metrics is snapshots[up.url] and anew_down.metrics is snapshots[down.url]


async def test_a_reload_that_changes_metrics_max_age_s_applies_it_to_the_engine_gauges(sims, gateway):
    """``routing.metrics_max_age_s`` reloads with the rest of ``routing``: the re-exported engine
    gauges (``switchyard_engine_*``) leave out a snapshot older than the live value. With one
    scrape at start and none for a minute, the snapshot is older than the 0.05 s the gateway
    started with, and within the 600 s a reload sets. Before, /metrics kept the start's value
    until a restart."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], routing={"metrics_max_age_s": 0.05},
                       scrape={"interval_s": 60.0})
    async with aiohttp.ClientSession() as s:
        async def page() -> str:
            async with s.get(gw.url + "/metrics") as r:
                return await r.text()

        async def stale() -> bool:
            return metric(await page(), "switchyard_engine_metrics_age_seconds", model="m") > 0.1
        await until(stale)
        assert not series(await page(), "switchyard_engine_running_requests")
        reloader = reloader_of(gw)
        config = reloader.live.config
        assert reloader.reload("test", msgspec.structs.replace(config, routing=msgspec.structs.replace(
            config.routing, metrics_max_age_s=600.0))).result == "ok"
        assert series(await page(), "switchyard_engine_running_requests")


async def test_a_reload_that_removes_the_admin_token_turns_the_admin_api_off_as_if_never_set(sims, gateway):
    """``The route exists only when auth.admin_token is set (a 404 otherwise)``: a reload that
    removes the token answers /admin/* as a gateway started without one does, 404 ``unknown
    path``, and one that sets it again turns them back on. Before, they answered 401 "a valid admin
    token is required", which no token could meet."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={"admin_token": TOKEN})
    reloader = reloader_of(gw)
    config = reloader.live.config
    off = msgspec.structs.replace(config, auth=msgspec.structs.replace(config.auth, admin_token=None))
    assert reloader.reload("test", off).result == "ok"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        for method, path in (("POST", "/admin/reload"), ("GET", "/admin/users")):
            async with s.request(method, gw.url + path) as r:
                body = await r.json()
                assert (r.status, body["error"]["message"]) == (404, f"unknown path {path}"), body
        assert reloader.reload("test", config).result == "ok"
        async with s.get(gw.url + "/admin/users") as r:
            assert r.status == 200


async def test_a_file_that_cannot_be_read_as_a_config_is_refused_and_the_old_one_keeps_serving(sims, gateway,
                                                                                                  tmp_path):
    """The path replaced by a directory, a dangling symlink (a ConfigMap's swap leaves one for a
    moment), bytes that are not UTF-8 and an empty file: each refused with its cause, counted as
    invalid, answered 400 by POST /admin/reload, and the running config keeps serving."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={"admin_token": TOKEN})
    path = tmp_path / "gw.yaml"
    f = ConfigFile(gw, path)
    client = openai_client(gw)

    def directory() -> None:
        path.mkdir()

    def dangling() -> None:
        path.symlink_to(tmp_path / "..data" / "gw.yaml")

    def latin1() -> None:
        path.write_bytes(b"models: [{name: caf\xe9, endpoints: ['http://127.0.0.1:1']}]\n")

    def empty() -> None:
        path.write_bytes(b"")

    cases = [(directory, "<file>", "cannot read: Is a directory"),
             (dangling, "<file>", "cannot read: No such file or directory"),
             (latin1, "<file>", "not UTF-8 text: invalid continuation byte at byte 19"),
             (empty, "models", "no model is declared")]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        for make, param, message in cases:
            make()
            async with s.post(gw.url + "/admin/reload") as r:
                err = (await r.json())["error"]
            assert (r.status, err["code"], err["param"]) == (400, "config_invalid", param), err
            assert err["message"].startswith(f"{path}: {param}: {message}"), err
            assert (await chat(client)).choices[0].message.content       # the old config serves
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
        async with s.get(gw.url + "/status.json") as r:
            last = (await r.json())["gateway"]["config"]["last_reload"]
    assert (last["result"], last["key_path"]) == ("invalid", "models")
    assert f.reloader.live.generation == 1 and gw.gw.pool.endpoints("m")[0].url == sim.url
    text = await gw.metrics_text()
    assert metric(text, "switchyard_config_reload_total", result="invalid") == len(cases)
    assert metric(text, "switchyard_config_last_reload_successful") == 0
    await client.close()


async def test_a_reload_forgets_the_prefix_entries_of_an_engine_it_removed_and_keeps_those_of_one_it_declared_anew(
        sims, gateway, tmp_path):
    """An endpoint a reload removes for good leaves the prefix index with it (its entries, which
    ``switchyard_prefix_index_entries`` counts, and the endpoint they hold), not after the idle TTL;
    one declared again with other settings keeps its entries, and one left as it was keeps them too."""
    from routers.prefix_index import prefix_keys

    sims_ = [await sims("vllm", "m") for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in sims_])], routing={"strategy": "prefix-cache"})
    f = ConfigFile(gw, tmp_path / "gw.yaml")
    index = f.reloader.live.routing.ctx.prefix_index
    eps = {ep.url: ep for ep in f.reloader.live.routing.pool.endpoints("m")}
    for i, s in enumerate(sims_):       # prompts of 3, 4 and 5 blocks
        index.apply_insert(prefix_keys(f"prompt {i} " * 1000, "m", index.block_chars, 2 + i + 1), eps[s.url])
    assert index.stats()["entries"] == 12
    kept, anew, gone = sims_
    f.write(models=[model_block("m", "vllm", [kept.url, {"url": anew.url, "max_prompt_tokens": 100_000}])])
    result = f.reloader.reload("test")
    assert result.result == "ok" and len(result.removed) == 2 and len(result.added) == 1
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert f.reloader.live.routing.ctx.prefix_index is index
    assert index.stats()["entries"] == 3 + 4
    assert eps[gone.url] not in index.slots().values()
    assert metric(await gw.metrics_text(), "switchyard_prefix_index_entries") == 7
    new = next(ep for ep in f.reloader.live.routing.pool.endpoints("m") if ep.url == anew.url)
    assert new in index.slots().values() and eps[kept.url] in index.slots().values()
