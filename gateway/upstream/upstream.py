"""The upstream: every leg to an engine, and the outcome of each told to the endpoint's breaker.

Data-plane legs (aggregated, prefill, decode, aborts) go through ``gateway.upstream.h1client.UpstreamPool``:
keep-alive connections, one write per request, ``Accept-Encoding: identity`` (engines answer
uncompressed and relayed bytes need no re-encoding; with no ``Accept-Encoding`` at all any coding would
be acceptable, RFC 9110 §12.5.3, and a compressing proxy in front of an engine could use one), connect and total timeouts from config. The first-byte
(response head) timeout is given per leg, because P/D legs and watchdogs use their own.

A leg that fails before a response status arrived raises ``UpstreamFailure`` with its kind; the
failure is counted (``switchyard_upstream_errors_total``) and told to the endpoint's circuit
breaker as a fault (``gateway.resilience.breaker``; a refused connection opens it at once with
``health.passive``). ``record`` is the one door to the breakers: the relay tells it how a relayed
answer ended, ``fetch`` the status of a whole-answer leg (prefill); ``gateway.resilience.outcome`` says what
each outcome means.

The body and headers an engine receives are shaped here too: the client's bytes unchanged unless
usage must be asked for, and the client's headers minus hop-by-hop and the gateway's own; every
leg to an engine the gateway has a key for (``Endpoint.api_key``) carries that key instead of the
client's (``gateway.endpoints.engine_headers``).

The monitor (health probes, ``/metrics`` scrapes, LoRA discovery reads) is not hot and keeps a
small aiohttp session of its own, with at most one idle connection per engine.
"""

from __future__ import annotations

import asyncio
import math
import time
from itertools import compress
from operator import itemgetter, not_
from typing import TYPE_CHECKING

import aiohttp
import structlog

from gateway.config.schema import HealthConfig, UpstreamConfig, WatchdogConfig
from gateway.endpoints import Endpoint, EndpointPool, engine_headers
from gateway.errors import ErrorClass, GatewayError
from gateway.observability.metrics import GatewayMetrics
from gateway.request import InferenceRequest, body_bytes, usage_stream_options
from gateway.resilience.breaker import Breakers
from gateway.resilience.outcome import Outcome, key_refused, of_failure, of_status
from gateway.upstream.h1client import (
    LOCAL_ERRNOS,
    Exchange,
    SendState,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamLocalError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamTooLarge,
)

if TYPE_CHECKING:
    from gateway.pipeline.context import RequestRecord

log = structlog.get_logger("switchyard.upstream")

# an engine refusing the gateway's key is logged once per endpoint in this many seconds (with the
# count since): a wrong key fails every request sent there
KEY_REFUSED_LOG_EVERY_S = 10.0
_KEY_REFUSED = "key_refused"        # Endpoint.extra: (monotonic time last logged, refusals since)

# client headers that are not forwarded to engines: hop-by-hop headers, the ones the gateway sets
# itself (the body goes out decoded, so its content-encoding too), and the gateway's own routing
# controls, among them the engine's data-parallel rank (a client must not pin ranks; the gateway
# picks them, ``gateway.kv.dp_rank``, and a model's ``kv_events.client_rank`` lets a client's through)
# and vLLM's priority, which it reads over the body's (a client must not jump the engine's queue;
# ``upstream.client_priority`` lets it through: ``InferenceRequest.priority_header``).
# Everything else passes through, as through a proxy.
DP_RANK_HEADER = "x-data-parallel-rank"
PRIORITY_HEADER = "x-vllm-priority"
_DROP_HEADERS = frozenset({
    "host", "content-length", "content-type", "content-encoding", "connection", "keep-alive", "proxy-connection",
    "transfer-encoding", "te", "trailer", "upgrade", "expect", "accept-encoding", "x-request-id",
    "routing-strategy", "proxy-authorization", DP_RANK_HEADER, PRIORITY_HEADER,
})
_DROP_KEEPING_PRIORITY = _DROP_HEADERS - {PRIORITY_HEADER}

_NAME = itemgetter(0)


class UpstreamFailure(Exception):
    """A leg failed before a response status arrived.

    ``kind``: connect (refused/unreachable/connect timeout), reset (connection dropped before the
    answer's head), timeout (no response head in time), protocol (not a valid HTTP answer),
    too_large (an answer read whole, ``Upstream.answer``, over ``upstream.max_response_bytes``).
    ``retryable`` is true when no byte came back, so no engine produced output for the client.
    ``local``: a connect that failed in this process (no file descriptor or socket buffer to make
    the socket with): no engine was asked, none is at fault, and another would fail the same way.
    ``cause``: what the endpoint's breaker is told, the kind but for a connect that failed other
    than refused (timed out, unreachable): ``connect_failed``, a fault as any other, where a refused
    one opens the breaker at once with ``health.passive``.
    """

    def __init__(self, kind: str, message: str, retryable: bool, local: bool = False, cause: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.local = local
        self.cause = cause or kind
        self.too_large: UpstreamTooLarge | None = None     # kind ``too_large``: a whole answer over its bound


def classify(e: UpstreamError, url: str) -> UpstreamFailure:
    if isinstance(e, UpstreamLocalError):
        return UpstreamFailure("connect", f"the gateway could not open a socket to {url}: {e}", retryable=False,
                               local=True)
    if isinstance(e, UpstreamTimeout):
        return UpstreamFailure("timeout", f"no response from {url} within {e.seconds:g}s", retryable=False)
    if isinstance(e, UpstreamConnectError):
        return UpstreamFailure("connect", f"cannot connect to {url}: {e}", retryable=True,
                               cause="connect" if e.refused else "connect_failed")
    if isinstance(e, UpstreamDisconnected):
        return UpstreamFailure("reset", f"{url}: {e}", retryable=not e.received)
    return UpstreamFailure("protocol", f"bad answer from {url}: {e}", retryable=False)


def upstream_headers(ireq: InferenceRequest) -> dict[str, str]:
    h = {"Content-Type": ireq.content_type, "X-Request-Id": ireq.request_id, "Accept-Encoding": "identity"}
    # the client's headers whose lower-cased name is not dropped, in their order (the last of a
    # repeated name wins), picked in C: no Python step per header
    items = list(ireq.headers.items())       # a multidict's keys() holds a repeated name once: not its items' order
    drop = _DROP_KEEPING_PRIORITY if ireq.priority_header else _DROP_HEADERS
    h.update(compress(items, map(not_, map(drop.__contains__, map(str.lower, map(_NAME, items))))))
    return h


def engine_key_refused(metrics: GatewayMetrics, ep: Endpoint, model: str, status: int, path: str) -> None:
    """``ep``'s engine answered 401 or 403 to a request that carried the gateway's key for it:
    counted (``switchyard_upstream_errors_total{error_class="upstream_auth"}``) and logged for the
    operator (the key is wrong, or the engine's was changed). Neither the key nor the engine's
    answer is logged."""
    metrics.child(metrics.upstream_errors, model, ep.name, ErrorClass.UPSTREAM_AUTH).inc()
    now = time.monotonic()
    last, since = ep.extra.get(_KEY_REFUSED, (-math.inf, 0))
    if now - last < KEY_REFUSED_LOG_EVERY_S:
        ep.extra[_KEY_REFUSED] = (last, since + 1)
        return
    ep.extra[_KEY_REFUSED] = (now, 0)
    log.warning("engine refused the gateway's api_key", model=model, endpoint=ep.name, status=status, path=path,
                refused_since_last=since)


def key_refused_error(status: int) -> GatewayError:
    """The client's answer when the engine refused the gateway's key: a 502 (the gateway's
    configuration, not the client's key), never the engine's own body."""
    return GatewayError(502, f"the engine refused the gateway's credentials for it (status {status})",
                        code="upstream_auth_failed", header=("x-error-upstream", "auth"),
                        error_class=ErrorClass.UPSTREAM_AUTH)


def no_socket_error(f: UpstreamFailure, rec: RequestRecord | None = None) -> GatewayError:
    """The client's answer when this process could make no socket to the engine (``f.local``): a
    503 to retry, as for a gateway short of capacity, not the 502 of an engine that failed. The
    same for every call to an engine a request makes (its leg, a P/D prefill or decode, a LoRA
    adapter's load, a stored response's read); ``rec``, the request's record, is told the class."""
    if rec is not None:
        rec.error_class = ErrorClass.GATEWAY_RESOURCES
    return GatewayError(503, f"{f.message} (the gateway is short of file descriptors or socket buffers; no engine "
                        "was asked, retry shortly)", code="service_unavailable", headers={"Retry-After": "1"},
                        error_class=ErrorClass.GATEWAY_RESOURCES)


def local_failure(e: BaseException, url: str) -> UpstreamFailure | None:
    """The ``UpstreamFailure`` of a connect by another client than the pool (aiohttp's, which raises
    an ``OSError``) that failed in this process, as ``classify`` makes the pool's; else None."""
    if isinstance(e, OSError) and e.errno in LOCAL_ERRNOS:
        return UpstreamFailure("connect", f"the gateway could not open a socket to {url}: {e.strerror or e}",
                               retryable=False, local=True)
    return None


def too_large_error(limit: int) -> GatewayError:
    """The client's answer when the engine's answer, read whole, passed ``upstream.max_response_bytes``."""
    return GatewayError(502, f"the engine's answer is larger than {limit} bytes (upstream.max_response_bytes)",
                        code="upstream_too_large", header=("x-error-upstream", "too_large"),
                        error_class=ErrorClass.UPSTREAM_TOO_LARGE)


def upstream_body(ireq: InferenceRequest, continuous_alone: bool = False) -> tuple[bytes, bool]:
    """The body to send, and whether the gateway injected ``include_usage`` (to strip later);
    ``continuous_alone``: the engine's ``EngineAdapter.continuous_usage_alone``. The original bytes
    go out unchanged unless usage must be asked for."""
    if not ireq.stream:                 # a whole answer: nothing to ask (``usage_stream_options``'s first test)
        return ireq.body, False
    extra = usage_stream_options(ireq, continuous_alone)
    if extra is not None:
        return body_bytes({**ireq.data, **extra}, ireq.body), True
    return ireq.body, False


def head_timeout(cfg: UpstreamConfig, wd: WatchdogConfig | None, stream: bool) -> float | None:
    """How long a leg waits for its answer's head: ``upstream.first_byte_timeout_s`` and, for a leg
    the watchdog watches (``wd``), its first-chunk bound (a stream: engines send the head with the
    first token) or whole-answer bound (a non-stream: the head comes with the body), whichever is
    shorter. None: unbounded. The one computation of it, for every leg that carries the answer."""
    first_byte = cfg.first_byte_timeout_s
    limit = (wd.first_chunk_timeout_s if stream else wd.response_timeout_s) if wd is not None else 0.0
    if limit and first_byte:
        return min(limit, first_byte)
    return limit or first_byte or None


class Upstream:
    def __init__(self, cfg: UpstreamConfig, health: HealthConfig, metrics: GatewayMetrics,
                 breakers: Breakers | None = None) -> None:
        self.cfg = cfg
        self.health = health
        self.metrics = metrics
        self.breakers = breakers
        self.pool: UpstreamPool | None = None      # opened inside the running loop (``start``)

    def start(self) -> None:
        self.pool = UpstreamPool.from_config(self.cfg)
        opened, failed = (self.metrics.upstream_reopened.labels(o) for o in ("opened", "failed"))
        self.pool.on_reopen = lambda ok: (opened if ok else failed).inc()

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    def follow(self, endpoints: EndpointPool) -> None:
        """Told of each endpoint that leaves ``endpoints``: once no endpoint left has its URL, its
        engine's connections close (idle ones now, busy ones when their answer ends) and none is
        opened again to keep it warm."""
        def left(ep: Endpoint) -> None:
            if self.pool is not None and not endpoints.has_url(ep.url):
                self.pool.retire(ep.url)
        endpoints.removal_listeners.append(left)

    @property
    def open_connections(self) -> int:
        return self.pool.open_connections if self.pool is not None else 0

    def connections(self) -> tuple[int, int]:
        """The pool's open connections: (busy: an exchange on it, idle: kept for the next)."""
        if self.pool is None:
            return 0, 0
        idle = self.pool.idle_connections
        return self.pool.open_connections - idle, idle

    def record(self, ep: Endpoint, outcome: Outcome, cause: str = "") -> None:
        """The classified outcome of a leg to ``ep``, for its breaker."""
        if self.breakers is not None:
            self.breakers.record(ep, outcome, cause)

    def failed(self, ep: Endpoint, model: str, kind: str, report: bool = True, cause: str = "") -> None:
        """Count a failure of a leg to ``ep`` before its answer's status; its breaker hears a fault
        (``cause``, else ``kind``: see ``UpstreamFailure.cause``)."""
        self.metrics.child(self.metrics.upstream_errors, model, ep.name, kind).inc()
        if report:
            self.record(ep, of_failure(kind), cause or kind)

    async def open(self, ep: Endpoint, path: str, body: bytes, headers: dict[str, str],
                   header_timeout: float | None, model: str, state: SendState | None = None) -> UpstreamResponse:
        """POST ``body`` and return once the response status and headers arrived; ``state`` records
        whether any of the request may have been written."""
        assert self.pool is not None
        url = ep.url + path
        try:
            return await self.pool.post(url, body, engine_headers(ep, headers), header_timeout, state)
        except UpstreamError as e:
            f = classify(e, url)
            if not f.local:
                self.failed(ep, model, f.kind, cause=f.cause)
            raise f from None

    async def fetch(self, ep: Endpoint, path: str, body: bytes, headers: dict[str, str],
                    model: str, timeout: float | None = None, report: bool = True,
                    timeout_fault: bool = True) -> tuple[int, bytes]:
        """POST and read the whole answer (prefill legs, aborts) within ``timeout``; raises
        ``UpstreamFailure`` (kind ``timeout`` when the time ran out). With ``report`` (not for
        aborts) the outcome goes to the endpoint's breaker; a timeout only with ``timeout_fault``
        (not for a LoRA adapter's load, which may outlast any bound on a healthy engine)."""
        status, raw = await self.answer(ep, self.begin(ep, path, body, headers), model, timeout, report,
                                        timeout_fault)
        keyed = ep.api_key is not None
        if key_refused(status, keyed):
            engine_key_refused(self.metrics, ep, model, status, path)
        if report:
            self.record(ep, of_status(status, keyed), f"status_{status}")
        return status, raw

    # -- a leg in two steps: written now, awaited later (P/D: the legs go out before any bookkeeping)

    def begin(self, ep: Endpoint, path: str, body: bytes, headers: dict[str, str],
              state: SendState | None = None, once: bool = False) -> Exchange:
        """POST ``body``, written before this returns when a keep-alive connection to ``ep`` is idle
        (else by ``opened``/``answer``). The exchange must then be awaited with ``opened`` or
        ``answer``, or dropped with ``Exchange.discard``. ``once``: never written twice
        (``Exchange.once``)."""
        assert self.pool is not None
        return self.pool.begin(ep.url + path, body, headers if ep.api_key is None else engine_headers(ep, headers),
                               state, once)

    async def opened(self, ep: Endpoint, x: Exchange, header_timeout: float | None, model: str) -> UpstreamResponse:
        """``open`` for a begun exchange: its response status and headers."""
        try:
            return await x.response(header_timeout)
        except UpstreamError as e:
            f = classify(e, x.url)
            if not f.local:
                self.failed(ep, model, f.kind, cause=f.cause)
            raise f from None

    async def answer(self, ep: Endpoint, x: Exchange, model: str, timeout: float | None = None,
                     report: bool = True, timeout_fault: bool = True) -> tuple[int, bytes]:
        """The whole answer of a begun exchange within ``timeout``, as ``fetch`` reads it; its
        status is not told to the breaker (``record`` it), its failures are (with ``report``; a
        timeout with ``timeout_fault`` too)."""
        try:
            async with asyncio.timeout(timeout):
                resp = await x.response()
                try:
                    raw = await resp.read(self.cfg.max_response_bytes)
                finally:
                    resp.release()      # back to the pool when fully read; closed (engine aborts) otherwise
            return resp.status, raw
        except TimeoutError:
            self.failed(ep, model, "timeout", report and timeout_fault)
            raise UpstreamFailure("timeout", f"no answer from {x.url} within {timeout:g}s", retryable=False) from None
        except UpstreamTooLarge as e:       # counted as the relay counts a whole answer over the bound
            self.failed(ep, model, "too_large", report)
            f = UpstreamFailure("too_large", f"bad answer from {x.url}: {e}", retryable=False)
            f.too_large = e
            raise f from None
        except UpstreamError as e:
            f = classify(e, x.url)
            if not f.local:
                self.failed(ep, model, f.kind, report, f.cause)
            raise f from None


class MonitorConnector(aiohttp.TCPConnector):
    """aiohttp's connector keeping at most one idle connection per engine (host, port, scheme).

    A burst of monitoring requests to one engine (a probe overlapping a scrape and a discovery
    read, several rounds' worth at once) opens a connection for each; aiohttp would keep them all
    and hand them out first in, first out, so each is taken in turn, none is ever idle long enough
    for a keep-alive to expire, and the engine holds them all for as long as the gateway runs. Here
    a connection that comes back while another to the same engine is idle and still connected is
    closed instead: the one kept carries the next requests, and no request opens a connection
    unless others to that engine are all in use (or the engine closed the idle one)."""

    def _release(self, key, protocol, *, should_close: bool = False) -> None:
        idle = self._conns.get(key)
        if idle and any(p.is_connected() for p, _ in idle):
            should_close = True
        super()._release(key, protocol, should_close=should_close)


def make_session(cfg: UpstreamConfig) -> aiohttp.ClientSession:
    """The monitor's session (health probes, metrics scrapes, LoRA discovery reads): at rest, one
    kept-alive connection per engine (``MonitorConnector``)."""
    connector = MonitorConnector(limit=0, keepalive_timeout=cfg.keepalive_timeout_s, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(sock_connect=cfg.connect_timeout_s or None),
                                 skip_auto_headers=("Accept-Encoding", "User-Agent"), auto_decompress=False)
