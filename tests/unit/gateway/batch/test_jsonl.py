"""Batch input files: the upload's line checks, fed in arbitrary chunks, and reading lines back."""

from __future__ import annotations

import orjson
import pytest

from gateway.batch.jsonl import LineCheck, LineError, endpoint_mismatch, read_chunk


def row(cid: str, url: str = "/v1/chat/completions", **over) -> bytes:
    return orjson.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m"}, **over}) + b"\n"


def check(data: bytes, step: int, max_lines: int = 10, max_line_bytes: int = 1000) -> int:
    c = LineCheck(max_lines, max_line_bytes)
    for i in range(0, len(data), step):
        c.feed(data[i:i + step])
    return c.finish()


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_good_file_counts_its_requests_whatever_the_chunking(step):
    data = row("a") + b"\n" + row("b") + row("c").rstrip(b"\n")    # a blank line, no final newline
    assert check(data, step) == 3


@pytest.mark.parametrize("step", [1, 7, 1000, 4096])
def test_blank_lines_as_long_as_a_line_may_be_are_taken(step):
    blank = b" " * 999 + b"\t\r\n"          # 1000 bytes and its CRLF
    assert check(row("a") + blank * 3 + b"\n" * 50 + row("b") + blank, step) == 2


@pytest.mark.parametrize(("data", "line", "code"), [
    (row("a") + b"\xff\xfe\n", 2, "invalid_encoding"),
    (row("a") + b"{nope\n", 2, "invalid_json"),
    (b"[1, 2]\n", 1, "invalid_json"),
    (row("a") + row("a"), 2, "duplicate_custom_id"),
    (row(""), 1, "missing_required_parameter"),
    (row("a", method="GET"), 1, "invalid_value"),
    (row("a", url="/v1/files"), 1, "invalid_url"),
    (row("a", body="text"), 1, "invalid_value"),
    (b"".join(row(f"r{i}") for i in range(11)), 11, "too_many_lines"),
    (row("a", body={"x": "y" * 2000}), 1, "line_too_long"),
    (b"\n\n", 0, "empty_file"),
    (row("a") + b"\n" * 5 + b"{nope\n", 7, "invalid_json"),
    (row("a") + b" \r\n" * 3 + b" " * 1001 + b"\n" + row("b"), 5, "line_too_long"),     # a blank line too
    (row("a") + b"\n" + b" " * 1000 + b"\t\r\n" + row("b"), 3, "line_too_long"),
])
@pytest.mark.parametrize("step", [2, 4096])
def test_a_bad_line_is_named(data, line, code, step):
    with pytest.raises(LineError) as ei:
        check(data, step)
    assert (ei.value.line, ei.value.code) == (line, code)


@pytest.mark.parametrize(("cid", "code", "message"), [
    ("x" * 513, "string_above_max_length", "line 1: Invalid 'custom_id': string too long. Expected a string with "
                                           "maximum length 512, but got a string with length 513 instead."),
    ("\U0001f600" * 513, "string_above_max_length", "line 1: Invalid 'custom_id': string too long. Expected a "
                     "string with maximum length 512, but got a string with length 513 instead."),
    (17, "invalid_type", "line 1: Invalid type for 'custom_id': expected a string, but got an integer instead."),
    (None, "invalid_type", "line 1: Invalid type for 'custom_id': expected a string, but got null instead."),
    ("", "missing_required_parameter", "line 1: Missing required parameter: 'custom_id'."),
])
def test_a_custom_id_that_is_not_a_short_string_is_named_as_openai_names_it(cid, code, message):
    """A custom_id past the 512 characters the gateway takes is OpenAI's ``string_above_max_length``
    saying the limit and the length it got, not a missing parameter (it is there), and one that is
    not a string is OpenAI's ``invalid_type``; both name ``custom_id``."""
    with pytest.raises(LineError) as ei:
        check(row(cid), 4096, max_line_bytes=4096)
    assert (ei.value.line, ei.value.code, ei.value.param, ei.value.message) == (1, code, "custom_id", message)
    assert check(row("x" * 512) + row("\U0001f600" * 512), 4096, max_line_bytes=4096) == 2


def test_a_line_without_a_custom_id_is_named_as_openai_names_it():
    with pytest.raises(LineError) as ei:
        check(orjson.dumps({"method": "POST", "url": "/v1/completions", "body": {}}) + b"\n", 4096)
    assert (ei.value.code, ei.value.param, ei.value.message) == (
        "missing_required_parameter", "custom_id", "line 1: Missing required parameter: 'custom_id'.")


@pytest.mark.parametrize("step", [1, 2, 7, 1000, 4096])
def test_a_line_of_max_line_bytes_ending_in_crlf_is_taken_wherever_a_chunk_ends(step):
    line = row("a", body={"x": ""}).rstrip(b"\n")
    line = line.replace(b'"x":""', b'"x":"' + b"y" * (1000 - len(line)) + b'"')
    assert len(line) == 1000
    assert check(line + b"\r\n" + row("b").replace(b"\n", b"\r\n"), step) == 2
    with pytest.raises(LineError) as ei:
        check(line + b" \r\n", step)
    assert (ei.value.line, ei.value.code) == (1, "line_too_long")


def test_lines_read_back_in_chunks_with_their_numbers(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(row("a") + b"\n" + row("b") + row("c", url="/v1/embeddings"))
    lines, offset, n = read_chunk(str(p), 0, 0, 2)
    assert [(ln.line_no, ln.custom_id) for ln in lines] == [(1, "a"), (3, "b")]
    rest, _, _ = read_chunk(str(p), offset, n, 2)
    assert [(ln.line_no, ln.custom_id) for ln in rest] == [(4, "c")]
    total, errors = endpoint_mismatch(str(p), "/v1/chat/completions")
    assert total == 3 and [(e["line"], e["code"]) for e in errors] == [(4, "mismatched_url")]


BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("step", [1, 2, 4, 4096])
def test_a_file_that_opens_with_a_utf8_bom_is_read_without_it(tmp_path, step):
    """Windows tools (Notepad, PowerShell's UTF8 encoding, Excel's CSV/UTF-8) open a UTF-8 file
    with a byte order mark: it is not part of the first line, wherever the upload's chunks split it."""
    data = BOM + row("a").replace(b"\n", b"\r\n") + row("b").replace(b"\n", b"\r\n")
    assert check(data, step) == 2
    p = tmp_path / "in.jsonl"
    p.write_bytes(data)
    lines, _, _ = read_chunk(str(p), 0, 0)
    assert [(ln.line_no, ln.custom_id) for ln in lines] == [(1, "a"), (2, "b")]
    assert endpoint_mismatch(str(p), "/v1/chat/completions") == (2, [])


@pytest.mark.parametrize(("data", "line", "code"), [
    (row("a") + BOM + row("b"), 2, "invalid_json"),      # only the file's first bytes may be one
    (BOM + BOM + row("a"), 1, "invalid_json"),
    (BOM, 0, "empty_file"),
    (BOM + b"\r\n", 0, "empty_file"),
])
@pytest.mark.parametrize("step", [1, 4096])
def test_a_bom_anywhere_but_the_start_is_still_refused(data, line, code, step):
    with pytest.raises(LineError) as ei:
        check(data, step)
    assert (ei.value.line, ei.value.code) == (line, code)


def _calls(fn) -> int:
    """How many function calls (Python and C) ``fn`` makes: the work done per line, where a blank
    line would cost one or more of them."""
    import sys

    n = 0

    def count(frame, event, arg):
        nonlocal n
        if event in ("call", "c_call"):
            n += 1
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


@pytest.mark.parametrize("blank", [b"\n", b"\r\n", b" \t \r\n"], ids=["lf", "crlf", "spaces"])
def test_blank_lines_are_passed_over_in_bulk_at_upload(blank):
    """Blank lines are skipped, not requests: the upload's check passes over them in bulk, not line
    by line, so a file of millions of them costs about what scanning its bytes costs."""

    def feed(n: int) -> int:
        c = LineCheck(10, 1000)
        data = row("a") + blank * n + row("b")
        calls = _calls(lambda: c.feed(data))
        assert c.finish() == 2 and c.line_no == n + 2
        return calls
    assert feed(20_000) - feed(10) < 50


@pytest.mark.parametrize("blank", [b"\n", b"\r\n", b" \t \r\n"], ids=["lf", "crlf", "spaces"])
def test_blank_lines_are_passed_over_in_bulk_when_read_back(tmp_path, blank):
    """The runner and a batch's validation read the file back: blank lines between two requests
    are passed over in bulk there too, and the requests keep their line numbers."""
    p = tmp_path / "in.jsonl"

    def read(n: int) -> int:
        p.write_bytes(row("a") + blank * n + row("b"))
        got = []
        calls = _calls(lambda: got.append(read_chunk(str(p), 0, 0)))
        lines, offset, line_no = got[0]
        assert [(ln.line_no, ln.custom_id) for ln in lines] == [(1, "a"), (n + 2, "b")]
        assert (offset, line_no) == (p.stat().st_size, n + 2)
        return calls
    assert read(20_000) - read(10) < 50


def test_the_custom_ids_an_upload_holds_to_find_a_duplicate_cost_little_memory():
    """A custom_id may be 512 characters, each up to 4 bytes: the ids an upload's check keeps, to
    refuse one used twice, cost a few bytes each, not their text, so an upload of ``max_lines``
    long ids does not hold about as much memory as the file's size while it arrives."""
    import tracemalloc

    n = 2000
    data = b"".join(row(f"{i:05d}" + "\U0001f600" * 500) for i in range(n))
    c = LineCheck(n, 4096)
    tracemalloc.start()
    try:
        for i in range(0, len(data), 65536):
            c.feed(data[i:i + 65536])
        assert c.finish() == n
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < n * 200, held
    with pytest.raises(LineError) as ei:
        check(row("x" * 512) + row("y" * 512) + row("x" * 512), 4096)
    assert (ei.value.line, ei.value.code) == (3, "duplicate_custom_id")


class _Counted(bytes):
    """Bytes that add to ``seen`` the span each search over them covers, and the size of each join
    they take part in (the join is counted too: a join copies, and what it makes is searched)."""

    seen = [0]

    def _span(self, start, end) -> int:
        return len(range(*slice(start, end).indices(len(self))))

    def find(self, sub, start=None, end=None):
        _Counted.seen[0] += self._span(start, end)
        return bytes.find(self, sub, start, end)

    def rfind(self, sub, start=None, end=None):
        _Counted.seen[0] += self._span(start, end)
        return bytes.rfind(self, sub, start, end)

    def count(self, sub, start=None, end=None):
        _Counted.seen[0] += self._span(start, end)
        return bytes.count(self, sub, start, end)

    def __add__(self, other):
        _Counted.seen[0] += len(self) + len(other)
        return _Counted(bytes(self) + bytes(other))

    def __radd__(self, other):
        if not isinstance(other, bytes):    # a bytearray grows in place (``+=``): not a copy
            return NotImplemented
        _Counted.seen[0] += len(self) + len(other)
        return _Counted(bytes(other) + bytes(self))


class _CountedPattern:
    def __init__(self, pattern) -> None:
        self.pattern = pattern

    def search(self, data, pos=0, endpos=None):
        _Counted.seen[0] += len(data[pos:endpos])
        return self.pattern.search(data, pos, len(data) if endpos is None else endpos)


def _one_long_line(size: int) -> bytes:
    head = b'{"custom_id": "long", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "'
    return head + b"x" * (size - len(head) - 4) + b'"}}\n'


@pytest.fixture
def scans(monkeypatch):
    """The bytes the searches of an input file's reader cover, and the bytes its joins copy."""
    from gateway.batch import jsonl
    monkeypatch.setattr(jsonl, "_CONTENT", _CountedPattern(jsonl._CONTENT))
    _Counted.seen[0] = 0
    return _Counted.seen


def test_one_long_line_arriving_in_many_chunks_is_checked_in_linear_work(scans):
    """A line that many chunks carry (a long prompt, under a raised ``batch.max_line_bytes``) is
    checked in work that grows with its size: the part of it already held is neither searched
    again nor copied again at each next chunk, where 64 MiB took seconds of a worker's CPU (each
    chunk joined to it and searched from its start, work that grows as its size squared). Counted
    here: the bytes every search of the check covers and every join copies."""
    size, step = 4 * 1024 * 1024, 4096
    data = _one_long_line(size)
    c = LineCheck(10, size)
    for i in range(0, len(data), step):
        c.feed(_Counted(data[i:i + step]))
    assert c.finish() == 1
    assert scans[0] <= 3 * size, scans[0]       # each chunk joined to what is held: ~1000x


def test_one_long_line_read_back_is_read_in_linear_work(tmp_path, monkeypatch, scans):
    """The batch's validation and its run read a long line back: each read asks for twice what is
    held of it, so its reads are as few as its size's doublings and the bytes searched and copied
    to find its end grow with its size, not with its square."""
    from gateway.batch import jsonl
    size = 16 * 1024 * 1024
    p = tmp_path / "in.jsonl"
    p.write_bytes(_one_long_line(size) + row("b"))
    reads = []

    class Reader:
        def __init__(self, f) -> None:
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, offset):
            return self.f.seek(offset)

        def read(self, n=-1):
            reads.append(n)
            return _Counted(self.f.read(n))

    monkeypatch.setattr(jsonl, "open", lambda path, mode: Reader(open(path, mode)), raising=False)
    lines, offset, line_no = read_chunk(str(p), 0, 0)
    assert [(ln.line_no, ln.custom_id) for ln in lines] == [(1, "long"), (2, "b")]
    assert (offset, line_no) == (p.stat().st_size, 2)
    assert len(reads) <= 12, reads      # what is held triples at each: eight; in blocks of 64 KiB, 257
    assert scans[0] <= 12 * size, scans[0]      # in blocks of 64 KiB: ~400x
