"""Listening ports for the servers the tests start in processes of their own (gateways, engines,
Redis, its Cluster and Sentinels).

``free_port()`` asks the kernel for a port of the ephemeral range, where the kernel also picks the
local ports of outgoing connections, and lets the port go at once. It never gives one process the
same port twice (two ports picked before either process binds would otherwise collide, and a test
would talk to an engine in its gateway's place), but a server that dies and is started again on
its port (a failover test's killed primary, a Redis restart) can still find the port taken in
between by one of the many connections a test makes, and so can a process slow to bind.

``listen_port()`` picks ports below that range, which ``connect()`` never takes, each one once per
test run, and checks that it can be bound now (as a server binds: with ``SO_REUSEADDR``, so a port
left in TIME_WAIT counts as free).
"""

from __future__ import annotations

import os
import random
import socket

_given: set[int] = set()
_rng = random.Random()


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999            # Linux's default


def _pool() -> range:
    lo, hi = _ephemeral()
    if lo - 10_000 >= 2_000:           # below the range (the usual case): 10000 .. lo - 1
        return range(10_000, lo)
    return range(hi + 1, 65_536)       # else above it


def _slice() -> tuple[int, int]:
    """``(i, n)`` from ``SWITCHYARD_TEST_PORT_SLICE=i/n``: this run takes the ports ``p % n == i``, so
    runs going on side by side (``tests/support/halves.py``) never pick one port; else ``(0, 1)``."""
    raw = os.environ.get("SWITCHYARD_TEST_PORT_SLICE", "")
    i, _, n = raw.partition("/")
    if i.isdigit() and n.isdigit() and 0 <= int(i) < int(n):
        return int(i), int(n)
    return 0, 1


def listen_port(host: str = "127.0.0.1") -> int:
    """A port no other server of this run was given, outside the ephemeral range, free now (and in
    this run's slice of them, when runs go on side by side)."""
    pool = _pool()
    part, parts = _slice()
    for _ in range(1_000):
        port = _rng.randrange(pool.start, pool.stop)
        port -= (port - part) % parts
        if port < pool.start:
            continue
        if port in _given:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {pool.start}..{pool.stop - 1}")
