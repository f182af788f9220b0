"""The ``--workers`` run directory's lock: who removes the directory (gateway/server/rundir.py)."""

from __future__ import annotations

import os
import socket
import tempfile

from gateway.server.rundir import LOCK, UNLOCKED_STALE_S, RunDirectory, _take, _unlocked_stale, reclaim_stale


def _in_child(fn) -> int:
    """``fn()`` in a forked process (as a worker is forked, inheriting the lock): its exit code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_the_directory_is_held_while_a_process_of_its_gateway_lives():
    d = RunDirectory()
    try:
        assert sorted(os.listdir(d.path)) == [LOCK]         # locked before it was given its name
        assert _take(d.path) is None
        # a worker that stops while the parent (or a sibling) still holds it leaves the directory
        assert _in_child(lambda: (d.close_if_last(), 0)[1]) == 0
        assert os.path.isdir(d.path)
        assert _take(d.path) is None                        # and the holder still holds it
    finally:
        d.close()
    assert not os.path.exists(d.path)


def test_the_last_process_to_let_go_removes_it():
    d = RunDirectory()
    open(os.path.join(d.path, "worker-0.sock"), "w").close()      # a killed sibling's leftovers
    d._let_go()                 # the parent gone; this process is the last holder's stand-in
    d.close_if_last()
    assert not os.path.exists(d.path)


def test_a_start_removes_only_the_directories_no_process_holds():
    held = RunDirectory()
    dead = RunDirectory()
    dead._let_go()              # every process of its gateway gone
    unlocked = tempfile.mkdtemp(prefix="switchyard-")       # no lock file: not known to be a dead gateway's
    try:
        removed = reclaim_stale()
        assert dead.path in removed and not os.path.exists(dead.path)
        assert held.path not in removed and os.path.isdir(held.path)
        assert unlocked not in removed and os.path.isdir(unlocked)
    finally:
        held.close()
        dead.close()
        os.rmdir(unlocked)


def test_a_directory_without_a_lock_file_is_a_dead_gateway_s_only_by_its_sockets():
    """An older version's directory (no lock file) is stale when unchanged for long enough, holding
    only a run directory's files, a socket among them, none with a process behind it; an empty one,
    one whose socket name is a plain file, and one whose socket is held are not."""
    d = tempfile.mkdtemp(prefix="sy-", dir="/tmp")
    try:
        later = os.stat(d).st_mtime + UNLOCKED_STALE_S + 1
        assert not _unlocked_stale(d, os.stat(d), now=later)              # empty
        open(os.path.join(d, "worker-0.sock"), "w").close()
        assert not _unlocked_stale(d, os.stat(d), now=later)              # not a socket
        os.unlink(os.path.join(d, "worker-0.sock"))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bus:
            bus.bind(os.path.join(d, "w0.sock"))
            open(os.path.join(d, "status-0.json.tmp"), "w").close()
            assert not _unlocked_stale(d, os.stat(d), now=later)          # held
            assert not _unlocked_stale(d, os.stat(d), now=later - 2)      # and changed too lately
        assert _unlocked_stale(d, os.stat(d), now=later)                  # its process gone
        assert not _unlocked_stale(d, os.stat(d), now=os.stat(d).st_mtime + UNLOCKED_STALE_S - 1)
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)
