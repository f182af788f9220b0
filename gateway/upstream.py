"""Upstream legs: the pooled HTTP/1.1 client to the engines, and failures classified.

Data-plane legs (aggregated, prefill, decode, SGLang ``/abort_request``) go through
``gateway.h1client.UpstreamPool``: keep-alive connections, one write per request, no
``Accept-Encoding`` (engines answer uncompressed and relayed bytes need no re-encoding), connect
and total timeouts from config. The first-byte (response head) timeout is applied per leg, because
P/D legs and watchdogs use their own.

The monitor (health probes, ``/metrics`` scrapes) is not hot and keeps a small aiohttp session.
"""

from __future__ import annotations

import aiohttp

from gateway.config import UpstreamConfig
from gateway.h1client import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)


class UpstreamFailure(Exception):
    """A leg failed before a response status arrived.

    ``kind``: connect (refused/unreachable/connect timeout), reset (connection dropped before the
    answer's head), timeout (no response head in time), protocol (not a valid HTTP answer).
    ``retryable`` is true when no byte came back, so no engine produced output for the client.
    """

    def __init__(self, kind: str, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = retryable


def make_pool(cfg: UpstreamConfig) -> UpstreamPool:
    """The data-plane client (call inside the running loop, e.g. at app startup)."""
    return UpstreamPool.from_config(cfg)


def make_session(cfg: UpstreamConfig) -> aiohttp.ClientSession:
    """The monitor's session: a few connections for health probes and metrics scrapes."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=cfg.keepalive_timeout_s, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(sock_connect=cfg.connect_timeout_s or None),
                                 skip_auto_headers=("Accept-Encoding", "User-Agent"), auto_decompress=False)


async def open_leg(pool: UpstreamPool, url: str, body: bytes, headers: dict[str, str],
                   header_timeout: float | None) -> UpstreamResponse:
    """POST ``body`` and return once the response status and headers arrived."""
    try:
        return await pool.post(url, body, headers, header_timeout)
    except UpstreamTimeout as e:
        raise UpstreamFailure("timeout", f"no response from {url} within {e.seconds:g}s", retryable=False) from None
    except UpstreamConnectError as e:
        raise UpstreamFailure("connect", f"cannot connect to {url}: {e}", retryable=True) from None
    except UpstreamDisconnected as e:
        raise UpstreamFailure("reset", f"{url}: {e}", retryable=not e.received) from None
    except UpstreamError as e:
        raise UpstreamFailure("protocol", f"bad answer from {url}: {e}", retryable=False) from None
