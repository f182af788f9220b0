"""The Redis sets' helpers (tests/support/redis_sentinel.py, redis_cluster.py) start redis-cli and
redis-server from the thread that starts a set ahead of its test (tests/conftest.py ``_Ahead``),
while the tests' thread goes on: pytest sets and removes ``PYTEST_CURRENT_TEST`` at each phase of
each test. A child made by vfork (subprocess's way on Linux) that execs with the process's own
environment reads that array while the other thread may be moving it (setenv reallocates it), and
the exec fails with EFAULT ("Bad address"): the helpers give their children an environment of
their own."""

from __future__ import annotations

import os
import threading

from tests.support.redis_cluster import RedisCluster
from tests.support.redis_sentinel import RedisSentinel

CALLS = 300


def test_the_sets_start_their_commands_while_another_thread_changes_the_environment():
    sentinel, cluster = RedisSentinel(), RedisCluster()
    failed: list[BaseException] = []
    done = threading.Event()

    def calls() -> None:
        try:
            for _ in range(CALLS):
                try:
                    sentinel._cli(sentinel.sentinels[0].port, "ping")
                    cluster.cli_call(cluster.nodes[0], "ping")
                except OSError as e:
                    failed.append(e)
        finally:
            done.set()

    t = threading.Thread(target=calls)
    t.start()
    i = 0
    try:
        while not done.is_set():       # as pytest does between a test's phases
            os.environ["SY_TEST_PHASE"] = f"test_{i} (call)"
            os.environ.pop("SY_TEST_PHASE")
            i += 1
    finally:
        t.join()
        sentinel.cleanup()
        cluster.cleanup()
    assert not failed, f"{len(failed)} of {2 * CALLS} calls failed to start: {failed[0]!r}"
