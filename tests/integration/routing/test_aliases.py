"""Aliases through the real gateway, driven by the openai SDK: the split, stickiness, the body
rewrite the engine sees, ``x-served-model``, ``/v1/models``, the counter and the record."""

from __future__ import annotations

from collections import Counter

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.factories import model_block
from tests.support.http import openai_client

CHAT = [{"role": "user", "content": "Which track?"}]
ALIAS = {"name": "chat", "targets": [{"model": "llama-8b", "weight": 90}, {"model": "llama-8b-v2", "weight": 10}]}


@pytest.fixture
async def canary(sims, gateway):
    # the simulated vLLM answers 404 for a model it does not serve: the rewrite is checked by it
    stable = await sims("vllm", "llama-8b")
    v2 = await sims("vllm", "llama-8b-v2")
    qwen = await sims("sglang", "qwen")
    gw = await gateway([model_block("llama-8b", "vllm", [stable.url]), model_block("llama-8b-v2", "vllm", [v2.url]),
                        model_block("qwen", "sglang", [qwen.url])],
                       aliases=[ALIAS, {"name": "mixed", "sticky": "none",
                                        "targets": [{"model": "llama-8b-v2"}, {"model": "qwen"}]},
                                {"name": "by-session", "sticky": "session",
                                 "targets": [{"model": "llama-8b", "weight": 1}, {"model": "qwen", "weight": 1}]}])
    records = []
    gw.gw.observers.append(lambda rec, _d: records.append(rec))
    return gw, records


def alias_counts(text: str) -> dict[tuple[str, str], float]:
    return {(s.labels["alias"], s.labels["target"]): s.value for f in text_string_to_metric_families(text)
            if f.name == "switchyard_alias_requests" for s in f.samples if s.name.endswith("_total")}


async def test_sdk_clients_stick_to_one_arm_and_see_the_served_model(canary):
    gw, records = canary
    client = openai_client(gw)
    served: dict[str, set[str]] = {}
    for i in range(60):
        user = f"user-{i}"
        for stream in (False, True):
            raw = await client.chat.completions.with_raw_response.create(
                model="chat", messages=CHAT, max_tokens=3, user=user, stream=stream)
            target = raw.headers["x-served-model"]
            served.setdefault(user, set()).add(target)
            if stream:
                chunks = [c async for c in raw.parse()]
                assert chunks[-1].choices[-1].finish_reason and {c.model for c in chunks} == {target}
                assert not any(c.usage for c in chunks)        # the injected include_usage is still hidden
            else:
                r = raw.parse()
                assert r.model == target and r.choices[0].message.content
    assert all(len(arms) == 1 for arms in served.values())
    arms = Counter(next(iter(a)) for a in served.values())
    assert set(arms) == {"llama-8b", "llama-8b-v2"} and arms["llama-8b"] > arms["llama-8b-v2"]

    counts = alias_counts(await gw.metrics_text())
    assert counts[("chat", "llama-8b")] == 2 * arms["llama-8b"]
    assert counts[("chat", "llama-8b-v2")] == 2 * arms["llama-8b-v2"]
    assert {(r.alias, r.status) for r in records} == {("chat", 200)}
    assert {r.model for r in records} == set(arms)          # metrics and logs name the model that served
    assert all(r.prompt_tokens and r.completion_tokens == 3 for r in records)
    await client.close()


async def test_models_lists_aliases_with_their_targets(canary):
    gw, _ = canary
    client = openai_client(gw)
    models = {m.id: m for m in (await client.models.list()).data}
    assert {"llama-8b", "llama-8b-v2", "qwen", "chat", "mixed", "by-session"} <= set(models)
    chat = models["chat"].model_dump()
    assert chat["targets"] == ALIAS["targets"] and chat["sticky"] == "user" and chat["ready_endpoints"] == 2
    assert "targets" not in models["qwen"].model_dump()
    await client.close()


async def test_session_stickiness_and_per_request_draws_across_engines(canary):
    gw, _ = canary
    client = openai_client(gw)
    by_session = {}
    for i in range(12):
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model="by-session", messages=CHAT, max_tokens=2, user="same-user",
                extra_headers={"x-session-id": f"s{i}"})
            by_session.setdefault(i, set()).add(raw.headers["x-served-model"])
    assert all(len(v) == 1 for v in by_session.values())
    assert set().union(*by_session.values()) == {"llama-8b", "qwen"}     # sessions of one user spread
    drawn = Counter()
    for _ in range(30):     # sticky: none — each request drawn; an SGLang target answers too
        raw = await client.chat.completions.with_raw_response.create(model="mixed", messages=CHAT, max_tokens=2,
                                                                     user="same-user")
        assert raw.parse().choices[0].message.content
        drawn[raw.headers["x-served-model"]] += 1
    assert set(drawn) == {"llama-8b-v2", "qwen"}
    await client.close()


async def test_a_target_without_ready_endpoints_is_passed_over(canary):
    gw, _ = canary
    client = openai_client(gw)
    v2 = gw.gw.pool.endpoints("llama-8b-v2")[0]
    v2.draining = True      # as a pod that is not ready (the health probe leaves it so)
    try:
        for i in range(30):
            raw = await client.chat.completions.with_raw_response.create(model="chat", messages=CHAT, max_tokens=2,
                                                                         user=f"user-{i}")
            assert raw.headers["x-served-model"] == "llama-8b"
    finally:
        v2.draining = False
    await client.close()


async def test_with_api_keys_the_keys_user_decides_the_arm(sims, gateway):
    a, b = await sims("vllm", "a"), await sims("vllm", "b")
    keys = [{"key": f"sk-test-key-user-{i:03d}", "user": f"user-{i}"} for i in range(12)]
    gw = await gateway([model_block("a", "vllm", [a.url]), model_block("b", "vllm", [b.url])],
                       auth={"api_keys": keys},
                       aliases=[{"name": "ab", "targets": [{"model": "a", "weight": 1}, {"model": "b", "weight": 1}]}])
    arms = set()
    for k in keys:
        client = openai_client(gw, k["key"])
        seen = set()
        for claimed in ("x", "y", "z"):       # the body's user cannot move an authenticated caller
            raw = await client.chat.completions.with_raw_response.create(model="ab", messages=CHAT, max_tokens=1,
                                                                         user=claimed)
            seen.add(raw.headers["x-served-model"])
        assert len(seen) == 1
        arms |= seen
        await client.close()
    assert arms == {"a", "b"}


async def test_errors_of_an_aliased_request_name_the_served_model(canary):
    gw, _ = canary
    client = openai_client(gw)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="chat", messages=CHAT, max_tokens=-1, user="user-1")
    assert "x-served-model" not in e.value.response.headers      # refused before an alias was resolved
    for ep in gw.gw.pool.endpoints():
        ep.draining = True
    try:
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="chat", messages=CHAT, max_tokens=2, user="user-1")
        assert e.value.status_code == 503 and e.value.response.headers["x-served-model"] in ("llama-8b", "llama-8b-v2")
    finally:
        for ep in gw.gw.pool.endpoints():
            ep.draining = False
    await client.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_alias_of_a_pd_model_sends_both_legs_the_targets_name(sims, gateway, engine):
    from tests.support.factories import pd_model, pd_pair, roleset

    p, d = await pd_pair(sims, engine)
    gw = await gateway([pd_model(engine, [roleset(engine, p, d)])],
                       aliases=[{"name": "chat", "targets": [{"model": "m"}]}])
    client = openai_client(gw)
    for stream in (False, True):
        raw = await client.chat.completions.with_raw_response.create(model="chat", messages=CHAT, max_tokens=4,
                                                                     stream=stream)
        assert raw.headers["x-served-model"] == "m" and raw.headers["prefill-target-pod"]
        if stream:
            assert [c async for c in raw.parse()][-1].choices[-1].finish_reason == "length"
        else:
            assert raw.parse().choices[0].message.content
    await client.close()


async def test_the_responses_api_through_an_alias_keeps_a_caller_on_the_model_that_holds_its_responses(sims, gateway):
    a = await sims("vllm", "a", enable_responses_store=True)
    b = await sims("vllm", "b", enable_responses_store=True)
    gw = await gateway([model_block("a", "vllm", [a.url]), model_block("b", "vllm", [b.url])],
                       aliases=[{"name": "ab", "targets": [{"model": "a", "weight": 1}, {"model": "b", "weight": 1}]}])
    client = openai_client(gw)
    served = set()
    for i in range(8):
        raw = await client.responses.with_raw_response.create(model="ab", input="Hello", max_output_tokens=3,
                                                              user=f"user-{i}")
        first = raw.parse()
        assert first.model == raw.headers["x-served-model"] and first.status == "incomplete"
        follow = await client.responses.with_raw_response.create(
            model="ab", input="And then?", max_output_tokens=3, user=f"user-{i}", previous_response_id=first.id)
        assert follow.headers["x-served-model"] == first.model and follow.parse().status == "incomplete"
        served.add(first.model)
    assert served == {"a", "b"}
    await client.close()
