"""The routing view's Redis stream keeps replicating through a fault of the client library: the
facts of a write that broke are sent again, and the writer goes on (against a real redis-server)."""

from __future__ import annotations

from gateway.config.schema import StateConfig
from gateway.observability.metrics import GatewayMetrics
from gateway.view import replicas
from gateway.view.config import ViewConfig
from gateway.view.metrics import ViewMetrics
from gateway.view.wire import Session
from tests.support.waiting import until


def _link(url: str, sender: str, got: list) -> replicas.ReplicaLink:
    state = StateConfig(redis_url=url, timeout_s=0.5)
    return replicas.ReplicaLink(state, ViewConfig(retry_s=0.05, read_block_s=0.1), sender, None,
                                lambda payload, live: got.append(payload), ViewMetrics(GatewayMetrics()))


async def test_a_write_that_breaks_in_the_client_is_sent_again_and_the_writer_goes_on(redis_server):
    got_a: list[bytes] = []
    got_b: list[bytes] = []
    a, b = _link(redis_server.url, "a", got_a), _link(redis_server.url, "b", got_b)
    real = a.writer.pipeline
    broke: list[int] = []

    def pipeline(*args, **kw):
        pipe = real(*args, **kw)
        if not broke:            # the first write: the connection was closed under it
            async def execute(*_a, **_kw):
                broke.append(1)
                raise AttributeError("'NoneType' object has no attribute 'writelines'")
            pipe.execute = execute
        return pipe

    a.writer.pipeline = pipeline

    def seen(name: bytes) -> bool:
        return any(name in p for p in got_b)

    a.start()
    b.start()
    try:
        await until(lambda: a.up and b.up, timeout=10)
        a.queue([Session("conversation-1", "http://e1")])
        await until(lambda: seen(b"conversation-1"), timeout=10)     # sent again once the stream is back
        assert broke == [1] and a.m.redis_lost._single.value == 1
        a.queue([Session("conversation-2", "http://e2")])       # and the writer is still there
        await until(lambda: seen(b"conversation-2"), timeout=10)
        assert not any(b"conversation" in p for p in got_a)     # a process skips its own entries
    finally:
        await a.stop()
        await b.stop()


async def test_a_redis_that_refuses_writes_is_one_loss_not_one_each_retry(redis_server):
    """A Redis out of memory (maxmemory, noeviction) refuses the stream's XADD and still serves
    XREAD. The link is lost once, logged once, and up again by itself with the first write that
    lands; where the reader's next read marked it up and the writer's next try down again, a loss,
    a warning and an info line every read_block_s for as long as Redis was full."""
    import redis.asyncio as aioredis
    import structlog

    got_b: list[bytes] = []
    a, b = _link(redis_server.url, "a", []), _link(redis_server.url, "b", got_b)
    admin = aioredis.Redis.from_url(redis_server.url)

    async def refused() -> int:
        stats = await admin.info("errorstats")
        return int(stats.get("errorstat_OOM", {}).get("count", 0))

    a.start()
    b.start()
    try:
        await until(lambda: a.up and b.up, timeout=10)
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", 1)
        with structlog.testing.capture_logs() as logs:
            a.queue([Session("conversation-1", "http://e1")])
            for _ in range(10):             # the writer tries again, reads go on meanwhile
                n = await refused()
                await until(lambda n=n: _refused_more(refused, n), timeout=10)
        assert not a.up and a.m.redis_lost._single.value == 1
        assert [e["event"] for e in logs if "redis stream" in e["event"]] == [
            "shared routing view: redis stream lost; routing on the local view"]
        await admin.config_set("maxmemory", 0)
        await until(lambda: any(b"conversation-1" in p for p in got_b), timeout=10)
        await until(lambda: a.up, timeout=10)
        assert a.m.redis_lost._single.value == 1
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()
        await a.stop()
        await b.stop()


async def _refused_more(refused, n: int) -> bool:
    return await refused() > n


async def test_a_stream_key_of_another_type_is_one_loss_not_one_each_retry(redis_server):
    """Another application writes a string where the stream is (the gateway's key names are under
    state.key_prefix, which it may share): every XREAD and XADD is refused (WRONGTYPE) while the
    key still exists. The link is lost once, logged once, and up again once the key is gone; where
    the reader's probe (the key exists) marked it up and its next read down again, a loss, a
    warning and an info line every retry_s for as long as the key stayed."""
    import redis.asyncio as aioredis
    import structlog

    got_b: list[bytes] = []
    a, b = _link(redis_server.url, "a", []), _link(redis_server.url, "b", got_b)
    admin = aioredis.Redis.from_url(redis_server.url)

    async def refused() -> int:
        stats = await admin.info("errorstats")
        return int(stats.get("errorstat_WRONGTYPE", {}).get("count", 0))

    a.start()
    b.start()
    try:
        await until(lambda: a.up and b.up, timeout=10)
        with structlog.testing.capture_logs() as logs:
            await admin.delete(a.key)
            await admin.set(a.key, "another application's value")
            a.queue([Session("conversation-1", "http://e1")])
            for _ in range(10):             # the reader and the writer try again meanwhile
                n = await refused()
                await until(lambda n=n: _refused_more(refused, n), timeout=10)
        assert not a.up and not b.up
        assert a.m.redis_lost._single.value == 1 and b.m.redis_lost._single.value == 1
        assert [e["event"] for e in logs if "redis stream" in e["event"]] == [
            "shared routing view: redis stream lost; routing on the local view"] * 2
        await admin.delete(a.key)
        await until(lambda: any(b"conversation-1" in p for p in got_b), timeout=10)
        await until(lambda: a.up and b.up, timeout=10)
        assert a.m.redis_lost._single.value == 1 and b.m.redis_lost._single.value == 1
    finally:
        await admin.delete(a.key)
        await admin.aclose()
        await a.stop()
        await b.stop()


async def test_a_redis_at_its_memory_limit_that_refuses_some_writes_is_logged_once_a_while(redis_server):
    """A Redis at the edge of its maxmemory (noeviction) refuses one write and takes the next:
    the link goes down and up again with each. Every loss is counted, but one line says it is lost
    and one that it is back, not a warning and an info line each time: the losses that follow
    within ``LOST_LOG_S`` of a logged one are logged with the next, as ``since_last``."""
    import redis.asyncio as aioredis
    import structlog

    got_b: list[bytes] = []
    a, b = _link(redis_server.url, "a", []), _link(redis_server.url, "b", got_b)
    admin = aioredis.Redis.from_url(redis_server.url)

    async def refused() -> int:
        stats = await admin.info("errorstats")
        return int(stats.get("errorstat_OOM", {}).get("count", 0))

    a.start()
    b.start()
    try:
        await until(lambda: a.up and b.up, timeout=10)
        await admin.config_set("maxmemory-policy", "noeviction")
        with structlog.testing.capture_logs() as logs:
            for i in range(3):            # refused, then taken: down and up again
                n = await refused()
                await admin.config_set("maxmemory", 1)
                a.queue([Session(f"conversation-{i}", "http://e1")])
                await until(lambda n=n: _refused_more(refused, n), timeout=10)
                await until(lambda: not a.up, timeout=10)
                await admin.config_set("maxmemory", 0)
                await until(lambda i=i: any(f"conversation-{i}".encode() in p for p in got_b), timeout=10)
                await until(lambda: a.up, timeout=10)
        assert a.m.redis_lost._single.value == 3
        assert [e["event"] for e in logs if "redis stream" in e["event"]] == [
            "shared routing view: redis stream lost; routing on the local view",
            "shared routing view: redis stream reachable"], logs
        # why, without the refused command's arguments (the facts' encoded bytes)
        [lost] = [e for e in logs if "lost" in e["event"]]
        assert lost["reason"] == "oom" and "XADD" not in lost["error"] and "\x00" not in lost["error"], lost
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()
        await a.stop()
        await b.stop()
