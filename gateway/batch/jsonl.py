"""Batch input files: the checks an upload passes, and reading its lines back in chunks.

A line is ``{"custom_id": str, "method": "POST", "url": one of ENDPOINTS, "body": {...}}``. What a
file says of itself is checked while it is uploaded (``LineCheck``): UTF-8, one JSON object per
line, those four fields, ``custom_id`` unique, the line and line-count limits; a failure is a 400
naming the line, and nothing is stored. What depends on the batch (each line's ``url`` equals the
batch's ``endpoint``) is checked when the batch is validated (``validate``); it fails the batch
with ``errors.data`` naming the line, as OpenAI does; the batch's ``model`` is read then too. Blank lines are skipped; line numbers
are the file's own, from 1. A UTF-8 byte order mark opening the file (Windows tools write one) is
not part of its first line; anywhere else it is a line's bytes, so not JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from gateway.request import may_hold_wide_ints

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID = 512
BOM = b"\xef\xbb\xbf"
CHUNK_LINES = 256


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
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        raise LineError(line_no, f"line {line_no}: custom_id must be a non-empty string of at most "
                                 f"{MAX_CUSTOM_ID} characters", "missing_required_parameter", "custom_id")
    if obj.get("method") != "POST":
        raise LineError(line_no, f"line {line_no}: method must be POST", "invalid_value", "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError(line_no, f"line {line_no}: url must be one of {', '.join(ENDPOINTS)}", "invalid_url", "url")
    if not isinstance(obj.get("body"), dict):
        raise LineError(line_no, f"line {line_no}: body must be a JSON object", "invalid_value", "body")
    return obj


class LineCheck:
    """Checks an upload as its bytes arrive (``feed``, then ``finish``); raises ``LineError``."""

    def __init__(self, max_lines: int, max_line_bytes: int) -> None:
        self.max_lines, self.max_line_bytes = max_lines, max_line_bytes
        self.buf = b""
        self.line_no = 0          # lines seen (blank ones included)
        self.requests = 0
        self.ids: set[str] = set()

    def feed(self, chunk: bytes) -> None:
        data = self.buf + chunk
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._line(data[start:end])
            start = end + 1
        self.buf = data[start:]
        # a line's bytes, not its line end: a CR the chunk ended on may be the first half of a CRLF
        if len(self.buf) > (self.max_line_bytes + (len(BOM) if self.line_no == 0 else 0)
                            + (1 if self.buf.endswith(b"\r") else 0)):
            raise LineError(self.line_no + 1, f"line {self.line_no + 1} is longer than {self.max_line_bytes} bytes",
                            "line_too_long")

    def finish(self) -> int:
        """The number of requests in the file."""
        if self.buf:
            self._line(self.buf)
            self.buf = b""
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
        if cid in self.ids:
            raise LineError(n, f"line {n}: custom_id {cid!r} is used by an earlier line", "duplicate_custom_id",
                            "custom_id")
        self.ids.add(cid)
        self.requests += 1
        if self.requests > self.max_lines:
            raise LineError(n, f"the file holds more than {self.max_lines} requests", "too_many_lines")


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
    parses is skipped."""
    out: list[Line] = []
    with open(path, "rb") as f:
        f.seek(offset)
        while len(out) < n:
            raw = f.readline()
            if not raw:
                break
            offset += len(raw)
            line_no += 1
            if line_no == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            if not raw.strip():
                continue
            try:
                obj = parse_line(raw.rstrip(b"\r\n"), line_no)
            except LineError:
                continue
            out.append(Line(line_no, obj["custom_id"], obj["url"], obj["body"],
                            raw if may_hold_wide_ints(raw) else b""))
    return out, offset, line_no


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
