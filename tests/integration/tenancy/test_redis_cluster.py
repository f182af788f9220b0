"""The shared state on a real Redis Cluster (3 primaries, 1 replica each, on loopback): one view of
limits, keys and stored responses for two gateways, and a primary killed mid-run."""

from __future__ import annotations

import asyncio

import openai

from gateway.config.schema import StateConfig
from gateway.state.redis import shared_prefix
from tests.support.factories import model_block
from tests.support.redis_failover import (
    changes_reach_the_other_at_once,
    failover_mid_run,
    one_view_of_limits_keys_and_responses,
)


async def test_two_gateways_share_limits_keys_and_responses_on_a_cluster(sims, gateway, redis_cluster):
    await one_view_of_limits_keys_and_responses(sims, gateway, redis_cluster.url)



async def test_a_key_made_or_revoked_through_one_gateway_holds_at_once_on_the_other_on_a_cluster(
        sims, gateway, redis_cluster):
    await changes_reach_the_other_at_once(sims, gateway, redis_cluster.url)

async def test_a_cluster_primary_killed_mid_run(sims, gateway, redis_cluster):
    # the primary of the slot every tenancy key shares: the one that matters
    slot_key = f"{shared_prefix(StateConfig(redis_url=redis_cluster.url))}:rpm:alice"
    victims = []

    def kill() -> None:
        victims.append(redis_cluster.kill_primary_of(slot_key))

    await failover_mid_run(sims, gateway, redis_cluster.url, kill, "cluster")
    # the old primary comes back as a replica of its successor; nothing else changes
    await asyncio.to_thread(redis_cluster.restart, victims[0])
    assert redis_cluster.role(victims[0]) == "slave"


async def test_the_shared_routing_view_comes_back_after_its_primary_is_killed(sims, gateway, redis_cluster):
    """The primary holding the replicas' view stream dies and its replica is promoted: a replica's
    writer reads the slot map again and writes to the new primary, and the other replica reads on,
    by themselves (a failed pipeline left the client on the dead node, retrying it forever)."""
    from tests.support.http import openai_client
    from tests.support.metrics import metric
    from tests.support.redis_failover import FAILOVER_S, FAST_STATE
    from tests.support.waiting import until

    sim = await sims("vllm", "m")
    blocks = {"state": {"redis_url": redis_cluster.url, **FAST_STATE}}
    a = await gateway([model_block("m", "vllm", [sim.url], strategy="prefix-cache")], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url], strategy="prefix-cache")], **blocks)
    links = [g.gw.gen.services.view.link for g in (a, b)]
    await until(lambda: all(link.up for link in links), timeout=FAILOVER_S)

    async def send(i: int) -> None:
        c = openai_client(a)
        await c.chat.completions.create(model="m", max_tokens=1,
                                        messages=[{"role": "user", "content": f"{i} a prompt of its own " * 40}])

    def received(text: str) -> float:
        return metric(text, "switchyard_view_messages_received_total", source="replica")

    await send(0)
    await asyncio.to_thread(redis_cluster.kill_primary_of, links[0].key)
    for i in range(1, 6):                           # A's writer meets the dead primary
        await send(i)
        await asyncio.sleep(0.2)
    await until(lambda: all(link.up for link in links), timeout=FAILOVER_S)
    before = received(await b.metrics_text())
    for i in range(6, 12):
        await send(i)

    async def b_reads_on() -> bool:
        return received(await b.metrics_text()) > before

    await until(b_reads_on, timeout=FAILOVER_S)

    async def a_up() -> bool:      # (a loaded machine can time a call out and the link come back)
        return metric(await a.metrics_text(), "switchyard_view_redis_up") == 1

    await until(a_up, timeout=FAILOVER_S)


async def test_the_shared_routing_view_is_lost_once_while_its_slot_is_down(redis_cluster):
    """Both nodes serving the view stream's slot die: the Cluster is down while its other nodes
    still answer INFO, which was the reader's whole probe, so every retry_s the link came up and
    was lost again (a loss counted, a warning and an info line each time). Now it is lost once and
    stays down, and is up again by itself once the slot is served."""
    import structlog

    from gateway.observability.metrics import GatewayMetrics
    from gateway.view.config import ViewConfig
    from gateway.view.metrics import ViewMetrics
    from gateway.view.replicas import ReplicaLink
    from tests.support.redis_failover import FAILOVER_S
    from tests.support.waiting import until

    state = StateConfig(redis_url=redis_cluster.url, timeout_s=0.5)
    link = ReplicaLink(state, ViewConfig(retry_s=0.05, read_block_s=0.1), "a", None, lambda p, live: None,
                       ViewMetrics(GatewayMetrics()))
    link.start()
    try:
        await until(lambda: link.up, timeout=FAILOVER_S)
        primary = redis_cluster.primary_of(link.key)
        shard = [primary, *_replicas_of(redis_cluster, primary)]
        live = [n for n in redis_cluster.nodes if n not in shard]
        with structlog.testing.capture_logs() as logs:
            for n in shard:
                redis_cluster.kill(n)
            await until(lambda: not link.up, timeout=FAILOVER_S)
            await until(lambda: all(redis_cluster._info_cluster(n).get("cluster_state") == "fail" for n in live),
                        timeout=FAILOVER_S)
            # the reader tries again and again, each time on new connections to the live nodes
            before = _connections(redis_cluster, live)
            await until(lambda: _connections(redis_cluster, live) > before + 20, timeout=FAILOVER_S)
        assert not link.up and link.m.redis_lost._single.value == 1
        assert [e["event"] for e in logs if "redis stream" in e["event"]] == [
            "shared routing view: redis stream lost; routing on the local view"]
        for n in shard:
            await asyncio.to_thread(redis_cluster.restart, n)
        await until(lambda: link.up, timeout=FAILOVER_S)
        assert link.m.redis_lost._single.value == 1
    finally:
        await link.stop()


def _replicas_of(cluster, primary) -> list:
    rows = [line.split() for line in cluster.cli_call(primary, "cluster", "nodes").splitlines()]
    me = next(f[0] for f in rows if "myself" in f[2])
    ports = {int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in rows if f[3] == me}
    return [n for n in cluster.nodes if n.port in ports]


def _connections(cluster, nodes) -> int:
    total = 0
    for n in nodes:
        out = cluster.cli_call(n, "info", "stats")
        total += int(next(line.split(":")[1] for line in out.splitlines()
                          if line.startswith("total_connections_received:")))
    return total


async def test_stored_responses_work_at_once_after_the_whole_cluster_restarted(sims, gateway, redis_cluster):
    """Every node of the Cluster restarts while the gateway is idle. A Cluster client's node pools
    handed out the connections the old servers had closed, so the first call on each failed: a
    follow-up got a 503 and a new response went unstored, with the Cluster long healthy again.
    Connections are now checked before they send, as a server's pool checks them."""
    from tests.support.http import openai_client
    from tests.support.redis_failover import FAST_STATE

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], responses={"state": "gateway"},
                       state={"redis_url": redis_cluster.url, **FAST_STATE, "timeout_s": 5.0})
    client = openai_client(gw)
    for _ in range(12):                 # connections to every primary, pooled
        r = await client.responses.create(model="m", input="Hello", max_output_tokens=2)
        assert (await client.responses.retrieve(r.id)).id == r.id
    for n in redis_cluster.nodes:
        redis_cluster.kill(n)
    for n in redis_cluster.nodes:
        await asyncio.to_thread(n.spawn)
    await asyncio.to_thread(redis_cluster.wait_ok)
    for _ in range(12):                 # nothing was kept (no persistence): new ones, stored and read
        r = await client.responses.create(model="m", input="Hello again", max_output_tokens=2)
        follow = await client.responses.create(model="m", input="And?", max_output_tokens=2,
                                               previous_response_id=r.id)
        assert (await client.responses.retrieve(follow.id)).id == follow.id


async def test_a_failover_of_the_view_stream_is_one_loss(redis_cluster):
    """The primary of the view stream's slot dies and its replica is promoted, while the link has
    nothing to write. The reader loses it and comes back on the new slot map; the writer, whose
    own client still had the old one, met the dead node with its first facts afterwards and lost
    the link a second time. Now a reader that loses the stream has the writer read the map too."""
    from gateway.observability.metrics import GatewayMetrics
    from gateway.view.config import ViewConfig
    from gateway.view.metrics import ViewMetrics
    from gateway.view.replicas import ReplicaLink
    from gateway.view.wire import Session
    from tests.support.redis_failover import FAILOVER_S
    from tests.support.waiting import until

    got: list[bytes] = []
    state = StateConfig(redis_url=redis_cluster.url, timeout_s=0.5)
    a, b = (ReplicaLink(state, ViewConfig(retry_s=0.05, read_block_s=0.1), name, None,
                        lambda p, live, mine=mine: mine.append(p), ViewMetrics(GatewayMetrics()))
            for name, mine in (("a", []), ("b", got)))
    a.start()
    b.start()
    try:
        await until(lambda: a.up and b.up, timeout=FAILOVER_S)
        a.queue([Session("before", "http://e1")])          # the writer's connection is pooled
        await until(lambda: any(b"before" in p for p in got), timeout=FAILOVER_S)
        await asyncio.to_thread(redis_cluster.kill_primary_of, a.key)
        await until(lambda: a.up, timeout=FAILOVER_S)      # the reader is back on the promoted replica
        a.queue([Session("after", "http://e2")])
        await until(lambda: any(b"after" in p for p in got), timeout=FAILOVER_S)
        assert a.up and a.m.redis_lost._single.value == 1
    finally:
        await a.stop()
        await b.stop()


def test_the_directory_read_and_the_farewell_while_the_slot_map_is_read_again(redis_cluster):
    """After a failure the client reads the slot map again on its next call. A whole-directory read
    (the first sync after an outage does one) or a replica's farewell on shutdown that comes while
    another call is reading it gets its answer: a transaction on the Cluster client ran each of
    its commands in a thread with an event loop of its own, which waited for the map's lock held by
    the caller's loop while that loop waited for the thread (the worker hung for good; when the
    lock had been waited for before, the sync failed with a traceback instead)."""
    import threading

    from gateway.state.redis import forget_topology
    from gateway.tenants.redis_state import RedisState
    from tests.support.redis_failover import FAILOVER_S

    async def scenario() -> tuple:
        st = RedisState(StateConfig(redis_url=redis_cluster.url, timeout_s=2.0))
        try:
            await st.load_directory()
            await forget_topology(st.client)
            _, directory = await asyncio.gather(st.sync(None), st.load_directory())
            await forget_topology(st.client)
            await asyncio.gather(st.sync(None), st.leave())
            return directory
        finally:
            await st.stop()

    got: dict = {}
    # its own thread (a daemon, as are the threads it starts), so that a hung loop fails the test
    runner = threading.Thread(target=lambda: got.update(directory=asyncio.run(scenario())), daemon=True)
    runner.start()
    runner.join(FAILOVER_S)
    assert got == {"directory": ("0", {}, {}, None)}


async def test_stored_responses_are_found_on_both_replicas_right_after_a_failover(sims, gateway, redis_cluster):
    """The primary holding a stored response dies and its replica is promoted while two gateways
    are idle. Each one's Responses client still maps the slot to the dead node: its first call there
    failed (a connection refused) and the client re-read the slot map only for its next call, so
    a GET, a follow-up naming the response and the record of a new response each met a 503 (or a
    lost write) on a Cluster long healthy again. A call that meets a lost connection is now sent
    again on the new slot map, within the call's bound."""
    from tests.support.http import openai_client
    from tests.support.redis_failover import FAST_STATE

    sim = await sims("vllm", "m")
    blocks = {"responses": {"state": "gateway"}, "state": {"redis_url": redis_cluster.url, **FAST_STATE,
                                                            "timeout_s": 5.0}}
    a = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    b = await gateway([model_block("m", "vllm", [sim.url])], **blocks)
    ca, cb = openai_client(a), openai_client(b)
    stored = [await ca.responses.create(model="m", input=f"Hello {i}", max_output_tokens=2) for i in range(9)]
    for c in (ca, cb):                  # each client's slot map and pooled connections to every primary
        for r in stored:
            assert (await c.responses.retrieve(r.id)).id == r.id
    prefix = StateConfig(redis_url=redis_cluster.url).key_prefix
    # the primary of the first one's record (its replica, promoted, serves it now)
    await asyncio.to_thread(redis_cluster.kill_primary_of, f"{prefix}:resp:hist:{stored[0].id}")
    got = []
    for c in (cb, ca):
        for r in stored:
            try:
                got.append((await c.responses.retrieve(r.id)).id == r.id)
            except openai.APIStatusError as e:
                got.append(e.status_code)
    assert got == [True] * len(got), got
    for c in (ca, cb):                  # a follow-up naming it, on each
        r = stored[0]
        follow = await c.responses.create(model="m", input="And?", previous_response_id=r.id, max_output_tokens=2)
        assert follow.status == "incomplete"
    for c, other in ((ca, cb), (cb, ca)):   # a response written after the failover is read on the other
        r = await c.responses.create(model="m", input="new", max_output_tokens=2)
        assert (await other.responses.retrieve(r.id)).id == r.id
    text = await a.metrics_text() + await b.metrics_text()
    assert 'result="unavailable"' not in text


async def test_limits_are_checked_while_the_tenancy_slot_is_resharded(sims, gateway, redis_cluster):
    """The slot of the tenancy keys is resharded to another primary (CLUSTER SETSLOT MIGRATING and
    IMPORTING, then MIGRATE key by key) under failure_policy: closed. While a user's keys are split
    between the two nodes, the limit check's script (several keys) is answered TRYAGAIN; the
    client tried it again for about 0.4 s and gave up, and the request was a 503. Calls answered
    TRYAGAIN (or redirected until the client gave up) are now tried again within the call's bound,
    so a resharding that moves the slot meanwhile costs no request an error."""
    from tests.support.http import openai_client
    from tests.support.redis_failover import blocks
    from tests.support.tenancy import ALICE, CHAT

    sim = await sims("vllm", "m")
    cfg = blocks(redis_cluster.url, {"alice": {"rpm": 1_000_000, "tpm": 100_000_000}}, timeout_s=1.0)
    cfg["state"]["failure_policy"] = "closed"
    gw = await gateway([model_block("m", "vllm", [sim.url])], **cfg)
    c = openai_client(gw, ALICE)

    async def chat() -> int:
        try:
            await c.chat.completions.create(model="m", messages=CHAT, max_tokens=1)
            return 200
        except openai.APIStatusError as e:
            return e.status_code

    assert [await chat() for _ in range(3)] == [200] * 3
    key = f"{shared_prefix(StateConfig(redis_url=redis_cluster.url))}:rpm:alice"
    slot, src, dst = await asyncio.to_thread(redis_cluster.begin_migration, key)
    await asyncio.to_thread(redis_cluster.migrate, src, dst, [key])     # alice's keys split: TRYAGAIN

    async def finish() -> None:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(redis_cluster.end_migration, slot, src, dst)

    *got, _ = await asyncio.gather(chat(), chat(), chat(), finish())
    assert got == [200] * 3
    assert [await chat() for _ in range(3)] == [200] * 3      # on the slot's new primary
    assert redis_cluster.primary_of(key) is dst
    assert redis_cluster.keys_in_slot(src, slot) == []
    usage = await gw.gw.tenancy.state.usage("alice")
    assert usage["requests"] == 9


async def test_a_cluster_that_refuses_the_gateways_password_is_said_to(sims, gateway, redis_cluster, monkeypatch):
    """Nodes that require a password the URL does not give: the Cluster client names the refusal
    only in the cause of its "cannot be connected" error, and the start's warning says the shared
    state refuses the gateway's credentials (``reason`` ``auth``), not that it is unreachable."""
    import structlog.testing

    from gateway.tenants import service
    from tests.support.redis_failover import FAST_STATE, chat
    from tests.support.tenancy import KEYS

    monkeypatch.setattr(service, "START_RETRY_S", 3.0)       # a retry would be seen, not timed
    for n in redis_cluster.nodes:
        assert redis_cluster.cli_call(n, "config", "set", "requirepass", "cluster-secret-16180").strip() == "OK"
    sim = await sims("vllm", "m")
    with structlog.testing.capture_logs() as logs:
        gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                           limits={"users": {"alice": {"rpm": 100}}},
                           state={**FAST_STATE, "redis_url": redis_cluster.url.replace("://", "://:not-it@"),
                                  "sync_interval_s": 30.0, "replica_ttl_s": 60.0})
        assert (await chat(gw)).choices
    at_start = [x for x in logs if "at start" in x["event"]]
    assert len(at_start) == 1, logs
    assert at_start[0]["reason"] == "auth" and "credentials" in at_start[0]["event"], at_start
    assert "not-it" not in repr(logs)
