"""HTTP helpers of the integration tests: a client's request to a gateway or an engine, its answer read
whole, the SSE events in it, the simulator's ``/_sim/state``, and SDK clients pointed at a gateway."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import aiohttp
import anthropic
import openai
import orjson
from multidict import CIMultiDictProxy

CHAT_PATH = "/v1/chat/completions"


class Reply(NamedTuple):
    """What came back, read to the end; unpacks as ``status, headers, body``."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def base_url(target: Any) -> str:
    """A URL as given, or the ``url`` of what has one (a running gateway, a simulated engine)."""
    return target if isinstance(target, str) else target.url


async def post(target: Any, payload: Mapping[str, Any] | bytes, headers: Mapping[str, str] | None = None, *,
               path: str = CHAT_PATH, http: aiohttp.ClientSession | None = None) -> Reply:
    """POST ``payload`` to ``target`` + ``path`` and read the whole answer. A mapping is sent as JSON;
    bytes are sent exactly as given (``Content-Type: application/json`` unless ``headers`` say otherwise).
    ``http``: a session to reuse, else one for this request alone."""
    if isinstance(payload, bytes):
        kw: dict[str, Any] = {"data": payload, "headers": {"Content-Type": "application/json", **(headers or {})}}
    else:
        kw = {"json": payload, "headers": dict(headers or {})}
    async with aiohttp.ClientSession() if http is None else contextlib.nullcontext(http) as s, \
            s.post(base_url(target) + path, **kw) as r:
        return Reply(r.status, r.headers, await r.read())


async def post_json(target: Any, path: str, payload: Mapping[str, Any] | bytes,
                    headers: Mapping[str, str] | None = None) -> tuple[int, Any, CIMultiDictProxy[str]]:
    """POST to ``path`` and decode the JSON answer: ``status, data, headers``."""
    r = await post(target, payload, headers, path=path)
    return r.status, r.json(), r.headers


def chat_body(messages: list[dict[str, Any]], *, model: str = "m", max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """A chat completion request; ``extra`` adds fields (``stream``, ``user``, ...) as they are.
    A test file binds its own defaults with ``functools.partial``."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# the SDK clients a test made, closed after it (tests/conftest.py): a client left to the garbage
# collector closes its connections from a loop that is gone, and logs that it could not
_sdk_clients: list[openai.AsyncOpenAI | anthropic.AsyncAnthropic] = []


def openai_client(gw: Any, key: str = "none") -> openai.AsyncOpenAI:
    """The OpenAI SDK against a gateway, without the SDK's own retries (a test sees every answer)."""
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
    _sdk_clients.append(client)
    return client


def anthropic_client(gw: Any, key: str = "none") -> anthropic.AsyncAnthropic:
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    _sdk_clients.append(client)
    return client


async def close_sdk_clients() -> None:
    """Close the SDK clients made by ``openai_client`` and ``anthropic_client`` since the last call."""
    while _sdk_clients:
        client = _sdk_clients.pop()
        with contextlib.suppress(Exception):
            await client.close()


async def sim_state(url: str, http: aiohttp.ClientSession | None = None) -> dict[str, Any]:
    """A simulated engine's ``/_sim/state``: what it received, runs, aborted, counted."""
    async with aiohttp.ClientSession() if http is None else contextlib.nullcontext(http) as s, s.get(url + "/_sim/state") as r:
        assert r.status == 200, r.status
        return await r.json()


def sse_events(raw: bytes) -> list[Any]:
    """The data events of an SSE body: decoded JSON objects, and "[DONE]"."""
    out = []
    for block in raw.split(b"\n\n"):
        block = block.strip()
        if block.startswith(b"data:"):
            data = block[5:].strip()
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def sse_frames(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of each frame of a named-event stream (Anthropic, Responses)."""
    out = []
    for block in raw.split(b"\n\n"):
        name, data = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data = orjson.loads(line[5:])
        if data is not None:
            out.append((name, data))
    return out
