"""Body fields that steer the engine past the gateway's own controls reach it only when the
operator lets them: a request's ``priority`` (vLLM's and SGLang's priority scheduling, which would
let a client jump the engine's queue whatever its admission class) and a client's own
``kv_transfer_params`` on an aggregated vLLM endpoint (a NIXL connector would pin the request's KV
blocks for a remote decode, or pull KV from a host the client chose). A real gateway in front of
simulated engines, which list the bodies they received."""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.apis.paths import MESSAGES
from gateway.request import CHAT, COMPLETIONS
from tests.support.enginesim import wait_state
from tests.support.factories import model_block, pd_model, pd_pair, roleset
from tests.support.http import post, sim_state
from tests.support.metrics import metric

MSG = [{"role": "user", "content": "hi"}]
KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "198.51.100.7", "remote_port": 5600,
      "remote_block_ids": [1, 2], "remote_request_id": "r"}


async def _received(url: str, path: str) -> list[dict]:
    return [x["body"] for x in (await sim_state(url))["received"] if x["path"] == path]


async def _metrics(gw) -> str:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        return await r.text()


async def test_a_clients_body_priority_does_not_reach_the_engine_unless_allowed(sims, gateway):
    """vLLM runs a lower ``priority`` first (``--scheduling-policy priority``), SGLang a higher one
    (``--enable-priority-scheduling``): either way a client's own value would put it ahead of
    everyone in the engine's queue, past the class admission gave it. It is dropped, counted and
    logged; ``upstream.client_priority: true`` passes it."""
    v = await sims("vllm", "m")
    s = await sims("sglang", "qwen")
    gw = await gateway([model_block("m", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])])
    with gw.gw.request_log.capture() as logs:
        r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "priority": -1000})
        assert r.status == 200, r.body
        r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "priority": -5, "stream": True})
        assert r.status == 200, r.body
        r = await post(gw, {"model": "m", "max_tokens": 2, "messages": MSG, "priority": -5}, path=MESSAGES)
        assert r.status == 200, r.body
        r = await post(gw, {"model": "qwen", "prompt": "hi", "max_tokens": 2, "priority": 1000}, path=COMPLETIONS)
        assert r.status == 200, r.body
        r = await post(gw, {"model": "qwen", "messages": MSG, "max_tokens": 2})
        assert r.status == 200, r.body
    sent = await _received(v.url, CHAT) + await _received(v.url, MESSAGES) + await _received(s.url, COMPLETIONS)
    assert len(sent) == 4 and not [b for b in sent if "priority" in b], sent
    assert [b["max_tokens"] for b in sent] == [2, 2, 2, 2]          # the rest of the body as sent
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["priority"]] * 4 + [None], lines
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", model="m", field="priority") == 3
    assert metric(page, "switchyard_request_fields_dropped_total", model="qwen", field="priority") == 1

    v2 = await sims("vllm", "m", scheduling_policy="priority")     # vLLM refuses a priority otherwise
    gw2 = await gateway([model_block("m", "vllm", [v2.url])], upstream={"client_priority": True})
    assert (await post(gw2, {"model": "m", "messages": MSG, "max_tokens": 2, "priority": -3})).status == 200
    assert [b.get("priority") for b in await _received(v2.url, CHAT)] == [-3]


async def test_a_clients_kv_transfer_params_do_not_reach_an_aggregated_engine_unless_allowed(sims, gateway):
    """On an aggregated endpoint the legs are nobody's but the client's: a vLLM engine with a NIXL
    connector in ``kv_both`` would pin the request's KV blocks for minutes (``do_remote_decode``) or
    connect to the host the client named to pull KV (``do_remote_prefill``). The field is dropped,
    counted and logged; ``pd.client_kv_transfer_params: true`` (globally or on the model) passes it,
    for clients that orchestrate prefill and decode themselves."""
    v = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [v.url])])
    with gw.gw.request_log.capture() as logs:
        for kv in (KV, {"do_remote_decode": True}):
            r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "kv_transfer_params": kv})
            assert r.status == 200, r.body
        r = await post(gw, {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True,
                            "kv_transfer_params": KV}, path=COMPLETIONS)
        assert r.status == 200, r.body
    sent = await _received(v.url, CHAT) + await _received(v.url, COMPLETIONS)
    assert len(sent) == 3 and not [b for b in sent if "kv_transfer_params" in b], sent
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["kv_transfer_params"]] * 3, lines
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", model="m", field="kv_transfer_params") == 3

    w = await sims("vllm", "own")
    gw2 = await gateway([model_block("m", "vllm", [v.url]),
                         {**model_block("own", "vllm", [w.url]), "pd": {"client_kv_transfer_params": True}}])
    r = await post(gw2, {"model": "own", "messages": MSG, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status == 200, r.body
    assert [b.get("kv_transfer_params") for b in await _received(w.url, CHAT)] == [{"do_remote_decode": True}]


async def test_admission_writes_the_requests_class_into_the_engines_priority(sims, gateway):
    """With ``admission.engine_priority`` (engines started with priority scheduling) the gateway
    owns the engine's queue order: each request carries its class's value, the user's class or a
    lower ``x-priority``, whatever priority its body named; a P/D model's legs carry it too, and a
    model whose admission is off writes none."""
    v = await sims("vllm", "m", scheduling_policy="priority")
    s = await sims("sglang", "qwen", enable_priority_scheduling=True)
    p = await sims("vllm", "pd", role="prefill", scheduling_policy="priority")
    d = await sims("vllm", "pd", role="decode", scheduling_policy="priority")
    o = await sims("vllm", "off")
    gw = await gateway([model_block("m", "vllm", [v.url]),
                        {**model_block("qwen", "sglang", [s.url]),
                         "admission": {"engine_priority": {"critical": 10, "standard": 5, "sheddable": 0}}},
                        {"name": "pd", "engine": "vllm", "rolesets": [{"name": "rs", "prefill": [p.url],
                                                                        "decode": [d.url]}]},
                        model_block("off", "vllm", [o.url], admission={"enabled": False})],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 4,
                                  "engine_priority": {"critical": -1, "standard": 0, "sheddable": 1}},
                       limits={"users": {"carol": {"priority": "critical"}}})
    asks = [({"user": "carol"}, {}), ({"user": "carol"}, {"x-priority": "sheddable"}),
            ({"user": "bob", "priority": -1000}, {}), ({"user": "bob"}, {"x-priority": "critical"})]
    for model in ("m", "qwen", "pd"):
        for extra, headers in asks:
            r = await post(gw, {"model": model, "messages": MSG, "max_tokens": 2, **extra}, headers)
            assert r.status == 200, (model, r.body)
    assert (await post(gw, {"model": "off", "messages": MSG, "max_tokens": 2, "user": "carol"})).status == 200
    sent = await _received(v.url, CHAT)
    assert [b.get("priority") for b in sent] == [-1, 1, 0, 0], sent
    assert [b.get("priority") for b in await _received(o.url, CHAT)] == [None]
    assert [b.get("priority") for b in await _received(s.url, CHAT)] == [10, 0, 5, 5]
    assert [b.get("priority") for b in await _received(p.url, CHAT)] == [-1, 1, 0, 0]
    assert [b.get("priority") for b in await _received(d.url, CHAT)] == [-1, 1, 0, 0]


async def test_a_clients_vllm_priority_header_does_not_reach_the_engine_unless_allowed(sims, gateway):
    """vLLM reads an ``X-Vllm-Priority`` header over the body's ``priority``: the header would put
    the request ahead in its queue as the body's field would. It is kept from the engine, counted
    and logged as the body's field is, on every leg (a P/D pair's too); ``upstream.client_priority:
    true`` passes it."""
    v = await sims("vllm", "m", scheduling_policy="priority")     # vLLM refuses a priority otherwise
    p, d = await sims("vllm", "pd", role="prefill"), await sims("vllm", "pd", role="decode")
    gw = await gateway([model_block("m", "vllm", [v.url]),
                        {"name": "pd", "engine": "vllm", "rolesets": [{"name": "rs", "prefill": [p.url],
                                                                        "decode": [d.url]}]}])
    with gw.gw.request_log.capture() as logs:
        for model in ("m", "pd"):
            r = await post(gw, {"model": model, "messages": MSG, "max_tokens": 2}, {"X-Vllm-Priority": "-1000"})
            assert r.status == 200, r.body
    sent = [x for u in (v.url, p.url, d.url) for x in (await sim_state(u))["received"] if x["path"] == CHAT]
    assert len(sent) == 3 and not [x for x in sent if "vllm_priority" in x], sent
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["x-vllm-priority"]] * 2, lines
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", field="x-vllm-priority") == 2

    gw2 = await gateway([model_block("m", "vllm", [v.url])], upstream={"client_priority": True})
    assert (await post(gw2, {"model": "m", "messages": MSG, "max_tokens": 2}, {"X-Vllm-Priority": "-3"})).status == 200
    assert [x.get("vllm_priority") for x in (await sim_state(v.url))["received"] if x["path"] == CHAT][-1] == "-3"


async def test_a_clients_body_rank_does_not_pin_an_sglang_engines_rank_unless_allowed(sims, gateway):
    """SGLang reads a body's ``routed_dp_rank`` (and its older name ``data_parallel_rank``) when no
    ``X-Data-Parallel-Rank`` header names a rank: a client would pin the engine's data-parallel rank,
    which the gateway keeps to itself as it strips the client's header. Both are dropped, counted
    and logged unless the model's ``kv_events.client_rank`` lets a client's rank through."""
    s = await sims("sglang", "m")
    t = await sims("sglang", "own")
    gw = await gateway([model_block("m", "sglang", [s.url]),
                        {**model_block("own", "sglang", [t.url]), "kv_events": {"enabled": False, "client_rank": True}}])
    with gw.gw.request_log.capture() as logs:
        for field in ("routed_dp_rank", "data_parallel_rank"):
            r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, field: 1})
            assert r.status == 200, r.body
    sent = await _received(s.url, CHAT)
    assert len(sent) == 2 and not [b for b in sent if "routed_dp_rank" in b or "data_parallel_rank" in b], sent
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["routed_dp_rank"], ["data_parallel_rank"]], lines
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", model="m", field="routed_dp_rank") == 1

    assert (await post(gw, {"model": "own", "messages": MSG, "max_tokens": 2, "routed_dp_rank": 1})).status == 200
    assert [b.get("routed_dp_rank") for b in await _received(t.url, CHAT)] == [1]


async def test_engine_priority_wins_over_a_client_priority_the_operator_lets_through(sims, gateway):
    """``upstream.client_priority: true`` passes a client's priority, but where admission writes the
    class (``engine_priority``) the gateway's value is the one the engine reads: the body's is
    replaced and the ``X-Vllm-Priority`` header, which vLLM reads over the body, is kept back."""
    v = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [v.url])], upstream={"client_priority": True},
                       admission={"enabled": True, "max_in_flight_per_endpoint": 4,
                                  "engine_priority": {"critical": -1, "standard": 0, "sheddable": 1}})
    r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "priority": -50}, {"X-Vllm-Priority": "-50"})
    assert r.status == 200, r.body
    got = [x for x in (await sim_state(v.url))["received"] if x["path"] == CHAT]
    assert len(got) == 1 and got[0]["body"]["priority"] == 0 and "vllm_priority" not in got[0], got


async def test_a_clients_logits_processors_do_not_reach_the_engine_unless_allowed(sims, gateway):
    """SGLang started with ``--enable-custom-logit-processor`` runs a request's
    ``custom_logit_processor``, a serialized Python callable: code of the client's choosing on the
    GPU host. vLLM loads the classes a request's ``logits_processors`` names when its
    ``--logits-processor-pattern`` matches them. Both are dropped, counted and logged; a tenant's
    request cannot run code in an engine other tenants share. ``upstream.client_logits_processors:
    true`` passes them."""
    v = await sims("vllm", "m")
    s = await sims("sglang", "qwen")
    gw = await gateway([model_block("m", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])])
    with gw.gw.request_log.capture() as logs:
        r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "logits_processors": ["os.system"]})
        assert r.status == 200, r.body
        r = await post(gw, {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True,
                            "logits_processors": [{"qualname": "m.P", "args": [1]}]}, path=COMPLETIONS)
        assert r.status == 200, r.body
        for path, body in ((CHAT, {"messages": MSG}), (COMPLETIONS, {"prompt": "hi"})):
            r = await post(gw, {"model": "qwen", **body, "max_tokens": 2, "custom_logit_processor": '{"callable": "x"}',
                                "custom_params": {"k": 1}}, path=path)
            assert r.status == 200, r.body
    sent = await _received(v.url, CHAT) + await _received(v.url, COMPLETIONS)
    assert len(sent) == 2 and not [b for b in sent if "logits_processors" in b], sent
    sent = await _received(s.url, CHAT) + await _received(s.url, COMPLETIONS)
    assert len(sent) == 2 and not [b for b in sent if "custom_logit_processor" in b], sent
    assert [b["custom_params"] for b in sent] == [{"k": 1}] * 2       # a processor's arguments are no code
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["logits_processors"]] * 2 + [["custom_logit_processor"]] * 2
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", model="m", field="logits_processors") == 2
    assert metric(page, "switchyard_request_fields_dropped_total", model="qwen", field="custom_logit_processor") == 2

    gw2 = await gateway([model_block("m", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])],
                        upstream={"client_logits_processors": True})
    assert (await post(gw2, {"model": "m", "messages": MSG, "max_tokens": 2, "logits_processors": ["a.B"]})).status == 200
    assert (await _received(v.url, CHAT))[-1]["logits_processors"] == ["a.B"]
    r = await post(gw2, {"model": "qwen", "messages": MSG, "max_tokens": 2, "custom_logit_processor": "{}"})
    assert r.status == 200, r.body
    assert (await _received(s.url, CHAT))[-1]["custom_logit_processor"] == "{}"



async def test_a_clients_rid_does_not_reach_an_sglang_engine(sims, gateway):
    """SGLang names a request by its body's ``rid`` and, when the client's connection closes, aborts
    it by that rid, matching every request whose rid starts with it: a client's short rid (``"a"``,
    or ``""``) would abort other tenants' requests on the engine as it hung up. The gateway keeps
    the engine's request ids to itself (its P/D legs carry its own rid): a client's is dropped,
    counted and logged."""
    s = await sims("sglang", "qwen")
    gw = await gateway([model_block("qwen", "sglang", [s.url])])
    with gw.gw.request_log.capture() as logs:
        r = await post(gw, {"model": "qwen", "messages": MSG, "max_tokens": 2, "rid": "a"})
        assert r.status == 200, r.body
        r = await post(gw, {"model": "qwen", "prompt": "hi", "max_tokens": 2, "rid": ""}, path=COMPLETIONS)
        assert r.status == 200, r.body
    sent = await _received(s.url, CHAT) + await _received(s.url, COMPLETIONS)
    assert len(sent) == 2 and not [b for b in sent if "rid" in b], sent
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["rid"]] * 2, lines
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", model="qwen", field="rid") == 2


async def test_kv_transfer_params_in_vllm_xargs_do_not_reach_an_aggregated_engine_unless_allowed(sims, gateway):
    """vLLM hands a request's ``vllm_xargs`` to the engine as its sampling params' extra args, the
    very dict its top-level ``kv_transfer_params`` is put in and its KV connector reads them from:
    a client's ``vllm_xargs.kv_transfer_params`` would reach the connector the top-level field is
    dropped to keep it from. That member is dropped (the other extra args pass), counted and
    logged; ``pd.client_kv_transfer_params: true`` passes it."""
    v = await sims("vllm", "m")
    w = await sims("vllm", "own")
    gw = await gateway([model_block("m", "vllm", [v.url]),
                        {**model_block("own", "vllm", [w.url]), "pd": {"client_kv_transfer_params": True}}])
    xargs = {"kv_transfer_params": "do_remote_decode", "target_token": 7}
    with gw.gw.request_log.capture() as logs:
        for model in ("m", "own"):
            r = await post(gw, {"model": model, "messages": MSG, "max_tokens": 2, "vllm_xargs": xargs})
            assert r.status == 200, r.body
    assert [b["vllm_xargs"] for b in await _received(v.url, CHAT)] == [{"target_token": 7}]
    assert [b["vllm_xargs"] for b in await _received(w.url, CHAT)] == [xargs]
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["vllm_xargs.kv_transfer_params"], None], lines
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", model="m", field="vllm_xargs.kv_transfer_params") == 1


async def test_a_clients_chat_template_does_not_reach_the_engine_unless_allowed(sims, gateway):
    """A chat request's ``chat_template`` is a Jinja template the engine renders the prompt with:
    current vLLM refuses it unless started with ``--trust-request-chat-template`` (so does it a
    ``chat_template`` member of ``chat_template_kwargs``), older vLLM rendered it, and SGLang passes
    ``chat_template_kwargs`` to the tokenizer's ``apply_chat_template``, whose ``chat_template``
    argument it then is: a template of the client's choosing rendered in an engine other tenants
    share. Both are dropped (the other template arguments, ``enable_thinking`` above all, pass),
    counted and logged; ``upstream.client_chat_template: true`` passes them."""
    v = await sims("vllm", "m")
    s = await sims("sglang", "qwen")
    gw = await gateway([model_block("m", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])])
    tpl = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with gw.gw.request_log.capture() as logs:
        r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "chat_template": tpl,
                            "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status == 200, r.body
        r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "stream": True,
                            "chat_template_kwargs": {"chat_template": tpl, "enable_thinking": True}})
        assert r.status == 200, r.body
        r = await post(gw, {"model": "qwen", "messages": MSG, "max_tokens": 2,
                            "chat_template_kwargs": {"chat_template": tpl, "thinking": True}})
        assert r.status == 200, r.body
        r = await post(gw, {"model": "qwen", "messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"thinking": 1}})
        assert r.status == 200, r.body
        # vLLM's Messages request takes chat_template_kwargs too, and renders its chat request with them
        r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2,
                            "chat_template_kwargs": {"chat_template": tpl, "enable_thinking": False}}, path=MESSAGES)
        assert r.status == 200, r.body
    assert [b["chat_template_kwargs"] for b in await _received(v.url, MESSAGES)] == [{"enable_thinking": False}]
    sent = await _received(v.url, CHAT)
    assert len(sent) == 2 and not [b for b in sent if "chat_template" in b], sent
    assert [b["chat_template_kwargs"] for b in sent] == [{"enable_thinking": False}, {"enable_thinking": True}]
    assert [b["chat_template_kwargs"] for b in await _received(s.url, CHAT)] == [{"thinking": True}, {"thinking": 1}]
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["chat_template"], ["chat_template_kwargs.chat_template"],
                                                        ["chat_template_kwargs.chat_template"], None,
                                                        ["chat_template_kwargs.chat_template"]], lines
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", model="m", field="chat_template") == 1
    assert metric(page, "switchyard_request_fields_dropped_total", model="m",
                  field="chat_template_kwargs.chat_template") == 2
    assert metric(page, "switchyard_request_fields_dropped_total", model="qwen",
                  field="chat_template_kwargs.chat_template") == 1

    gw2 = await gateway([model_block("m", "vllm", [v.url])], upstream={"client_chat_template": True})
    body = {"model": "m", "messages": MSG, "max_tokens": 2, "chat_template": tpl, "chat_template_kwargs": {"chat_template": tpl}}
    assert (await post(gw2, body)).status == 200
    got = (await _received(v.url, CHAT))[-1]
    assert (got["chat_template"], got["chat_template_kwargs"]) == (tpl, {"chat_template": tpl})


async def test_a_clients_prefill_rank_does_not_reach_an_sglang_pd_pair(sims, gateway):
    """SGLang's decode reads a body's ``disagg_prefill_dp_rank`` to learn which data-parallel rank
    of the prefill holds the request's KV: a client's would send the decode to a rank the gateway
    did not choose, where no KV waits, while the prefill holds the blocks it computed until its
    bootstrap timeout. It is dropped with the other rank fields, counted and logged."""
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])])
    with gw.gw.request_log.capture() as logs:
        r = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "disagg_prefill_dp_rank": 3})
        assert r.status == 200, r.body
    sent = await _received(p.url, CHAT) + await _received(d.url, CHAT)
    assert len(sent) == 2 and not [b for b in sent if "disagg_prefill_dp_rank" in b], sent
    lines = [x for x in logs if x["event"] == "request"]
    assert [x.get("dropped_fields") for x in lines] == [["disagg_prefill_dp_rank"]], lines
    page = await _metrics(gw)
    assert metric(page, "switchyard_request_fields_dropped_total", model="m", field="disagg_prefill_dp_rank") == 1


async def test_engine_priority_puts_a_critical_request_ahead_of_a_sheddable_flood_in_the_engines_queue(sims, gateway):
    """An engine started with priority scheduling (``--scheduling-policy priority``) runs what
    ``engine_priority`` wrote: a critical request sent after a flood of sheddable ones already waiting
    in the engine's queue goes to its head, not its tail; each answers once the slot frees."""
    v = await sims("vllm", "m", scheduling_policy="priority", max_num_seqs=1)
    gw = await gateway([model_block("m", "vllm", [v.url])],
                       admission={"enabled": True, "max_in_flight_per_endpoint": 16, "max_waiting_per_endpoint": 16,
                                  "waiting_share": {"critical": 1.0, "standard": 1.0, "sheddable": 1.0},
                                  "engine_priority": {"critical": -1, "standard": 0, "sheddable": 1}},
                       limits={"users": {"carol": {"priority": "critical"}}})
    hold = asyncio.create_task(post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "user": "bob"},
                                    {"x-sim-fault": "stall_before_first=inf"}))
    await until_state(v.url, lambda s: len(s["running"]) == 1)
    flood = [asyncio.create_task(post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "user": "bob"},
                                     {"x-priority": "sheddable"}))
             for _ in range(3)]
    await until_state(v.url, lambda s: len(s["waiting"]) == 3)      # the flood waits in the engine
    vip = asyncio.create_task(post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "user": "carol"}))
    state = await until_state(v.url, lambda s: len(s["waiting"]) == 4)
    assert [w["priority"] for w in state["waiting"]] == [-1, 1, 1, 1], state
    hold.cancel()                                   # the client leaves: the engine's slot frees
    await asyncio.gather(hold, return_exceptions=True)
    for r in await asyncio.gather(vip, *flood):
        assert r.status == 200, r.body


async def until_state(url: str, pred) -> dict:
    async with aiohttp.ClientSession() as http:
        return await wait_state(http, url, pred)
