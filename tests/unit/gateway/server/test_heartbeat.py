"""The workers' heartbeats and the parent's watchdog (gateway/server/heartbeat.py)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from gateway.server.heartbeat import BEAT_S, Beat, Heartbeats, Told, Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Log(list):
    def __call__(self, event: str, level: str = "info", **fields) -> None:
        self.append((event, level, fields))


def watchdog(timeout=5.0, kill=None):
    """A watchdog over two slots with a fake clock; ``timeout`` a number or a callable, ``kill`` a
    stand-in for ``os.kill`` (by default one that records ``(pid, signal)``)."""
    beats, clock, killed, logged = Heartbeats(2), Clock(), [], Log()
    dog = Watchdog(beats, timeout if callable(timeout) else lambda: timeout, logged, clock=clock,
                   kill=kill or (lambda pid, sig: killed.append((pid, sig))))
    return beats, clock, dog, killed, logged


def test_a_worker_that_stops_ticking_is_killed_once_and_reported_stalled():
    beats, clock, dog, killed, logged = watchdog()
    dog.spawning(0)
    dog.spawned(1000, 0)
    beats.tick(0)
    dog.check()                                  # ticked: past its start-up
    clock.now += 4.9
    dog.check()
    assert killed == []
    clock.now += 0.2
    dog.check()
    assert killed == [(1000, signal.SIGKILL)]
    assert logged == [("worker's event loop stalled; killing it", "error",
                       {"worker": 0, "pid": 1000, "stalled_s": 5.1, "worker_stall_timeout_s": 5.0})]
    clock.now += 10
    dog.check()                                  # not killed twice
    assert len(killed) == 1
    assert dog.gone(1000) == ("stalled", True)


def test_ticks_keep_a_worker_alive_and_start_up_is_not_judged():
    beats, clock, dog, killed, _ = watchdog()
    dog.spawning(1)
    dog.spawned(2000, 1)
    clock.now += 60                              # no tick yet: still starting
    dog.check()
    assert killed == []
    for _ in range(20):
        beats.tick(1)
        clock.now += 3
        dog.check()
    assert killed == []
    assert dog.gone(2000) == ("exited", True)
    assert dog.gone(2000) == ("exited", True)    # unknown pid


def test_timeout_zero_never_kills_and_the_timeout_is_read_at_each_check():
    timeout = [0.0]
    beats, clock, dog, killed, _ = watchdog(lambda: timeout[0])
    dog.spawning(0)
    dog.spawned(7, 0)
    beats.tick(0)
    dog.check()
    clock.now += 1000
    dog.check()
    assert killed == []
    timeout[0] = 3.0
    dog.check()
    assert killed == [(7, signal.SIGKILL)]


def test_a_restarted_worker_starts_from_no_tick():
    beats, clock, dog, killed, _ = watchdog()
    dog.spawning(0)
    dog.spawned(1, 0)
    beats.tick(0)
    dog.check()
    dog.gone(1)
    dog.spawning(0)                               # its successor, same slot
    assert beats.ticks(0) == 0
    dog.spawned(2, 0)
    clock.now += 60
    dog.check()
    assert killed == []


def test_a_vanished_pid_is_not_an_error():
    def gone(pid, sig):
        raise ProcessLookupError

    beats, clock, dog, _, _ = watchdog(2.0, kill=gone)
    dog.spawning(0)
    dog.spawned(5, 0)
    beats.tick(0)
    dog.check()
    clock.now += 3
    dog.check()
    assert dog.gone(5) == ("stalled", True)


def test_restart_counts_by_reason():
    beats = Heartbeats(3)
    assert beats.restarts() == {"exited": 0, "stalled": 0}
    beats.restarted("stalled")
    beats.restarted("exited")
    beats.restarted("stalled")
    assert beats.restarts() == {"exited": 1, "stalled": 2}
    with pytest.raises(ValueError):
        beats.restarted("bored")


def test_the_siblings_that_serve_have_applied_a_told_reload_once_each_noted_it_or_a_later_one():
    beats = Heartbeats(3)
    for index in range(3):
        beats.applied(index, 0)             # each worker, at its start: the reloads told before its fork
    beats.tick(0)
    beats.tick(1)                           # worker 2 is still starting: left out
    assert not beats.applied_by_siblings(0, 1)
    beats.applied(1, 1)
    assert beats.applied_by_siblings(0, 1) and not beats.applied_by_siblings(1, 1)
    beats.applied(0, 2)                     # one SIGHUP for two told reloads: the later one covers both
    assert beats.applied_by_siblings(1, 1)
    beats.applied(1, (1 << 24) + 3)         # the told number wraps as the slot holds it
    assert beats.applied_by_siblings(0, 3) and not beats.applied_by_siblings(0, 4)


def test_a_worker_gone_is_not_waited_for_by_its_siblings_until_it_is_started_again():
    """A worker that exited (or was killed) serves nothing until the parent starts it again, a
    second or more later, on the config the parent read last: a sibling asked POST /admin/reload
    does not wait for its note meanwhile."""
    beats, _clock, dog, _killed, _ = watchdog()
    for index, pid in ((0, 1000), (1, 1001)):
        dog.spawning(index)
        dog.spawned(pid, index)
        beats.applied(index, 0)
        beats.tick(index)
    dog.check()
    assert not beats.applied_by_siblings(0, 1)
    assert dog.gone(1001) == ("exited", True)
    assert beats.applied_by_siblings(0, 1)


def test_a_forked_child_ticks_where_the_parent_reads():
    beats = Heartbeats(2)
    pid = os.fork()
    if pid == 0:                                  # the child: tick slot 1 three times, then go
        try:
            for _ in range(3):
                beats.tick(1)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert beats.ticks(1) == 3 and beats.ticks(0) == 0


async def test_the_beat_ticks_from_the_event_loop_until_stopped():
    beats = Heartbeats(1)
    beat = Beat(beats, 0)
    beat.start()
    assert beats.ticks(0) == 1                    # at once, then every BEAT_S
    await asyncio.sleep(BEAT_S * 2.5)
    assert beats.ticks(0) >= 2
    beat.stop()
    seen = beats.ticks(0)
    await asyncio.sleep(BEAT_S * 1.5)
    assert beats.ticks(0) == seen


@pytest.mark.parametrize("value,ok", [(0, True), (2, True), (20.5, True), (1, False), (0.5, False), (-1, False)])
def test_the_stall_timeout_is_zero_or_at_least_two_seconds(value, ok):
    from gateway.config.schema import ConfigError, config_from_dict

    raw = {"server": {"worker_stall_timeout_s": value},
           "models": [{"name": "m", "engine": "vllm", "endpoints": ["http://127.0.0.1:1"]}]}
    if ok:
        assert config_from_dict(raw).server.worker_stall_timeout_s == value
    else:
        with pytest.raises(ConfigError, match="server.worker_stall_timeout_s"):
            config_from_dict(raw)


def test_the_watchdog_knows_whether_a_worker_and_the_gateway_got_past_start_up():
    beats, clock, dog, _, _ = watchdog()
    dog.spawning(0)
    dog.spawned(1, 0)
    dog.spawning(1)
    dog.spawned(2, 1)
    dog.check()
    assert dog.gone(1) == ("exited", False) and not dog.served      # ended before its first tick
    beats.tick(1)                                # ticked after the last poll, then ended
    assert dog.gone(2) == ("exited", True) and dog.served


def test_a_stop_signal_reaching_a_worker_twice_is_one_and_the_parents_second_stops_at_once():
    from gateway.server.run import second_signal
    from gateway.server.workers import WorkerInfo
    beats = Heartbeats(2)
    worker = WorkerInfo(0, 2, "/nonexistent", beats)
    beats.stopping()                                # the parent got Ctrl-C, and passes it on
    assert beats.stops() == 1 and beats.restarts() == {"exited": 0, "stalled": 0}
    assert not second_signal(2, worker)             # the terminal's copy and the parent's: one stop
    beats.stopping()                                # a second Ctrl-C
    assert second_signal(3, worker)
    alone = WorkerInfo(1, 2, "/nonexistent", Heartbeats(2))
    assert second_signal(2, alone)                  # signalled itself twice, the parent never
    assert second_signal(2, None)                   # one process


def test_a_reload_a_worker_asked_for_is_admin_in_every_worker_and_a_bare_sighup_is_signal():
    beats = Heartbeats(2)
    assert beats.last_told() == Told(0, "signal", 1)                            # none yet
    assert beats.note_trigger() == "signal"                                     # kill -HUP
    beats.asked_reload(1)                                                       # POST /admin/reload on worker 1
    assert beats.note_trigger() == "admin"
    assert beats.note_trigger() == "signal"
    beats.asked_reload(0)
    beats.asked_reload(1)           # two asks before the parent's handler ran: one reload
    assert beats.note_trigger() == "admin"
    assert beats.note_trigger() == "signal"
    assert [beats.ticks(i) for i in range(2)] == [0, 0] and beats.generation() == 1 and beats.stops() == 0


def test_each_reload_the_parent_tells_of_carries_its_own_trigger_and_generation():
    """The parent tells the workers of a reload once it applied it, with its trigger: a reload
    noted next does not change what a worker reads of the one before until it is told too."""
    beats = Heartbeats(2)
    beats.reloaded(2)
    beats.told(beats.note_trigger())
    assert beats.last_told() == Told(1, "signal", 2)
    beats.asked_reload(0)
    assert beats.note_trigger() == "admin"          # noted, being applied: the workers read the last told
    assert beats.last_told() == Told(1, "signal", 2)
    beats.told("admin")                             # refused: the generation stays
    assert beats.last_told() == Told(2, "admin", 2) and beats.told_count == 2


def test_an_ask_is_answered_only_by_a_told_reload_the_parent_began_after_it():
    """The parent notes each worker's count of asks when it begins a reload and tells it with that
    reload: a reload it began before an ask (whose SIGHUP reached the worker after the ask) does
    not answer it; the one it began next does, and so does any later one."""
    beats = Heartbeats(2)
    trigger = beats.note_trigger()                  # a SIGHUP: the parent begins a reload
    ask = beats.asked_reload(1)                     # meanwhile, POST /admin/reload on worker 1
    assert ask == 1
    beats.reloaded(2)
    beats.told(trigger)
    told = beats.last_told(1)
    assert told == Told(1, "signal", 2, 0) and not told.after(ask)
    assert beats.last_told(0).asks == 0 and beats.last_told().asks is None
    beats.reloaded(3)
    beats.told(beats.note_trigger())                # the reload the ask's SIGHUP began
    told = beats.last_told(1)
    assert told == Told(2, "admin", 3, 1) and told.after(ask)
    assert not told.after(beats.asked_reload(1))    # a second ask: the next one answers it
    beats.note_trigger()
    # told slot read, then the parent writes the next reload's asks before telling it: not known
    beats._slots[beats._after + 1] = 3 << 40 | 2
    assert beats.last_told(1) == Told(2, "admin", 3, None) and not beats.last_told(1).after(1)
    beats.told("admin")
    assert beats.last_told(1) == Told(3, "admin", 3, 2) and beats.last_told(1).after(2)


def test_an_ask_count_that_wraps_is_still_after_its_ask():
    told = Told(5, "admin", 2, 3)
    assert told.after((1 << 40) - 2) and told.after(3) and not told.after(4)
