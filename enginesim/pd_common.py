"""Plumbing shared by the P/D roles: a second small HTTP listener and a client for the peer.

A prefill engine runs one extra listener next to its API server (vLLM: the NIXL side channel;
SGLang: the bootstrap server), and a decode engine talks to it over plain HTTP. Both are
aiohttp, both live in the engine's event loop and are started/stopped with the role.
"""

from __future__ import annotations

import contextlib
from typing import Any

import aiohttp
import orjson
from aiohttp import web

# Long enough for a rendezvous answer to be written at shutdown, short enough not to stall tests.
_LISTENER_SHUTDOWN_S = 0.5


def url_host(host: str) -> str:
    """``host`` as it goes into a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class SideListener:
    """An extra aiohttp server on ``host:port`` (port 0: a free one); ``port`` is the bound port.

    Handlers are cancelled when their client goes away, like the engine's own server: a decode
    that gives up on a rendezvous is noticed at once.
    """

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._app = app
        self._host = host
        self._want_port = port
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> int:
        runner = web.AppRunner(self._app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=_LISTENER_SHUTDOWN_S)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._want_port, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


def client_session() -> aiohttp.ClientSession:
    """A session for the peer's listener. The threaded resolver reads /etc/hosts, so a
    ``localhost`` side-channel host works whether it resolves to 127.0.0.1, ::1 or both."""
    connector = aiohttp.TCPConnector(resolver=aiohttp.ThreadedResolver(), limit=0)
    return aiohttp.ClientSession(connector=connector, trust_env=False)


async def close_session(session: aiohttp.ClientSession | None) -> None:
    if session is not None:
        with contextlib.suppress(Exception):
            await session.close()


async def read_body(resp: aiohttp.ClientResponse) -> Any:
    """The peer's JSON answer, or its text when it is not JSON."""
    raw = await resp.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")


__all__ = ["SideListener", "client_session", "close_session", "read_body", "url_host"]
