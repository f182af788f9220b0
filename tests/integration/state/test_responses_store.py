"""The Responses records in a real redis-server, reached through a proxy that can cut a gateway's
connection at a given command: a call that meets the store unreachable between its reads and its
write is answered as any call that meets it so, and changes nothing."""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
import redis

from gateway.apis.responses_state import TRIES, RedisStore, StoreUnavailable
from gateway.config.schema import StateConfig
from gateway.state.redis import redis_client
from tests.support.gateway_process import gateway_process
from tests.support.ports import listen_port
from tests.support.waiting import process_stopped, until


class CuttingProxy:
    """In front of a Redis: every byte passed on, except that while ``cut_at`` is set, a
    connection that sends a command holding all of its parts is closed before Redis sees it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = listen_port()
        self.cut_at: tuple[bytes, ...] | None = None
        self.cuts = 0
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> CuttingProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, watch: bool) -> None:
            try:
                while data := await src.read(65536):
                    if watch and self.cut_at is not None and all(p in data for p in self.cut_at):
                        self.cuts += 1
                        return
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                for w in (writer, up_writer):
                    w.close()

        tasks = [asyncio.create_task(pump(reader, up_writer, True)), asyncio.create_task(pump(up_reader, writer, False))]
        self._tasks.update(tasks)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks)
        self._tasks.difference_update(tasks)


def config(port: int, url: str, redis_port: int, state: str) -> str:
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
            f"state: {{redis_url: 'redis://127.0.0.1:{redis_port}/0'}}\n"
            f"responses: {{state: {state}}}\n"
            f"models: [{{name: m, engine: vllm, endpoints: ['{url}']}}]\n")


@pytest.mark.timeout(120)
async def test_a_delete_that_meets_the_store_unreachable_after_its_lookup_is_the_state_stores_503(
        sims, tmp_path, redis_server):
    """Gateway-held history: the record is read, then the store is cut as its deletion is sent.
    The deletion is sent again (each time cut), then the client gets the 503 of an unreachable
    store with its documented x-error-state-unavailable and Retry-After, the record is still there,
    and the DELETE sent again once the store answers removes it."""
    sim = await sims("vllm", "m")
    port = listen_port()
    async with CuttingProxy(redis_server.port) as proxy:
        path = tmp_path / "gw.yaml"
        path.write_text(config(port, sim.url, proxy.port, "gateway"))
        async with gateway_process(path, port, "--workers", "1"):
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            try:
                first = await client.responses.create(model="m", input="Hello", max_output_tokens=2)
                proxy.cut_at = (b"DEL", b":resp:hist:" + first.id.encode())
                with pytest.raises(openai.InternalServerError) as ei:
                    await client.responses.delete(first.id)
                proxy.cut_at = None
                assert proxy.cuts == TRIES
                e = ei.value
                assert (e.status_code, e.body["code"], e.body["type"]) == (503, "service_unavailable", "overloaded_error")
                assert e.response.headers.get("x-error-state-unavailable") == "true"
                assert e.response.headers.get("Retry-After") == "1"
                # the connection closed after the DEL was sent: whether Redis ran it, the gateway cannot know
                assert "whether the response was deleted is unknown" in e.body["message"], e.body
                # nothing changed: the record is there, and the DELETE sent again takes it away
                assert (await client.responses.retrieve(first.id)).id == first.id
                await until(lambda: _deleted(client, first.id), timeout=10)
                with pytest.raises(openai.NotFoundError):
                    await client.responses.retrieve(first.id)
            finally:
                await client.close()


async def _deleted(client: openai.AsyncOpenAI, rid: str) -> bool:
    with contextlib.suppress(openai.InternalServerError):
        await client.responses.delete(rid)
        return True
    return False


def _auth_refusals(port: int) -> int:
    """How many connections the Redis on ``port`` refused a password (its ACL log)."""
    r = redis.Redis(port=port, password="right")
    try:
        return sum(int(e["count"]) for e in r.acl_log() if e["reason"] == "auth")
    finally:
        r.close()


async def test_a_refused_password_is_not_sent_again(redis_server):
    """A wrong password is no passing fault: the store's call is not made again (each try would
    send the same AUTH, refused the same way), and it fails at once with reason ``auth``."""
    r = redis.Redis(port=redis_server.port)
    r.config_set("requirepass", "right")
    r.close()
    store = RedisStore(redis_client(StateConfig(redis_url=redis_server.url, password="wrong")), "sy:resp:",
                       ttl_s=60, timeout_s=1.0, owns_client=True)
    before = _auth_refusals(redis_server.port)
    try:
        with pytest.raises(StoreUnavailable) as ei:
            await store.get("resp_1")
    finally:
        await store.close()
    assert ei.value.reason == "auth"
    assert _auth_refusals(redis_server.port) - before == 1


async def test_a_deletion_redis_took_but_did_not_answer_in_time_is_of_unknown_outcome(redis_server):
    """A Redis paused (SIGSTOP) as the DEL is sent keeps it in its socket, and runs it once it
    resumes: the store's failure says the outcome is unknown (not that nothing was deleted), and
    indeed the key is gone after the resume."""
    plain = redis.Redis(port=redis_server.port)
    store = RedisStore(redis_client(StateConfig(redis_url=redis_server.url, timeout_s=0.2)), "sy:resp:",
                       ttl_s=60, timeout_s=0.2, owns_client=True)
    try:
        await store.put("resp_1", b"{}")            # its connection, open
        redis_server.pause()
        await until(lambda: process_stopped(redis_server.proc.pid), timeout=10)
        try:
            with pytest.raises(StoreUnavailable) as ei:
                await store.delete("resp_1")
        finally:
            redis_server.resume()
        assert ei.value.reason == "unreachable" and ei.value.outcome_unknown, ei.value
        await until(lambda: plain.exists("sy:resp:resp_1") == 0, timeout=10)
    finally:
        await store.close()
        plain.close()


async def test_a_deletion_whose_connection_was_refused_is_known_not_done(redis_server):
    """A Redis that refuses the connection ran nothing: that failure is no unknown outcome."""
    port = redis_server.port
    redis_server.stop()
    store = RedisStore(redis_client(StateConfig(redis_url=f"redis://127.0.0.1:{port}/0", timeout_s=0.2)),
                       "sy:resp:", ttl_s=60, timeout_s=0.2, owns_client=True)
    try:
        with pytest.raises(StoreUnavailable) as ei:
            await store.delete("resp_1")
    finally:
        await store.close()
    assert ei.value.reason == "unreachable" and not ei.value.outcome_unknown, ei.value
