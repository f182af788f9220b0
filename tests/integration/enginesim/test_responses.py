"""enginesim's /v1/responses on the wire, vLLM and SGLang style."""

from __future__ import annotations

import aiohttp

from tests.support.http import sse_frames
from tests.support.waiting import wait_for


async def test_vllm_stream_event_sequence_and_store(sims):
    sim = await sims("vllm", "m", enable_responses_store=True)
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/v1/responses", json={"model": "m", "input": "hi", "stream": True,
                                                         "max_output_tokens": 3}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = sse_frames(await r.read())
        names = [n for n, _ in events]
        assert names == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        assert all(d["type"] == n for n, d in events)
        done = events[-1][1]["response"]
        assert done["usage"]["output_tokens"] == 3 and done["status"] == "incomplete"
        assert done["incomplete_details"] == {"reason": "max_output_tokens"}
        async with s.get(sim.url + f"/v1/responses/{done['id']}") as r:
            assert (await r.json())["output"][0]["content"][0]["text"] == events[-4][1]["text"]
        async with s.delete(sim.url + f"/v1/responses/{done['id']}") as r:
            assert r.status == 405                         # vLLM serves no DELETE


async def test_vllm_without_store_ignores_store_and_refuses_background(sims):
    sim = await sims("vllm", "m")
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}) as r:
            rid = (await r.json())["id"]
        async with s.post(sim.url + "/v1/responses", json={"model": "m", "input": "x",
                                                         "previous_response_id": rid}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["message"] == f"Response with id '{rid}' not found."
        async with s.post(sim.url + "/v1/responses", json={"model": "m", "input": "x", "background": True}) as r:
            assert r.status == 400 and "VLLM_ENABLE_RESPONSES_API_STORE" in (await r.json())["error"]["message"]


async def test_sglang_shapes_background_and_cancel(sims):
    sim = await sims("sglang", "m", itl_ms=20.0)
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/v1/responses/bogus") as r:
            body = await r.json()
            assert r.status == 400 and body["object"] == "error" and body["param"] == "response_id"
        async with s.post(sim.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}) as r:
            done = await r.json()
            assert done["usage"]["prompt_tokens"] > 0         # SGLang's chat usage in a non-streaming body
        async with s.post(sim.url + "/v1/responses", json={"model": "m", "input": "hi", "background": True,
                                                         "max_output_tokens": 500}) as r:
            queued = await r.json()
            assert queued["status"] == "queued"
        async with s.post(sim.url + f"/v1/responses/{queued['id']}/cancel") as r:
            assert (await r.json())["status"] == "cancelled"
        async with s.post(sim.url + f"/v1/responses/{done['id']}/cancel") as r:
            assert r.status == 400 and (await r.json())["message"] == "Cannot cancel a synchronous response."
        assert await wait_for(lambda: sim.engine.num_live == 0)


async def test_a_huge_max_output_tokens_is_clamped_to_the_context_left(sims):
    """vLLM (and SGLang after it) takes ``min(max_output_tokens, max_model_len - prompt)`` for a
    Responses request: a limit of 2**31 generates what the context leaves, then stops
    ``incomplete`` (SGLang says ``completed``), streamed or not (no 400, unlike chat's ``max_tokens``)."""
    for engine in ("vllm", "sglang"):
        sim = await sims(engine, "m", max_model_len=64, itl_ms=0.0)
        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                body = {"model": "m", "input": "hi", "max_output_tokens": 2**31, "stream": stream}
                async with s.post(sim.url + "/v1/responses", json=body) as r:
                    assert r.status == 200
                    done = sse_frames(await r.read())[-1][1]["response"] if stream else await r.json()
                usage = done["usage"]
                prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
                out = usage.get("output_tokens", usage.get("completion_tokens"))
                assert out == 64 - prompt and done["max_output_tokens"] == out, (engine, stream, done)
                assert done["status"] == ("incomplete" if engine == "vllm" else "completed"), (engine, stream, done)


async def test_vllm_logprobs_and_reasoning_as_vllm_streams_them(sims):
    """With ``--reasoning-parser`` the first half of max_output_tokens is a reasoning item
    (reasoning_part / reasoning_text events), counted in reasoning_tokens; logprobs asked for with
    ``include`` come on the message's deltas (no bytes) and in its finished part (with bytes)."""
    sim = await sims("vllm", "m", reasoning_parser="deepseek_r1")
    body = {"model": "m", "input": "hi", "max_output_tokens": 5, "include": ["message.output_text.logprobs"],
            "top_logprobs": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/v1/responses", json={**body, "stream": True}) as r:
            events = sse_frames(await r.read())
        async with s.post(sim.url + "/v1/responses", json=body) as r:
            whole = await r.json()
        async with s.post(sim.url + "/v1/responses", json={**body, "top_logprobs": 21}) as r:
            assert r.status == 400
    names = [n for n, _ in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.reasoning_part.added"] + ["response.reasoning_text.delta"] * 2 + [
        "response.reasoning_text.done", "response.reasoning_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    thought = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    assert all(d["output_index"] == 1 and len(d["logprobs"]) == 1 for d in deltas)
    assert all("bytes" not in lp and len(lp["top_logprobs"]) == 2 for d in deltas for lp in d["logprobs"])
    done = events[-1][1]["response"]
    assert [o["type"] for o in done["output"]] == [o["type"] for o in whole["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"] == whole["output"][0]["content"] == [{"text": thought,
                                                                              "type": "reasoning_text"}]
    part = done["output"][1]["content"][0]
    assert [lp["token"] for lp in part["logprobs"]] == [lp["token"] for d in deltas for lp in d["logprobs"]]
    assert part["logprobs"] == whole["output"][1]["content"][0]["logprobs"]
    assert all(lp["bytes"] == list(lp["token"].encode()) for lp in part["logprobs"])
    assert done["usage"]["output_tokens"] == 5 and done["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
