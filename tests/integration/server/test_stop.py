"""A gateway process that stops with requests still running: at the end of the grace period, or at
a second signal, each client is told the gateway is shutting down (a 503, or a stream's last
event in its API's shape) and the request log says so, instead of a connection closed in the
middle of the answer and a line blaming the client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys

import anthropic
import openai
import pytest

from tests.support.gateway_process import get_new
from tests.support.http import sim_state
from tests.support.ports import listen_port

LONG = 5000         # tokens: a stream far longer than any grace here


async def ready(port: int) -> None:
    """Until the gateway on ``port`` answers ``/ready`` with 200 (its log is the test's to read)."""
    async with asyncio.timeout(40):
        while True:
            try:
                if (await get_new(port, "/ready"))[0] == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.05)


async def first_event(stream) -> object:
    it = stream.__aiter__()
    return await it.__anext__()


async def rest_of(stream) -> Exception | None:
    """Reads a stream to its end; the error its client raised, or None for a complete answer."""
    try:
        async for _ in stream:
            pass
    except Exception as e:     # noqa: BLE001 - what the SDK raises is what the test checks
        return e
    return None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["grace", "second_signal"])
async def test_requests_still_running_when_the_gateway_stops_are_told_so(sims, tmp_path, how):
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    grace = 1 if how == "grace" else 60
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   f"server: {{drain_delay_s: 0, shutdown_grace_s: {grace}, log_format: json}}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", stderr=log_file)
    base = f"http://127.0.0.1:{port}"
    oc = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    ac = anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0)
    try:
        await ready(port)
        chat = await oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=LONG, stream=True)
        messages = await ac.messages.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=LONG, stream=True)
        await first_event(chat)
        await first_event(messages)
        whole = asyncio.ensure_future(oc.completions.create(model="m", prompt="hi", max_tokens=LONG))
        async with asyncio.timeout(10):     # the non-streaming request reached the engine
            while (await sim_state(sim.url))["counts"]["started"] < 3:
                await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        if how == "second_signal":
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            chat_end, messages_end = await rest_of(chat), await rest_of(messages)
            with pytest.raises(openai.APIStatusError) as whole_end:
                await whole
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await oc.close()
        await ac.close()
    # each client heard why its answer ended
    assert isinstance(chat_end, openai.APIError), chat_end
    assert "shutting down" in str(chat_end)
    assert isinstance(messages_end, anthropic.APIStatusError), messages_end
    assert "shutting down" in str(messages_end)
    assert whole_end.value.status_code == 503
    assert "shutting down" in str(whole_end.value)
    assert code == 0
    text = log_path.read_text()
    assert "Traceback" not in text
    lines = [json.loads(raw) for raw in text.splitlines() if raw.startswith("{")]
    requests = [x for x in lines if x.get("event") == "request" and x.get("model") == "m"]
    assert len(requests) == 3
    assert {x["error_class"] for x in requests} == {"draining"}       # not the client's cancel
    assert sorted(x["status"] for x in requests) == [200, 200, 503]   # two streams under way, one whole answer


@pytest.mark.timeout(90)
async def test_one_signal_to_the_whole_process_group_drains_and_a_second_stops(sims, tmp_path):
    """Ctrl-C in a terminal (or systemd stopping the service's cgroup) signals the parent and every
    worker, and the parent passes the signal on: each worker gets it twice, which is one stop (the
    stream finishes within the grace), not the second signal that stops at once."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 60, log_format: json}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", stderr=log_file, start_new_session=True)
    oc = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        await ready(port)
        finished = await oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=100, stream=True)
        cut = await oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=LONG, stream=True)
        await first_event(finished)
        await first_event(cut)
        os.killpg(proc.pid, signal.SIGINT)         # the group: the parent and both workers
        async with asyncio.timeout(30):
            chunks = [c async for c in finished]
        assert chunks[-1].choices[0].finish_reason == "length"     # the whole answer, after the signal
        assert proc.returncode is None              # the long stream goes on within the grace
        os.killpg(proc.pid, signal.SIGINT)         # a second Ctrl-C: stop now
        async with asyncio.timeout(30):
            cut_end = await rest_of(cut)
            code = await proc.wait()
        assert isinstance(cut_end, openai.APIError) and "shutting down" in str(cut_end), cut_end
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await oc.close()
    assert code == 0
    text = log_path.read_text()
    assert "Traceback" not in text
    stops = [json.loads(raw) for raw in text.splitlines() if "second signal" in raw]
    assert [x["cut"] for x in stops if x["cut"]] == [1]     # the worker with the long stream, at the second


# the gateway's entry point, with a SIGTERM sent to the parent the moment its first fork returns
# there: the worker it made must still be told to stop (signals are held across the fork)
_TERM_AT_FORK = """
import os, runpy, signal, sys
real_fork = os.fork
def fork():
    pid = real_fork()
    if pid:
        os.fork = real_fork
        os.kill(os.getpid(), signal.SIGTERM)
    return pid
os.fork = fork
sys.argv = ["gateway", *sys.argv[1:]]
runpy.run_module("gateway", run_name="__main__")
"""


@pytest.mark.timeout(60)
async def test_a_stop_signal_that_comes_while_a_worker_is_forked_reaches_it(tmp_path):
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
                   "models: [{name: m, engine: vllm, endpoints: ['http://127.0.0.1:9']}]\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _TERM_AT_FORK, "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.PIPE)
    err = b""
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                _, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None, "the gateway waited on a worker that was never told to stop"
    assert b"Traceback" not in err
