"""A real Redis Cluster on loopback: three primaries, one replica each, for the failover tests.

Six ``redis-server --cluster-enabled yes`` processes (no persistence, ``cluster-node-timeout``
1000 ms so a dead primary is replaced within a few seconds) in one temporary directory, joined
with ``redis-cli --cluster create --cluster-replicas 1``. ``kill_primary_of(key)`` SIGKILLs the
primary serving a key's slot and waits until its replica has taken the slots over and every
live node agrees; ``restart(node)`` brings a killed node back (it rejoins as a replica).
``cleanup()`` stops every process by pid and removes the directory.

``make test`` installs Debian's ``redis-server`` (which brings ``redis-cli``) when it is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import pytest

from tests.support.ports import listen_port
from tests.support.redis_server import SET_FLAGS, RedisProc, run, stop_set, wait_until


@dataclass
class Node(RedisProc):
    """A cluster node: a server with its cluster bus port."""

    bus_port: int = 0


class RedisCluster:
    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.server = shutil.which("redis-server")
        self.cli = shutil.which("redis-cli")
        if self.server is None or self.cli is None:
            pytest.fail("redis-server and redis-cli are not installed (make test installs them: "
                        "apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="switchyard-redis-cluster-")
        self.node_timeout_ms = node_timeout_ms
        self.replicas = replicas
        self.nodes = []
        for i in range(primaries * (1 + replicas)):
            port, bus, d = listen_port(), listen_port(), f"{self.dir}/n{i}"
            self.nodes.append(Node(port, d, [
                self.server, "--port", str(port), "--cluster-enabled", "yes", "--cluster-port", str(bus),
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
                "--dir", d, *SET_FLAGS], bus_port=bus))

    @property
    def url(self) -> str:
        """Two startup nodes are enough: the client learns the others from them."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    # -- processes ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> RedisCluster:
        for n in self.nodes:
            n.spawn()
        run([self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
        self.wait_ok(timeout)
        # every replica has finished its first sync, so a failover has something to promote
        wait_until(lambda: all(self._info(n, "replication").get("master_link_status") == "up"
                               for n in self.nodes if self.role(n) == "slave"), timeout, "replicas in sync")
        return self

    def kill(self, node: Node) -> None:
        node.kill()

    def restart(self, node: Node, timeout: float = 30.0) -> None:
        """A killed node comes back with its nodes.conf and rejoins (as a replica of its successor)."""
        assert node.proc is None
        node.spawn()
        self.wait_ok(timeout)

    def cleanup(self) -> None:
        stop_set(self.nodes, self.dir)

    # -- topology ----------------------------------------------------------------------------

    def cli_call(self, node: Node, *args: str) -> str:
        return run([self.cli, "-p", str(node.port), *args], capture_output=True, text=True,
                              timeout=5, check=False).stdout

    def _info(self, node: Node, section: str) -> dict[str, str]:
        out = self.cli_call(node, "info", section)
        return dict(line.split(":", 1) for line in out.splitlines() if ":" in line)

    def role(self, node: Node) -> str:
        return self._info(node, "replication").get("role", "")

    def keyslot(self, key: str) -> int:
        return int(self.cli_call(self.live()[0], "cluster", "keyslot", key).strip())

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def primary_of(self, key: str) -> Node:
        slot = self.keyslot(key)
        for line in self.cli_call(self.live()[0], "cluster", "nodes").splitlines():
            f = line.split()
            if "master" in f[2] and "fail" not in f[2] and any(_covers(r, slot) for r in f[8:]):
                port = int(f[1].split("@")[0].rsplit(":", 1)[1])
                return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no primary serves slot {slot}")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Every live node says cluster_state:ok and agrees on who serves every slot."""
        def agreed() -> bool:
            live = self.live()
            if not all(self._info_cluster(n).get("cluster_state") == "ok" for n in live):
                return False
            views = {self._slot_owners(n) for n in live}
            return len(views) == 1
        wait_until(agreed, timeout, "cluster_state:ok on every node")

    def _info_cluster(self, node: Node) -> dict[str, str]:
        out = self.cli_call(node, "cluster", "info")
        return dict(line.strip().split(":", 1) for line in out.splitlines() if ":" in line)

    def _slot_owners(self, node: Node) -> tuple:
        rows = []
        for line in self.cli_call(node, "cluster", "nodes").splitlines():
            f = line.split()
            if len(f) > 8 and "master" in f[2] and "fail" not in f[2]:
                rows.append((f[1].split("@")[0], tuple(sorted(f[8:]))))
        return tuple(sorted(rows))

    def kill_primary_of(self, key: str, timeout: float = 30.0) -> Node:
        """SIGKILL the primary serving ``key`` and wait until its replica serves the slot."""
        victim = self.primary_of(key)
        self.kill(victim)
        wait_until(lambda: self.primary_of(key) is not victim, timeout, "a replica promoted")
        self.wait_ok(timeout)
        return victim


    # -- resharding --------------------------------------------------------------------------

    def node_id(self, node: Node) -> str:
        return self.cli_call(node, "cluster", "myid").strip()

    def begin_migration(self, key: str) -> tuple[int, Node, Node]:
        """Mark the slot of ``key`` migrating from its primary to another primary, as a resharding
        does before it moves the keys: (slot, source, target)."""
        slot = self.keyslot(key)
        src = self.primary_of(key)
        dst = next(n for n in self.live() if self.role(n) == "master" and n is not src)
        assert self.cli_call(dst, "cluster", "setslot", str(slot), "importing", self.node_id(src)).strip() == "OK"
        assert self.cli_call(src, "cluster", "setslot", str(slot), "migrating", self.node_id(dst)).strip() == "OK"
        return slot, src, dst

    def migrate(self, src: Node, dst: Node, keys: list[str]) -> None:
        for k in keys:
            assert self.cli_call(src, "migrate", "127.0.0.1", str(dst.port), k, "0", "5000").strip() == "OK"

    def keys_in_slot(self, node: Node, slot: int) -> list[str]:
        return self.cli_call(node, "cluster", "getkeysinslot", str(slot), "1000").split()

    def end_migration(self, slot: int, src: Node, dst: Node) -> None:
        """The slot's remaining keys moved and the slot given to ``dst`` on every node."""
        self.migrate(src, dst, self.keys_in_slot(src, slot))
        for n in (dst, src, *(n for n in self.live() if n not in (src, dst))):
            self.cli_call(n, "cluster", "setslot", str(slot), "node", self.node_id(dst))


def _covers(spec: str, slot: int) -> bool:
    if spec.startswith("["):        # a slot being migrated
        return False
    lo, _, hi = spec.partition("-")
    return int(lo) <= slot <= int(hi or lo)
