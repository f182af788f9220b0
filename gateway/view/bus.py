"""The local bus: the workers of one gateway (``--workers N``) tell each other their routing facts.

The parent creates a private directory (mode 0700: only this user's processes can send to the
workers) before it forks, and removes it when it exits (``gateway.server.rundir.RunDirectory``). Worker *i* binds one
Unix datagram socket there, ``w<i>.sock`` (a restarted worker unlinks and binds it again), and
sends each batch to every sibling's socket with one non-blocking ``sendto``: nothing waits on
another process. A sibling whose receive queue is full, or that is not there (starting,
restarting), misses that batch, which is counted: in-flight counts are absolute, so the next
batch heals them, and a worker that missed insertions, sessions or ejections catches up from the sender
(``RoutingView.catch_up``; ``refused`` tells the sender a sibling missed one).

Datagrams keep message boundaries, need no framing, connection or reconnection, and the kernel
copies them between processes in a few microseconds; a worker reads every queued datagram when
its socket is readable (``loop.add_reader``), between two requests' steps.

A batch is at most ``view.max_datagram_bytes``, but a single fact larger than that travels alone
(the adapters of an engine that lists thousands, say): a worker reads a datagram as large as its
sending socket takes (``SO_SNDBUF``, the same in every worker, up to ``RCVBUF_BYTES``), into one
buffer kept for it, so none arrives cut short; a larger one is not sent, counted ``too_large``.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
from collections.abc import Callable
from pathlib import Path

# a worker's receive buffer: room for a burst of batches while its loop is busy
RCVBUF_BYTES = 4 * 1024 * 1024


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"w{index}.sock")


class LocalBus:
    """Worker ``index`` of ``count``: ``send`` to every sibling, ``on_message`` for each received."""

    def __init__(self, directory: str, index: int, count: int, on_message: Callable[[bytes], None],
                 on_drop: Callable[[str], None], max_bytes: int) -> None:
        self.directory = directory
        self.index = index
        self.path = socket_path(directory, index)
        self.peers = [socket_path(directory, i) for i in range(count) if i != index]
        self.on_message = on_message
        self.on_drop = on_drop
        self.max_bytes = max_bytes
        self.sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.datagram_max = max_bytes + 65536     # the largest datagram sent and read (``open`` sets it)
        self._buf: mmap.mmap | None = None        # read into: its pages are used as far as the largest datagram
        self.sent = 0
        self.refused = 0          # datagrams a living sibling refused in the last ``send`` (its queue full)

    def open(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RCVBUF_BYTES)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)                 # a previous incarnation of this worker
        s.bind(self.path)
        self.sock = s
        with contextlib.suppress(OSError):
            self.datagram_max = min(RCVBUF_BYTES, max(self.datagram_max, s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)))
        self._buf = mmap.mmap(-1, self.datagram_max)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(s.fileno(), self._readable)

    def close(self) -> None:
        if self.sock is None:
            return
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.sock = None
        if self._buf is not None:
            self._buf.close()
            self._buf = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def send(self, payloads: list[bytes]) -> int:
        """Each payload to each sibling; returns how many datagrams left. Never blocks."""
        s = self.sock
        if s is None:
            return 0
        sent = refused = 0
        for peer in self.peers:
            for p in payloads:
                if len(p) > self.datagram_max:                     # the sibling could not read it whole
                    self.on_drop("too_large")
                    refused += 1
                    continue
                try:
                    s.sendto(p, peer)
                    sent += 1
                except BlockingIOError:                           # the sibling's queue is full
                    self.on_drop("peer_full")
                    refused += 1
                except (FileNotFoundError, ConnectionRefusedError):   # not there (yet, or any more)
                    self.on_drop("peer_down")
                    break
                except OSError:                                   # e.g. EMSGSIZE
                    self.on_drop("error")
                    refused += 1
        self.sent += sent
        self.refused = refused
        return sent

    def _readable(self) -> None:
        s, buf = self.sock, self._buf
        if s is None or buf is None:
            return
        while True:
            try:
                n = s.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self.on_message(buf[:n])


def sibling_paths(directory: str) -> list[Path]:
    """The worker sockets present in ``directory`` (for tests and debugging)."""
    return sorted(Path(directory).glob("w*.sock"))
