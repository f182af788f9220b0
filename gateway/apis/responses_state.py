"""Where the gateway keeps Responses API state: the response-id → endpoint map (affinity) and,
with ``responses.state: gateway``, each response's history.

Two backends behind one small interface of byte values with a TTL: ``MemoryStore`` (this process;
oldest entries evicted first past a count or byte cap) and ``RedisStore`` (every replica on one
Redis, when ``state.redis_url`` is set; keys ``<state.key_prefix>:resp:<kind>:<response id>`` with
a ``PX`` expiry, so nothing outlives its TTL). A Redis call is bounded by four times
``state.timeout_s``; one that met a lost connection or a Cluster in the middle of a failover
(``UNAVAILABLE``, but for a pool timeout: that call waited its time already) is sent again, at
most ``TRIES`` times in all within that bound, ``RETRY_PAUSES_S`` between: a Cluster client re-reads its slot map only for the call after the one that failed, so
after a failover each idle replica's first call on a moved slot would fail on a Cluster healthy
again, and a Sentinel-managed client asks the Sentinels again on its next connection. Every call
(GET, SET with PX, DEL) may be sent twice. A refused password or user (``auth``) and a TLS
handshake that got no answer (``no_tls``: a Redis serving plain TCP) or a TLS certificate that
failed verification (``tls_verify``: a CA not trusted, another host's name) are no passing faults: that
call is not sent again, and fails after one connect timeout. A failure still there raises ``StoreUnavailable`` and
the caller decides (a lookup answers 503 with Retry-After, a write is counted and logged). Every
call touches one key, so on a Redis Cluster the records spread over its shards (no hash tag); the
client is gateway/state/redis.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from gateway.state.redis import (
    CALL_FAILED,
    UNAVAILABLE,
    Client,
    PoolTimeout,
    caused_by,
    close_client,
    held_loop_timeout,
    no_tls_answer,
    refusal,
    tls_verify_failed,
    transport_reason,
)

TRIES = 3                       # a call sent at most this often (see the module's description)
RETRY_PAUSES_S = (0.05, 0.25)   # before the second and the third


class StoreUnavailable(Exception):
    """The backing store could not answer. ``reason``: ``unreachable`` (``no_tls``: a TLS URL's
    server took the connection and never answered the handshake; ``tls_verify``: its certificate
    failed verification), ``auth`` (it refused the
    connection's password or user), or why a Redis that answered refused the call (gateway/state/redis.py ``refusal``: ``wrongtype``, ``noperm``,
    ``readonly``, ...; ``error`` for another error it answered). ``outcome_unknown``: a try was sent
    and got no answer (it timed out, or its connection was lost), so Redis may have run it."""

    def __init__(self, message: str = "", reason: str = "unreachable", outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.outcome_unknown = outcome_unknown      # a try may have run on Redis (see ``_not_sent``)


class MemoryStore:
    """Values with one TTL per store, in insertion order, so the oldest expire (or are evicted
    past ``max_entries`` / ``max_bytes``) first."""

    def __init__(self, ttl_s: float, max_entries: int, max_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self._d: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._d)

    def _drop(self, key: str) -> None:
        _, v = self._d.pop(key)
        self.bytes -= len(v)

    def _expire(self, now: float) -> None:
        d = self._d
        while d:
            key, (exp, _) = next(iter(d.items()))
            if exp > now:
                break
            self._drop(key)

    async def put(self, key: str, value: bytes) -> None:
        # a copy of the value's own length: orjson.dumps answers a short value in a buffer of about
        # 4 KiB, which an entry kept for its TTL would hold (an affinity entry: ~60 bytes of JSON)
        value = bytes(memoryview(value))
        now = self.clock()
        self._expire(now)
        if key in self._d:
            self._drop(key)
        self._d[key] = (now + self.ttl_s, value)
        self.bytes += len(value)
        while len(self._d) > self.max_entries or (self.max_bytes and self.bytes > self.max_bytes):
            self._drop(next(iter(self._d)))
            self.evictions += 1

    async def get(self, key: str) -> bytes | None:
        hit = self._d.get(key)
        if hit is None:
            return None
        if hit[0] <= self.clock():
            self._drop(key)
            return None
        return hit[1]

    async def delete(self, key: str) -> bool:
        if key in self._d:
            self._drop(key)
            return True
        return False

    async def close(self) -> None:
        pass


# asks the gateway's other workers one question (gateway/server/siblings.py ``Siblings.ask``):
# their answers by worker index, an empty answer left out
AskSiblings = Callable[[str], Awaitable[dict[int, bytes]]]


class WorkerStore:
    """A ``MemoryStore`` of one worker whose misses are asked of the gateway's other workers
    (``server.workers`` > 1): a response is kept by the worker that answered it, and found by
    whichever worker a follow-up, a ``GET`` or a ``DELETE`` reaches. A delete goes to every worker.
    A sibling that does not answer within the siblings' timeout (0.5 s) counts as not having it."""

    def __init__(self, local: MemoryStore, name: str, ask: AskSiblings,
                 found_elsewhere: Callable[[], None] = lambda: None) -> None:
        self.local = local
        self.name = name
        self.ask = ask
        self.found_elsewhere = found_elsewhere      # counts a value another worker held

    def __len__(self) -> int:
        return len(self.local)

    async def put(self, key: str, value: bytes) -> None:
        await self.local.put(key, value)

    async def get(self, key: str) -> bytes | None:
        value = await self.local.get(key)
        if value is not None or not sibling_key_ok(key):
            return value
        answers = await self.ask(f"rget {self.name} {key}")
        value = next(iter(answers.values()), None)
        if value is not None:
            self.found_elsewhere()
        return value

    async def delete(self, key: str) -> bool:
        here = await self.local.delete(key)
        if not sibling_key_ok(key):
            return here
        answers = await self.ask(f"rdel {self.name} {key}")
        return here or any(a == b"1" for a in answers.values())

    async def close(self) -> None:
        await self.local.close()

    async def answer(self, op: str, key: str) -> bytes:
        """A sibling's question about this worker's own entries."""
        if op == "rget":
            return await self.local.get(key) or b""
        return b"1" if await self.local.delete(key) else b""


def sibling_key_ok(key: str) -> bool:
    """Whether ``key`` can travel in a siblings' question line (printable, no spaces, bounded)."""
    return 0 < len(key) <= 256 and key.isprintable() and " " not in key


def _not_sent(e: BaseException) -> bool:
    """Whether the failed try ``e`` is known not to have run on Redis: it got no connection (a
    pool timeout, a refused connection, a refused password or user, a TLS handshake that failed),
    or Redis answered it with an error. A timeout or a lost connection cannot tell."""
    if isinstance(e, PoolTimeout) or (isinstance(e, RedisError) and not isinstance(e, UNAVAILABLE)):
        return True
    return (transport_reason(e) == "auth" or no_tls_answer(e) or tls_verify_failed(e)
            or caused_by(e, ConnectionRefusedError))


def _out_of_reach(e: BaseException) -> str:
    """The ``StoreUnavailable.reason`` of a call that got no answer (``e`` is one of ``UNAVAILABLE``)."""
    if no_tls_answer(e):
        return "no_tls"
    if tls_verify_failed(e):
        return "tls_verify"
    return transport_reason(e)


class RedisStore:
    def __init__(self, client: Client, prefix: str, ttl_s: float, timeout_s: float,
                 owns_client: bool = False) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout = timeout_s * 4         # the socket timeouts bound each read; this, the call
        self.owns_client = owns_client

    async def _call(self, call: Callable[[], Awaitable]):
        """``call()``'s answer; one that met a lost connection or a failover is made again (see
        the module's description), all within the call's bound."""
        failed: BaseException | None = None
        unknown = False                             # a try that may have run (``_not_sent``)
        sending = False                             # a try under way
        try:
            async with held_loop_timeout(self.timeout):
                for pause in (0.0, *RETRY_PAUSES_S)[:TRIES]:
                    if failed is not None:
                        await asyncio.sleep(pause)
                    sending = True
                    try:
                        return await call()
                    except PoolTimeout:             # it waited its time for a connection already
                        raise
                    except UNAVAILABLE as e:
                        sending = False
                        unknown = unknown or not _not_sent(e)
                        # the same password refused again; a plain-TCP server silent again
                        if transport_reason(e) == "auth" or no_tls_answer(e) or tls_verify_failed(e):
                            raise
                        failed = e
                assert failed is not None
                raise failed
        except CALL_FAILED as e:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from None
            unknown = unknown or (sending and not _not_sent(e))   # the bound ran out as it waited
            if isinstance(e, TimeoutError) and failed is not None:
                e = failed                          # the bound ran out between tries: the last failure
            answered = isinstance(e, RedisError) and not isinstance(e, UNAVAILABLE)
            raise StoreUnavailable(f"{type(e).__name__}: {e}",
                                   (refusal(e) or "error") if answered else _out_of_reach(e), unknown) from None

    async def put(self, key: str, value: bytes) -> None:
        await self._call(lambda: self.client.set(self.prefix + key, value, px=self.ttl_ms))

    async def get(self, key: str) -> bytes | None:
        return await self._call(lambda: self.client.get(self.prefix + key))

    async def delete(self, key: str) -> bool:
        return bool(await self._call(lambda: self.client.delete(self.prefix + key)))

    async def close(self) -> None:
        if self.owns_client:
            await close_client(self.client)
