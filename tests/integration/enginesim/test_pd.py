"""enginesim's prefill/decode roles, driven by hand the way a P/D proxy would, over real sockets."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from enginesim import SimConfig, SimServer, start_sim
from enginesim.config import config_from_args
from enginesim.faults import FaultSpecError, parse_fault
from tests.support.enginesim import FAST, call, metric_samples, next_event, wait_state
from tests.support.http import sim_state
from tests.support.metrics import metric

MakeSim = Callable[..., Awaitable[SimServer]]
PROMPT = "The switchyard sorts freight cars onto tracks by destination. " * 6  # ~100 tokens
MESSAGES = [{"role": "user", "content": PROMPT}]
INTERNAL_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError",
                            "param": None, "code": 500}}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def make_sim() -> AsyncIterator[MakeSim]:
    servers: list[SimServer] = []

    async def make(**knobs: Any) -> SimServer:
        server = await start_sim(SimConfig(**{"model": "pd-model", **FAST, **knobs}))
        servers.append(server)
        await server.wait_ready()
        return server

    yield make
    for server in servers:
        await server.close()
        assert not server.engine._tasks
        assert not server.engine.num_live


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- vLLM: NIXL pull ------------------------------------------------------------------------------


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's toy proxy sends to P."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    return out


async def vllm_prefill(http: aiohttp.ClientSession, p: SimServer, body: dict[str, Any],
                       request_id: str = "req-1") -> dict[str, Any]:
    status, answer, _ = await call(http, p.url + "/v1/chat/completions", prefill_body(body),
                                {"X-Request-Id": request_id})
    assert status == 200, answer
    return answer


async def test_vllm_prefill_then_decode(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="vllm", role="prefill", seed=1)
    d = await make_sim(engine="vllm", role="decode", seed=2)
    assert p.side_channel_port and d.side_channel_port is None
    body = {"model": "pd-model", "messages": MESSAGES, "max_tokens": 6}

    answer = await vllm_prefill(http, p, body, "req-1")
    choice, usage = answer["choices"][0], answer["usage"]
    assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 1
    kv = answer["kv_transfer_params"]
    n = usage["prompt_tokens"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_request_id"].startswith("chatcmpl-req-1-") and len(kv["remote_request_id"]) == len("chatcmpl-req-1-") + 8
    assert kv["remote_host"] == "localhost" and kv["remote_port"] == p.side_channel_port
    assert kv["remote_num_tokens"] == n and kv["transfer_mode"] == "pull"
    assert (kv["tp_size"], kv["dcp_size"], kv["pp_size"]) == (1, 1, 1)
    assert "remote_blocks_expiry_time" in kv
    blocks = kv["remote_block_ids"]
    assert isinstance(blocks, list) and len(blocks) == 1 and len(blocks[0]) == -(-n // 16)
    pd = (await sim_state(p.url, http))["pd"]
    assert pd["pinned"][0]["remote_request_id"] == kv["remote_request_id"]
    assert pd["pinned"][0]["block_ids"] == blocks and 0 < pd["pinned"][0]["expires_in_s"] <= 30
    # A second prefill gets its own blocks and the same stable engine id.
    second = (await vllm_prefill(http, p, body, "req-2"))["kv_transfer_params"]
    assert second["remote_engine_id"] == kv["remote_engine_id"]

    # Decode, non-streaming, with remote_host rewritten the way the gateway does.
    status, out, _ = await call(http, d.url + "/v1/chat/completions",
                             {**body, "kv_transfer_params": {**kv, "remote_host": "127.0.0.1"}},
                             {"X-Request-Id": "req-1"})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == 6
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n  # transferred counts as cached
    assert out["kv_transfer_params"] is None
    state = await sim_state(p.url, http)
    assert [x["remote_request_id"] for x in state["pd"]["pinned"]] == [second["remote_request_id"]]
    assert state["pd"]["transfers"] == 1
    assert (await sim_state(d.url, http))["pd"]["transfers"] == 1

    # Decode, streaming, with the params verbatim: remote_host "localhost" reaches 127.0.0.1.
    status, events, _ = await call(http, d.url + "/v1/chat/completions",
                                {**body, "stream": True, "stream_options": {"include_usage": True},
                                 "kv_transfer_params": second})
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == \
        out["choices"][0]["message"]["content"]
    state = await sim_state(p.url, http)
    assert state["pd"]["pinned"] == [] and state["pd"]["transfers"] == 2
    assert state["kv"]["used_blocks"] == 0


async def test_vllm_choices_on_both_roles(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """``n`` > 1 on vLLM's NIXL roles, as vLLM forks it into child requests that each carry the
    request's kv_transfer_params: a prefill runs every choice and keeps each one's blocks for a
    decode, its answer naming one choice's (the others stay pinned until their lease runs out); a
    decode's choices read the same remote blocks, one pull for all, each counting the prompt as
    cached; the usage counts the prompt once and every choice's tokens."""
    p = await make_sim(engine="vllm", role="prefill", seed=1)
    d = await make_sim(engine="vllm", role="decode", seed=2)
    body = {"model": "pd-model", "messages": MESSAGES, "max_tokens": 4, "n": 2}
    answer = await vllm_prefill(http, p, body, "req-n")
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "length"]
    n = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == 2
    kv = answer["kv_transfer_params"]
    pinned = (await sim_state(p.url, http))["pd"]["pinned"]
    assert len(pinned) == 2 and kv["remote_request_id"] in [x["remote_request_id"] for x in pinned]
    status, out, _ = await call(http, d.url + "/v1/chat/completions", {**body, "kv_transfer_params": kv},
                                {"X-Request-Id": "req-n"})
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][0]["message"]["content"] != out["choices"][1]["message"]["content"]
    assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]) == (n, 8)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    state = await sim_state(p.url, http)
    assert state["pd"]["transfers"] == 1 and len(state["pd"]["pinned"]) == 1      # the other choice's
    assert (await sim_state(d.url, http))["pd"]["transfers"] == 1
    # streamed, from a prefill of one choice: both of the decode's read its blocks
    kv = (await vllm_prefill(http, p, {**body, "n": 1}, "req-m"))["kv_transfer_params"]
    status, events, _ = await call(http, d.url + "/v1/chat/completions",
                                   {**body, "stream": True, "stream_options": {"include_usage": True},
                                    "kv_transfer_params": kv})
    assert status == 200 and events[-1] == "[DONE]"
    assert {c["index"] for e in events[:-2] for c in e["choices"]} == {0, 1}
    usage = events[-2]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == \
        (n, 8, n)
    assert (await sim_state(p.url, http))["pd"]["transfers"] == 2


async def test_vllm_messages_prefill_then_decode(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """vLLM's Messages API passes ``kv_transfer_params`` into the chat request it builds, and its
    non-streaming answer carries the chat answer's at top level (``messages_full_converter``): a
    Messages prefill answers the params a decode pulls the KV with, streamed or not."""
    p = await make_sim(engine="vllm", role="prefill", seed=1)
    d = await make_sim(engine="vllm", role="decode", seed=2)
    body = {"model": "pd-model", "messages": MESSAGES, "max_tokens": 6}
    prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_body(body)["kv_transfer_params"]}
    status, answer, _ = await call(http, p.url + "/v1/messages", prefill, {"X-Request-Id": "m-1"})
    assert status == 200, answer
    assert answer["type"] == "message" and answer["usage"]["output_tokens"] == 1
    kv = answer["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_request_id"].startswith("chatcmpl-m-1-") and kv["remote_port"] == p.side_channel_port
    n = answer["usage"]["input_tokens"]
    assert kv["remote_num_tokens"] == n

    status, out, _ = await call(http, d.url + "/v1/messages", {**body, "kv_transfer_params": kv})
    assert status == 200, out
    assert out["usage"] == {"input_tokens": n, "output_tokens": 6} and "kv_transfer_params" not in out
    assert (await sim_state(d.url, http))["pd"]["transfers"] == 1

    status, answer, _ = await call(http, p.url + "/v1/messages", prefill, {"X-Request-Id": "m-2"})
    assert status == 200, answer
    async with http.post(d.url + "/v1/messages", json={**body, "stream": True,
                                                       "kv_transfer_params": answer["kv_transfer_params"]}) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw.count(b"event: content_block_delta") == 6 and raw.endswith(b"event: message_stop\ndata: "
                                                                           b'{"type":"message_stop"}\n\n')
    state = await sim_state(p.url, http)
    assert state["pd"]["pinned"] == [] and state["pd"]["transfers"] == 2
    # a plain Messages answer names no params (vLLM leaves None fields out)
    status, out, _ = await call(http, d.url + "/v1/messages", body)
    assert status == 200 and "kv_transfer_params" not in out


async def test_vllm_kv_load_failures(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="vllm", role="prefill", kv_lease_s=0.05)
    fail = await make_sim(engine="vllm", role="decode")
    recompute = await make_sim(engine="vllm", role="decode", kv_load_failure_policy="recompute")
    body = {"messages": MESSAGES, "max_tokens": 3}
    kv = (await vllm_prefill(http, p, body))["kv_transfer_params"]
    await wait_state(http, p.url, lambda s: s["pd"]["pinned"] == [] and s["pd"]["expired"] == 1)
    assert (await sim_state(p.url, http))["kv"]["used_blocks"] == 0

    # Expired lease, policy fail: 500 before streaming, in-stream error once streaming.
    status, out, _ = await call(http, fail.url + "/v1/chat/completions", {**body, "kv_transfer_params": kv})
    assert status == 500 and out == INTERNAL_ERROR
    status, events, _ = await call(http, fail.url + "/v1/chat/completions",
                                {**body, "stream": True, "kv_transfer_params": kv})
    assert status == 200 and events == [INTERNAL_ERROR, "[DONE]"]
    # Policy recompute: a normal answer, prefilled locally.
    status, out, _ = await call(http, recompute.url + "/v1/chat/completions", {**body, "kv_transfer_params": kv})
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await sim_state(recompute.url, http))["pd"]["recomputed"] == 1

    # Wrong engine id, unreachable prefill, simulated pull failure: all KV load failures.
    fresh = (await vllm_prefill(http, p, body, "req-2"))["kv_transfer_params"]
    for bad in ({**fresh, "remote_engine_id": "not-the-engine"},
                {**fresh, "remote_port": closed_port()}):
        status, out, _ = await call(http, fail.url + "/v1/chat/completions", {**body, "kv_transfer_params": bad})
        assert status == 500 and out == INTERNAL_ERROR
    status, out, _ = await call(http, fail.url + "/v1/chat/completions", {**body, "kv_transfer_params": fresh},
                             {"x-sim-fault": "decode.kv_pull_fail=1"})
    assert status == 500
    pd = (await sim_state(fail.url, http))["pd"]
    assert pd["kv_failures"] == 5 and pd["transfers"] == 0
    assert (await sim_state(fail.url, http))["counts"]["errors"] == 5


async def test_vllm_plain_and_malformed_params(make_sim: MakeSim, http: aiohttp.ClientSession,
                                               caplog: pytest.LogCaptureFixture) -> None:
    d = await make_sim(engine="vllm", role="decode")
    body = {"messages": MESSAGES, "max_tokens": 2}
    for extra in ({}, {"kv_transfer_params": None}):
        status, out, _ = await call(http, d.url + "/v1/chat/completions", {**body, **extra})
        assert status == 200 and out["kv_transfer_params"] is None
    malformed = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
                 "remote_request_id": "r", "remote_block_ids": [[1]], "remote_port": 5600}  # no host
    with caplog.at_level(logging.WARNING, logger="enginesim"):
        status, out, _ = await call(http, d.url + "/v1/chat/completions", {**body, "kv_transfer_params": malformed})
    assert status == 200 and "Got invalid KVTransferParams" in caplog.text
    pd = (await sim_state(d.url, http))["pd"]
    assert pd["transfers"] == 0 and pd["kv_failures"] == 0
    status, out, _ = await call(http, d.url + "/v1/chat/completions", {**body, "kv_transfer_params": "x"})
    assert status == 400


async def test_vllm_decode_abandoned_before_pull(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """A decode that dies before pulling leaves P's blocks pinned only until the lease ends."""
    p = await make_sim(engine="vllm", role="prefill", kv_lease_s=1.0)
    d = await make_sim(engine="vllm", role="decode")
    body = {"messages": MESSAGES, "max_tokens": 2}
    kv = (await vllm_prefill(http, p, body))["kv_transfer_params"]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await call(http, d.url + "/v1/chat/completions", {**body, "kv_transfer_params": kv},
                       {"x-sim-fault": "decode.hang=inf"})
    await wait_state(http, d.url, lambda s: s["counts"]["aborted"] == 1)
    assert len((await sim_state(p.url, http))["pd"]["pinned"]) == 1
    await wait_state(http, p.url, lambda s: s["pd"]["pinned"] == [] and s["pd"]["expired"] == 1)


# -- SGLang: bootstrap rendezvous -----------------------------------------------------------------


def sglang_bodies(p: SimServer, room: int, rid: str, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill body, decode body) as a router builds them: same body, same bootstrap triple."""
    body = {"model": "pd-model", "messages": MESSAGES, "max_tokens": 5, "rid": rid,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": room, **extra}
    return {**body, "max_tokens": 1, "stream": False}, body


@pytest.mark.parametrize("first", ["prefill", "decode"])
async def test_sglang_rendezvous(first: str, make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="sglang", role="prefill", seed=1)
    d = await make_sim(engine="sglang", role="decode", seed=2)  # a different seed: D must take P's token
    pbody, dbody = sglang_bodies(p, 7, "rdv-1")
    url_p, url_d = p.url + "/v1/chat/completions", d.url + "/v1/chat/completions"

    if first == "prefill":
        p_task = asyncio.create_task(call(http, url_p, pbody))
        state = await wait_state(http, p.url, lambda s: bool(s["pd"]["rooms_waiting"]))
        assert state["pd"]["rooms_waiting"][0]["state"] == "bootstrapping"
        assert [w["id"] for w in state["waiting"]] == ["rdv-1"] and state["running"] == []
        samples = await metric_samples(http, p.url)
        assert metric(samples, "sglang:num_prefill_bootstrap_queue_reqs", engine_type="prefill") == 1
        await asyncio.sleep(0.05)
        assert not p_task.done()  # no decode yet, no answer
        d_task = asyncio.create_task(call(http, url_d, {**dbody, "stream": True}))
    else:
        d_task = asyncio.create_task(call(http, url_d, {**dbody, "stream": True}))
        state = await wait_state(http, p.url, lambda s: bool(s["pd"]["rooms_waiting"]))
        assert state["pd"]["rooms_waiting"][0]["side"] == "decode"
        dstate = await wait_state(http, d.url, lambda s: bool(s["pd"]["rooms_waiting"]))
        assert dstate["pd"]["rooms_waiting"][0]["state"] == "transfer"
        assert metric(await metric_samples(http, d.url), "sglang:num_decode_transfer_queue_reqs") == 1
        await asyncio.sleep(0.05)
        assert not d_task.done()
        p_task = asyncio.create_task(call(http, url_p, pbody))

    (p_status, p_out, _), (d_status, events, _) = await asyncio.gather(p_task, d_task)
    assert p_status == 200 and d_status == 200, (p_out, events)
    assert p_out["choices"][0]["finish_reason"] == "length" and p_out["usage"]["completion_tokens"] == 1
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    first_token = p_out["choices"][0]["message"]["content"]
    assert first_token and text.startswith(first_token) and len(text) > len(first_token)
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    # P answered only after D took the KV: by then P's room is gone and the transfer is counted.
    for sim in (p, d):
        pd = (await sim_state(sim.url, http))["pd"]
        assert pd["rooms_waiting"] == [] and pd["transfers"] == 1


@pytest.mark.parametrize("rooms", ["scalar", "list"])
async def test_sglang_batch_prompts_meet_on_a_room_each(rooms: str, make_sim: MakeSim,
                                                         http: aiohttp.ClientSession) -> None:
    """A completion's batch: prompt i's room is room + i (one room given) or the list's i-th, on
    both legs, as SGLang normalizes a batch's bootstrap fields; the prefill answers one token a
    prompt and the decode continues each from its own prompt's token."""
    p = await make_sim(engine="sglang", role="prefill", seed=1)
    d = await make_sim(engine="sglang", role="decode", seed=2)
    prompts = [PROMPT, "Hump yards use gravity to sort cars. " * 4, "A short third prompt."]
    room: int | list[int] = 40 if rooms == "scalar" else [9, 3, 77]
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": room}
    if rooms == "list":
        boot = {k: v if k == "bootstrap_room" else [v] * 3 for k, v in boot.items()}
    body = {"model": "pd-model", "prompt": prompts, "max_tokens": 4, "rid": "batch-1", **boot}
    (ps, pout, _), (ds, dout, _) = await asyncio.gather(
        call(http, p.url + "/v1/completions", {**body, "max_tokens": 1}),
        call(http, d.url + "/v1/completions", body))
    assert ps == 200 and ds == 200, (pout, dout)
    assert [c["index"] for c in dout["choices"]] == [0, 1, 2]
    for pc, dc in zip(pout["choices"], dout["choices"], strict=True):
        assert pc["text"] and dc["text"].startswith(pc["text"]) and len(dc["text"]) > len(pc["text"])
    assert pout["usage"]["prompt_tokens"] == dout["usage"]["prompt_tokens"]
    assert pout["usage"]["completion_tokens"] == 3 and dout["usage"]["completion_tokens"] == 12
    for sim in (p, d):
        pd = (await sim_state(sim.url, http))["pd"]
        assert pd["rooms_waiting"] == [] and pd["transfers"] == 3
    # a list of rooms names one a prompt
    status, out, _ = await call(http, d.url + "/v1/completions", {**body, "bootstrap_room": [1, 2]})
    assert status == 400 and "bootstrap_room has 2 values for a batch of 3 prompts" in out["message"]


async def test_sglang_generate_first_token_and_cached(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="sglang", role="prefill", seed=3)
    d = await make_sim(engine="sglang", role="decode", seed=4)
    boot = {"bootstrap_host": "localhost", "bootstrap_port": p.bootstrap_port}
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4}, **boot}
    # Warm P's radix cache, then check that D reports P's cached tokens.
    for room in (1, 2):
        (ps, pout, _), (ds, dout, _) = await asyncio.gather(
            call(http, p.url + "/generate", {**body, "bootstrap_room": room, "rid": f"g{room}"}),
            call(http, d.url + "/generate", {**body, "bootstrap_room": room, "rid": f"g{room}"}))
        assert ps == 200 and ds == 200
        assert pout["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert pout["output_ids"] == dout["output_ids"][:1] and len(dout["output_ids"]) == 4
        assert dout["meta_info"]["cached_tokens"] == pout["meta_info"]["cached_tokens"]
    assert dout["meta_info"]["cached_tokens"] > 0


async def test_sglang_bootstrap_required(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="sglang", role="prefill")
    d = await make_sim(engine="sglang", role="decode")
    message = "Invalid request: Disaggregated request received without bootstrap room id."
    for sim in (p, d):
        status, out, _ = await call(http, sim.url + "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 400 and out == {"object": "error", "message": message, "type": "BadRequest",
                                         "param": None, "code": 400}
        status, out, _ = await call(http, sim.url + "/generate", {"text": "hi", "bootstrap_room": None})
        assert status == 400 and out == {"error": {"message": message}}
        # Health needs no peer.
        async with http.get(sim.url + "/health") as resp:
            assert resp.status == 200
        async with http.get(sim.url + "/model_info") as resp:
            assert (await resp.json())["disaggregation_mode"] == sim.cfg.role
        assert metric(await metric_samples(http, sim.url), "sglang:num_running_reqs",
                      engine_type=sim.cfg.role) == 0
    async with http.get(f"http://127.0.0.1:{p.bootstrap_port}/health") as resp:
        assert resp.status == 200 and await resp.text() == "OK"


async def test_sglang_timeouts(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="sglang", role="prefill", bootstrap_timeout_s=0.1)
    d = await make_sim(engine="sglang", role="decode", waiting_timeout_s=0.1)
    pbody, dbody = sglang_bodies(p, 11, "t-1")
    # P alone: the bootstrap timeout, an abort with status 500 (before any stream header).
    for stream in (False, True):
        status, out, _ = await call(http, p.url + "/v1/chat/completions", {**pbody, "stream": stream})
        assert status == 500 and out["type"] == "500" and out["code"] == 500
        assert out["message"] == "Request 11 timed out after 0.1s in KVPoll.Bootstrapping"
    status, out, _ = await call(http, p.url + "/generate", {"text": PROMPT, **{k: pbody[k] for k in pbody
                                                                             if k.startswith("bootstrap")}})
    assert status == 500 and "KVPoll.Bootstrapping" in out["message"]
    # D alone: the waiting timeout.
    status, out, _ = await call(http, d.url + "/v1/chat/completions", dbody)
    assert status == 500 and "fail to receive KV Cache transfer done signal" in out["message"]
    # D pointed at a port nobody listens on: a bootstrap failure, at once.
    status, out, _ = await call(http, d.url + "/generate",
                             {"text": PROMPT, "stream": True, "bootstrap_host": "127.0.0.1",
                              "bootstrap_port": closed_port(), "bootstrap_room": 12})
    assert status == 200 and "Decode handshake failed" in out[0]["error"]["message"] and out[-1] == "[DONE]"
    # A prefill that hangs (before its rendezvous) leaves the decode to its waiting timeout.
    _, hdbody = sglang_bodies(p, 13, "t-2")
    hp = asyncio.create_task(call(http, p.url + "/v1/chat/completions", {**pbody, "bootstrap_room": 13},
                                  {"x-sim-fault": "prefill.hang=inf"}))
    status, out, _ = await call(http, d.url + "/v1/chat/completions", hdbody,
                             {"x-sim-fault": "prefill.hang=inf"})
    assert status == 500 and "KVPoll.WaitingForInput" in out["message"]
    await call(http, p.url + "/abort_request", {"rid": "t-1"})
    assert (await hp)[1]["choices"][0]["finish_reason"] == "abort"
    samples = await metric_samples(http, d.url)
    assert metric(samples, "sglang:num_bootstrap_failed_reqs_total", engine_type="decode") == 1
    assert metric(samples, "sglang:num_transfer_failed_reqs_total", engine_type="decode") == 2
    assert metric(await metric_samples(http, p.url), "sglang:num_bootstrap_failed_reqs_total") == 3
    assert metric(samples, "sglang:num_aborted_requests_total") == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_abort_waiting_prefill(stream: bool, make_sim: MakeSim,
                                            http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="sglang", role="prefill")
    pbody, _ = sglang_bodies(p, 21, "gw-0001-abcd")
    task = asyncio.create_task(call(http, p.url + "/v1/chat/completions", {**pbody, "stream": stream}))
    await wait_state(http, p.url, lambda s: bool(s["pd"]["rooms_waiting"]))
    await call(http, p.url + "/abort_request", {"rid": "gw-0001-abcd"})
    status, out, _ = await task
    assert status == 200
    if stream:
        assert [e["choices"][0]["finish_reason"] for e in out[:-1] if e["choices"]][-1] == "abort"
    else:
        assert out["choices"][0]["finish_reason"] == "abort"
    state = await sim_state(p.url, http)
    assert state["pd"]["rooms_waiting"] == [] and state["aborted_ids"] == ["gw-0001-abcd"]


async def test_sglang_abort_waiting_decode(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="sglang", role="prefill")
    d = await make_sim(engine="sglang", role="decode")
    _, dbody = sglang_bodies(p, 31, "gw-0002-abcd")
    async with http.post(d.url + "/generate", json={"text": PROMPT, "stream": True, **{
            k: dbody[k] for k in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room")}}) as resp:
        await wait_state(http, p.url, lambda s: bool(s["pd"]["rooms_waiting"]))
        await call(http, d.url + "/abort_request", {"rid": "gw-0002-abcd"})
        event = await next_event(resp)
        assert event["meta_info"]["finish_reason"]["type"] == "abort"
    # The decode's rendezvous call went away with it.
    await wait_state(http, p.url, lambda s: s["pd"]["rooms_waiting"] == [])


# -- role-targeted faults -------------------------------------------------------------------------


def test_role_targeted_fault_parsing() -> None:
    spec = "status=503;prefill.status=500;decode.stall_before_first=inf;decode.kv_pull_fail=1;hang=2"
    assert parse_fault(spec, "prefill").status == 500 and parse_fault(spec, "prefill").hang == 2
    dec = parse_fault(spec, "decode")
    assert dec.status == 503 and dec.stall_before_first == float("inf") and dec.kv_pull_fail
    agg = parse_fault(spec, "aggregated")
    assert agg.status == 503 and not agg.kv_pull_fail and agg.stall_before_first is None
    assert not parse_fault("prefill.status=503", "decode").active
    assert parse_fault("decode.p=0;decode.status=502", "decode").probability == 0.0
    for bad in ("sidecar.status=503", "prefill.bogus=1", "decode.kv_pull_fail=maybe", "hang=-1"):
        with pytest.raises(FaultSpecError):
            parse_fault(bad, "decode")
    with pytest.raises(ValueError):
        SimConfig(role="prefill", fault="router.status=500")
    cfg = config_from_args(["--engine", "vllm", "--role", "prefill", "--kv-lease-s", "5"])
    assert cfg.side_channel_port == 5600 and cfg.bootstrap_port == 8998 and cfg.kv_lease_s == 5.0
    assert cfg.side_channel_host == "localhost" and cfg.kv_load_failure_policy == "fail"


async def test_role_targeted_faults_on_both_legs(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    """The same header goes to both legs; each engine applies only its own items."""
    p = await make_sim(engine="vllm", role="prefill")
    d = await make_sim(engine="vllm", role="decode")
    body = {"messages": MESSAGES, "max_tokens": 4}
    fault = {"x-sim-fault": "prefill.status=503;decode.drop_after=2"}
    status, out, _ = await call(http, p.url + "/v1/chat/completions", prefill_body(body), fault)
    assert status == 503 and out["error"]["code"] == 503
    kv = (await vllm_prefill(http, p, body))["kv_transfer_params"]
    # The decode ignores prefill.status but dies mid-stream.
    async with http.post(d.url + "/v1/chat/completions", json={**body, "stream": True, "kv_transfer_params": kv},
                         headers=fault) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    # A decode stall before the first token after a successful pull.
    kv = (await vllm_prefill(http, p, body, "req-3"))["kv_transfer_params"]
    async with http.post(d.url + "/v1/chat/completions", json={**body, "stream": True, "kv_transfer_params": kv},
                         headers={"x-sim-fault": "decode.stall_before_first=inf;prefill.hang=inf"}) as resp:
        state = await wait_state(http, d.url, lambda s: s["pd"]["transfers"] == 2)
        assert state["running"][0]["generated"] == 0
    await wait_state(http, d.url, lambda s: not s["running"])
    assert (await sim_state(p.url, http))["pd"]["pinned"] == []


async def test_sglang_transfer_failure_seen_by_both_legs(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    p = await make_sim(engine="sglang", role="prefill")
    d = await make_sim(engine="sglang", role="decode")
    pbody, dbody = sglang_bodies(p, 41, "xf-1")
    fault = {"x-sim-fault": "decode.kv_pull_fail=1"}
    (ps, pout, _), (ds, dout, _) = await asyncio.gather(
        call(http, p.url + "/v1/chat/completions", pbody, fault),
        call(http, d.url + "/v1/chat/completions", {**dbody, "stream": True}, fault))
    assert ps == 500 and "Failed to send kv chunk" in pout["message"]
    assert ds == 500 and "Decode transfer failed" in dout["message"]  # before the first chunk: HTTP 500
    for sim in (p, d):
        state = await sim_state(sim.url, http)
        assert state["pd"]["kv_failures"] == 1 and state["counts"]["aborted"] == 1
        assert metric(await metric_samples(http, sim.url), "sglang:num_transfer_failed_reqs_total") == 1
