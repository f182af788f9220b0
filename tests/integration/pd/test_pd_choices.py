"""Requests of several choices (``n`` > 1) on a P/D model, with the openai SDK. vLLM forks them
into child requests that each carry the request's kv_transfer_params: the prefill leg needs one
choice (the prompt's KV is the same for every choice), the decode's choices read its blocks.
SGLang sends a prompt's samples with the prompt's one bootstrap room, so its P/D legs cannot serve
them: such a request runs whole on a combined endpoint, or is refused, never split."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.support.factories import pd_model, pd_pair, roleset
from tests.support.http import openai_client, sim_state
from tests.support.waiting import until, wait_for

MSG = [{"role": "user", "content": "Disaggregated serving splits prefill from decode. " * 8}]


def _posts(state: dict) -> list[dict]:
    return [r["body"] for r in state["received"] if r["method"] == "POST"]


async def test_vllm_choices_are_decoded_from_one_prefilled_choice(sims, gateway):
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    client = openai_client(gw)
    with gw.gw.request_log.capture() as logs:
        whole = await client.chat.completions.create(model="m", messages=MSG, max_tokens=4, n=3)
        streamed: dict[int, str] = {}
        usage = None
        async for chunk in await client.chat.completions.create(model="m", messages=MSG, max_tokens=4, n=3,
                                                                stream=True, stream_options={"include_usage": True}):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            usage = chunk.usage or usage
    assert [c.index for c in whole.choices] == [0, 1, 2] and sorted(streamed) == [0, 1, 2]
    n = whole.usage.prompt_tokens
    assert whole.usage.completion_tokens == 12 and usage.prompt_tokens == n and usage.completion_tokens == 12
    assert whole.usage.prompt_tokens_details.cached_tokens == n      # every choice's prompt came as KV
    lines = [e for e in logs if e["event"] == "request"]
    assert [(e["status"], e["prompt_tokens"], e["completion_tokens"], e["finish_reasons"]) for e in lines] == \
        [(200, n, 12, ["length"] * 3)] * 2
    # the prefill ran one choice a request, whose blocks the decode pulled: none is left pinned
    ps, ds = await sim_state(p.url), await sim_state(d.url)
    assert [b.get("n", 1) for b in _posts(ps)] == [1, 1]
    assert [b["n"] for b in _posts(ds)] == [3, 3]
    assert ps["pd"]["pinned"] == [] and ps["pd"]["transfers"] == 2
    assert ps["counts"]["completed"] == 2


@pytest.mark.parametrize("with_combined", [True, False])
async def test_sglang_choices_run_whole_on_a_combined_endpoint_or_are_refused(sims, gateway, with_combined):
    p, d = await pd_pair(sims, "sglang")
    rs = roleset("sglang", p, d)
    c = None
    if with_combined:
        c = await sims("sglang", "m")
        rs["combined"] = [c.url]
    gw = await gateway([pd_model("sglang", [rs], pd={"combined_load_ratio": 0})])
    client = openai_client(gw)
    with gw.gw.request_log.capture() as logs:
        if with_combined:
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=4, n=2)
            r = raw.parse()
            assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 8
            assert raw.headers["x-pd-decision"] == "combined; reason=several_choices"
            assert raw.headers["target-pod"] == c.url.split("//")[1]
            assert (await sim_state(c.url))["counts"]["completed"] == 2
        else:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as ei:
                    await client.chat.completions.create(model="m", messages=MSG, max_tokens=4, n=2, stream=stream)
                err = ei.value
                assert err.status_code == 400 and err.param == "n" and err.type == "invalid_request_error"
                assert "n > 1" in err.message and "P/D" in err.message, err.message
        # one choice is split as ever
        one = await client.chat.completions.create(model="m", messages=MSG, max_tokens=4)
        assert one.usage.completion_tokens == 4
    assert not _posts(await sim_state(p.url))[:-1] and len(_posts(await sim_state(d.url))) == 1
    lines = [e for e in logs if e["event"] == "request"]
    assert lines[-1]["status"] == 200 and lines[-1]["pd_mode"] == "disaggregated"


async def test_a_vllm_batch_of_prompts_runs_whole_on_the_decode(sims, gateway):
    """vLLM's prefill answers the kv_transfer_params of a batch's first prompt only, and its decode
    would read those blocks for every prompt of the batch: a batch is not split, it runs whole on
    the chosen decode (which prefills it), each prompt's choices in its answer."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    client = openai_client(gw)
    prompts = ["Once upon a time", "The quick brown fox jumps over the lazy dog"]
    for stream in (False, True):
        raw = await client.completions.with_raw_response.create(model="m", prompt=prompts, max_tokens=3, n=2,
                                                                stream=stream)
        assert raw.headers["x-pd-decision"] == "decode; reason=several_prompts"
        assert raw.headers["target-pod"] == d.url.split("//")[1]
        answer = raw.parse()
        got = [c.index for c in answer.choices] if not stream else \
            sorted({c.index async for chunk in answer for c in chunk.choices})
        assert got == [0, 1, 2, 3]
    assert _posts(await sim_state(p.url)) == []
    sent = _posts(await sim_state(d.url))
    assert [b["prompt"] for b in sent] == [prompts, prompts] and not any("kv_transfer_params" in b for b in sent)


async def test_vllm_prompt_logprobs_run_whole_on_the_decode(sims, gateway):
    """Prompt logprobs (a completion's echo with logprobs, or prompt_logprobs) come from the
    prompt's forward pass, which a decode that loads the prompt's KV does not run (vLLM reads no
    cached prefix for them): such a request runs whole on the chosen decode, which answers them."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    client = openai_client(gw)
    raw = await client.completions.with_raw_response.create(model="m", prompt="Once upon a time", max_tokens=2,
                                                            echo=True, logprobs=2)
    assert raw.headers["x-pd-decision"] == "decode; reason=prompt_logprobs"
    lp = raw.parse().choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) > 2
    assert _posts(await sim_state(p.url)) == []
    one = await client.completions.with_raw_response.create(model="m", prompt="Once upon a time", max_tokens=2,
                                                            logprobs=2)
    assert one.headers["x-pd-decision"].startswith("disaggregated")      # the answer's logprobs alone: split


async def test_an_sglang_batch_of_prompts_is_split_with_a_room_a_prompt(sims, gateway):
    """SGLang gives each prompt of a batch a bootstrap room of its own on both legs, so a batch is
    split: each leg names one room a prompt (as sgl-router's PD mode does), the prefill runs one
    token a prompt and the decode continues each prompt's, choice i being prompt i's."""
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])])
    client = openai_client(gw)
    prompts = ["Once upon a time", "The quick brown fox jumps over the lazy dog", "Freight cars"]
    with gw.gw.request_log.capture() as logs:
        raw = await client.completions.with_raw_response.create(model="m", prompt=prompts, max_tokens=3)
        assert raw.headers["x-pd-decision"].startswith("disaggregated")
        whole = raw.parse()
        assert [c.index for c in whole.choices] == [0, 1, 2] and all(c.text for c in whole.choices)
        assert whole.usage.completion_tokens == 9
        texts: dict[int, str] = {}
        usage = None
        async for chunk in await client.completions.create(model="m", prompt=prompts, max_tokens=3, stream=True,
                                                           stream_options={"include_usage": True}):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            usage = chunk.usage or usage
        await until(lambda: len([e for e in logs if e["event"] == "request"]) == 2, timeout=3)
    assert sorted(texts) == [0, 1, 2] and all(texts.values())
    assert usage.completion_tokens == 9 and usage.prompt_tokens == whole.usage.prompt_tokens
    lines = [e for e in logs if e["event"] == "request"]
    assert [(e["status"], e["completion_tokens"], e["finish_reasons"]) for e in lines] == \
        [(200, 9, ["length"] * 3)] * 2
    ps, ds = await sim_state(p.url), await sim_state(d.url)
    for line, pb, db in zip(lines, _posts(ps), _posts(ds), strict=True):
        for key in ("bootstrap_room", "bootstrap_host", "bootstrap_port", "rid"):
            assert pb[key] == db[key] and isinstance(db[key], list) and len(db[key]) == 3, (key, db[key])
        assert len(set(db["bootstrap_room"])) == 3 and len(set(db["bootstrap_host"])) == 1
        assert db["rid"] == [f"{line['rid']}_{i}" for i in range(3)]
    assert ps["pd"]["transfers"] == 6 and ds["pd"]["transfers"] == 6
    assert ps["pd"]["rooms_waiting"] == [] and ps["counts"]["completed"] == 6


@pytest.mark.parametrize("prompts", [["Once upon a time", "Freight cars"], ["Once upon a time"]])
async def test_a_failed_sglang_prefill_of_a_batch_aborts_each_prompts_decode(sims, gateway, prompts):
    """SGLang holds a batch's prompts (a completion's list of prompts, even of one) by rids of their
    own and passes an abort on only for a rid it holds: when the prefill fails, the decode is told
    to drop each prompt's request, not the batch's rid, which would leave them waiting for KV that
    never comes (the decode notices a closed connection only after 30 s here, as SGLang, late)."""
    p = await sims("sglang", "m", role="prefill")
    d = await sims("sglang", "m", role="decode", sglang_abort_delay_s=30.0)
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])], health={"passive": False},
                       pd={"abort_retry_delay_s": 0.2})
    with gw.gw.request_log.capture() as logs:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": prompts, "max_tokens": 3},
                              headers={"x-sim-fault": "prefill.status=500"}) as r:
                assert r.status == 502
        await until(lambda: any(e["event"] == "request" for e in logs), timeout=3)
    rid = next(e for e in logs if e["event"] == "request")["rid"]
    held = [f"{rid}_{i}" for i in range(len(prompts))]
    await until(lambda: _decode_received(d.url), timeout=3)

    async def dropped() -> bool:
        st = await sim_state(d.url)
        return not st["running"] + st["waiting"] and set(held) <= set(st["abort_requests"])

    st = await sim_state(d.url)
    assert await wait_for(dropped, timeout=3), ([x["rid"] for x in st["running"] + st["waiting"]],
                                                st["abort_requests"])


async def _decode_received(url: str) -> bool:
    return bool(_posts(await sim_state(url)))


async def test_an_sglang_chat_of_max_tokens_0_is_split_and_warms_the_prefills_cache(sims, gateway):
    """A chat of max_tokens 0 is split like any other: an SGLang decode-mode server checks the
    request's length limit once the KV came (disaggregation/decode.py) and ends it there with no
    token, and the prefill, which alone cannot finish a request without its decode, caches the
    prompt, which the next request split onto it reads."""
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])])
    client = openai_client(gw)
    for stream in (False, True):
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=MSG, max_tokens=0, stream=stream, stream_options={"include_usage": True} if stream else None)
        assert raw.headers["x-pd-decision"].startswith("disaggregated")
        if stream:
            chunks = [c async for c in raw.parse()]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            usage = chunks[-1].usage
        else:
            answer = raw.parse()
            assert answer.choices[0].message.content == "" and answer.choices[0].finish_reason == "length"
            usage = answer.usage
        assert usage.completion_tokens == 0 and usage.prompt_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens > 0      # the second read the first's prefill
    sent = _posts(await sim_state(d.url))
    assert [b["max_tokens"] for b in sent] == [0, 0]
    assert [b["max_tokens"] for b in _posts(await sim_state(p.url))] == [1, 1]


@pytest.mark.parametrize("with_combined", [True, False])
async def test_sglang_prompt_logprobs_run_whole_on_a_combined_endpoint_or_are_refused(sims, gateway, with_combined):
    """A completion's echo with logprobs asks the prompt's logprobs, from the prompt's forward
    pass: an SGLang decode-mode server skips it (it builds the prompt's batch from the KV it got),
    and sgl-router takes them from the prefill's answer, which the gateway drops. Such a request
    runs whole on a combined endpoint, or is refused; the answer's logprobs alone are split."""
    p, d = await pd_pair(sims, "sglang")
    rs = roleset("sglang", p, d)
    if with_combined:
        c = await sims("sglang", "m")
        rs["combined"] = [c.url]
    gw = await gateway([pd_model("sglang", [rs], pd={"combined_load_ratio": 0})])
    client = openai_client(gw)
    if with_combined:
        raw = await client.completions.with_raw_response.create(model="m", prompt="Once upon a time", max_tokens=2,
                                                                echo=True, logprobs=2)
        assert raw.headers["x-pd-decision"] == "combined; reason=prompt_logprobs"
        assert raw.parse().choices[0].text.startswith("Once upon a time")
    else:
        with pytest.raises(openai.BadRequestError) as ei:
            await client.completions.create(model="m", prompt="Once upon a time", max_tokens=2, echo=True, logprobs=2)
        assert ei.value.param == "logprobs" and "prompt logprobs" in ei.value.message, ei.value.message
    assert _posts(await sim_state(p.url)) == [] and _posts(await sim_state(d.url)) == []
    one = await client.completions.with_raw_response.create(model="m", prompt="Once upon a time", max_tokens=2,
                                                            logprobs=2)
    assert one.headers["x-pd-decision"].startswith("disaggregated")


async def test_a_client_leaving_an_sglang_batch_mid_decode_has_each_prompts_decode_aborted(sims, gateway):
    """A stream of a batch whose client leaves after its first chunk: the decode is told to drop
    each prompt's request (it notices the closed connection only after 30 s here), and the
    prefill holds no room."""
    p = await sims("sglang", "m", role="prefill")
    d = await sims("sglang", "m", role="decode", itl_ms=50, sglang_abort_delay_s=30.0)
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])], pd={"abort_retry_delay_s": 0.2})
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": ["a b c", "d e f"],
                                                              "max_tokens": 500, "stream": True})
        assert resp.status == 200
        await resp.content.readline()
        resp.close()

    async def dropped() -> bool:
        st = await sim_state(d.url)
        return not st["running"] + st["waiting"] and st["counts"]["aborted"] == 2

    assert await wait_for(dropped, timeout=3)
    rids = (await sim_state(d.url))["abort_requests"]
    assert len(rids) >= 2 and all(r.endswith(("_0", "_1")) for r in rids)
    assert (await sim_state(p.url))["pd"]["rooms_waiting"] == []


async def test_a_vllm_request_of_no_tokens_runs_whole_on_the_decode_which_refuses_it(sims, gateway):
    """vLLM refuses ``max_tokens: 0`` (``max_completion_tokens: 0``) with 400, but its prefill leg
    is sent ``max_tokens: 1``: split, the prefill computed the prompt and pinned its blocks for a
    decode that then refused the request, until the lease ran out. Such a request generates
    nothing: it runs whole on the chosen decode, whose own 400 the client gets, the prefill not asked."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    client = openai_client(gw)
    for field, stream in (("max_tokens", False), ("max_completion_tokens", False), ("max_tokens", True)):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=MSG, stream=stream, **{field: 0})
        assert e.value.response.headers["x-pd-decision"] == "decode; reason=no_generation"
        assert e.value.response.headers["target-pod"] == d.url.split("//")[1]
        assert e.value.body["param"] == field and "at least 1" in e.value.body["message"]
    ps = await sim_state(p.url)
    assert _posts(ps) == [] and ps["pd"]["pinned"] == []
    assert len(_posts(await sim_state(d.url))) == 3
    # a chat's bound is its max_completion_tokens when it names one: a max_tokens of 0 beside it is no refusal
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_completion_tokens=3,
                                                                max_tokens=0)
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=always"
    assert raw.parse().usage.completion_tokens == 3


async def test_a_vllm_request_whose_min_tokens_its_engine_refuses_runs_whole_on_the_decode(sims, gateway):
    """vLLM refuses a ``min_tokens`` above the request's bound, or below 0; the prefill leg is sent
    none (and ``max_tokens: 1``), so split, the prefill pinned the prompt's blocks for a decode that
    then refused the request. Such a request runs whole on the chosen decode, whose 400 the client
    gets; one whose ``min_tokens`` fits is split as before."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    client = openai_client(gw)
    for bounds in ({"max_tokens": 4, "min_tokens": 5}, {"max_completion_tokens": 4, "min_tokens": 5},
                   {"max_tokens": 4, "min_tokens": -1}):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=MSG, extra_body=bounds)
        assert e.value.response.headers["x-pd-decision"] == "decode; reason=min_tokens", bounds
        assert "min_tokens must be" in e.value.body["message"]
    ps = await sim_state(p.url)
    assert _posts(ps) == [] and ps["pd"]["pinned"] == []
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=4,
                                                                extra_body={"min_tokens": 4})
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=always"
    assert raw.parse().usage.completion_tokens == 4
    # vLLM's Messages request has no min_tokens (its model drops it): nothing there to refuse
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/messages", json={
            "model": "m", "messages": MSG, "max_tokens": 4, "min_tokens": 9}) as r:
        assert r.status == 200 and r.headers["x-pd-decision"] == "disaggregated; reason=always"


async def test_a_vllm_request_of_fewer_best_of_than_choices_is_split(sims, gateway):
    """vLLM (V1) has no ``best_of`` and ignores it: a ``best_of`` below ``n`` is no refusal to keep
    off the prefill, and the request is split as any of ``n`` choices. It ran whole on the decode,
    told ``reason=best_of``."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])])
    client = openai_client(gw)
    raw = await client.completions.with_raw_response.create(model="m", prompt=MSG[0]["content"], max_tokens=4,
                                                           n=2, best_of=1)
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=always"
    assert len(raw.parse().choices) == 2
    assert len(_posts(await sim_state(p.url))) == 1


async def test_a_vllm_request_whose_bound_passes_the_decodes_context_runs_whole_on_the_decode(sims, gateway):
    """A request whose prompt plus its bound (``max_completion_tokens`` or ``max_tokens``) passes the
    decode's ``max_model_len`` is refused by vLLM's decode, but its prefill leg, sent ``max_tokens: 1``,
    accepts it: split, the prefill computed the prompt and pinned its blocks for a decode that then
    refused the request. The gateway reads each engine's ``max_model_len`` from its ``/v1/models``:
    such a request runs whole on the decode, whose own 400 the client gets; one that fits is split."""
    p, d = await pd_pair(sims, "vllm", max_model_len=512)
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])], lora={"discovery_interval_s": 0.1})
    client = openai_client(gw)

    async def refused_whole(**bound) -> bool:
        try:
            await client.chat.completions.create(model="m", messages=MSG, **bound)
        except openai.BadRequestError as e:
            return e.response.headers["x-pd-decision"] == "decode; reason=context"
        return False

    # the first discovery round may not have answered yet: a split one is refused by the decode alone
    assert await until(lambda: refused_whole(max_tokens=512), timeout=20, interval=0.05)
    # (split before the first round answered, a request left the prefill's blocks pinned: counted before)
    ps = await sim_state(p.url)
    before = (len(_posts(ps)), ps["pd"]["pinned"])
    # the bound alone, and the bound beside half the prompt's estimate (about 100 tokens here)
    for bound in ({"max_tokens": 600}, {"max_completion_tokens": 512}, {"max_tokens": 490}):
        assert await refused_whole(**bound), bound
    ps = await sim_state(p.url)
    assert (len(_posts(ps)), ps["pd"]["pinned"]) == before
    # one that fits (with the margin the estimate needs) is split as before
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=4)
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=always"
    # a completion of token ids counts its prompt exactly: 300 + 250 passes 512, 300 + 200 fits
    prompt = list(range(1, 301))
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="m", prompt=prompt, max_tokens=250)
    assert e.value.response.headers["x-pd-decision"] == "decode; reason=context"
    raw = await client.completions.with_raw_response.create(model="m", prompt=prompt, max_tokens=200)
    assert raw.headers["x-pd-decision"] == "disaggregated; reason=always"
