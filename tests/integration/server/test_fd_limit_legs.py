"""A gateway that can open no file (RLIMIT_NOFILE met) and the engine calls off the main inference
path: the P/D legs, a LoRA adapter's load, a stored response's read from the engine that keeps it.
Each is answered as the main path's is, a 503 service_unavailable with Retry-After saying the
gateway is short of file descriptors (error_class gateway_resources), and no engine is counted a
fault for it: not its breaker, not its upstream errors, not an adapter's load cooldown; the load
counts in switchyard_lora_loads_total as one that could not be sent (result no_socket)."""

from __future__ import annotations

import asyncio
import resource
import sys
from pathlib import Path

import orjson
import pytest

from tests.integration.server.test_fd_limit import METRICS, answer
from tests.support.lora import LORA_SIM
from tests.support.metrics import metric
from tests.support.ports import listen_port

STATUS = b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n"


def post_json(path: str, payload: dict, user: str = "") -> bytes:
    body = orjson.dumps(payload)
    extra = b"user: %s\r\n" % user.encode() if user else b""
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path.encode(), extra, len(body), body))


def connected_to(port: int) -> int:
    """Established TCP connections to ``port`` (an engine's), from any process on this host."""
    return sum(1 for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
               if (f := line.split())[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) == port)


def get(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode()


def chat(model: str, user: str = "") -> bytes:
    return post_json("/v1/chat/completions", {"model": model, "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "hello there"}]}, user)


async def remaining_requests(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> int:
    """A request's answer, read whole: what its user's RPM window has left."""
    writer.write(head)
    status_line = await reader.readline()
    assert int(status_line.split()[1]) == 200, status_line
    length, left = 0, -1
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
        elif name.strip().lower() == b"x-ratelimit-remaining-requests":
            left = int(value)
    await reader.readexactly(length)
    return left


@pytest.mark.timeout(120)
async def test_pd_legs_lora_loads_and_response_reads_without_descriptors_answer_503_and_blame_no_engine(
        sims, tmp_path):
    prefill = await sims("vllm", "pd", role="prefill")
    decode = await sims("vllm", "pd", role="decode")
    lora = await sims("vllm", "lm", **LORA_SIM)
    keeper = await sims("vllm", "rs", enable_responses_store=True)
    # a pair whose prefill keeps the gateway's connection and whose decode closes it at once: the
    # decode leg is the one that needs a new socket
    prefill2 = await sims("vllm", "pdd", role="prefill", keepalive_timeout_s=300)
    decode2 = await sims("vllm", "pdd", role="decode", keepalive_timeout_s=0.05)
    # SGLang's legs go out together (the concurrent path)
    prefill3 = await sims("sglang", "pds", role="prefill")
    decode3 = await sims("sglang", "pds", role="decode")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, header_timeout_s: 300, keepalive_timeout_s: 300,"
                   " log_level: warning}\n"
                   "health: {interval_s: 60, timeout_s: 1}\n"
                   "scrape: {enabled: false}\n"
                   "upstream: {keepalive_timeout_s: 300, warm_connections: 0}\n"
                   "lora: {discovery_interval_s: 0}\n"
                   "limits: {users: {alice: {rpm: 100}}}\n"
                   "responses: {state: engine}\n"
                   "models:\n"
                   f"  - {{name: pd, engine: vllm, rolesets: [{{name: rs-1, prefill: ['{prefill.url}'],"
                   f" decode: ['{decode.url}']}}]}}\n"
                   f"  - {{name: lm, engine: vllm, endpoints: ['{lora.url}'], adapters: {{tone: org/tone-lora}}}}\n"
                   f"  - {{name: rs, engine: vllm, endpoints: ['{keeper.url}']}}\n"
                   f"  - {{name: pdd, engine: vllm, rolesets: [{{name: rs-2, prefill: ['{prefill2.url}'],"
                   f" decode: ['{decode2.url}']}}]}}\n"
                   f"  - {{name: pds, engine: sglang, rolesets: [{{name: rs-3, prefill: [{{url: '{prefill3.url}',"
                   f" bootstrap_port: {prefill3.bootstrap_port}}}], decode: ['{decode3.url}']}}]}}\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "1", "--log-format", "json", stderr=(tmp_path / "gw.log").open("wb"))
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        async with asyncio.timeout(30):
            while True:         # every endpoint ready (one probe each)
                try:
                    conn = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                status, body = await answer(*conn, STATUS)
                conn[1].close()
                page = orjson.loads(body) if status == 200 else {}
                models = page.get("models")
                if models and all(m["ready_endpoints"] == m["endpoints"] > 0 for m in models):
                    worker = page["gateway"]["pid"]        # the process serving (the parent's worker)
                    break
                await asyncio.sleep(0.05)
        for _ in range(8):
            conns.append(await asyncio.open_connection("127.0.0.1", port))
        # a response the keeper stores, through the gateway's engine connections (not the reads')
        status, body = await answer(*conns[0], post_json("/v1/responses", {"model": "rs", "input": "hi",
                                                                          "max_output_tokens": 4}))
        assert status == 200, body
        rid = orjson.loads(body)["id"]
        status, body = await answer(*conns[0], chat("pdd"))
        assert status == 200, body
        async with asyncio.timeout(30):     # the decode closed its connection; the prefill's stays
            while connected_to(decode2.port):
                await asyncio.sleep(0.05)
        assert connected_to(prefill2.port) >= 1       # the pool's (and the health probe's)

        soft, hard = resource.prlimit(worker, resource.RLIMIT_NOFILE)
        # a new descriptor takes the lowest free number, and none is under 3: no new file
        resource.prlimit(worker, resource.RLIMIT_NOFILE, (3, hard))
        try:
            pd = await answer(*conns[1], chat("pd", "alice"))
            adapter = await answer(*conns[2], chat("tone", "alice"))
            read = await answer(*conns[3], get(f"/v1/responses/{rid}"))
            decoded = await answer(*conns[6], chat("pdd", "alice"))
            together = await answer(*conns[7], chat("pds", "alice"))
        finally:
            resource.prlimit(worker, resource.RLIMIT_NOFILE, (soft, hard))
        wrong = {}
        for what, (status, body) in {"pd": pd, "lora": adapter, "responses": read,
                                        "pd_decode": decoded, "pd_concurrent": together}.items():
            err = orjson.loads(body).get("error", {}) if status != 200 else {}
            if status != 503 or err.get("code") != "service_unavailable" or "file descriptor" not in err["message"]:
                wrong[what] = (status, body[:300])
        assert not wrong, wrong

        status, page = await answer(*conns[4], METRICS)
        assert status == 200
        text = page.decode()
        assert metric(text, "switchyard_breaker_transitions_total") == 0, text
        assert metric(text, "switchyard_upstream_errors_total") == 0
        assert metric(text, "switchyard_pd_prefill_failures_total") == 0     # no prefill failed
        # the adapter's load that could not be sent is counted as such, not as the engine's error
        assert metric(text, "switchyard_lora_loads_total", model="lm", adapter="tone", result="no_socket") == 1
        assert metric(text, "switchyard_lora_loads_total", result="error") == 0
        # and each is served once descriptors are there again: no cooldown, no breaker open
        for request in (chat("pd"), chat("tone"), get(f"/v1/responses/{rid}"), chat("pdd"),
                        chat("pds")):
            status, body = await answer(*conns[5], request)
            assert status == 200, body
        # no engine answered alice's four requests: her RPM window counts none of them (the
        # 503 of a leg with no socket gives its count back, as a refused connection's does)
        assert await remaining_requests(*conns[5], chat("pd", "alice")) == 99
    finally:
        for _r, w in conns:
            w.close()
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()
