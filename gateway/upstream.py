"""Upstream legs: one pooled client session to all engines, and failures classified.

The session keeps connections alive between requests (TCP_NODELAY is set on every connection by
aiohttp's protocol), sends no ``Accept-Encoding`` so engines answer uncompressed and relayed bytes
need no re-encoding, and applies the connect and total timeouts from config. The first-byte
(response headers) timeout is applied per leg, because P/D legs and watchdogs use their own.
"""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.config import UpstreamConfig


class UpstreamFailure(Exception):
    """A leg failed before a response status arrived.

    ``kind``: connect (refused/unreachable), reset (connection dropped before any byte),
    timeout (no response headers in time), protocol (anything else the client library raised).
    ``retryable`` is true when no byte came back, so no engine produced output for the client.
    """

    def __init__(self, kind: str, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = retryable


def make_session(cfg: UpstreamConfig) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=cfg.max_connections,
        limit_per_host=0,
        keepalive_timeout=cfg.keepalive_timeout_s,
        ttl_dns_cache=300,
    )
    timeout = aiohttp.ClientTimeout(total=cfg.total_timeout_s or None, sock_connect=cfg.connect_timeout_s or None)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        auto_decompress=False,
    )


async def open_leg(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                   header_timeout: float | None) -> aiohttp.ClientResponse:
    """POST ``body`` and return once the response status and headers arrived."""
    try:
        if header_timeout:
            async with asyncio.timeout(header_timeout):
                return await session.post(url, data=body, headers=headers)
        return await session.post(url, data=body, headers=headers)
    except TimeoutError:
        raise UpstreamFailure("timeout", f"no response from {url} within {header_timeout:g}s",
                              retryable=False) from None
    except aiohttp.ClientConnectorError as e:
        raise UpstreamFailure("connect", f"cannot connect to {url}: {e.os_error.strerror or e}",
                              retryable=True) from None
    except aiohttp.ServerDisconnectedError:
        raise UpstreamFailure("reset", f"{url} closed the connection before answering", retryable=True) from None
    except aiohttp.ClientOSError as e:
        raise UpstreamFailure("reset", f"connection to {url} failed: {e.strerror or e}", retryable=True) from None
    except aiohttp.ClientError as e:
        raise UpstreamFailure("protocol", f"bad answer from {url}: {e}", retryable=False) from None
