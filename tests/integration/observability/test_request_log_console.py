"""The request line in the console format, written by a gateway process to its stderr, cannot be
broken or forged by what a client sends: a model name, a body's ``user``, the error message that
quotes them. Their control characters (a line break, a carriage return, a terminal's escape
sequence) are written escaped, so every request is one line and the terminal shows what was sent.
A value with a space, an ``=``, a quote or a backslash in it, or none at all, is written quoted
(logfmt's way, ``"`` and ``\\`` escaped inside), so every field a reader sees in a line is the
gateway's: a model name ``x status=200 user=admin`` is the line's model, not three fields."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import openai
import pytest

from tests.support.gateway_process import get_new
from tests.support.ports import listen_port

FORGED = "2020-01-01 00:00:00 [info     ] request                        model=m status=200 user=admin"
MESSAGES = [{"role": "user", "content": "hi"}]
HEAD = "[info     ] request                        "
# a field: a key, then a bare value (no space, quote, `=` or backslash) or a quoted one
FIELD = re.compile(r'([a-z_]+)=([^ "=\\]+|"(?:[^"\\]|\\.)*")(?: |$)')


def fields(line: str) -> dict[str, str]:
    """The fields of a console request line as a logfmt reader splits them, each value as written;
    asserts that each field is read once and that nothing in the line is left out of a field."""
    rest = line.split(HEAD, 1)[1]
    out: dict[str, str] = {}
    pos = 0
    while pos < len(rest):
        m = FIELD.match(rest, pos)
        assert m is not None, (rest[pos:], line)
        assert m[1] not in out, (m[1], line)
        out[m[1]] = m[2]
        pos = m.end()
    return out


async def ready(port: int) -> None:
    async with asyncio.timeout(40):
        while True:
            try:
                if (await get_new(port, "/ready"))[0] == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
async def test_a_clients_control_characters_are_escaped_in_the_console_line(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    log_path = tmp_path / "gw.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "2", "--log-format", "console", stderr=log_file)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        await ready(port)
        # an unknown model: the line's model and its error (which quotes the name) carry it
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model=f"m\n{FORGED}\x1b[2J\r", messages=MESSAGES, max_tokens=1,
                                                 extra_headers={"x-request-id": "unknown-model"})
        # a served request: the body's user is the line's user
        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1, user=f"u\r\n{FORGED}\x07",
                                             extra_headers={"x-request-id": "served"})
        # fields written inside a value, without a control character: a model, a user with a quote
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="x status=200 user=admin", messages=MESSAGES, max_tokens=1,
                                                 extra_headers={"x-request-id": "spaced"})
        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1,
                                             user='a" status=500 path=\\" x=', extra_headers={"x-request-id": "quoted"})
        proc.send_signal(signal.SIGTERM)        # the request lines are flushed at exit
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await client.close()
    raw = log_path.read_bytes()
    assert b"\x1b" not in raw and b"\r" not in raw and b"\x07" not in raw, raw
    lines = raw.decode().splitlines()
    assert not [x for x in lines if x.startswith("2020-01-01")], lines       # no line forged
    requests = {f["request_id"]: f for f in map(fields, (x for x in lines if HEAD in x))}
    unknown, served, spaced, quoted = (requests[k] for k in ("unknown-model", "served", "spaced", "quoted"))
    assert unknown["model"] == f'"m\\n{FORGED}\\x1b[2J\\r"', unknown
    assert unknown["status"] == "404" and unknown["error"].startswith('"The model `m\\n2020-01-01'), unknown
    assert served["user"] == f'"u\\r\\n{FORGED}\\x07"' and served["status"] == "200", served
    assert spaced["model"] == '"x status=200 user=admin"' and spaced["status"] == "404", spaced
    assert "user" not in spaced or spaced["user"] == "None", spaced
    assert quoted["user"] == '"a\\" status=500 path=\\\\\\" x="' and quoted["status"] == "200", quoted
    assert quoted["path"] == "/v1/chat/completions" and quoted["model"] == "m", quoted    # plain: bare
