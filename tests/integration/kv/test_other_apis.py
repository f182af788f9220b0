"""Requests on a model with KV events that routing does not key as the engine caches a prompt
(embeddings, pass-through endpoints such as ``/detokenize``) are routed on the approximate index
without being counted as prompts that failed to tokenize."""

from __future__ import annotations

import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from tests.support.http import post
from tests.support.kv import events_gateway
from tests.support.metrics import metric
from tests.support.waiting import until

pytestmark = pytest.mark.integration

TOK = str(TINY_DIR)
TEXT = "kqz lo abc the of " * 40


async def test_embeddings_and_pass_through_requests_are_no_tokenize_errors(sims, gateway):
    _, gw, kv = await events_gateway(sims, gateway, TOK)
    chat = {"model": "m", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 2}
    assert (await post(gw, chat)).status == 200
    states = kv.index.states
    await until(lambda: states and all(st.on_fallback is None and st.emap for st in states.values()))
    sent = [("/v1/embeddings", {"model": "m", "input": TEXT}),
            ("/v1/embeddings", {"model": "m", "input": [TEXT, "another one"]}),
            ("/v1/embeddings", {"model": "m", "input": [5, 6, 7]}),
            ("/detokenize", {"model": "m", "tokens": [5, 6, 7]}),
            ("/v1/rerank", {"model": "m", "query": TEXT, "documents": ["a", "b"]})]
    for path, body in sent:
        r = await post(gw, body, path=path)
        assert r.status == 200, (path, r.body)
    page = await gw.metrics_text()
    assert metric(page, "switchyard_kv_events_fallbacks_total", model="m", reason="tokenize_error") == 0
    assert metric(page, "switchyard_routing_fallbacks_total", strategy="prefix-cache", reason="kv_events_tokenize") == 0
    # a chat is still keyed on the events
    assert (await post(gw, chat)).status == 200
    page = await gw.metrics_text()
    assert metric(page, "switchyard_kv_events_fallbacks_total", model="m", reason="tokenize_error") == 0


async def test_a_responses_request_is_no_tokenize_error(sims, gateway):
    """A Responses request's ``input`` is rendered by the engine in its own way (instructions, items
    made messages), which the gateway does not key: routed on the approximate index as a fallback
    of its own reason, ``responses``, where it was counted a tokenize error."""
    _, gw, kv = await events_gateway(sims, gateway, TOK)
    chat = {"model": "m", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 2}
    assert (await post(gw, chat)).status == 200
    states = kv.index.states
    await until(lambda: states and all(st.on_fallback is None and st.emap for st in states.values()))
    for body in ({"model": "m", "input": TEXT, "max_output_tokens": 2},
                 {"model": "m", "input": [{"role": "user", "content": TEXT}], "instructions": "Be brief.",
                  "max_output_tokens": 2}):
        r = await post(gw, body, path="/v1/responses")
        assert r.status == 200, r.body
    page = await gw.metrics_text()
    assert metric(page, "switchyard_kv_events_fallbacks_total", model="m", reason="tokenize_error") == 0
    assert metric(page, "switchyard_routing_fallbacks_total", strategy="prefix-cache", reason="kv_events_tokenize") == 0
    assert metric(page, "switchyard_kv_events_fallbacks_total", model="m", reason="responses") == 2
    assert metric(page, "switchyard_routing_fallbacks_total", strategy="prefix-cache",
                  reason="kv_events_responses") == 2
