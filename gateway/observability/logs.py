"""Logging: the one line per request, cheap, and everything else through structlog.

The request line is what users rely on, and at high request rates its cost is the gateway's
largest after the sockets, so it skips structlog's processor chain: ``RequestLog.emit`` renders
the record's fields once (orjson for JSON, a plain formatter for the console) and hands the bytes
to a ``LineWriter``. The writer never blocks the event loop: lines collect in a buffer that a
short timer hands to one writer thread, which writes them to stderr: to a pipe (a container's
stderr) in chunks no larger than ``PIPE_BUF`` cut at line ends, so worker processes sharing it never
interleave inside a line; to a regular file in one write a batch (Linux keeps the file position
locked across a write, so the workers' batches do not interleave either). A pipe keeps a write whole
only up to ``PIPE_BUF`` bytes (a longer one waits for room part of the way, and another process's
lines land inside it), so to a pipe a request line longer than that (a client's strings of many
bytes each, a batch of thousands of prompts' ``finish_reasons``) has its longest values cut until it
fits (``RequestLog._fit``): a string keeps its start and says its length, a list its first
elements, and ``line_cut`` names them. The request path takes
no lock: what is pending is counted by the loop's thread and the writer's, each its own counter.
The buffer is one ``bytearray`` the lines are copied into: orjson's output keeps its whole working
buffer (4 KB or more for a 400-byte line), so holding the lines themselves through a burst of
requests ending at once (10,000 idle streams whose clients leave) would hold tens of MB.
``close`` flushes and waits for the thread, so a drain at SIGTERM loses nothing. If stderr stops
draining, the buffer is bounded: lines past the bound are counted and dropped, not queued forever.

Formats: ``json`` for machines, ``console`` for people at a terminal, ``auto`` (the default):
console when stderr is a TTY, JSON otherwise (as in containers).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import logging
import os
import queue
import re
import select
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import structlog

from gateway.errors import printable

PIPE_BUF = getattr(select, "PIPE_BUF", 4096)


def resolve_format(fmt: str, stream: Any = None) -> str:
    if fmt != "auto":
        return fmt
    stream = stream if stream is not None else sys.stderr
    try:
        return "console" if stream.isatty() else "json"
    except (AttributeError, ValueError):
        return "json"


def _dumps(obj, **_kw) -> str:
    return orjson.dumps(obj, default=str).decode()


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    """structlog for the gateway's other lines (startup, warnings): rare, so its processors are fine."""
    fmt = resolve_format(fmt)
    lvl = getattr(logging, level.upper(), logging.INFO)
    # JSON lines too long for a pipe are cut to fit, as request lines are (see the module doc)
    renderer = (_FitJSON(_write_limit(sys.stderr)) if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (with its newline): on an unbuffered stderr (PYTHONUNBUFFERED) print's
        # two writes let another worker's line in between them
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # the standard library's loggers (asyncio's failed callbacks and tasks, the tracing exporter,
    # aiohttp) in the same format, one write a record: warnings and above (all of them at debug)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                           structlog.processors.TimeStamper(fmt="iso", utc=True),
                           structlog.processors.format_exc_info]))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_switchyard", False)]:
        root.removeHandler(old)
    handler._switchyard = True             # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(lvl if lvl <= logging.DEBUG else max(lvl, logging.WARNING))
    logging.captureWarnings(True)          # warnings.warn's too (logger py.warnings), not Python's bare print


class _Clock:
    """ISO-8601 UTC timestamps, the seconds part formatted once per second."""

    __slots__ = ("_second", "_iso", "_console")

    def __init__(self) -> None:
        self._second = -1
        self._iso = self._console = ""

    def stamps(self) -> tuple[str, str]:
        t = time.time()
        s = int(t)
        if s != self._second:
            self._second = s
            tm = time.gmtime(s)
            self._iso = time.strftime("%Y-%m-%dT%H:%M:%S", tm)
            self._console = time.strftime("%Y-%m-%d %H:%M:%S", tm)
        return f"{self._iso}.{int((t - s) * 1e6):06d}Z", self._console


class LineWriter:
    """Bytes out to a file descriptor from a thread, handed over by a timer (see module doc)."""

    def __init__(self, fd: int = 2, interval_s: float = 0.05, max_pending_bytes: int = 16 << 20,
                 on_drop: Callable[[int], None] | None = None) -> None:
        self.fd = fd
        self.interval_s = interval_s
        self.max_pending_bytes = max_pending_bytes
        self.on_drop = on_drop
        self.dropped = 0
        self._buf = bytearray()
        # bytes handed to the thread, and bytes it wrote: each is written by one thread only (the
        # loop's, the writer's), so what is pending needs no lock on the request path
        self._queued = 0
        self._written = 0
        self._chunk = 0                    # the largest write (see _chunk_limit); 0: not known yet
        self._timer: asyncio.TimerHandle | None = None
        self._queue: queue.SimpleQueue[bytearray | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def _pending(self) -> int:
        """Bytes buffered or queued and not yet written."""
        return len(self._buf) + self._queued - self._written

    def write(self, line: bytes) -> None:
        if self._pending > self.max_pending_bytes:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop(1)
            return
        self._buf += line                  # a copy: the caller's bytes are freed now (see module doc)
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:           # no loop (a script, a test): write through
                self.flush()
                return
            self._timer = loop.call_later(self.interval_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        batch, self._buf = self._buf, bytearray()
        self._queued += len(batch)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="switchyard-log", daemon=True)
            self._thread.start()
        self._queue.put(batch)

    def close(self, timeout: float = 5.0) -> None:
        """Flush everything and wait until it is written (shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        self._thread = None

    @property
    def line_limit(self) -> int | None:
        """The longest line a write keeps whole: ``PIPE_BUF`` where a longer write can be split by
        another process's (a pipe, a socket, a terminal); None to a regular file, where it is whole."""
        if not self._chunk:
            self._chunk = self._chunk_limit()
        return self._chunk if self._chunk <= PIPE_BUF else None

    def _chunk_limit(self) -> int:
        """The largest write: ``PIPE_BUF`` where only that much is written whole (a pipe, a socket,
        a terminal: a container's stderr), so worker processes sharing it never interleave inside
        a line; a batch in one write to a regular file, where a write is never interleaved with
        another process's on the same open file (Linux keeps the file position locked across it)."""
        try:
            regular = stat.S_ISREG(os.fstat(self.fd).st_mode)
        except OSError:
            regular = False
        return 1 << 30 if regular else PIPE_BUF

    def _run(self) -> None:
        if not self._chunk:
            self._chunk = self._chunk_limit()
        while (batch := self._queue.get()) is not None:
            for chunk in _chunks(batch, self._chunk):
                self._write_all(chunk)
                self._written += len(chunk)
            batch = chunk = None           # not held while the thread waits for the next batch

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except BlockingIOError:
                select.select([], [self.fd], [], 1.0)
                continue
            except OSError as e:           # stderr closed (EPIPE, EBADF): nothing more can be written
                if e.errno in (errno.EPIPE, errno.EBADF):
                    return
                raise
            view = view[n:]


def _chunks(buf: bytes | bytearray, limit: int) -> Iterator[memoryview]:
    """``buf`` (whole lines) in chunks of at most ``limit`` bytes, cut only at line ends (a longer
    line goes out alone)."""
    view = memoryview(buf)
    start, end = 0, len(buf)
    while start < end:
        stop = start + limit
        if stop >= end:
            cut = end
        else:
            cut = buf.rfind(b"\n", start, stop) + 1
            if cut <= start:               # one line longer than ``limit``
                cut = buf.find(b"\n", stop) + 1 or end
        yield view[start:cut]
        start = cut


def _console_text(text: str) -> str:
    """A string of a client's (a model name, a user, an error quoting them) as the console line can
    carry it: every character ``str.isprintable`` refuses (a line break, a carriage return, an
    escape sequence's ESC, a byte that was not UTF-8) written as Python writes it in a literal
    (``\\n``, ``\\x1b``, ``\\u2028``), so a client can neither add a line nor drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in printable(text))


# a console value written quoted: one a reader would not take whole as written bare (logfmt's rule)
_QUOTED = re.compile(r'[\s="\\]')


def _console_value(v: Any) -> str:
    """A field's value as the console line writes it: bare when it is plain (``200``, ``m``,
    ``/v1/chat/completions``, ``None``), else quoted as logfmt quotes it, ``"`` and ``\\`` escaped
    inside: one that is empty or holds a space, an ``=``, a quote, a backslash or a character that
    does not print (escaped later, see ``_console_text``). So a client's model name
    ``x status=200 user=admin`` stays one value of its own line, never fields of its own."""
    s = v if isinstance(v, str) else str(v)
    if s and s.isprintable() and _QUOTED.search(s) is None:
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _printable(v: Any) -> Any:
    """``v`` with every string as UTF-8 can carry it (gateway.errors.printable), at any depth."""
    if isinstance(v, str):
        return printable(v)
    if isinstance(v, dict):
        return {printable(str(k)): _printable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_printable(x) for x in v]
    return v


# the fields a line keeps whole however long it is (none of them is long)
_UNCUT = frozenset(("request_id", "event", "level", "timestamp", "status", "line_cut"))
_CUT_MARK = re.compile(r"… \((\d+) characters\)\Z")
_HEAD_MARK = re.compile(r"\A… \((\d+) characters\) ")
# the fields cut from their start, keeping their end: a traceback's last frames and its exception
_TAILS = frozenset(("exception",))


def _size(v: Any) -> int:
    """About the bytes ``v`` takes in a line (its JSON)."""
    if v is None or isinstance(v, bool | int | float):
        return 8
    try:
        return len(orjson.dumps(v, default=str))
    except TypeError:                      # lone surrogates
        return 6 * len(str(v))


def _shorter(v: Any, tail: bool = False) -> Any:
    """``v`` cut to about half (None: it cannot be): a string keeps its first half and ends with its
    whole length, as the line's cut fields do (``… (N characters)``, the length it had before any
    cut), or with ``tail`` (a traceback, whose end is the failure) keeps its last half and starts
    with that length; a list or an object keeps its first half."""
    if isinstance(v, str):
        if tail:
            mark = _HEAD_MARK.match(v)
            body, total = (v[mark.end():], int(mark.group(1))) if mark else (v, len(v))
            body = body[len(body) - len(body) // 2:]
            return f"… ({total} characters) {body}" if body else None
        mark = _CUT_MARK.search(v)
        head, total = (v[:mark.start()], int(mark.group(1))) if mark else (v, len(v))
        if not head:
            return None
        return f"{head[:len(head) // 2]}… ({total} characters)"
    if isinstance(v, list | tuple) and len(v) > 1:
        return list(v[:len(v) // 2])
    if isinstance(v, dict) and len(v) > 1:
        return dict(list(v.items())[:len(v) // 2])
    return None


def fit(fields: dict[str, Any], render: Callable[[dict[str, Any]], bytes], limit: int) -> bytes:
    """The line of ``fields`` (rendered by ``render``) in at most ``limit`` bytes, so that a pipe
    keeps it whole (see the module doc): the value that renders longest is cut, again and again (a
    string to half its characters, saying its whole length; a traceback to its last half; a list or
    an object to its first half), and ``line_cut`` names the fields cut. Only for a line that is too
    long: it renders the line again at every cut."""
    fields = dict(fields)
    cut: list[str] = []
    line = render(fields)
    for _ in range(64):
        if len(line) <= limit:
            break
        for key in sorted((k for k in fields if k not in _UNCUT), key=lambda k: -_size(fields[k])):
            shorter = _shorter(fields[key], tail=key in _TAILS)
            if shorter is not None:
                break
        else:
            break                          # nothing left to cut: written as it is
        fields[key] = shorter
        if key not in cut:
            cut.append(key)
        fields["line_cut"] = cut
        line = render(fields)
    return line


def _write_limit(stream: Any) -> int | None:
    """``PIPE_BUF`` when ``stream`` is not a regular file (a pipe, a socket, a terminal), where a
    longer write can be split by another process's; None for a regular file or a stream with no
    descriptor (see LineWriter.line_limit)."""
    try:
        return None if stat.S_ISREG(os.fstat(stream.fileno()).st_mode) else PIPE_BUF
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


class _FitJSON:
    """structlog's JSON renderer for the gateway's other lines, each cut to ``limit`` bytes (its
    newline included) like a request line when it is longer (a traceback many frames deep)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._render = structlog.processors.JSONRenderer(serializer=_dumps)

    def __call__(self, logger: Any, name: str, event_dict: dict[str, Any]) -> str:
        text = self._render(logger, name, event_dict)
        if self.limit is None or len(text) * 4 < self.limit or len(text.encode()) < self.limit:
            return text
        line = fit(event_dict, lambda f: self._render(logger, name, dict(f)).encode() + b"\n", self.limit)
        return line[:-1].decode()


class RequestLog:
    """The per-request line. ``emit`` takes the record's fields in their order."""

    def __init__(self, fmt: str = "auto", level: str = "info", writer: LineWriter | None = None) -> None:
        self.format = resolve_format(fmt)
        self.enabled = getattr(logging, level.upper(), logging.INFO) <= logging.INFO
        self.writer = writer if writer is not None else LineWriter()
        self._clock = _Clock()
        self._render = self._json if self.format == "json" else self._console
        self._captured: list[list[dict[str, Any]]] = []

    def emit(self, fields: dict[str, Any]) -> None:
        if self._captured:
            for sink in self._captured:
                sink.append({**fields, "event": "request", "log_level": "info"})
        if self.enabled:
            line = self._render(fields)
            if len(line) > PIPE_BUF and (limit := self.writer.line_limit) is not None and len(line) > limit:
                line = self._fit(fields, limit)
            self.writer.write(line)

    def _fit(self, fields: dict[str, Any], limit: int) -> bytes:
        """The line of ``fields`` in at most ``limit`` bytes (``fit``)."""
        return fit(fields, self._render, limit)

    def _json(self, fields: dict[str, Any]) -> bytes:
        iso, _ = self._clock.stamps()
        fields["event"] = "request"
        fields["level"] = "info"
        fields["timestamp"] = iso
        try:
            return orjson.dumps(fields, default=str, option=orjson.OPT_APPEND_NEWLINE)
        except TypeError:   # a client's bytes that are not UTF-8 (lone surrogates), in a field that quotes them
            return orjson.dumps(_printable(fields), default=str, option=orjson.OPT_APPEND_NEWLINE)

    def _console(self, fields: dict[str, Any]) -> bytes:
        _, stamp = self._clock.stamps()
        text = " ".join([f"{k}={_console_value(v)}" for k, v in sorted(fields.items())])
        if not text.isprintable():      # a client's control character (a newline in its `user`, its path)
            text = _console_text(text)
        return f"{stamp} [info     ] request                        {text}\n".encode("utf-8", "replace")

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[dict[str, Any]]]:
        """The lines emitted meanwhile, as dicts (tests)."""
        sink: list[dict[str, Any]] = []
        self._captured.append(sink)
        try:
            yield sink
        finally:
            self._captured.remove(sink)

    def close(self) -> None:
        self.writer.close()
