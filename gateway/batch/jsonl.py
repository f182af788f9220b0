"""Batch input files: the checks an upload passes, and reading its lines back in chunks.

A line is ``{"custom_id": str, "method": "POST", "url": one of ENDPOINTS, "body": {...}}``. What a
file says of itself is checked while it is uploaded (``LineCheck``): UTF-8, one JSON object per
line, those four fields, ``custom_id`` unique, the line and line-count limits; a failure is a 400
naming the line, and nothing is stored. What depends on the batch (each line's ``url`` equals the
batch's ``endpoint``) is checked when the batch is validated (``validate``); it fails the batch
with ``errors.data`` naming the line, as OpenAI does; the batch's ``model`` is read then too. Blank lines are skipped, passed
over in bulk (a file of millions of them costs what scanning its bytes costs); line numbers are the
file's own, from 1. A UTF-8 byte order mark opening the file (Windows tools write one) is
not part of its first line; anywhere else it is a line's bytes, so not JSON.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import orjson

from gateway.batch.files import open_stored
from gateway.request import may_hold_wide_ints

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID = 512
BOM = b"\xef\xbb\xbf"
CHUNK_LINES = 256
READ_BLOCK = 64 * 1024              # the first read of ``read_chunk``, doubled at each next one
MAX_READ_BLOCK = 4 * 1024 * 1024
_CONTENT = re.compile(rb"[^ \t\n\r\x0b\x0c]")   # a byte that makes its line not blank: any bytes.strip() keeps


class LineError(Exception):
    """A line that cannot be run: its number (from 1), a code, a message and the offending field."""

    def __init__(self, line: int, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.line, self.message, self.code, self.param = line, message, code, param

    def error(self) -> dict:
        """As an item of a batch's ``errors.data``."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def parse_line(raw: bytes, line_no: int) -> dict:
    """One line's request, or ``LineError``."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LineError(line_no, f"line {line_no} is not UTF-8", "invalid_encoding") from None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise LineError(line_no, f"line {line_no} is not valid JSON", "invalid_json") from None
    if not isinstance(obj, dict):
        raise LineError(line_no, f"line {line_no} is not a JSON object", "invalid_json")
    cid = obj.get("custom_id")
    if not isinstance(cid, str):
        if "custom_id" not in obj:
            raise LineError(line_no, f"line {line_no}: Missing required parameter: 'custom_id'.",
                            "missing_required_parameter", "custom_id")
        raise LineError(line_no, f"line {line_no}: Invalid type for 'custom_id': expected a string, but got "
                                 f"{json_type(cid)} instead.", "invalid_type", "custom_id")
    if not cid:         # an empty id names no line: as good as none
        raise LineError(line_no, f"line {line_no}: Missing required parameter: 'custom_id'.",
                        "missing_required_parameter", "custom_id")
    if len(cid) > MAX_CUSTOM_ID:        # OpenAI names no limit; the gateway keeps each id with its answer
        raise LineError(line_no, f"line {line_no}: Invalid 'custom_id': string too long. Expected a string with "
                                 f"maximum length {MAX_CUSTOM_ID}, but got a string with length {len(cid)} instead.",
                        "string_above_max_length", "custom_id")
    if obj.get("method") != "POST":
        raise LineError(line_no, f"line {line_no}: method must be POST", "invalid_value", "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError(line_no, f"line {line_no}: url must be one of {', '.join(ENDPOINTS)}", "invalid_url", "url")
    if not isinstance(obj.get("body"), dict):
        raise LineError(line_no, f"line {line_no}: body must be a JSON object", "invalid_value", "body")
    return obj


def json_type(value: object) -> str:
    """A JSON value's type as OpenAI's messages name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


class LineCheck:
    """Checks an upload as its bytes arrive (``feed``, then ``finish``); raises ``LineError``.

    Each line that is not blank is checked on its own; runs of blank lines between them are passed
    over in bulk (counted, their lengths checked, in C), so a chunk costs about what scanning its
    bytes costs however many blank lines it holds. The bytes of a line that a chunk leaves open
    are kept until its end arrives, and never scanned again."""

    def __init__(self, max_lines: int, max_line_bytes: int) -> None:
        self.max_lines, self.max_line_bytes = max_lines, max_line_bytes
        self.buf = bytearray()    # the line the last chunk left open
        self.line_no = 0          # lines seen (blank ones included)
        self.requests = 0
        self.ids: set[bytes] = set()     # each custom_id's digest
        self.too_long = too_long_blank(max_line_bytes)

    def feed(self, chunk: bytes) -> None:
        start = 0
        if self.buf:                            # the open line ends in this chunk, or goes on
            end = chunk.find(b"\n")
            if end < 0:
                self.buf += chunk
                self._open_line()
                return
            self.buf += chunk[:end]
            line, self.buf = bytes(self.buf), bytearray()
            self._line(line)
            start = end + 1
        while (m := _CONTENT.search(chunk, start)) is not None:
            first = m.start()
            head = max(chunk.rfind(b"\n", start, first) + 1, start)      # where its line begins
            self._blank(chunk, start, head)
            end = chunk.find(b"\n", first)
            if end < 0:
                start = head
                break
            self._line(chunk[head:end])
            start = end + 1
        else:
            head = max(chunk.rfind(b"\n", start) + 1, start)
            self._blank(chunk, start, head)
            start = head
        self.buf += chunk[start:]
        self._open_line()

    def _open_line(self) -> None:
        # a line's bytes, not its line end: a CR the chunk ended on may be the first half of a CRLF
        if len(self.buf) > (self.max_line_bytes + (len(BOM) if self.line_no == 0 else 0)
                            + (1 if self.buf.endswith(b"\r") else 0)):
            raise LineError(self.line_no + 1, f"line {self.line_no + 1} is longer than {self.max_line_bytes} bytes",
                            "line_too_long")

    def _blank(self, data: bytes, start: int, end: int) -> None:
        """``data[start:end]``, whole lines of whitespace only: counted, and refused only if one of
        them is longer than a line may be."""
        n = data.count(b"\n", start, end)
        if end - start - n > self.max_line_bytes:       # enough whitespace for one line too long
            m = self.too_long.search(data, start, end)
            if m is not None:
                at = self.line_no + data.count(b"\n", start, m.start()) + 1
                raise LineError(at, f"line {at} is longer than {self.max_line_bytes} bytes", "line_too_long")
        self.line_no += n

    def finish(self) -> int:
        """The number of requests in the file."""
        if self.buf:
            line, self.buf = bytes(self.buf), bytearray()
            self._line(line)
        if not self.requests:
            raise LineError(0, "the file holds no request", "empty_file")
        return self.requests

    def _line(self, raw: bytes) -> None:
        self.line_no += 1
        n = self.line_no
        if n == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if raw.endswith(b"\r"):           # a CRLF line end: not the line's bytes, as LF is not
            raw = raw[:-1]
        if len(raw) > self.max_line_bytes:
            raise LineError(n, f"line {n} is longer than {self.max_line_bytes} bytes", "line_too_long")
        if not raw.strip():
            return
        obj = parse_line(raw, n)
        cid = obj["custom_id"]
        # its digest, not its text: an id may be 2 KB (512 characters outside the BMP), and an
        # upload holds one for each of up to max_lines lines while it arrives
        key = hashlib.blake2b(cid.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if key in self.ids:
            raise LineError(n, f"line {n}: custom_id {cid!r} is used by an earlier line", "duplicate_custom_id",
                            "custom_id")
        self.ids.add(key)
        self.requests += 1
        if self.requests > self.max_lines:
            raise LineError(n, f"the file holds more than {self.max_lines} requests", "too_many_lines")


def too_long_blank(max_line_bytes: int) -> re.Pattern[bytes]:
    """A line longer than ``max_line_bytes`` among whole lines (each ending in LF): more bytes than
    that before its LF, a CR just before it not counted."""
    n = max_line_bytes
    return re.compile(rb"(?m)^(?:[^\n]{%d}|[^\n]{%d}[^\n\r]\n)" % (n + 2, n))


@dataclass(slots=True)
class Line:
    """One request of a batch, as the runner reads it back."""

    line_no: int
    custom_id: str
    url: str
    body: dict
    # the line as the file holds it when it may hold integers past 64 bits (19 digits in a row), which
    # its re-encoded body takes back from it (gateway/request.py ``body_bytes``); else empty
    raw: bytes = b""


def read_chunk(path: str, offset: int, line_no: int, n: int = CHUNK_LINES) -> tuple[list[Line], int, int]:
    """Up to ``n`` requests from byte ``offset`` (``line_no`` lines already read): the lines, the
    next offset and line count. The file passed ``LineCheck`` at upload; a line that no longer
    parses is skipped. Blank lines are counted in bulk, as at upload: reading a request costs about
    the same whatever number of blank lines stand before it."""
    out: list[Line] = []
    buf = b""
    pos = 0                 # in ``buf``: where the lines not yet read begin
    block = READ_BLOCK
    with open_stored(path) as f:
        f.seek(offset)
        while len(out) < n:
            m = _CONTENT.search(buf, pos)
            if m is not None:
                first = m.start()
                head = max(buf.rfind(b"\n", pos, first) + 1, pos)
                end = buf.find(b"\n", first)
                if end >= 0:
                    line_no += buf.count(b"\n", pos, head) + 1
                    _take(out, buf[head:end], line_no)
                    pos = end + 1
                    continue
            else:
                head = max(buf.rfind(b"\n", pos) + 1, pos)
            line_no += buf.count(b"\n", pos, head)     # the whole lines before ``head`` are blank
            offset += head
            more = f.read(max(block, 2 * (len(buf) - head)))    # a long line: twice what is held of it
            block = min(2 * block, MAX_READ_BLOCK)
            buf, pos = buf[head:] + more, 0
            if not more:
                if buf.strip():                 # its last line, with no line end
                    line_no += 1
                    _take(out, buf, line_no)
                offset += len(buf)
                return out, offset, line_no
    return out, offset + pos, line_no


def _take(out: list[Line], raw: bytes, line_no: int) -> None:
    if line_no == 1 and raw.startswith(BOM):
        raw = raw[len(BOM):]
    if not raw.strip():
        return
    try:
        obj = parse_line(raw.rstrip(b"\r"), line_no)
    except LineError:
        return
    out.append(Line(line_no, obj["custom_id"], obj["url"], obj["body"], raw if may_hold_wide_ints(raw) else b""))


def endpoint_mismatch(path: str, endpoint: str, max_errors: int = 10) -> tuple[int, list[dict]]:
    """Validation of a batch: (its number of requests, ``errors.data`` items for the lines whose
    ``url`` is not the batch's ``endpoint``, at most ``max_errors``)."""
    total, errors, _ = validate(path, endpoint, max_errors)
    return total, errors


def validate(path: str, endpoint: str, max_errors: int = 10) -> tuple[int, list[dict], str | None]:
    """``endpoint_mismatch``, and the batch's model: the one ``model`` its lines name, None when they
    name several (each line runs on its own) or none."""
    total, errors, offset, line_no = 0, [], 0, 0
    models: set[str] = set()
    while True:
        lines, offset, line_no = read_chunk(path, offset, line_no, 4096)
        if not lines:
            return total, errors, next(iter(models)) if len(models) == 1 else None
        total += len(lines)
        for ln in lines:
            if ln.url != endpoint and len(errors) < max_errors:
                errors.append({"code": "mismatched_url", "param": "url", "line": ln.line_no,
                               "message": f"line {ln.line_no}: url {ln.url} is not the batch's endpoint {endpoint}"})
            model = ln.body.get("model")
            if len(models) < 2 and isinstance(model, str) and model:
                models.add(model)
