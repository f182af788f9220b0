"""`python -m gateway --demo` as a newcomer runs it: the real process, answered through the SDK."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import socket
import sys

import aiohttp
import anthropic
import openai
import orjson
import pytest

from enginesim.faults import parse_fault
from gateway.demo import DEMO_ADAPTERS, DEMO_ALIASES, DEMO_ENGINES, DEMO_PD_ADAPTERS, DEMO_USERS
from tests.support.batch import run_to_end
from tests.support.metrics import metric
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.ports import listen_port

MODELS = sorted({m for m, *_ in DEMO_ENGINES})


async def test_demo_answers_every_model_streaming_and_not():
    """Also with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, as one would to look at its traces: the
    gateway and the simulated engines then trace to it, and a P/D request arrives as one tree with
    each engine's span under the gateway's leg to it."""
    rx = await OTLPReceiver().start()
    port = listen_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.url.removesuffix("/v1/traces"),
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--demo", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env)
    try:
        banner = b""
        async with asyncio.timeout(30):
            while b"Tracing:" not in banner:
                line = await proc.stdout.readline()
                if not line:
                    pytest.fail(f"demo exited early:\n{banner.decode()}")
                banner += line
        assert b"curl" in banner and b"OpenAI" in banner and b"Metrics:" in banner
        # its python lines import the OpenAI SDK, which the demo's own install (the runtime lock) lacks
        assert b"pip install openai" in banner.split(b'python -c "from openai', 1)[0]
        assert f"http://127.0.0.1:{port}/status ".encode() in banner
        # every curl line is a command of its own, its continuation lines indented under it
        assert not re.search(rb"' {2,}-d '", banner)     # a continuation joined to the line above it
        assert rx.url.encode() in banner
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert {m.id for m in (await client.models.list()).data} == (
                set(MODELS) | {a["name"] for a in DEMO_ALIASES} | set(DEMO_ADAPTERS) | set(DEMO_PD_ADAPTERS))
        for model in MODELS:
            r = await client.chat.completions.create(model=model, max_tokens=5,
                                                     messages=[{"role": "user", "content": "Hello!"}])
            assert r.choices[0].message.content
            stream = await client.chat.completions.create(model=model, max_tokens=5, stream=True,
                                                          messages=[{"role": "user", "content": "Hello!"}])
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/status.json") as r:
            doc = await r.json()
        assert {m["name"] for m in doc["models"]} == set(MODELS) and len(doc["endpoints"]) == len(DEMO_ENGINES)
        assert {m["name"]: m["minute"]["requests"] for m in doc["models"]} == {m: 2 for m in MODELS}
        assert [a["name"] for a in doc["aliases"]] == ["demo-chat"]
        served = set()
        for user in DEMO_USERS:
            r = await client.chat.completions.with_raw_response.create(
                model="demo-chat", max_tokens=2, user=user, messages=[{"role": "user", "content": "Hi"}])
            served.add(r.headers["x-served-model"])
        assert served == {"demo-llama", "demo-qwen"}        # the banner's 90/10 canary, both arms reached
        # the engines make tool calls, as vLLM and SGLang with a tool-call parser do
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        for model in ("demo-llama", "demo-qwen"):
            r = await client.chat.completions.create(model=model, max_tokens=64, tools=[weather],
                                                     messages=[{"role": "user", "content": "Weather in Paris?"}])
            assert r.choices[0].finish_reason == "tool_calls"
            assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        # the Messages API (vLLM) and a pass-through endpoint (SGLang's rerank), as the banner shows
        ac = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)
        msg = await ac.messages.create(model="demo-llama", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        assert msg.content[0].text and msg.usage.output_tokens == 4
        # and over demo-llama-pd's prefill/decode pair (vLLM), as the banner shows
        assert b'/v1/messages' in banner and b'{"model":"demo-llama-pd","max_tokens":16,' in banner
        raw = await ac.messages.with_raw_response.create(model="demo-llama-pd", max_tokens=4,
                                                         messages=[{"role": "user", "content": "Hi"}])
        assert raw.headers["prefill-target-pod"] == "127.0.0.1:8121" and raw.headers["target-pod"] == "127.0.0.1:8122"
        msg = await raw.parse()
        assert msg.content[0].text and msg.usage.output_tokens == 4
        await ac.close()
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/rerank", json={
                "model": "demo-qwen", "query": "red apple", "documents": ["green pear", "red apple pie"]}) as r:
            assert r.status == 200 and (await r.json())[0]["document"] == "red apple pie"
        # a batch, as the banner shows: uploaded, run on idle slots, its output read back
        rows = b"".join(orjson.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                      "body": {"model": "demo-llama", "max_tokens": 4,
                                               "messages": [{"role": "user", "content": f"Question {i}"}]}}) + b"\n"
                        for i in range(3))
        f = await client.files.create(file=("in.jsonl", rows), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = await run_to_end(client, b.id)
        assert b.status == "completed" and b.request_counts.completed == 3
        assert len((await client.files.content(b.output_file_id)).content.splitlines()) == 3
        # the LoRA adapters: one already loaded on a replica, one loaded on demand by this request
        models = {m.id: m for m in (await client.models.list()).data}
        assert {"sql-lora", "chat-lora"} <= set(models)
        lora = await client.chat.completions.create(model="chat-lora", max_tokens=2,
                                                    messages=[{"role": "user", "content": "Hi"}])
        assert lora.model == "chat-lora" and lora.choices[0].message.content
        pd_lora = await client.chat.completions.create(model="pd-lora", max_tokens=2,     # P/D: both roles load it
                                                       messages=[{"role": "user", "content": "Hi"}])
        assert pd_lora.model == "pd-lora" and pd_lora.choices[0].message.content
        # KV events (demo-kv), as the banner shows: the engine that served the first turn publishes
        # the blocks it cached, the gateway's event index holds them, and the second turn lands there
        system = "".join(f"Rule {i}: answer in one short line. " for i in range(1, 41))
        first = await client.chat.completions.create(model="demo-kv", max_tokens=2, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "first question"}])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        async with aiohttp.ClientSession() as s:
            for _ in range(250):
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    kv = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines()
                          if line.startswith("switchyard_kv_events")}
                if kv.get('switchyard_kv_events_index_blocks{model="demo-kv"}', 0) > 0:
                    break
                await asyncio.sleep(0.02)
        assert kv['switchyard_kv_events_index_blocks{model="demo-kv"}'] >= first.usage.prompt_tokens // 16
        assert kv['switchyard_kv_events_total{kind="BlockStored",model="demo-kv"}'] >= 1
        assert 1.0 in {v for k, v in kv.items() if k.startswith("switchyard_kv_events_endpoint_live{")}
        # its answer, tokenized ahead of the conversation's next turn
        assert kv.get('switchyard_kv_events_answers_total{model="demo-kv",outcome="tokenized"}', 0) >= 1
        second = await client.chat.completions.create(model="demo-kv", max_tokens=2, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "second question"}])
        assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
        # the second chat of that shape (system, user) was put together from it, and checked
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            page = await r.text()
        assert metric(page, "switchyard_kv_events_chat_renders_total", model="demo-kv", how="shape") >= 1
        assert metric(page, "switchyard_kv_events_chat_renders_total", model="demo-kv", how="mismatch") == 0
        assert metric(page, "switchyard_kv_events_fast_tokenizer", model="demo-kv") == 1      # tiktoken, checked
        assert metric(page, "switchyard_kv_events_fast_tokenizer_checks_total", model="demo-kv", outcome="agreed") >= 1
        assert metric(page, "switchyard_kv_events_fast_tokenizer_checks_total", model="demo-kv", outcome="differed") == 0
        # a conversation's next turn sends its answer back: the engine cached the blocks the answer
        # filled (as vLLM does), and the gateway, which took the answer to tokenize ahead (counted
        # when it does), found it held
        turn = [{"role": "system", "content": system}, {"role": "user", "content": "third question"}]
        third = await client.chat.completions.create(model="demo-kv", max_tokens=40, messages=turn)
        turn += [{"role": "assistant", "content": third.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
        async with aiohttp.ClientSession() as s:
            for _ in range(250):
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    page = await r.text()
                if metric(page, "switchyard_kv_events_answers_total", model="demo-kv", outcome="tokenized") >= 2:
                    break
                await asyncio.sleep(0.02)
        fourth = await client.chat.completions.create(model="demo-kv", max_tokens=2, messages=turn)
        assert fourth.usage.prompt_tokens_details.cached_tokens > third.usage.prompt_tokens
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            page = await r.text()
        assert metric(page, "switchyard_kv_events_answers_met_total", model="demo-kv", outcome="held") >= 1
        # the same two turns under a cache_salt: a cache of their own, found by the second
        salted = [await client.chat.completions.create(model="demo-kv", max_tokens=2, extra_body={"cache_salt": "tenant-b"},
                                                       messages=[{"role": "system", "content": system},
                                                                 {"role": "user", "content": f"{q} question"}])
                  for q in ("first", "second")]
        assert salted[0].usage.prompt_tokens_details.cached_tokens == 0
        assert salted[1].usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
        # mid-stream continuation, as the banner shows: a replica drops every stream after 4 tokens,
        # and each stream still ends whole (12 tokens, one usage block) on the other replica
        async with aiohttp.ClientSession() as s:
            await (await s.post("http://127.0.0.1:8102/_sim/config", json={"fault": "drop_after=4"})).read()
            async def whole() -> int:
                stream = await client.chat.completions.create(
                    model="demo-llama", max_tokens=12, stream=True, stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": "Go"}])
                usage = [c.usage async for c in stream if c.usage is not None]
                assert len(usage) == 1
                return usage[0].completion_tokens

            try:    # concurrent, so least-request puts some on each replica
                assert await asyncio.gather(*(whole() for _ in range(4))) == [12] * 4
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    migrated = [line for line in (await r.text()).splitlines()
                                if line.startswith("switchyard_migrations_total{") and 'outcome="continued"' in line]
                assert migrated and sum(float(line.rsplit(" ", 1)[1]) for line in migrated) >= 1
            finally:
                await (await s.post("http://127.0.0.1:8102/_sim/config", json={"fault": "none"})).read()
        # breakers, as the banner shows: the replica made sick faults every request it gets (its
        # answer is a 500 or a dropped connection, never a roll that lets one through), so the
        # banner's loop opens its breaker on faults in a row whatever the routing's draws; every
        # answer is a 200, the faults retried on the other replica within the retry budget
        text = banner.decode()
        sick = re.search(r"8102/_sim/config -d '(\{\"fault\":\"status=[^']*)'", text).group(1)
        spec, rounds = parse_fault(orjson.loads(sick)["fault"]), int(re.search(r"\$\(seq (\d+)\); do curl -s -o /dev/null -D -",
                                                                               text).group(1))
        alternatives = []
        while spec is not None:
            alternatives.append(spec)
            spec = spec.otherwise
        assert any(a.probability == 1 and dataclasses.replace(a, otherwise=None).active for a in alternatives), \
            f"a request of the sick replica may go unfaulted: {sick}"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                retried = metric(await r.text(), "switchyard_retries_total", model="demo-llama")
            await (await s.post("http://127.0.0.1:8102/_sim/config", data=sick)).read()
            try:
                for _ in range(rounds):
                    async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                            "model": "demo-llama", "messages": [{"role": "user", "content": "Hi"}]}) as r:
                        assert r.status == 200, await r.text()
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    page = await r.text()
            finally:
                await (await s.post("http://127.0.0.1:8102/_sim/config", data='{"fault":"none"}')).read()
        assert metric(page, "switchyard_breaker_state", model="demo-llama", endpoint="127.0.0.1:8102") == 1
        assert metric(page, "switchyard_retries_total", model="demo-llama") > retried
        raw = await client.chat.completions.with_raw_response.create(
            model="demo-qwen-pd", max_tokens=3, messages=[{"role": "user", "content": "Trace me"}])
        assert raw.headers["x-pd-decision"].startswith("disaggregated")
        await client.close()
        rid = raw.headers["request-id"]

        def root(r):
            return next((s for s in r.spans if s.attributes.get("gen_ai.request.id") == rid), None)

        assert await rx.wait_for(lambda r: root(r) and len(r.trace(root(r).trace_id)) >= 6, timeout=15)
        legs = {s.span_id: s.name for s in rx.children(root(rx))}
        engine_spans = [s for s in rx.trace(root(rx).trace_id) if s.name == "llm_request"]
        assert sorted(legs.get(s.parent_id) for s in engine_spans) == ["decode", "prefill"]
        assert {s.service for s in engine_spans} == {"sglang"}
    finally:
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(15):
            await proc.wait()
        await rx.close()


def _soft_nofile(pid: int) -> int:
    """The soft open-files limit of ``pid``, as /proc/PID/limits shows it."""
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no open-files line")


async def _started_low(argv: list[str], soft: int, until: bytes) -> tuple[asyncio.subprocess.Process, bytes]:
    """``python -m gateway *argv`` started with the soft open-files limit ``soft``, its output read
    up to the line holding ``until``."""
    import resource

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", *argv, preexec_fn=low,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = b""
    try:
        async with asyncio.timeout(30):
            while until not in out:
                line = await proc.stdout.readline()
                if not line:
                    pytest.fail(f"exited early:\n{out.decode()}")
                out += line
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, out


async def test_the_demo_raises_the_file_descriptor_limit_as_a_start_does(tmp_path):
    """Started under a low soft open-files limit, the demo raises it to the hard one (at most
    NOFILE_MAX and fs.nr_open), as a gateway started with a config file does, and says so. Before,
    only the config file's start raised it: the demo kept the soft limit it was started with."""
    import resource

    from gateway.server.run import NOFILE_MAX

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    expected = NOFILE_MAX if hard == resource.RLIM_INFINITY else min(hard, NOFILE_MAX)
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/fs/nr_open") as f:
        expected = min(expected, int(f.read()))
    soft = min(1024, expected // 2)
    if soft < 256:
        pytest.skip(f"a hard open-files limit of {hard} leaves nothing to raise")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "models: [{name: m, engine: vllm, endpoints: ['http://127.0.0.1:9']}]\n")
    started, out = await _started_low(["--config", str(cfg), "--workers", "1", "--log-format", "json"], soft,
                                      b'"listening"')
    try:
        assert _soft_nofile(started.pid) == expected, out.decode()
    finally:
        started.send_signal(signal.SIGINT)
        await started.wait()
    demo_port = listen_port()
    demo, out = await _started_low(["--demo", "--port", str(demo_port), "--log-format", "json"], soft, b"Tracing:")
    try:
        assert _soft_nofile(demo.pid) == expected, out.decode()
        assert b'"file descriptor limit raised"' in out, out.decode()
    finally:
        demo.send_signal(signal.SIGINT)
        async with asyncio.timeout(15):
            await demo.wait()


async def _demo_exit(port: int) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--demo", "--port", str(port), "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, (out + err).decode()


def _hold(port: int) -> socket.socket | None:
    """A listening socket on ``port``, or None when something else holds it already."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


async def test_a_demo_whose_port_is_taken_says_so_in_one_line():
    """`make demo` where 8888 is taken (a Jupyter server's default port), or a port of its
    simulated engines: exit 1 with one line that names the port and what to do, as a start with a
    config file says `cannot listen on ...`, not a traceback. Before, both ended in a traceback
    (ListenError from the gateway's bind, OSError or zmq's ZMQError from an engine's)."""
    port = listen_port()
    held = _hold(port)
    assert held is not None
    try:
        code, out = await _demo_exit(port)
    finally:
        held.close()
    assert code == 1 and "Traceback" not in out, out
    line = out.strip().splitlines()[-1]
    assert line.startswith(f"switchyard: cannot listen on 127.0.0.1:{port}: "), out
    assert "--port" in line and "simulated engine" not in out, out      # found before any engine started
    kv_port = next(entry["kv_events"]["port"] for model, *_, entry in DEMO_ENGINES if model == "demo-kv")
    held = _hold(kv_port)           # a KV-event publisher's port (ZMQ), bound after eight engines started
    try:
        code, out = await _demo_exit(listen_port())
    finally:
        if held is not None:
            held.close()
    assert code == 1 and "Traceback" not in out, out
    line = out.strip().splitlines()[-1]
    assert re.match(r"switchyard: the demo cannot start its simulated engine demo-[a-z-]+ on 127\.0\.0\.1:\d+: ", line), out
    assert "8101-8150 and 8998" in line, out
