"""The ``--workers`` parent's private directory: the workers' sockets for each other.

Created before the fork (``mkdtemp``: mode 0700, so only this user's processes reach the sockets)
and removed by the parent when it exits; when the parent was killed outright (SIGKILL, the OOM
killer), by the last of its workers to stop (``close_if_last``). Worker *i* binds ``worker-<i>.sock`` there for its
siblings' scrapes (gateway/server/siblings.py) and ``w<i>.sock`` for the shared routing view's bus
(gateway/view/bus.py); a restarted worker rebinds its predecessor's paths.

Which process is the last is told by a lock, not by the sockets left (a worker killed outright
leaves its own behind): the parent locks a file in the directory (``flock``) as it makes it, and
the lock, taken on a descriptor every worker inherits at its fork, is held for as long as one of the
gateway's processes lives, whichever dies and however. A worker stopping after its parent died
lets go of its descriptor and tries the lock on one of its own: it gets it only when no other
process of the gateway holds the directory, and then removes it. A gateway whose every process
was killed leaves its directory with the lock free: the next gateway to start removes it
(``reclaim_stale``), and so a directory made before the lock file was, once nothing of its gateway
is left: unchanged for a while, and no process behind any of its sockets.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import tempfile
import time

LOCK = "gateway.lock"       # held by every process of the gateway the directory is of
PLACES = ((None, "switchyard-"), ("/tmp", "sy-"))      # (where, prefix) a run directory is made: None, the temp dir
# a run directory's name after its prefix: mkdtemp's 8 characters (another program's
# "switchyard-demo-batch-..." is not one), and the files a gateway keeps in it (a worker's sockets
# for its siblings and for the routing view's bus, its last reports, written aside then renamed)
NAME_TAIL = re.compile(r"[a-z0-9_]{8}")
RUN_FILE = re.compile(r"worker-\d+\.sock|w\d+\.sock|(?:status-\d+\.json|metrics-\d+\.prom)(?:\.tmp)?")
# a directory without a lock file (made by a version before it) is a dead gateway's when it has
# not changed for this long and no process is behind any of its sockets: a running gateway's
# workers rebind theirs at each restart, within seconds of its start
UNLOCKED_STALE_S = 600.0


class RunDirectory:
    """The directory; ``close`` removes it (idempotent)."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="switchyard-")
        if len(os.path.join(self.path, "worker-9999.sock")) >= 100:     # sun_path holds 108 bytes
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = tempfile.mkdtemp(prefix="sy-", dir="/tmp")
        self._lock: int | None = None
        try:
            self._lock = _hold(self.path)
        except OSError:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._let_go()

    def close_if_last(self) -> None:
        """Remove the directory if no other process of the gateway holds it any more: this one lets
        go of the lock's descriptor it inherited, then tries the lock on a descriptor of its own,
        which it gets only once every other holder has ended (a worker's last reports, which the
        parent would have removed, go with it)."""
        self._let_go()
        fd = _take(self.path)
        if fd is not None:
            try:
                shutil.rmtree(self.path, ignore_errors=True)
            finally:
                os.close(fd)

    def _let_go(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock)
            self._lock = None


def _hold(path: str) -> int:
    """The lock file made and locked in ``path``, its descriptor returned: made under another name
    and renamed once locked, so that nothing finds it unlocked while its gateway starts."""
    final = os.path.join(path, LOCK)
    fresh = final + ".new"
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(fresh, final)
    except OSError:
        os.close(fd)
        raise
    return fd


def _take(path: str) -> int | None:
    """The lock of the run directory ``path`` on a descriptor of this call's, when no process holds
    it: then no process of its gateway lives. None when one does, or there is no lock file (a
    directory being made, or made before the lock was)."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def reclaim_stale() -> list[str]:
    """Remove the run directories, this user's, of gateways none of whose processes lives any more
    (all killed outright, the last without a chance to remove it); a running gateway's directory
    is held by its lock. One without a lock file, as versions before the lock made them, is
    removed when it has not changed for ``UNLOCKED_STALE_S``, holds only a run directory's files,
    and none of its sockets has a process behind it; else (and any other directory named alike)
    it is left alone. Returns the paths removed."""
    removed = []
    uid = os.getuid()
    for where, prefix in PLACES:
        base = tempfile.gettempdir() if where is None else where
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            if not name.startswith(prefix):
                continue
            path = os.path.join(base, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            if not os.path.lexists(os.path.join(path, LOCK)) and not os.path.lexists(os.path.join(path, LOCK + ".new")):
                if NAME_TAIL.fullmatch(name[len(prefix):]) and _unlocked_stale(path, st):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
                continue
            fd = _take(path)
            if fd is None:
                continue
            try:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)
            removed.append(path)
    return removed


def _unlocked_stale(path: str, st: os.stat_result, now: float | None = None) -> bool:
    """Whether ``path``, a run directory without a lock file (made by a version before it), is a
    gateway's that no longer runs: unchanged for ``UNLOCKED_STALE_S``, holding nothing but a run
    directory's files, a socket among them, and none of its sockets with a process behind it (a
    connect is refused)."""
    if (time.time() if now is None else now) - st.st_mtime < UNLOCKED_STALE_S:
        return False        # being made, or its workers bound their sockets a moment ago
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if not any(name.endswith(".sock") for name in names):
        return False        # nothing a gateway's worker made
    for name in names:
        if not RUN_FILE.fullmatch(name):
            return False
        try:
            mode = os.lstat(os.path.join(path, name)).st_mode
        except OSError:
            return False
        if name.endswith(".sock"):
            if not stat.S_ISSOCK(mode) or _socket_held(os.path.join(path, name)):
                return False
        elif not stat.S_ISREG(mode):
            return False
    return True


def _socket_held(path: str) -> bool:
    """Whether a process holds the Unix socket bound at ``path``: a connect to it is anything but
    refused (a stream socket's listener, or a datagram socket, which a stream connect finds of the
    wrong type). The connection, if made, is closed at once, unaccepted and without a byte."""
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_UNIX, kind) as s:
            s.setblocking(False)
            try:
                s.connect(path)
            except OSError as e:
                if e.errno == errno.EPROTOTYPE:
                    continue        # the other kind
                return e.errno != errno.ECONNREFUSED
            return True
    return True
