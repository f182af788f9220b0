"""Sessions through the real gateway, driven by the openai SDK: what names a session under each
strategy, what a session name may be, and whose session it is."""

from __future__ import annotations

import openai
import pytest

from tests.support.factories import model_block
from tests.support.gateway_process import metric_total
from tests.support.http import openai_client, sim_state
from tests.support.lora import FAST_LORA, LORA_SIM
from tests.support.waiting import wait_for

CHAT = [{"role": "user", "content": "hi"}]


async def served(engine) -> list[str]:
    """The API paths an engine was sent (its health and models probes left out)."""
    return [r["path"] for r in (await sim_state(engine.url))["received"] if r["path"] != "/v1/models" and r["path"].startswith("/v1/")]


async def test_session_affinity_keeps_a_prompt_cache_key_on_one_engine_after_the_key_headers(sims, gateway):
    """A client that names its conversation by ``prompt_cache_key`` alone stays on one engine under
    ``session-affinity`` (rendezvous over the key, as for ``x-session-key``), and the key headers win
    over it."""
    engines = [await sims("vllm", "m") for _ in range(4)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="session-affinity")])
    client = openai_client(gw)
    for s in range(6):
        served = set()
        for _ in range(5):
            raw = await client.chat.completions.with_raw_response.create(
                model="m", max_tokens=2, messages=CHAT, prompt_cache_key=f"conv-{s}")
            assert raw.parse().choices[0].message.content
            served.add(raw.headers["target-pod"])
        assert len(served) == 1, (s, served)
    page = await gw.metrics_text()
    assert metric_total(page, "switchyard_routing_fallbacks_total", strategy="session-affinity") == 0
    # the header names the session: whatever prompt_cache_key says, its engine is the header's
    raw = await client.chat.completions.with_raw_response.create(
        model="m", max_tokens=2, messages=CHAT, extra_headers={"x-session-key": "by-header"})
    pod = raw.headers["target-pod"]
    for s in range(6):
        raw = await client.chat.completions.with_raw_response.create(
            model="m", max_tokens=2, messages=CHAT, prompt_cache_key=f"conv-{s}",
            extra_headers={"x-session-key": "by-header"})
        assert raw.headers["target-pod"] == pod


@pytest.mark.parametrize("value", [7, 1.5, True, {"id": "conv-1"}, ["conv-1"]])
async def test_a_prompt_cache_key_that_is_no_string_is_400_on_chat_completions_and_responses(sims, gateway, value):
    """OpenAI types ``prompt_cache_key`` as a string: any other JSON value is refused with its
    ``param`` named, and reaches no engine; ``null`` is no key and is served."""
    e = await sims("vllm", "m", enable_responses_store=True)
    gw = await gateway([model_block("m", "vllm", [e.url], strategy="prefix-cache")])
    client = openai_client(gw)
    calls = [
        lambda key: client.chat.completions.create(model="m", max_tokens=2, messages=CHAT, prompt_cache_key=key),
        lambda key: client.completions.create(model="m", max_tokens=2, prompt="hi", extra_body={"prompt_cache_key": key}),
        lambda key: client.responses.create(model="m", max_output_tokens=2, input="hi", prompt_cache_key=key),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as err:
            await call(value)
        body = err.value.body
        assert err.value.status_code == 400 and body["type"] == "invalid_request_error", body
        assert body["param"] == "prompt_cache_key", body
    assert await served(e) == []
    for call in calls:
        await call(None)
    assert await served(e) == ["/v1/chat/completions", "/v1/completions", "/v1/responses"]


async def test_an_adapters_session_under_lora_prefix_cache_is_not_its_base_models_of_the_same_name(sims, gateway):
    """Under ``lora.strategy: prefix-cache`` one session name used with the base model and with an
    adapter of it is two sessions: the adapter's turns neither continue the base model's session
    nor move it."""
    a = await sims("vllm", "m", **LORA_SIM)
    b = await sims("vllm", "m", lora_modules=("sql=org/sql-lora",), **LORA_SIM)
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="prefix-cache")],
                       lora={**FAST_LORA, "strategy": "prefix-cache"})
    await wait_for(lambda: any("sql" in ep.adapters.served for ep in gw.gw.pool.endpoints()))
    client = openai_client(gw)
    base, adapter = [], []
    for _ in range(3):
        for model, served in (("m", base), ("sql", adapter)):
            raw = await client.chat.completions.with_raw_response.create(
                model=model, max_tokens=2, messages=CHAT, prompt_cache_key="conv-1")
            assert raw.parse().choices[0].message.content
            served.append(raw.headers["target-pod"])
    assert len(set(base)) == 1, base
    assert adapter == [b.url.split("//")[1]] * 3
    # each continues its own session: two turns kept of each, none of the adapter's on the base's
    page = await gw.metrics_text()
    assert metric_total(page, "switchyard_routing_session_total", outcome="kept") == 4


ALICE, BOB = "sk-alice-sessions", "sk-bob-sessions"
KEYS = {"api_keys": [{"key": ALICE, "user": "alice"}, {"key": BOB, "user": "bob"}]}


async def test_two_users_who_name_a_session_alike_hold_two_sessions(sims, gateway):
    """With auth on a session is its user's: bob's turns under alice's session name neither continue
    her session nor move it."""
    engines = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")], auth=KEYS)
    alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)
    served: dict[str, list[str]] = {"alice": [], "bob": []}
    for _ in range(3):
        for name, client in (("alice", alice), ("bob", bob)):
            raw = await client.chat.completions.with_raw_response.create(
                model="m", max_tokens=2, messages=CHAT, prompt_cache_key="conv-1")
            assert raw.parse().choices[0].message.content
            served[name].append(raw.headers["target-pod"])
    assert len(set(served["alice"])) == 1 and len(set(served["bob"])) == 1, served
    page = await gw.metrics_text()
    # two turns kept of each user's session; bob's first turn found no session of his
    assert metric_total(page, "switchyard_routing_session_total", outcome="kept") == 4


async def test_a_user_naming_a_new_session_on_every_request_does_not_push_out_another_users(sims, gateway):
    """One user holds at most ``routing.session_user_share`` of the map: bob's stream of fresh
    session names churns his own sessions, and alice's stays."""
    engines = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")], auth=KEYS,
                       routing={"session_max_entries": 20})
    alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)

    async def turn(client, key: str) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", max_tokens=2, messages=CHAT, prompt_cache_key=key)
        assert raw.parse().choices[0].message.content
        return raw.headers["target-pod"]

    first = await turn(alice, "alice-conv")
    for i in range(40):
        await turn(bob, f"bob-{i}")
    assert await turn(alice, "alice-conv") == first
    page = await gw.metrics_text()
    assert metric_total(page, "switchyard_routing_session_total", outcome="kept") == 1
    await turn(bob, "bob-0")            # his own oldest went to make room for his newest
    page = await gw.metrics_text()
    assert metric_total(page, "switchyard_routing_session_total", outcome="kept") == 1


async def test_a_users_stored_responses_count_against_that_users_share_of_the_session_map(sims, gateway):
    """With gateway-held Responses state each stored response's lineage (``r:<id>``) is an entry of
    the session map, named by its owner: bob's stream of stored responses churns his own share, as
    his fresh session names would, and alice's session stays. Evictions are counted by reason."""
    engines = [await sims("vllm", "m") for _ in range(2)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")], auth=KEYS,
                       routing={"session_max_entries": 20}, responses={"state": "gateway"})
    alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)

    async def turn() -> str:
        raw = await alice.chat.completions.with_raw_response.create(
            model="m", max_tokens=2, messages=CHAT, prompt_cache_key="alice-conv")
        assert raw.parse().choices[0].message.content
        return raw.headers["target-pod"]

    first = await turn()
    for i in range(40):
        assert (await bob.responses.create(model="m", input=f"question {i}", max_output_tokens=2)).id
    assert await turn() == first
    page = await gw.metrics_text()
    assert metric_total(page, "switchyard_routing_session_total", outcome="kept") == 1
    # bob holds five (a quarter of twenty): his 35 oldest went to make room for his newest
    assert metric_total(page, "switchyard_session_map_evictions_total", reason="user_share") == 35
    assert metric_total(page, "switchyard_session_map_evictions_total", reason="full") == 0
