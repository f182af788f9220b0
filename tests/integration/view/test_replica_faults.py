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
