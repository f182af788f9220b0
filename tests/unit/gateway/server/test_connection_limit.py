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


def _raised_in_child(soft: int, hard: int, nr_open: str) -> tuple[str, tuple[int, int]]:
    """``raise_nofile_limit`` in a process started at (``soft``, ``hard``), with ``nr_open`` as
    the kernel's fs.nr_open: what it returned, and the limit it left."""
    import resource
    import subprocess
    import sys

    code = ("import resource, sys; from gateway.server.run import raise_nofile_limit; "
            "r = raise_nofile_limit(sys.argv[1]); print(repr(r)); "
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code, nr_open], capture_output=True, text=True, check=True, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))).stdout
    first, second = out.splitlines()
    a, b = second.split()
    return first, (int(a), int(b))


def test_the_soft_limit_is_raised_to_the_hard_one_within_what_the_kernel_allows(tmp_path):
    nr_open = tmp_path / "nr_open"
    nr_open.write_text("1048576\n")
    assert _raised_in_child(256, 4096, str(nr_open)) == (
        "NofileRaise(before=256, after=4096, hard=4096, error=None)", (4096, 4096))
    nr_open.write_text("1000\n")         # fs.nr_open under the hard limit bounds it
    assert _raised_in_child(256, 4096, str(nr_open)) == (
        "NofileRaise(before=256, after=1000, hard=4096, error=None)", (1000, 4096))
    assert _raised_in_child(256, 4096, str(tmp_path / "none")) == (     # not readable: the hard limit
        "NofileRaise(before=256, after=4096, hard=4096, error=None)", (4096, 4096))


def test_a_soft_limit_at_or_above_the_target_is_never_lowered(tmp_path):
    nr_open = tmp_path / "nr_open"
    nr_open.write_text("1000\n")
    assert _raised_in_child(2048, 4096, str(nr_open)) == ("None", (2048, 4096))
    assert _raised_in_child(4096, 4096, str(tmp_path / "none")) == ("None", (4096, 4096))
