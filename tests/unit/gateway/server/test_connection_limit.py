"""The client-connection cap a worker takes from its file-descriptor limit (gateway/server/run.py)."""

from __future__ import annotations

from gateway.server.run import FD_RESERVE, connection_limit


def test_without_a_file_descriptor_limit_the_config_s_cap_holds():
    assert connection_limit(10000, None, 30) == 10000
    assert connection_limit(0, None, 30) == 0


def test_a_limit_that_leaves_room_for_the_cap_and_its_engine_connections_changes_nothing():
    assert connection_limit(10000, 65536, 30) == 10000
    assert connection_limit(10000, 2 * 10000 + FD_RESERVE + 30, 30) == 10000


def test_a_low_limit_takes_half_of_what_it_leaves_free():
    assert connection_limit(10000, 256, 30) == (256 - 30 - FD_RESERVE) // 2
    assert connection_limit(10000, 1024, 30) == (1024 - 30 - FD_RESERVE) // 2
    assert connection_limit(0, 1024, 30) == (1024 - 30 - FD_RESERVE) // 2      # no cap configured: the share


def test_a_limit_already_spent_still_takes_one_connection():
    assert connection_limit(10000, 64, 60) == 1
