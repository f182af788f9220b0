"""The request log line: rendered once, written off the loop, nothing lost at close, bounded."""

from __future__ import annotations

import asyncio
import io
import os

import orjson
import pytest

from gateway.observability.logs import PIPE_BUF, LineWriter, RequestLog, _chunks, resolve_format
from tests.support.writes import Writes

FIELDS = {"request_id": "r-1", "path": "/v1/chat/completions", "model": "m", "user": None, "status": 200,
          "stream": True, "ttft_ms": 1.5, "error": None}


def read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 65536):
        out += chunk
    return out


def test_auto_is_console_on_a_tty_and_json_otherwise():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert resolve_format("auto", Tty()) == "console"
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("json", Tty()) == "json"


def test_json_line_keeps_every_field_and_adds_time_and_level():
    r, w = os.pipe()
    log = RequestLog("json", writer=LineWriter(fd=w))
    log.emit(dict(FIELDS))
    log.close()
    os.close(w)
    line = read_all(r)
    os.close(r)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    data = orjson.loads(line)
    assert {k: data[k] for k in FIELDS} == FIELDS
    assert data["event"] == "request" and data["level"] == "info" and data["timestamp"].endswith("Z")


def test_console_line_is_one_readable_line():
    r, w = os.pipe()
    log = RequestLog("console", writer=LineWriter(fd=w))
    log.emit(dict(FIELDS))
    log.close()
    os.close(w)
    line = read_all(r).decode()
    os.close(r)
    assert line.count("\n") == 1 and " request " in line and "request_id=r-1" in line and "ttft_ms=1.5" in line


def test_warning_level_writes_no_request_line_but_tests_can_still_capture():
    r, w = os.pipe()
    log = RequestLog("json", "warning", writer=LineWriter(fd=w))
    with log.capture() as seen:
        log.emit(dict(FIELDS))
    log.close()
    os.close(w)
    assert read_all(r) == b"" and seen[0]["request_id"] == "r-1"
    os.close(r)


async def test_lines_leave_the_loop_in_order_and_all_of_them_at_close():
    r, w = os.pipe()
    os.set_blocking(r, False)
    writer = LineWriter(fd=w, interval_s=0.01)
    log = RequestLog("json", writer=writer)
    for i in range(2000):
        log.emit({**FIELDS, "request_id": f"r-{i}"})
    got = b""
    for _ in range(200):                  # the timer hands them to the thread; read as they come
        await asyncio.sleep(0.01)
        try:
            got += os.read(r, 1 << 20)
        except BlockingIOError:
            pass
    log.close()
    os.close(w)
    os.set_blocking(r, True)
    got += read_all(r)
    os.close(r)
    ids = [orjson.loads(x)["request_id"] for x in got.splitlines()]
    assert ids == [f"r-{i}" for i in range(2000)]


def test_writes_are_cut_at_line_ends_within_pipe_buf():
    lines = [(b"x" * n) + b"\n" for n in (10, 3000, 2000, 5000, 1, 4095)]
    chunks = [bytes(c) for c in _chunks(b"".join(lines), PIPE_BUF)]
    assert b"".join(chunks) == b"".join(lines)
    for c in chunks:
        assert c.endswith(b"\n")
        assert len(c) <= PIPE_BUF or c.count(b"\n") == 1     # only a line longer than PIPE_BUF goes alone


@pytest.mark.parametrize("sizes", [(4096,), (4095, 1), (4096, 4096), (1, 9000, 1), (2048, 2048, 2048)])
def test_chunks_at_the_limit_and_beyond(sizes):
    buf = bytearray(b"".join((b"z" * (n - 1)) + b"\n" for n in sizes))
    chunks = [bytes(c) for c in _chunks(buf, 4096)]
    assert b"".join(chunks) == buf
    assert all(c.endswith(b"\n") and (len(c) <= 4096 or c.count(b"\n") == 1) for c in chunks)


def test_a_stalled_reader_bounds_the_buffer_and_counts_what_it_drops():
    import threading

    r, w = os.pipe()
    dropped = []
    writer = LineWriter(fd=w, max_pending_bytes=100_000, on_drop=dropped.append)
    line = b"y" * 999 + b"\n"
    for _ in range(1000):                  # 1 MB into a pipe nobody reads (it holds 64 KB)
        writer.write(line)
    assert writer.dropped > 0 and writer.dropped == len(dropped)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(read_all(r)))
    reader.start()                        # the reader wakes up: what was kept is written, in full lines
    writer.close(timeout=5)
    os.close(w)
    reader.join(5)
    os.close(r)
    assert len(got[0]) == (1000 - writer.dropped) * 1000 and got[0].endswith(b"\n")


def test_a_pipe_is_written_within_pipe_buf_and_a_regular_file_a_batch_at_once(tmp_path):
    r, w = os.pipe()
    f = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT)
    try:
        assert LineWriter(fd=w)._chunk_limit() == PIPE_BUF
        assert LineWriter(fd=f)._chunk_limit() > 16 << 20      # any batch the bound lets through
    finally:
        for fd in (r, w, f):
            os.close(fd)


def test_writers_sharing_a_regular_file_keep_every_line_whole(tmp_path):
    # two workers' writers on one inherited stderr (one open file, as a fork shares it), each
    # writing its batches in one write from its own thread
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    fd2 = os.dup(fd)
    writers = [LineWriter(fd=fd), LineWriter(fd=fd2)]
    for i in range(3000):
        for k, wr in enumerate(writers):
            wr._buf += b'{"worker":%d,"i":%d,"pad":"%s"}\n' % (k, i, b"p" * (i % 700))
            if i % 97 == 0:
                wr.flush()
    for wr in writers:
        wr.close()
    os.close(fd)
    os.close(fd2)
    lines = path.read_bytes().splitlines()
    got = [orjson.loads(x) for x in lines]
    for k in (0, 1):
        assert [g["i"] for g in got if g["worker"] == k] == list(range(3000))


def test_what_is_pending_counts_the_buffer_and_the_unwritten_batches():
    r, w = os.pipe()
    writer = LineWriter(fd=w, max_pending_bytes=10_000)
    writer._buf += b"a" * 99 + b"\n"
    assert writer._pending == 100
    writer.flush()                          # handed to the thread; the pipe takes it
    writer.close(timeout=5)
    assert writer._pending == 0
    os.close(w)
    assert read_all(r) == b"a" * 99 + b"\n"
    os.close(r)


def test_each_gateway_line_is_one_write_on_an_unbuffered_stderr(monkeypatch):
    """With PYTHONUNBUFFERED (as container images often set) stderr writes through to its file at
    every call: a line and its newline written apart let another worker's line in between, two
    JSON objects on one line. Each line goes out in one write."""
    import logging

    import structlog

    from gateway.observability.logs import configure_logging

    raw = Writes()
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr("sys.stderr", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    try:
        configure_logging("json", "info")
        log = structlog.get_logger("test")
        log.warning("second signal: stopping now", in_flight=2)
        log.info("another line")
    finally:
        structlog.configure(**saved)
        root.handlers[:] = handlers        # the standard library's logging as it was (configure_logging
        root.setLevel(level)               # adds a handler to the root logger and captures warnings)
        logging.captureWarnings(False)
    assert len(raw.writes) == 2
    assert all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in raw.writes)
    assert orjson.loads(raw.writes[0])["event"] == "second signal: stopping now"


LONG = {**FIELDS, "status": 404, "user": "\x01" * 1024 + "… (3000 characters)", "model": "é" * 1024,
        "finish_reasons": ["length"] * 2000}


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_line_too_long_for_a_pipe_is_cut_to_fit_and_says_what_was_cut(fmt):
    r, w = os.pipe()
    log = RequestLog(fmt, writer=LineWriter(fd=w))
    log.emit(dict(LONG))
    log.close()
    os.close(w)
    line = read_all(r)
    os.close(r)
    assert line.count(b"\n") == 1 and len(line) <= PIPE_BUF        # one write, kept whole by the pipe
    if fmt == "console":
        assert b"line_cut=" in line and b"request_id=r-1" in line
        return
    data = orjson.loads(line)
    assert set(data["line_cut"]) == {"user", "model", "finish_reasons"}
    assert data["user"].startswith("\x01") and data["user"].endswith("… (3000 characters)")
    assert data["model"].startswith("é") and data["model"].endswith("… (1024 characters)")
    assert 0 < len(data["finish_reasons"]) < 2000 and set(data["finish_reasons"]) == {"length"}
    assert {k: data[k] for k in ("request_id", "path", "status", "stream", "ttft_ms")} == {
        k: LONG[k] for k in ("request_id", "path", "status", "stream", "ttft_ms")}


def test_a_long_line_to_a_regular_file_is_written_whole(tmp_path):
    with open(tmp_path / "log", "wb") as f:
        log = RequestLog("json", writer=LineWriter(fd=f.fileno()))
        log.emit(dict(LONG))
        log.close()
    data = orjson.loads((tmp_path / "log").read_bytes())
    assert "line_cut" not in data and data["user"] == LONG["user"] and data["finish_reasons"] == LONG["finish_reasons"]


# a gateway line with a traceback many frames deep, and a long value: what a worker writes when a
# handler fails far down (the process's own structlog configuration, its stderr a pipe or a file)
TRACEBACK_SCRIPT = r"""
import structlog
from gateway.observability.logs import configure_logging
configure_logging("json", "info")
log = structlog.get_logger("test")
src = "".join(f"def down{i}():\n    down{i + 1}()\n" for i in range(200))
exec(compile(src + "def down200():\n    raise ValueError('the innermost failure')\n", "handlers.py", "exec"))
try:
    down0()
except ValueError:
    log.exception("handler failed", detail="d" * 6000, worker=1)
log.info("next line")
"""


def _run_logging(stderr) -> None:
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-c", TRACEBACK_SCRIPT], stderr=stderr, env=env, timeout=60, check=True)


def test_a_gateway_line_with_a_long_traceback_fits_a_pipe_and_keeps_the_failure():
    """Worker processes share one stderr pipe, and a pipe keeps a write whole only up to PIPE_BUF
    bytes: a JSON line with a traceback longer than that could have another worker's line land
    inside it, two broken objects for the log collector. To a pipe the line is cut to fit (the
    traceback keeps its end: the innermost frames and the exception), and says what was cut."""
    r, w = os.pipe()
    proc_err = os.fdopen(w, "wb")
    try:
        _run_logging(proc_err)
    finally:
        proc_err.close()
    out = read_all(r)
    os.close(r)
    lines = out.splitlines(keepends=True)
    assert len(lines) == 2 and all(len(line) <= PIPE_BUF for line in lines)
    first = orjson.loads(lines[0])
    assert first["event"] == "handler failed" and first["worker"] == 1 and first["level"] == "error"
    assert set(first["line_cut"]) == {"exception", "detail"}
    assert first["exception"].rstrip().endswith("ValueError: the innermost failure")
    assert first["exception"].startswith("… (") and "characters)" in first["exception"]
    assert first["detail"].startswith("d") and first["detail"].endswith("… (6000 characters)")
    assert orjson.loads(lines[1])["event"] == "next line"


def test_a_gateway_line_with_a_long_traceback_is_whole_in_a_regular_file(tmp_path):
    with open(tmp_path / "err", "wb") as f:
        _run_logging(f)
    lines = (tmp_path / "err").read_bytes().splitlines()
    first = orjson.loads(lines[0])
    assert "line_cut" not in first and first["detail"] == "d" * 6000
    assert first["exception"].count(", in down") == 201


STDLIB_SCRIPT = r"""
import asyncio, logging
from gateway.observability.logs import configure_logging
configure_logging("json", "info")
logging.getLogger("switchyard.tracing").warning("exporter refused %d spans", 3)

async def main():
    async def fails():
        raise RuntimeError("a task nobody awaited")
    asyncio.get_running_loop().call_soon(lambda: 1 / 0)    # a callback that raises: asyncio logs it
    await asyncio.sleep(0.01)
    t = asyncio.ensure_future(fails())
    await asyncio.sleep(0.01)
    del t

asyncio.run(main())
import gc; gc.collect()
"""


def test_lines_of_the_standard_library_s_loggers_are_json_lines_too():
    """asyncio (a callback that raised), the tracing exporter and other libraries log through the
    standard library's logging: with JSON logs their lines are JSON lines too, one per record
    (traceback inside), not bare multi-line text that breaks the collector's parsing."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", STDLIB_SCRIPT], stderr=subprocess.PIPE, env=env,
                         timeout=60, check=True).stderr
    lines = [orjson.loads(line) for line in out.splitlines()]
    assert lines[0]["event"] == "exporter refused 3 spans" and lines[0]["level"] == "warning"
    assert lines[0]["logger"] == "switchyard.tracing" and lines[0]["timestamp"]
    callback = next(x for x in lines if "ZeroDivisionError" in x.get("exception", ""))
    assert callback["level"] == "error" and callback["logger"] == "asyncio"
    task = next(x for x in lines if "a task nobody awaited" in x.get("exception", ""))
    assert task["level"] == "error"


WARNINGS_SCRIPT = r"""
import warnings
from gateway.observability.logs import configure_logging
configure_logging("json", "info")
warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)
warnings.warn("something odd", RuntimeWarning)
"""


def test_pythons_warnings_are_json_lines_too():
    """A library's ``warnings.warn`` (a deprecation, a resource warning) was printed by Python's
    own hook as two bare lines, the warning and its source line, in the middle of a JSON log."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PYTHONWARNINGS": "default"}
    out = subprocess.run([sys.executable, "-c", WARNINGS_SCRIPT], stderr=subprocess.PIPE, env=env,
                         timeout=60, check=True).stderr
    lines = [orjson.loads(line) for line in out.splitlines()]
    assert [x["level"] for x in lines] == ["warning", "warning"] and lines[0]["logger"] == "py.warnings"
    assert "DeprecationWarning: a library's deprecation" in lines[0]["event"]
    assert "RuntimeWarning: something odd" in lines[1]["event"]
