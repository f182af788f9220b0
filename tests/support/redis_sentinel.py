"""A real Sentinel-managed Redis on loopback: a primary, one replica and three Sentinels.

The Sentinels (``redis-server --sentinel``, so Debian's ``redis-server`` package is all it takes)
monitor the primary as ``mymaster`` with a quorum of 2, ``down-after-milliseconds`` 1000 and
``failover-timeout`` 3000, so a dead primary is replaced within a few seconds. ``kill_primary()``
SIGKILLs the current primary and waits until the Sentinels name the replica as the primary and it
says so itself; ``restart(node)`` brings a killed server back (the Sentinels make it a replica).
``cleanup()`` stops every process by pid and removes the temporary directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.support.ports import listen_port
from tests.support.redis_server import SET_FLAGS, RedisProc, run, stop_set, wait_until

SERVICE = "mymaster"


class RedisSentinel:
    def __init__(self, sentinels: int = 3, down_after_ms: int = 1000, failover_timeout_ms: int = 3000) -> None:
        self.server = shutil.which("redis-server")
        self.cli = shutil.which("redis-cli")
        if self.server is None or self.cli is None:
            pytest.fail("redis-server and redis-cli are not installed (make test installs them: "
                        "apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="switchyard-redis-sentinel-")
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        common = SET_FLAGS
        p0, p1 = listen_port(), listen_port()
        self.servers = [RedisProc(p0, f"{self.dir}/r0", [self.server, "--port", str(p0), *common]),
                        RedisProc(p1, f"{self.dir}/r1", [self.server, "--port", str(p1), *common,
                                                    "--replicaof", "127.0.0.1", str(p0)])]
        self.sentinels = []
        for i in range(sentinels):
            port = listen_port()
            d = f"{self.dir}/s{i}"
            self.sentinels.append(RedisProc(port, d, [self.server, f"{d}/sentinel.conf", "--sentinel"]))

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{SERVICE}"

    # -- processes ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> RedisSentinel:
        for s in self.servers:
            s.spawn()
        primary = self.servers[0].port
        for s in self.sentinels:
            os.makedirs(s.dir, exist_ok=True)
            with open(f"{s.dir}/sentinel.conf", "w") as f:
                f.write(f"port {s.port}\nbind 127.0.0.1\ndir {s.dir}\nprotected-mode no\nloglevel warning\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
                        f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                        f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}\n"
                        f"sentinel parallel-syncs {SERVICE} 1\n")
            s.spawn()
        # the replica is in sync and every Sentinel knows the replica and the other Sentinels: only
        # then can a failover be agreed on and carried out
        wait_until(lambda: self._info(self.servers[1], "replication").get("master_link_status") == "up",
                   timeout, "replica in sync")
        wait_until(self._sentinels_ready, timeout, "sentinels that know each other and the replica")
        return self

    def _sentinels_ready(self) -> bool:
        for s in self.sentinels:
            info = self._sentinel_master(s)
            if int(info.get("num-slaves", 0)) < 1 or int(info.get("num-other-sentinels", 0)) < len(self.sentinels) - 1:
                return False
        return True

    def kill(self, p: RedisProc) -> None:
        p.kill()

    def restart(self, p: RedisProc) -> None:
        assert p.proc is None
        p.spawn()

    def cleanup(self) -> None:
        stop_set([*self.sentinels, *self.servers], self.dir)

    # -- roles -------------------------------------------------------------------------------

    def _cli(self, port: int, *args: str) -> str:
        return run([self.cli, "-p", str(port), *args], capture_output=True, text=True,
                              timeout=5, check=False).stdout

    def _info(self, p: RedisProc, section: str) -> dict[str, str]:
        out = self._cli(p.port, "info", section)
        return dict(line.strip().split(":", 1) for line in out.splitlines() if ":" in line)

    def _sentinel_master(self, s: RedisProc) -> dict[str, str]:
        lines = self._cli(s.port, "sentinel", "master", SERVICE).splitlines()
        return dict(zip(lines[::2], lines[1::2], strict=False))

    def primary(self) -> RedisProc:
        """The server every live Sentinel names as the primary, and which says it is one."""
        named = {self._cli(s.port, "sentinel", "get-master-addr-by-name", SERVICE).split()[1]
                 for s in self.sentinels if s.alive}
        assert len(named) == 1, named
        port = int(named.pop())
        p = next(p for p in self.servers if p.port == port)
        assert p.alive and self._info(p, "replication").get("role") == "master"
        return p

    def kill_primary(self, timeout: float = 30.0) -> RedisProc:
        """SIGKILL the primary; wait until the Sentinels have promoted the replica."""
        victim = self.primary()
        self.kill(victim)
        wait_until(lambda: self.primary() is not victim, timeout, "a promoted replica")
        return victim
