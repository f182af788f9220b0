"""The client factory: one kind of client per deployment, all with the same manners, and key
prefixes that keep a script's keys in one Cluster slot. Nothing here connects anywhere."""

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from gateway.config.schema import StateConfig
from gateway.state.redis import close_client, redis_client, shared_prefix


def _conn_kwargs(client) -> dict:
    return client.connection_pool.connection_kwargs


async def test_a_standalone_client_has_the_gateway_manners():
    c = redis_client(StateConfig(redis_url="redis://127.0.0.1:1/3", password="pw", timeout_s=0.3))
    kw = _conn_kwargs(c)
    assert isinstance(c, aioredis.Redis)
    assert (kw["socket_timeout"], kw["socket_connect_timeout"], kw["db"], kw["password"]) == (0.3, 0.3, 3, "pw")
    assert kw["retry"].get_retries() == 0
    assert (c.room.size, c.room.timeout, c.connection_pool.max_connections) == (32, 0.3, 32)
    await close_client(c)


async def test_a_sentinel_client_follows_the_named_primary():
    c = redis_client(StateConfig(redis_url="redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/4",
                                 timeout_s=0.3, sentinel_password="spw"))
    pool = c.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster" and pool.is_master
    kw = pool.connection_kwargs
    assert (kw["socket_timeout"], kw["db"], kw["password"], kw["retry"].get_retries()) == (0.3, 4, "pw", 0)
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["port"]) for s in sentinels] == [1, 2]
    skw = sentinels[0].connection_pool.connection_kwargs
    assert (skw["socket_timeout"], skw["socket_connect_timeout"], skw["password"]) == (0.3, 0.3, "spw")
    assert skw["retry"].get_retries() == 0
    assert (c.room.size, pool.max_connections, sentinels[0].connection_pool.max_connections) == (32, 32, 32)
    await close_client(c)


async def test_a_cluster_client_starts_from_the_given_nodes():
    c = redis_client(StateConfig(redis_url="redis+cluster://:pw@127.0.0.1:7000,127.0.0.1:7001", timeout_s=0.3,
                                 max_connections=5))
    assert isinstance(c, RedisCluster)
    assert sorted(c.nodes_manager.startup_nodes) == ["127.0.0.1:7000", "127.0.0.1:7001"]
    assert c.retry.get_retries() == 0
    kw = c.nodes_manager.connection_kwargs
    assert (kw["socket_timeout"], kw["socket_connect_timeout"], kw["password"]) == (0.3, 0.3, "pw")
    assert c.room.size == 5 and {n.max_connections for n in c.nodes_manager.startup_nodes.values()} == {5}
    await close_client(c)


@pytest.mark.parametrize(("url", "prefix", "shared"), [
    ("redis://h/0", "switchyard", "switchyard"),                 # names as they always were
    ("redis+sentinel://s/m", "switchyard", "switchyard"),
    ("redis+cluster://n", "switchyard", "{switchyard}"),         # one hash slot for a script's keys
    ("redis+cluster://n", "{sy}", "{sy}"),                       # the prefix's own tag is kept
    ("redis+cluster://n", "a{}b", "{a{}b}"),                     # an empty tag is no tag
])
def test_keys_used_together_share_a_cluster_slot(url, prefix, shared):
    assert shared_prefix(StateConfig(redis_url=url, key_prefix=prefix)) == shared
