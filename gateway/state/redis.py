"""The one Redis client factory of the gateway, for a standalone server, a Sentinel-managed
primary or a Redis Cluster (``state.redis_url``, read by gateway/state/urls.py).

Every client has the same manners, whatever the deployment: connect and socket timeouts of
``state.timeout_s``, no client-side retries (the caller decides what an outage means: a request
is not held up while a client retries; only a Cluster call refused while its slot is being moved
is tried again, see :class:`BoundedCluster`), TLS verified against ``state.tls_ca_file``, and
maintenance notifications off — with them on (the client's "auto" default) a pool skips its check
for connections the server closed, so after a restart or a failover every idle pooled connection
would fail one call instead of being reconnected when it is taken from the pool.

Failover, per mode:

- Sentinel: every new connection asks the Sentinels where the primary is, and connections to a
  primary that died are closed; one that was demoted answers READONLY, which the client turns
  into a connection error. So the first call after the promotion reaches the new primary.
- Cluster: a failed command makes the client read the slot map again on its next call; a failed
  pipeline does not, so callers call :func:`forget_topology` on a transport failure. A Cluster
  client's nodes keep pools of their own, which hand out a connection without the check a
  server's pool makes (one the server closed, by a restart or a failover, would fail its next
  call): its connections make that check before each send (:class:`CheckedConnection`).

Bounded: a client runs at most ``state.max_connections`` calls at once (a command, or a pipeline),
so its pool holds at most that many connections (to each node, on a Cluster), whatever a burst
asks of it; the pool's own ``max_connections`` is the same number, as a second bound. A call that
finds every one busy waits for one to be free, up to ``state.timeout_s``, then fails with
:class:`PoolTimeout`, a connection error as an unreachable Redis raises (its caller degrades the
same way), counted by the client's ``on_pool_timeout``.

Keys that one script or one transaction touches together must share a hash slot on a Cluster:
:func:`shared_prefix` is the key prefix for those (``{prefix}`` on a Cluster, the plain prefix
elsewhere, so standalone and Sentinel keep their names).
"""

from __future__ import annotations

import asyncio
import functools
import re
import socket
import ssl
from collections.abc import Callable

import redis.asyncio as aioredis
import redis.asyncio.connection as _redis_connection
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelManagedSSLConnection
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from gateway.config.schema import StateConfig
from gateway.state.urls import Mode, parse_redis_url, redis_mode

Client = aioredis.Redis | RedisCluster
FORGET_TIMEOUT_S = 2.0        # closing a Cluster client whose nodes are gone, at most

# What "the state cannot be reached now" looks like: a transport failure (Sentinel's "no primary
# known" is one), or a Cluster in the middle of a failover (CLUSTERDOWN, TRYAGAIN, no node
# reachable or no slot map yet). Anything else a call raises is a bug in the call, not an outage.
# The client library raises AttributeError when a connection is closed under a call that is
# sending on it: a Cluster client closes all its connections when one call fails, so a failover
# can meet calls of others half-way. On uvloop (the gateway's loop) a call that writes to such a
# connection before the client has dropped it meets uvloop's RuntimeError ("the handler is
# closed") instead. Either is a lost connection like any other.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OSError, TimeoutError,
    ClusterDownError, TryAgainError, RedisClusterException, AttributeError, RuntimeError)
# For a store that answers "not now" to any failed call (the Responses records, the routing view's
# stream): the outages above, and any error Redis answered.
CALL_FAILED: tuple[type[BaseException], ...] = (RedisError, *UNAVAILABLE)

# the codes of the refusals the client library has no class for (or not inside a script's error),
# as they open the error's text
_REFUSED = re.compile(r"(?:^|\W)(MISCONF|NOREPLICAS|NOPERM|WRONGTYPE) ")

# refusals of the gateway's commands as sent, whatever Redis's state: a Redis that takes writes
# may refuse them, so a heartbeat that lands does not say they are over (see COMMAND_REFUSALS' use)
COMMAND_REFUSALS = frozenset({"noperm", "wrongtype"})


def refusal(e: BaseException) -> str | None:
    """Why a Redis that still answers refused a call, or None when ``e`` is no such refusal (a
    bug in the call): ``oom`` (``maxmemory`` reached under the ``noeviction`` policy),
    ``readonly`` (a replica), ``misconf`` (an RDB save failed and ``stop-writes-on-bgsave-error``
    holds writes) or ``noreplicas`` (fewer replicas in reach than ``min-replicas-to-write``), which
    refuse writes; ``noperm`` (the ACL user may not run the command or touch the key) or
    ``wrongtype`` (a key of the gateway's names holds another type: another application wrote
    it), which refuse the command. A script's call refused so fails the script with the same
    error."""
    if isinstance(e, OutOfMemoryError):
        return "oom"
    if isinstance(e, ReadOnlyError):
        return "readonly"
    if isinstance(e, NoPermissionError):
        return "noperm"
    if isinstance(e, ResponseError) and (m := _REFUSED.search(str(e))):
        return m.group(1).lower()
    return None


def transport_reason(e: BaseException) -> str:
    """Why a call failed as an outage does (``e`` is one of ``UNAVAILABLE``): ``auth`` when Redis
    answered the connection's AUTH (or HELLO) with a refusal (a wrong password or user, or none
    given to a Redis that requires one: a Cluster client says so only in the cause of its "cannot
    be connected"), else ``unreachable``."""
    seen: BaseException | None = e
    for _ in range(4):
        if seen is None:
            break
        if isinstance(seen, AuthenticationError):
            return "auth"
        seen = seen.__cause__ or seen.__context__
    return "unreachable"


def caused_by(e: BaseException, cls: type[BaseException]) -> bool:
    """Whether ``e``, or what it was raised from (as the client library wraps it), is a ``cls``."""
    seen: BaseException | None = e
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, cls):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def no_tls_answer(e: BaseException) -> bool:
    """Whether ``e`` (a failed connect, as the client library wraps it) is a TLS URL's server that
    took the connection and never answered the handshake (:class:`NoTLSAnswer`)."""
    return caused_by(e, NoTLSAnswer)


def tls_verify_failed(e: BaseException) -> bool:
    """Whether ``e`` (a failed connect) is a TLS server whose certificate failed verification
    (:class:`TLSVerifyFailed`): a CA not trusted, another host's name, expired."""
    return caused_by(e, TLSVerifyFailed)


# A timer that fires this much later than its deadline means the loop was held meanwhile
LATE_S = 0.05


class HeldLoopTimeout(asyncio.Timeout):
    """``asyncio.timeout`` that does not blame Redis for the loop's own stall. A loop held past a
    call's deadline (a long callback, a collector pause, a stopped process) runs the due timer
    before it reads its sockets, so an answer that came meanwhile would lie unread while the call
    times out and the state is marked down. A timer that fires more than ``LATE_S`` late gives the
    call its whole delay again, once, counted from when the loop ran again; a Redis that does not
    answer still times out, after at most twice the delay."""

    def __init__(self, delay: float | None) -> None:
        self._delay = delay
        self._held = False
        super().__init__(None if delay is None else asyncio.get_running_loop().time() + delay)

    def _on_timeout(self) -> None:
        loop = asyncio.get_running_loop()
        when = self.when()
        if not self._held and self._delay is not None and when is not None and loop.time() - when > LATE_S:
            self._held = True
            self.reschedule(loop.time() + self._delay)
            return
        super()._on_timeout()            # type: ignore[misc]


def held_loop_timeout(delay: float | None) -> HeldLoopTimeout:
    return HeldLoopTimeout(delay)


# the client library's socket timeouts (each read, each connect) are this one: the gateway runs no
# other Redis client
_redis_connection.async_timeout = held_loop_timeout   # type: ignore[attr-defined]


class PoolTimeout(RedisConnectionError):
    """Every connection a client may hold stayed busy for ``state.timeout_s``: the call was not
    sent. To its caller, Redis could not be reached; it does not say Redis is down (the calls that
    hold the connections find that out)."""


class Room:
    """The calls a client may run at once: ``size`` (one connection each from a server's pool,
    at most one to each node from a Cluster client's). A call beyond them waits its turn (first
    come, first served) for at most ``timeout`` seconds. A call its holder makes from inside its
    own (a Cluster pipeline sends the commands a MOVED or ASK answer redirected as commands of
    its client, in its task) takes no other place: it would wait for itself."""

    __slots__ = ("size", "timeout", "on_timeout", "_sem", "_holders")

    def __init__(self, size: int, timeout: float, on_timeout: Callable[[], None] | None = None) -> None:
        self.size = size
        self.timeout = timeout
        self.on_timeout = on_timeout
        self._sem = asyncio.Semaphore(size)
        self._holders: set[asyncio.Task | None] = set()     # the tasks whose call holds a place

    async def run(self, call, *args, **kwargs):
        task = asyncio.current_task()
        if task in self._holders:
            return await call(*args, **kwargs)
        if self._sem.locked():
            try:
                async with held_loop_timeout(self.timeout):
                    await self._sem.acquire()
            except TimeoutError:
                if self.on_timeout is not None:
                    self.on_timeout()
                raise PoolTimeout(f"all {self.size} Redis connections busy for {self.timeout:g} s "
                                  "(state.max_connections)") from None
        else:
            await self._sem.acquire()               # free now: no wait, no timer
        self._holders.add(task)
        try:
            return await call(*args, **kwargs)
        finally:
            self._holders.discard(task)
            self._sem.release()


class _Bounded:
    """A client whose commands and pipelines each take a place in its :class:`Room` while they
    run (``room`` is set by :func:`redis_client`)."""

    room: Room

    async def execute_command(self, *args, **options):
        return await self.room.run(super().execute_command, *args, **options)     # type: ignore[misc]

    def pipeline(self, *args, **kwargs):
        pipe = super().pipeline(*args, **kwargs)                                   # type: ignore[misc]
        pipe.execute = functools.partial(self.room.run, pipe.execute)
        return pipe


class BoundedRedis(_Bounded, aioredis.Redis):
    pass


# a Cluster's slot being moved (resharded): paused between two tries of a call it refused
SLOT_MOVING_PAUSE_S = 0.05


def slot_moving(e: BaseException) -> bool:
    """Whether a Cluster answered ``e`` because the slot of the call's keys is being moved: TRYAGAIN
    (a call on several keys that the move has split between two nodes), or the client's own "TTL
    exhausted" once it followed TRYAGAIN, ASK or MOVED answers as often as it does (16 times)."""
    return isinstance(e, TryAgainError) or (type(e) is ClusterError and str(e) == "TTL exhausted.")


class BoundedCluster(_Bounded, RedisCluster):
    """Also: a command refused while its slot is being moved (:func:`slot_moving`) is sent again,
    ``SLOT_MOVING_PAUSE_S`` apart, for up to ``slot_moving_s`` (set by :func:`redis_client`: three
    times ``state.timeout_s``, within the four its callers bound a call by), where the client
    library tries about 0.4 s and gives up. A pipeline sends its commands so refused again one by
    one, as commands of the client, so they are tried again the same way."""

    slot_moving_s: float = 0.0

    async def execute_command(self, *args, **options):
        deadline = None
        while True:
            try:
                return await super().execute_command(*args, **options)
            except (TryAgainError, ClusterError) as e:
                if not slot_moving(e):
                    raise
                now = asyncio.get_running_loop().time()
                if deadline is None:
                    deadline = now + self.slot_moving_s
                if now + SLOT_MOVING_PAUSE_S >= deadline:
                    raise
            await asyncio.sleep(SLOT_MOVING_PAUSE_S)


def state_mode(cfg: StateConfig) -> Mode:
    assert cfg.redis_url is not None
    return redis_mode(cfg.redis_url)


def shared_prefix(cfg: StateConfig) -> str:
    """The prefix of keys used together in one call: wrapped in a hash tag on a Cluster, so they
    all live in one slot (unless the prefix carries a hash tag of its own)."""
    p = cfg.key_prefix
    if state_mode(cfg) != "cluster" or _has_hash_tag(p):
        return p
    return "{" + p + "}"


def _has_hash_tag(key: str) -> bool:
    start = key.find("{")
    return start >= 0 and key.find("}", start + 2) > start


def _common(cfg: StateConfig, socket_timeout: float | None = None) -> dict:
    return {"socket_timeout": socket_timeout or cfg.timeout_s, "socket_connect_timeout": cfg.timeout_s,
            "health_check_interval": 0, "decode_responses": False, "max_connections": cfg.max_connections}


def redis_client(cfg: StateConfig, socket_timeout: float | None = None,
                 on_pool_timeout: Callable[[], None] | None = None) -> Client:
    """A client for ``state.redis_url``: ``redis.asyncio.Redis`` for a server or a Sentinel-managed
    primary, ``redis.asyncio.RedisCluster`` for a Cluster. Connects lazily, on its first call.
    ``socket_timeout``: a longer read timeout than ``state.timeout_s`` (a blocking read's).
    At most ``state.max_connections`` calls at once (see :class:`Room`); ``on_pool_timeout`` is
    called for each that waited ``state.timeout_s`` in vain."""
    client = _make_client(cfg, socket_timeout)
    client.room = Room(cfg.max_connections, cfg.timeout_s, on_pool_timeout)
    if isinstance(client, BoundedCluster):
        client.slot_moving_s = 3 * cfg.timeout_s
    return client


def _make_client(cfg: StateConfig, socket_timeout: float | None) -> BoundedRedis | BoundedCluster:
    assert cfg.redis_url is not None
    target = parse_redis_url(cfg.redis_url)
    common = _common(cfg, socket_timeout)
    tls: dict = {"ssl_ca_certs": cfg.tls_ca_file} if cfg.tls_ca_file else {}
    password = target.password if target.password is not None else cfg.password
    if target.mode == "standalone":
        kw: dict = dict(tls)
        if cfg.password is not None:
            kw["password"] = cfg.password
        client = BoundedRedis.from_url(
            cfg.redis_url, retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
            maint_notifications_config=MaintNotificationsConfig(enabled=False), **common, **kw)
        if target.tls:
            client.connection_pool.connection_class = TLSConnection
        return client
    if target.mode == "cluster":
        cluster = BoundedCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.nodes], retry=Retry(NoBackoff(), 0),
            username=target.username, password=password, ssl=target.tls, **tls,
            maint_notifications_config=MaintNotificationsConfig(enabled=False), **common)
        _check_taken_connections(cluster, CheckedSSLConnection if target.tls else CheckedConnection)
        _one_pool_per_node(cluster)
        return cluster
    # Sentinel: the Sentinels get the same timeouts, no retries, and TLS when the scheme says so;
    # their own password, if they have one, is state.sentinel_password.
    sentinel_kw: dict = {**common, "retry": Retry(NoBackoff(), 0),
                         "maint_notifications_config": MaintNotificationsConfig(enabled=False)}
    if target.tls:
        sentinel_kw.update(ssl=True, **tls)
    if cfg.sentinel_password is not None:
        sentinel_kw["password"] = cfg.sentinel_password
    sentinel = _Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kw)
    sentinel.tls = target.tls
    if target.tls:
        for s in sentinel.sentinels:
            s.connection_pool.connection_class = TLSConnection
        tls["connection_class"] = SentinelTLSConnection
    assert target.service is not None
    return sentinel.master_for(
        target.service, redis_class=BoundedRedis, db=target.db, username=target.username, password=password, ssl=target.tls,
        retry=Retry(NoBackoff(), 0), maint_notifications_config=MaintNotificationsConfig(enabled=False),
        **common, **tls)


class _Sentinel(Sentinel):
    """Sentinel whose "no primary" error says what was tried: the primary's name, how many
    Sentinels were asked and whether over TLS (``tls``, set by :func:`redis_client`), and names each
    Sentinel by its address with what it answered: no answer (what went wrong), a refused password
    (a refusal as the error's cause), no primary of that name, the primary named down, or no
    Sentinel at all (a plain Redis refuses SENTINEL as an unknown command). The client library's
    listed each Sentinel it could not ask as its Python object (its connection pool, connection and
    every setting, about 1 KB a Sentinel), the error only by its class, and named none that
    answered; a server that is no Sentinel failed the call with its "unknown command". That text
    is what the warnings of an outage carry."""

    tls = False

    async def discover_master(self, service_name: str):
        failed, refused, unknown, down, strangers = [], [], [], [], []
        auth: AuthenticationError | None = None
        for i, sentinel in enumerate(self.sentinels):
            kw = sentinel.connection_pool.connection_kwargs
            where = f"{kw.get('host')}:{kw.get('port')}"
            try:
                masters = await sentinel.sentinel_masters()
            except (RedisConnectionError, RedisTimeoutError) as e:
                said = f"{where}: {str(e) or type(e).__name__}"
                if isinstance(e, AuthenticationError):
                    auth = e
                    refused.append(said)
                else:
                    failed.append(said)
                continue
            except ResponseError as e:          # a server that is no Sentinel
                strangers.append(f"{where}: {str(e).strip()}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                # as the client library does: ask this Sentinel first next time
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]
                ip = self._force_master_ip if self._force_master_ip is not None else state["ip"]
                return ip, state["port"]
            (down if state else unknown).append(where)
        why = ([f"Sentinels refusing the password (state.sentinel_password): {'; '.join(refused)}"] if refused else []) \
            + ([f"Sentinels not answering: {'; '.join(failed)}"] if failed else []) \
            + ([f"Sentinels that know no primary {service_name!r}: {', '.join(unknown)}"] if unknown else []) \
            + ([f"Sentinels that name it down (or seen by too few Sentinels): {', '.join(down)}"] if down else []) \
            + ([f"no Sentinels (SENTINEL refused): {'; '.join(strangers)}"] if strangers else [])
        n = len(self.sentinels)
        # a refused password is the cause (``transport_reason`` reads it): it is what to fix
        raise MasterNotFoundError(f"No master found for {service_name!r} by {n} Sentinel{'s' if n > 1 else ''} "
                                  f"{'over TLS' if self.tls else '(no TLS)'} ({'; '.join(why)})") from auth


class _CheckBeforeSend:
    """A connection that, before it sends, checks it is still open, as a server's pool checks a
    connection it hands out: one the server closed (it restarted, or failed over) is reconnected,
    instead of failing the call that took it. (Only the close: an answer waiting unread is not a
    fault here, the client writes its handshake's commands before it reads their answers.)"""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        reader, writer = self._reader, self._writer             # type: ignore[attr-defined]
        if reader is not None and writer is not None and (reader.at_eof() or writer.transport.is_closing()):
            await self.disconnect()                             # type: ignore[attr-defined]
        await super().send_packed_command(command, check_health)   # type: ignore[misc]


class NoTLSAnswer(RedisConnectionError):
    """A TLS URL's server took the connection but never answered the TLS handshake: most likely
    a Redis serving plain TCP (it reads the handshake as the start of a command and waits for
    the rest)."""


class TLSVerifyFailed(RedisConnectionError):
    """A TLS server's certificate failed verification: signed by a CA ``state.tls_ca_file`` (or
    the system's store) does not hold, made for another host than the URL's, or expired. Another
    try meets the same certificate."""


class _TLSSaysWhy:
    """A TLS connection made in two steps, TCP then the TLS handshake, within the one connect
    timeout as before, so that a handshake that got no answer says so: the client library's
    "Timeout connecting to server" reads as a server out of reach, where the usual cause is a
    ``rediss://`` URL for a Redis serving plain TCP."""

    async def _connect(self) -> None:
        args = dict(self._connection_arguments())               # type: ignore[attr-defined]
        tls = args.pop("ssl")
        host, port = self.host, self.port                       # type: ignore[attr-defined]
        tcp = False
        try:
            async with held_loop_timeout(self.socket_connect_timeout):     # type: ignore[attr-defined]
                reader, writer = await asyncio.open_connection(**args)
                tcp = True
                try:
                    await writer.start_tls(tls, server_hostname=host)
                except BaseException:
                    writer.close()
                    raise
        except TimeoutError:
            if not tcp:
                raise
            raise NoTLSAnswer(f"no TLS handshake answer from {host}:{port}; is this Redis serving TLS? "
                              "use redis:// for plain TCP") from None
        except ssl.SSLCertVerificationError as e:
            why = (e.verify_message or str(e)).rstrip(".")
            raise TLSVerifyFailed(f"the TLS certificate of {host}:{port} fails verification: {why}; check "
                                  "state.tls_ca_file and the URL's host") from None
        self._reader, self._writer = reader, writer             # type: ignore[attr-defined]
        sock = writer.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TLSConnection(_TLSSaysWhy, SSLConnection):
    pass


class SentinelTLSConnection(_TLSSaysWhy, SentinelManagedSSLConnection):
    pass


class CheckedConnection(_CheckBeforeSend, Connection):
    pass


class CheckedSSLConnection(_CheckBeforeSend, _TLSSaysWhy, SSLConnection):
    pass


def _check_taken_connections(client: RedisCluster, cls: type[Connection]) -> None:
    """Every node the client knows now (its startup nodes) or learns later makes ``cls``
    connections (the client has no argument for it: it picks Connection or SSLConnection)."""
    client.nodes_manager.connection_kwargs["connection_class"] = cls
    for node in (*client.startup_nodes, *client.nodes_manager.startup_nodes.values()):
        node.connection_class = cls


def _one_pool_per_node(client: RedisCluster) -> None:
    """The nodes of the URL are the nodes the client sends commands to once the slot map names
    them, with one pool each. Otherwise each keeps a node object of its own beside the slot map's,
    whose pool holds the connection the slot map was read on: one more than
    ``state.max_connections`` to that node."""
    nodes = client.nodes_manager
    nodes.nodes_cache.update(nodes.startup_nodes)


async def forget_topology(client: Client) -> None:
    """After a transport failure: make the next call find the primary again. A Cluster client
    re-reads its slot map on its next call (only a failed single command arranges that by
    itself); a Sentinel-managed or plain client reconnects on its own."""
    if isinstance(client, RedisCluster):
        try:
            async with asyncio.timeout(FORGET_TIMEOUT_S):     # a node that is gone must not hold the caller
                await client.aclose()   # closes its connections and marks the slot map stale
        except Exception:               # closing sockets of a node that is gone
            pass


async def close_client(client: Client) -> None:
    """Close the client's connections (and a Sentinel-managed client's connections to the
    Sentinels, which it does not own)."""
    sentinels = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for c in (client, sentinels):
        if c is not None:
            try:
                await c.aclose()
            except Exception:           # closing a client whose server is gone
                pass
