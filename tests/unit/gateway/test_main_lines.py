"""The one-line messages ``python -m gateway`` writes to stderr (a config error, a port it cannot
listen on) are each one whole write. With ``--workers N`` the parent and its workers share the one
stderr, a pipe to the container runtime: a line written in two parts (its text, then its newline,
as ``print`` does to an unbuffered stream) lets another process's log line land between them, and
the log collector reads ``switchyard: cannot listen on …{"event": …}`` as one garbled line."""

from __future__ import annotations

import io
import logging
import sys

import pytest
import structlog

from gateway.__main__ import main
from tests.support.writes import Writes


@pytest.fixture(autouse=True)
def logging_as_before():
    """``main`` configures structlog and the root logger to write to the stderr these tests
    replace: put back what was there, or the tests that run after in the same process log into a
    stream nobody reads (and a test reading its own log lines finds none)."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**config)
    root.handlers[:] = handlers
    root.setLevel(level)


def stderr_writes(monkeypatch, argv: list[str]) -> tuple[int, list[bytes]]:
    raw = Writes()
    # what Python makes of fd 2 when it is not a terminal: text over the file itself, each write passed on
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8",
                                                        write_through=True))
    code = main(argv)
    sys.stderr.flush()
    return code, raw.writes


def test_a_config_error_is_one_whole_write(monkeypatch, tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("models: [{name: m, engine: vllm, endpoints: ['http://127.0.0.1:9']}]\nnot_a_key: 1\n")
    code, writes = stderr_writes(monkeypatch, ["--config", str(cfg)])
    assert code == 2
    assert len(writes) == 1 and writes[0].startswith(b"switchyard: config error: ") and writes[0].endswith(b"\n"), writes


def test_workers_below_one_is_one_whole_write(monkeypatch, tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("models: [{name: m, engine: vllm, endpoints: ['http://127.0.0.1:9']}]\n")
    code, writes = stderr_writes(monkeypatch, ["--config", str(cfg), "--workers", "0"])
    assert code == 2
    assert writes == [b"switchyard: --workers must be >= 1\n"], writes
