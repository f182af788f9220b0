"""``free_port``: a port free now, never the same one twice in a process (the port is let go at
once, so a caller that picks ports for several servers before any of them binds could otherwise be
handed one port for two of them)."""

from __future__ import annotations

import socket

from gateway.server import run
from gateway.server.run import free_port


def test_a_process_is_never_given_the_same_port_twice():
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_the_port_given_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_given_before_is_skipped(monkeypatch):
    first = free_port()
    seen = []
    real = socket.socket

    class Repeats(real):          # the kernel offers the port given before, then another
        def getsockname(self):
            name = super().getsockname()
            if not seen:
                seen.append(name[1])
                return (name[0], first)
            return name

    monkeypatch.setattr(run.socket, "socket", Repeats)
    assert free_port() != first
