"""``GET /v1/files/{id}/content`` with ranges and conditionals, on real requests: a single byte range
served as 206, an unsatisfiable one a 416 in OpenAI's shape with ``Content-Range``, one that does not
parse (or several) ignored, a failed precondition a 412 in OpenAI's shape, a 304 without a body, and
the openai SDK's ``files.content`` unchanged (RFC 9110 §13, §14, §15.3.7, §15.4.5, §15.5.13, §15.5.17)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from email.utils import formatdate
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.batch import jsonl
from tests.support.factories import model_block
from tests.support.http import openai_client
from tests.support.waiting import until

ROWS = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": f"Say {i}"}]}} for i in range(4)]
DATA = jsonl(ROWS)


async def _stored(sims, gateway, tmp_path) -> tuple[Any, str]:
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch={"enabled": True, "dir": str(tmp_path / "batch")})
    f = await openai_client(gw).files.create(file=("in.jsonl", DATA), purpose="batch")
    return gw, f.id


async def _get(gw, fid: str, headers: dict[str, str] | None = None, method: str = "GET"):
    async with aiohttp.ClientSession(auto_decompress=False) as s, \
            s.request(method, f"{gw.url}/v1/files/{fid}/content", headers=headers or {}) as r:
        return r.status, r.headers, await r.read()


def _shaped(status: int, headers, body: bytes, code: str, param: str) -> dict[str, Any]:
    assert headers["Content-Type"].startswith("application/json"), (status, headers, body)
    assert headers.get("request-id"), headers
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param), err
    return err


async def test_the_sdk_reads_a_file_whole(sims, gateway, tmp_path):
    gw, fid = await _stored(sims, gateway, tmp_path)
    assert (await openai_client(gw).files.content(fid)).content == DATA
    status, headers, body = await _get(gw, fid)
    assert (status, body) == (200, DATA)
    assert headers["Content-Type"] == "application/octet-stream"
    assert headers["Accept-Ranges"] == "bytes" and headers["ETag"] and headers["Last-Modified"]
    assert int(headers["Content-Length"]) == len(DATA)


@pytest.mark.parametrize("spec,first,last", [
    ("bytes=0-9", 0, 9),
    ("bytes=10-", 10, len(DATA) - 1),
    ("bytes=-7", len(DATA) - 7, len(DATA) - 1),
    ("bytes=5-99999999999999999999999", 5, len(DATA) - 1),     # past the end: to the end
    ("bytes=-99999999999999999999999", 0, len(DATA) - 1),      # a suffix longer than the file: all of it
    ("BYTES=3-4", 3, 4),                                      # the unit case-insensitive
    ("bytes=0-9,", 0, 9),                                    # an empty list element
])
async def test_a_single_satisfiable_range_is_a_206(sims, gateway, tmp_path, spec, first, last):
    gw, fid = await _stored(sims, gateway, tmp_path)
    status, headers, body = await _get(gw, fid, {"Range": spec})
    assert status == 206, (status, body)
    assert body == DATA[first:last + 1]
    assert headers["Content-Range"] == f"bytes {first}-{last}/{len(DATA)}"
    assert int(headers["Content-Length"]) == last - first + 1


@pytest.mark.parametrize("spec", [
    f"bytes={len(DATA)}-",
    f"bytes={len(DATA) + 10}-{len(DATA) + 20}",
    "bytes=-0",
    "bytes=" + "9" * 5000 + "-",                             # past what int() converts: past the end
])
async def test_an_unsatisfiable_range_is_a_shaped_416(sims, gateway, tmp_path, spec):
    gw, fid = await _stored(sims, gateway, tmp_path)
    status, headers, body = await _get(gw, fid, {"Range": spec})
    assert status == 416
    assert headers["Content-Range"] == f"bytes */{len(DATA)}"
    err = _shaped(status, headers, body, "range_not_satisfiable", "Range")
    assert str(len(DATA)) in err["message"]


@pytest.mark.parametrize("spec", [
    "garbage", "bytes=", "bytes=abc", "bytes=5-2", "items=0-5", "bytes=0-1,4-5", "bytes=0x10-",
    "bytes=1-2-3", "bytes=--5", "bytes = 3 - 4", "bytes=²-",
])
async def test_a_range_that_does_not_parse_or_lists_several_is_ignored(sims, gateway, tmp_path, spec):
    gw, fid = await _stored(sims, gateway, tmp_path)
    status, headers, body = await _get(gw, fid, {"Range": spec})
    assert (status, body) == (200, DATA)
    assert "Content-Range" not in headers


async def test_preconditions(sims, gateway, tmp_path):
    gw, fid = await _stored(sims, gateway, tmp_path)
    _, headers, _ = await _get(gw, fid)
    etag, modified = headers["ETag"], headers["Last-Modified"]
    long_ago, later = formatdate(0, usegmt=True), formatdate(4102444800, usegmt=True)    # 1970, 2100

    for h in ({"If-Match": '"other"'}, {"If-Match": f"W/{etag}"}, {"If-Match": "garbage"},
              {"If-Unmodified-Since": long_ago}):
        status, rh, body = await _get(gw, fid, h)
        assert status == 412, (h, status, body)
        _shaped(status, rh, body, "precondition_failed", next(iter(h)))

    for h in ({"If-Match": etag}, {"If-Match": "*"}, {"If-Match": f'"x", {etag}'},
              {"If-Unmodified-Since": later}, {"If-Unmodified-Since": "not a date"},
              {"If-None-Match": '"other"'}, {"If-Modified-Since": long_ago},
              {"If-Modified-Since": "not a date"}):
        status, _, body = await _get(gw, fid, h)
        assert (status, body) == (200, DATA), h

    for h in ({"If-None-Match": etag}, {"If-None-Match": f"W/{etag}"}, {"If-None-Match": "*"},
              {"If-Modified-Since": modified}, {"If-Modified-Since": later}):
        status, rh, body = await _get(gw, fid, h)
        assert (status, body) == (304, b""), h
        assert rh["ETag"] == etag and rh["Last-Modified"] == modified
    # If-None-Match decides, and If-Modified-Since is not read (RFC 9110 §13.1.3)
    status, _, body = await _get(gw, fid, {"If-None-Match": '"other"', "If-Modified-Since": later})
    assert (status, body) == (200, DATA)
    # a failed If-Match is answered before a Range is read
    status, rh, body = await _get(gw, fid, {"If-Match": '"other"', "Range": "bytes=999999-"})
    _shaped(status, rh, body, "precondition_failed", "If-Match")
    # HEAD: the same answer without a body
    status, rh, body = await _get(gw, fid, {"If-Match": '"other"'}, method="HEAD")
    assert (status, body) == (412, b"")
    status, rh, body = await _get(gw, fid, {"Range": "bytes=0-3"}, method="HEAD")
    assert (status, body) == (200, b"") and int(rh["Content-Length"]) == len(DATA)


async def test_if_range(sims, gateway, tmp_path):
    gw, fid = await _stored(sims, gateway, tmp_path)
    _, headers, _ = await _get(gw, fid)
    etag, modified = headers["ETag"], headers["Last-Modified"]
    for validator in (etag, modified):      # the representation the client holds: the range
        status, _, body = await _get(gw, fid, {"Range": "bytes=0-3", "If-Range": validator})
        assert (status, body) == (206, DATA[:4]), validator
    # another representation (or a validator that is weak or does not parse): the whole file, so a
    # client resuming a download never splices bytes of two files
    for validator in ('"other"', f"W/{etag}", formatdate(0, usegmt=True), "garbage"):
        status, _, body = await _get(gw, fid, {"Range": "bytes=0-3", "If-Range": validator})
        assert (status, body) == (200, DATA), validator


def _open_on(path: str) -> int:
    """How many of this process's file descriptors (the gateway runs in it) are open on ``path``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == path
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
async def test_a_client_that_leaves_mid_download_leaves_no_file_open(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch={"enabled": True, "dir": str(tmp_path / "batch")})
    pad = "x" * 60_000         # a file of several MiB: far more than the socket buffers hold
    rows = [{**ROWS[0], "custom_id": f"req-{i}", "body": {"model": "m", "messages": [{"role": "user", "content": pad}]}}
            for i in range(100)]
    f = await openai_client(gw).files.create(file=("big.jsonl", jsonl(rows)), purpose="batch")
    path = os.path.realpath(str(tmp_path / "batch" / "files" / f.id))
    for headers in ({}, {"Range": "bytes=100-"}):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"GET /v1/files/{f.id}/content HTTP/1.1\r\nHost: gw\r\n{head}\r\n".encode())
        assert (await asyncio.wait_for(reader.read(4096), 10)).startswith(b"HTTP/1.1 20")
        writer.transport.abort()            # gone, most of the file unread
        await until(lambda: _open_on(path) == 0, timeout=10)
    status, _, body = await _get(gw, f.id, {"Range": "bytes=0-0"})      # and it is still served
    assert (status, body) == (206, b"{")


def _unblock(path: str) -> None:
    """A FIFO's reader blocked in its open (a thread) is let go: a writer comes and goes at once."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


async def test_a_file_whose_bytes_cannot_be_read_is_a_storage_error_not_a_404(sims, gateway, tmp_path):
    """The content of a file whose bytes are there but cannot be read (its place taken by a
    directory, or by a FIFO, which an open would wait on for a writer) is a 500 ``storage_error``
    in OpenAI's shape, answered at once: the file exists, the gateway's storage fails it; a file
    whose bytes are gone is the 404 it was."""
    gw, fid = await _stored(sims, gateway, tmp_path)
    path = str(tmp_path / "batch" / "files" / fid)
    os.unlink(path)
    status, headers, body = await _get(gw, fid)
    assert status == 404 and orjson.loads(body)["error"]["code"] == "file_not_found"
    os.mkdir(path)
    for method in ("GET", "HEAD"):
        status, headers, body = await _get(gw, fid, method=method)
        assert status == 500, (method, status, body)
    err = orjson.loads((await _get(gw, fid))[2])["error"]
    assert (err["type"], err["code"]) == ("api_error", "storage_error") and fid in err["message"], err
    os.rmdir(path)
    os.mkfifo(path)
    try:
        async with asyncio.timeout(10):
            status, headers, body = await _get(gw, fid)
        assert status == 500 and orjson.loads(body)["error"]["code"] == "storage_error", (status, body)
    finally:
        _unblock(path)


async def test_a_batch_whose_input_is_no_regular_file_fails_and_holds_up_nothing(sims, gateway, tmp_path):
    """A batch whose input file's place was taken by a FIFO fails its validation (``file_unreadable``)
    rather than waiting on it for a writer for good; the next batch runs."""
    gw, fid = await _stored(sims, gateway, tmp_path)
    c = openai_client(gw)
    path = str(tmp_path / "batch" / "files" / fid)
    os.unlink(path)
    os.mkfifo(path)
    try:
        b = await c.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")

        async def failed() -> bool:
            return (await c.batches.retrieve(b.id)).status == "failed"

        await until(failed, timeout=10)
        got = await c.batches.retrieve(b.id)
        assert [e.code for e in got.errors.data] == ["file_unreadable"], got.errors
    finally:
        _unblock(path)
    f = await c.files.create(file=("in.jsonl", DATA), purpose="batch")
    nxt = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def done() -> bool:
        return (await c.batches.retrieve(nxt.id)).status == "completed"

    await until(done, timeout=20)
