"""A reload's wait for a config file written in place to be whole (``server.reload_settle_s``), and
its bound on a read that does not return (``server.reload_read_timeout_s``)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gateway.config.schema import ConfigError, ReadStopped, Settling, read_within


def test_a_file_left_alone_is_read_at_once_and_one_just_written_waits(tmp_path):
    f = tmp_path / "gw.yaml"
    f.write_text("models: []\n")
    old = time.time() - 120
    os.utime(f, (old, old))
    assert Settling(f, 60.0).wait_s() == 0.0
    deferred: list[str] = []
    f.write_text("models: [{name: m}]\n")
    s = Settling(f, 60.0, lambda: deferred.append("once"))
    assert 0 < s.wait_s() <= 60.0 and deferred == ["once"]
    with open(f, "a") as w:                 # changed during the wait: another
        w.write("# more\n")
    assert 0 < s.wait_s() <= 60.0 and deferred == ["once"]


def test_a_time_ahead_of_the_clock_is_read_once_unchanged_across_a_wait(tmp_path):
    f = tmp_path / "gw.yaml"
    f.write_text("models: []\n")
    ahead = time.time() + 3600
    os.utime(f, (ahead, ahead))
    s = Settling(f, 60.0)
    assert s.wait_s() == 60.0
    assert s.wait_s() == 0.0            # unchanged across the wait
    assert not s.changed()


def test_a_change_while_it_was_read_reads_it_again(tmp_path):
    f = tmp_path / "gw.yaml"
    f.write_text("models: []\n")
    old = time.time() - 120
    os.utime(f, (old, old))
    s = Settling(f, 60.0)
    assert s.wait_s() == 0.0
    with open(f, "a") as w:
        w.write("# more\n")
    assert s.changed() and s.waited
    assert s.wait_s() > 0


def test_a_file_that_keeps_changing_is_refused_and_no_regular_file_is_read_at_once(tmp_path):
    f = tmp_path / "gw.yaml"
    f.write_text("models: []\n")
    s = Settling(f, 2.0, limit_s=1.0)      # three times the settle time, the longer
    s.started -= 5.0                       # waited 5 s already: 2 s more is past the limit
    with pytest.raises(ConfigError, match=r"<file>: still being written: it changed within 2 s again and again "
                                          r"for 6 s, not read"):
        s.wait_s()
    os.mkfifo(tmp_path / "fifo")
    assert Settling(tmp_path / "fifo", 60.0).wait_s() == 0.0
    assert Settling(tmp_path / "missing", 60.0).wait_s() == 0.0       # the read says why
    assert Settling(f, 0.0).wait_s() == 0.0                           # off


def test_a_read_that_does_not_return_is_given_up_and_the_next_refused_until_it_returns(tmp_path):
    """A file on a hung mount blocks its read in the kernel, where nothing ends it (here a read
    that waits on an event it does not ask ``given_up`` of): it is refused after the limit, and
    while it has not returned another read is refused at once, not started in a thread of its own;
    a read that asks ``given_up`` in its waits (a FIFO's) ends when given up."""
    path = tmp_path / "gw.yaml"
    hung = threading.Event()
    with pytest.raises(ConfigError, match="did not return within 0.05 s") as e:
        read_within(lambda given_up: hung.wait(), 0.05, path)
    assert e.value.key_path == "<file>"
    with pytest.raises(ConfigError, match="an earlier read of the file has not returned"):
        read_within(lambda given_up: "text", 1.0, path)
    hung.set()
    ended = threading.Event()

    def polls(given_up) -> str:     # as read_config_file's wait for a FIFO's text
        while not given_up():
            time.sleep(0.001)
        ended.set()
        raise ReadStopped("<file>", "not read: stopped", str(path))

    for t in [t for t in threading.enumerate() if t.name == "config-read"]:     # the hung one, returned now
        t.join(5)
    with pytest.raises(ConfigError, match="did not return"):
        read_within(polls, 0.05, path)
    assert ended.is_set()

    def own_bound(given_up) -> str:     # one that ends once given up on with its own reason says it
        while not given_up():
            time.sleep(0.001)
        raise ConfigError("<file>", "not read: no text came in 0.01 s", str(path))

    with pytest.raises(ConfigError, match="no text came"):
        read_within(own_bound, 0.05, path)
    assert read_within(lambda given_up: "text", 1.0, path) == "text"
    assert read_within(lambda given_up: "no limit", 0.0, path) == "no limit"
    with pytest.raises(ValueError, match="raised"):
        read_within(lambda given_up: (_ for _ in ()).throw(ValueError("raised")), 1.0, path)
