"""A Redis call whose answer came while the gateway's loop was held (a long callback, a collector
pause, a stopped process) is answered, not timed out: the loop runs its due timers before it reads
its sockets, so the socket timeout's timer would otherwise fire with the answer unread. A Redis
that does not answer still times out."""
import asyncio
import socket
import time

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config.schema import StateConfig
from gateway.state.redis import close_client, redis_client


async def test_an_answer_that_came_while_the_loop_was_held_is_read(redis_server):
    client = redis_client(StateConfig(redis_url=redis_server.url, timeout_s=0.2))
    try:
        await client.set(b"k", b"v")
        for _ in range(3):
            redis_server.pause()            # SIGSTOP: the command waits in its socket
            call = asyncio.ensure_future(client.get(b"k"))
            await asyncio.sleep(0.05)       # sent; the call waits for its answer
            redis_server.resume()
            time.sleep(0.5)                 # the loop is held past state.timeout_s; the answer comes
            assert await call == b"v"
    finally:
        await close_client(client)


async def test_a_silent_redis_still_times_out_when_the_loop_was_held():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)                        # accepts (the kernel does) and never answers
    client = redis_client(StateConfig(redis_url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout_s=0.2))
    try:
        call = asyncio.ensure_future(client.get(b"k"))
        await asyncio.sleep(0.05)
        time.sleep(0.5)
        with pytest.raises((RedisTimeoutError, TimeoutError)):
            await asyncio.wait_for(call, 5)
        with pytest.raises((RedisTimeoutError, TimeoutError)):    # and without a held loop
            await asyncio.wait_for(client.get(b"k"), 5)
    finally:
        await close_client(client)
        silent.close()
