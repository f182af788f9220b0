"""An API key's user name, from the config, goes where the gateway writes it: the ``user`` header
to the engine, the ``user`` label of the tenants' metrics (merged over ``--workers 2``), the status
page. Quotes, backslashes and letters outside ASCII are served and exported as they are; a name a
header cannot carry (a line break, NUL) is refused when the config is read."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.server.test_workers import workers_listening
from tests.support.gateway_process import get_new
from tests.support.ports import listen_port

MESSAGES = [{"role": "user", "content": "hi"}]
KEY = "sk-odd-0123456789"


def config(path, port: int, url: str, user: str):
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "server": {"drain_delay_s": 0, "shutdown_grace_s": 2, "log_level": "warning"},
        "auth": {"api_keys": [{"key": KEY, "user": user}]},
        "limits": {"users": {user: {"rpm": 1000}}},
        "models": [{"name": "m", "engine": "vllm", "endpoints": [url]}]}, allow_unicode=True))
    return path


@pytest.mark.timeout(90)
async def test_a_users_quotes_backslashes_and_letters_are_served_and_exported_as_they_are(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    user = 'ops "blue" \\ équipe 用户'
    cfg = config(tmp_path / "gw.yaml", port, sim.url, user)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.DEVNULL)
    try:
        await workers_listening(proc.pid, port)
        for _ in range(6):          # a client each: new connections, spread over both workers
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0) as c:
                await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        for _ in range(4):          # whichever worker answers
            status, page = await get_new(port, "/metrics")
            assert status == 200
            tokens = {(s.labels["user"], s.labels["kind"]): s.value
                      for fam in text_string_to_metric_families(page) if fam.name == "switchyard_user_tokens"
                      for s in fam.samples if s.name == "switchyard_user_tokens_total"}
            assert set(tokens) == {(user, "prompt"), (user, "completion")}
            assert tokens[(user, "completion")] == 12
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await proc.wait()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("user", ["ops\nteam", "ops\rteam", "ops\x00team"])
async def test_a_user_name_no_header_can_carry_is_refused_with_the_config(sims, tmp_path, user):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, sim.url, user)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            while proc.returncode is None:
                with contextlib.suppress(OSError):
                    if (await get_new(port, "/ready"))[0] == 200:
                        break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 0.1)
        if proc.returncode is None:     # it serves: what does that key's request get?
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0) as c:
                try:
                    await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
                    got = "200"
                except openai.APIStatusError as e:
                    got = f"{e.status_code} {e.message}"
            pytest.fail(f"the config was taken, and a request with the key got {got}")
        err = (await proc.stderr.read()).decode()
        assert proc.returncode == 2, err
        assert "auth.api_keys[0].user" in err, err
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(20):
                await proc.wait()
