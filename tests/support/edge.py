"""Helpers of the edge tests.

Raw HTTP/1.1 on loopback: send bytes exactly as given, read every byte back, split what came back
into responses. No HTTP client library in the way (they refuse to send the malformed requests
these tests are about, and they hide a close without an answer).

And a gateway in front of one simulated engine, run on both event loops: the default one and
uvloop, which ``python -m gateway`` runs on. The two split reads and writes differently and fire
flow control at different moments, which is exactly what the edge's clocks depend on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from enginesim import SimConfig, start_sim
from gateway.config.schema import config_from_dict
from gateway.server.app import GATEWAY_KEY
from gateway.server.run import start
from tests.support.http import sim_state
from tests.support.metrics import samples
from tests.support.waiting import wait_for

FAST_SIM = {"ttft_base_ms": 1.0, "prefill_ms_per_token": 0.0, "itl_ms": 1.0}
# the gateway's own health probes and metric scrapes, left out of "what reached the engine"
MONITOR = {("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models")}   # /v1/models: LoRA discovery


@dataclass
class EdgeGateway:
    port: int
    app: Any
    sim: Any
    runner: Any = None          # the aiohttp runner: its server's live connections (their protocols)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def samples(self) -> dict[str, float]:
        """The gateway's metrics, read in-process (an HTTP scrape would be one more client connection)."""
        return samples(self.app[GATEWAY_KEY].metrics.render())

    def busy(self) -> dict[str, float]:
        """In-flight gauges that are not back to zero (the gateway's and each endpoint's)."""
        return {k: v for k, v in self.samples().items() if v and k.startswith(
            ("switchyard_in_flight_requests{", "switchyard_endpoint_in_flight_requests{"))}

    def timeouts(self, reason: str) -> float:
        return self.samples().get(f"switchyard_client_timeouts_total{{reason={reason}}}", 0.0)

    def connections(self) -> float:
        return self.samples()["switchyard_client_connections{}"]

    async def sim_state(self) -> dict:
        return await sim_state(self.sim.url)

    async def received(self) -> list[dict]:
        """What reached the engine, the gateway's health probes and metric scrapes aside."""
        return [r for r in (await self.sim_state())["received"] if (r["method"], r["path"]) not in MONITOR]


@contextlib.asynccontextmanager
async def edge_gateway(sim: dict[str, Any] | None = None, endpoint: str | None = None,
                       **server: Any) -> AsyncIterator[EdgeGateway]:
    """A gateway with ``server:`` settings in front of one vLLM engine serving model ``m`` (the
    simulated one, or the engine at ``endpoint``); on the way out, no request may still be in
    flight (every handler ended, however its client behaved)."""
    engine = await start_sim(SimConfig(engine="vllm", model="m", port=0, host="127.0.0.1",
                                       **{**FAST_SIM, **(sim or {})}))
    runner = None
    try:
        cfg = config_from_dict({"listen": {"host": "127.0.0.1", "port": 0},
                                "health": {"interval_s": 0.2, "timeout_s": 1.0}, "scrape": {"interval_s": 0.2},
                                "server": {"shutdown_grace_s": 2.0, **server},
                                "models": [{"name": "m", "engine": "vllm", "endpoints": [endpoint or engine.url]}]})
        runner, app, port = await start(cfg)
        gw = EdgeGateway(port=port, app=app, sim=engine, runner=runner)
        yield gw
        assert await wait_for(lambda: not gw.busy(), timeout=10.0, interval=0.01), f"still in flight after the test: {gw.busy()}"
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.close()


@dataclass
class Resp:
    status: int
    headers: dict[str, str]             # lower-case names; a repeated header keeps the last value
    body: bytes
    version: str = "HTTP/1.1"
    raw_headers: list[tuple[str, str]] = field(default_factory=list)

    def json(self):
        return orjson.loads(self.body)


@dataclass
class Exchange:
    responses: list[Resp]
    closed: bool                        # the server closed the connection (EOF or reset)
    reset: bool = False                 # ... with a reset
    trailing: bytes = b""               # bytes after the last complete response

    @property
    def first(self) -> Resp:
        assert self.responses, f"no answer before the connection {'closed' if self.closed else 'went quiet'}"
        return self.responses[0]


def _dechunk(data: bytes, pos: int) -> tuple[bytes, int] | None:
    out = bytearray()
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return None
        size = int(data[pos:end].split(b";")[0], 16)
        pos = end + 2
        if size == 0:
            end = data.find(b"\r\n", pos)   # no trailers expected: the final CRLF
            return (bytes(out), end + 2) if end >= 0 else None
        if len(data) < pos + size + 2:
            return None
        out += data[pos:pos + size]
        pos += size + 2


def parse_responses(data: bytes, *, eof: bool) -> tuple[list[Resp], bytes]:
    """Complete responses in ``data`` and the bytes left over. A response without a length ends
    at EOF (``eof``), as HTTP/1.x says."""
    out: list[Resp] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            break
        lines = data[pos:end].decode("latin-1").split("\r\n")
        version, status_s = lines[0].split(" ", 2)[:2]
        raw_headers = [tuple(p.strip() for p in line.split(":", 1)) for line in lines[1:] if ":" in line]
        headers = {k.lower(): v for k, v in raw_headers}
        body_start = end + 4
        status = int(status_s)
        if 100 <= status < 200:
            pos = body_start
            continue
        if "content-length" in headers:
            n = int(headers["content-length"])
            if len(data) < body_start + n:
                break
            body, pos = data[body_start:body_start + n], body_start + n
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            got = _dechunk(data, body_start)
            if got is None:
                break
            body, pos = got
        elif eof:
            body, pos = data[body_start:], len(data)
        else:
            break
        out.append(Resp(status=status, headers=headers, body=body, version=version, raw_headers=raw_headers))
    return out, data[pos:]


async def exchange(port: int, *parts: bytes, pause: float = 0.05, wait: float = 10.0,
                   until_close: bool = True, responses: int | None = None) -> Exchange:
    """Send ``parts`` (``pause`` s apart), then read until the server closes the connection (or,
    with ``responses``, until that many answers came). ``wait`` bounds a test that would hang."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = b""
    closed = reset = False
    try:
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(pause)
            try:
                writer.write(part)
                await writer.drain()
            except (ConnectionResetError, BrokenPipeError):
                break
        try:
            async with asyncio.timeout(wait):
                while True:
                    if responses is not None and len(parse_responses(data, eof=False)[0]) >= responses \
                            and not until_close:
                        break
                    chunk = await reader.read(65536)
                    if not chunk:
                        closed = True
                        break
                    data += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed = reset = True
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    got, rest = parse_responses(data, eof=closed)
    return Exchange(responses=got, closed=closed, reset=reset, trailing=rest)


def roundtrip(port: int, raw: bytes, *, timeout: float = 15.0) -> Exchange:
    """Blocking: send one request (which should carry ``Connection: close``), read to EOF."""
    data = b""
    closed = reset = False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(raw)
        except (ConnectionResetError, BrokenPipeError):
            pass
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    closed = True
                    break
                data += chunk
        except ConnectionResetError:
            closed = reset = True
    got, rest = parse_responses(data, eof=closed)
    return Exchange(responses=got, closed=closed, reset=reset, trailing=rest)


def request(method: str, target: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            *, close: bool = False) -> bytes:
    h = {"Host": "gateway.test", **(headers or {})}
    if body is not None:
        h.setdefault("Content-Type", "application/json")
        h.setdefault("Content-Length", str(len(body)))
    if close:
        h["Connection"] = "close"
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    return head.encode("utf-8", "surrogateescape") + (body or b"")


def assert_openai_error(resp: Resp, status: int | None = None) -> dict:
    """An error answer as OpenAI clients parse it, with the gateway's request id."""
    if status is not None:
        assert resp.status == status, (resp.status, resp.body[:300])
    assert resp.status >= 400
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    assert resp.headers.get("request-id"), resp.headers
    body = orjson.loads(resp.body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err
