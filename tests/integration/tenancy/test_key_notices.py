"""Directory change notices: a key created, changed or revoked on one replica reaches every worker of
every other replica at once, not at its next sync. Two real gateway processes of two workers each,
sharing a real redis-server, with a sync interval far longer than the tests wait."""

from __future__ import annotations

import asyncio
import hashlib
import signal

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from tests.support.gateway_process import gateway_process, get_new, metric_total, post_new
from tests.support.ports import listen_port
from tests.support.tenancy import CHAT, KEYS
from tests.support.waiting import wait_for

ADMIN = "admin-token-notices-1"
BODY = {"model": "m", "messages": CHAT, "max_tokens": 1}
# longer than any wait below: what reaches a replica in these tests came by a notice, not a sync
SLOW_SYNC = {"sync_interval_s": 30, "replica_ttl_s": 90, "timeout_s": 2.0}
BOUND_S = 5.0        # generous: a notice lands in milliseconds, on a machine many tests share


def _config(tmp_path, name: str, port: int, engine: str, redis_url: str):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "server": {"drain_delay_s": 0, "log_level": "warning"},
        "auth": {**KEYS, "admin_token": ADMIN},
        "state": {"redis_url": redis_url, **SLOW_SYNC, "replica_id": name},
        "models": [{"name": "m", "engine": "vllm", "endpoints": [engine]}]}))
    return cfg


async def _statuses(port: int, key: str, n: int = 8) -> list[int]:
    """What ``n`` requests, each on a connection of its own (so on either worker), got with ``key``."""
    got = await asyncio.gather(*(post_new(port, "/v1/chat/completions", BODY, {"Authorization": f"Bearer {key}"})
                                 for _ in range(n)))
    return [g[0] for g in got]


async def _everywhere(ports: list[int], key: str, status: int) -> bool:
    for p in ports:
        if any(s != status for s in await _statuses(p, key)):
            return False
    return True


@pytest.mark.timeout(120)
async def test_a_key_made_or_revoked_on_one_replica_holds_at_once_on_every_worker_of_the_others(
        sims, tmp_path, redis_server):
    sim = await sims("vllm", "m")
    pa, pb = listen_port(), listen_port()
    ca = _config(tmp_path, "a", pa, sim.url, redis_server.url)
    cb = _config(tmp_path, "b", pb, sim.url, redis_server.url)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    key = "sk-notice-dana-0123456789"
    async with gateway_process(ca, pa, "--workers", "2", ready_workers=2, admin_token=ADMIN), \
            gateway_process(cb, pb, "--workers", "2", ready_workers=2, admin_token=ADMIN):
        # the key tried before it exists: every worker that met it remembers the store did not know it
        assert set(await _statuses(pb, key)) == {401}
        status, _, created = await post_new(pa, "/admin/keys", {"user": "dana", "key": key}, admin)
        assert status == 201, created
        assert await wait_for(lambda: _everywhere([pa, pb], key, 200), timeout=BOUND_S), \
            "a key made on one replica is refused on another"
        status = await _delete(pa, f"/admin/keys/{created['id']}", admin)
        assert status == 200
        assert await wait_for(lambda: _everywhere([pa, pb], key, 401), timeout=BOUND_S), \
            "a key revoked on one replica is still served on another"
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            version = int(await r.get("switchyard:version"))
        finally:
            await r.aclose()
        for port in (pa, pb):            # each worker of each replica took both changes in by their notices
            views = await _per_worker(port)
            assert [(v["tenants"]["directory_version"], v["tenants"]["directory_notices_up"])
                    for pid, v in views.items() if pid] == [(version, True)] * 2
            assert metric_total(views[0], "switchyard_directory_notices_total") >= 2


async def _delete(port: int, path: str, headers: dict[str, str]) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.delete(f"http://127.0.0.1:{port}{path}", headers=headers) as r:
        await r.read()
        return r.status


async def _per_worker(port: int, workers: int = 2) -> dict:
    """The status page as each worker answers it, by pid, and under 0 the gateway's ``/metrics``
    (its workers' merged)."""
    found: dict = {}
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with asyncio.timeout(20):
        while len(found) < workers:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), headers=headers) as s:
                async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                    view = await r.json()
            found[view["gateway"]["pid"]] = view
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                found[0] = await r.text()
    return found


@pytest.mark.timeout(120)
async def test_a_reload_making_a_stored_key_the_admin_token_is_refused(sims, tmp_path, redis_server):
    """The config's own check cannot see the keys the admin API stored in Redis: the reload that
    would make one of them the admin token (every holder of that key an admin) is refused when
    applied, naming auth.admin_token and the key's id, and the running config is kept."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = _config(tmp_path, "a", port, sim.url, redis_server.url)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    key = "sk-stored-then-admin-0123456789"
    async with gateway_process(path, port, "--workers", "2", ready_workers=2, admin_token=ADMIN):
        status, _, created = await post_new(port, "/admin/keys", {"user": "dana", "key": key}, admin)
        assert status == 201, created
        cfg = yaml.safe_load(path.read_text())
        cfg["auth"]["admin_token"] = key
        path.write_text(yaml.safe_dump(cfg))
        status, _, body = await post_new(port, "/admin/reload", {}, admin)
        assert status == 400 and body["error"]["param"] == "auth.admin_token", body
        assert created["id"] in body["error"]["message"], body
        for _ in range(4):              # on either worker: the old token is still the admin's, the key a client's
            assert (await post_new(port, "/admin/keys", {"user": "erin"}, admin))[0] == 201
            assert (await post_new(port, "/admin/keys", {"user": "erin"}, {"Authorization": f"Bearer {key}"}))[0] == 401
        assert set(await _statuses(port, key)) == {200}


async def _metrics(port: int) -> str:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.get(f"http://127.0.0.1:{port}/metrics") as r:
        return await r.text()


async def _refused_gauge(port: int, value: int) -> bool:
    """switchyard_admin_token_refused is ``value`` on the gateway's /metrics (its workers' highest)."""
    async def seen() -> bool:
        return metric_total(await _metrics(port), "switchyard_admin_token_refused") == value
    return await wait_for(seen, timeout=20)


@pytest.mark.timeout(120)
async def test_a_gateway_started_with_a_stored_key_as_its_admin_token_refuses_that_token(
        sims, tmp_path, redis_server):
    """A replica started (or restarted) with an admin token that is a key the admin API stored keeps
    serving, but its admin API and its status page refuse that token with a 403 naming the key and auth.admin_token
    (every holder of the key would be an admin), counted in switchyard_admin_token_refused; the key
    stays a client's. Likewise on a running replica once another one, with another admin token,
    stores a key that is its token (which a key's creation refuses, but for one racing the reload)."""
    sim = await sims("vllm", "m")
    port_a, port_b = listen_port(), listen_port()
    key = "sk-stored-then-admin-0123456789"
    later = "sk-stored-later-admin-987654321"
    path_a = _config(tmp_path, "a", port_a, sim.url, redis_server.url)
    path_b = _config(tmp_path, "b", port_b, sim.url, redis_server.url)
    cfg = yaml.safe_load(path_b.read_text())
    cfg["auth"]["admin_token"] = key
    path_b.write_text(yaml.safe_dump(cfg))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with gateway_process(path_a, port_a, admin_token=ADMIN):
        status, _, created = await post_new(port_a, "/admin/keys", {"user": "dana", "key": key}, admin)
        assert status == 201, created
        async with gateway_process(path_b, port_b, status_page=False) as gateway_b:
            as_admin = {"Authorization": f"Bearer {key}"}
            status, answer = await get_new(port_b, "/status.json", key)
            assert status == 403 and created["id"] in answer["error"]["message"], answer
            for path, body in (("/admin/keys", {"user": "erin"}), ("/admin/reload", {})):
                status, headers, answer = await post_new(port_b, path, body, as_admin)
                assert status == 403 and answer["error"]["code"] == "admin_token_refused", (path, answer)
                assert headers.get("Cache-Control") == "no-store", headers
                assert created["id"] in answer["error"]["message"], answer
                assert "auth.admin_token" in answer["error"]["message"], answer
            assert await _refused_gauge(port_b, 1)
            assert (await post_new(port_b, "/admin/keys", {"user": "erin"}, admin))[0] == 401
            assert set(await _statuses(port_b, key, 2)) == {200}         # the key is still a client's
            assert metric_total(await _metrics(port_a), "switchyard_admin_token_refused") == 0
            # a key made later on the other replica, that is this replica's admin token
            cfg["auth"]["admin_token"] = later
            path_b.write_text(yaml.safe_dump(cfg))
            status, _, answer = await post_new(port_b, "/admin/reload", {}, {"Authorization": f"Bearer {later}"})
            assert status == 401, answer         # not its token yet: the reload comes by SIGHUP
            gateway_b.send_signal(signal.SIGHUP)
            later_admin = {"Authorization": f"Bearer {later}"}

            async def takes_later() -> bool:
                return (await post_new(port_b, "/admin/keys", {"user": "gus"}, later_admin))[0] == 201
            assert await wait_for(takes_later, timeout=20)
            assert await _refused_gauge(port_b, 0)          # every worker reloaded
            # the other replica stores it before this one's new token reached the shared state (a
            # reload racing the key's creation): the published tokens are cleared to stand for that
            assert await _published(redis_server.url, later, 2)          # both workers of b
            r = aioredis.Redis.from_url(redis_server.url)
            try:
                await r.delete("switchyard:admintokens")
            finally:
                await r.aclose()
            status, _, made = await post_new(port_a, "/admin/keys", {"user": "hal", "key": later}, admin)
            assert status == 201, made

            async def refuses_later() -> bool:
                return (await post_new(port_b, "/admin/keys", {"user": "gus"}, later_admin))[0] == 403
            assert await wait_for(refuses_later, timeout=BOUND_S)
            assert await _refused_gauge(port_b, 1)


async def _published(redis_url: str, token: str, replicas: int) -> bool:
    """Whether ``replicas`` replicas (a gateway's workers are each one) publish ``token`` as their
    admin token (its SHA-256), once they do."""
    digest = hashlib.sha256(token.encode()).hexdigest().encode()
    r = aioredis.Redis.from_url(redis_url)
    try:
        async def seen() -> bool:
            return (await r.hvals("switchyard:admintokens")).count(digest) == replicas
        return await wait_for(seen, timeout=20)
    finally:
        await r.aclose()


@pytest.mark.timeout(120)
async def test_a_key_that_is_another_replicas_admin_token_is_refused(sims, tmp_path, redis_server):
    """Replicas with different admin tokens on one Redis: POST /admin/keys on one refuses a key that
    is the admin token of another live replica (which would make every holder of the key an admin
    there), with a 400 naming key; once that replica reloads to another token, the new one is refused
    and the old one is an ordinary key. The sync interval is far longer than the test: a reload's
    token is published at once."""
    sim = await sims("vllm", "m")
    port_a, port_b = listen_port(), listen_port()
    token_b, token_b2 = "admin-token-of-b-0123456789", "admin-token-of-b-later-0123456789"
    path_a = _config(tmp_path, "a", port_a, sim.url, redis_server.url)
    path_b = _config(tmp_path, "b", port_b, sim.url, redis_server.url)
    cfg = yaml.safe_load(path_b.read_text())
    cfg["auth"]["admin_token"] = token_b
    path_b.write_text(yaml.safe_dump(cfg))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with gateway_process(path_a, port_a, admin_token=ADMIN), \
            gateway_process(path_b, port_b, admin_token=token_b) as gateway_b:
        status, _, answer = await post_new(port_a, "/admin/keys", {"user": "dana", "key": token_b}, admin)
        assert status == 400 and answer["error"]["param"] == "key", answer
        assert "admin token" in answer["error"]["message"], answer
        assert (await post_new(port_b, "/admin/keys", {"user": "dana"}, {"Authorization": f"Bearer {token_b}"}))[0] == 201
        cfg["auth"]["admin_token"] = token_b2
        path_b.write_text(yaml.safe_dump(cfg))
        gateway_b.send_signal(signal.SIGHUP)
        assert await _published(redis_server.url, token_b, 0)      # every worker of b reloaded
        assert await _published(redis_server.url, token_b2, 2)
        status, _, answer = await post_new(port_a, "/admin/keys", {"user": "dana", "key": token_b2}, admin)
        assert status == 400 and answer["error"]["param"] == "key", answer
        status, _, answer = await post_new(port_a, "/admin/keys", {"user": "dana", "key": token_b}, admin)
        assert status == 201, answer
