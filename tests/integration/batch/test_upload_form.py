"""``POST /v1/files`` as clients other than the openai SDK write the form: the ``file`` field before
``purpose`` (``curl -F`` writes the fields in the order given; OpenAI reads them in any order); and
filenames holding a ``"``, which the SDK percent-encodes (``%22``, as the WHATWG multipart encoder
does, RFC 7578 §4.2) and older curl escapes (``\\"``): the name is stored as the client gave it,
and the content download names it in ``Content-Disposition`` (RFC 6266 ``filename*``)."""

from __future__ import annotations

import io
import os
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest

from tests.support.batch import jsonl
from tests.support.factories import model_block
from tests.support.http import openai_client

ROWS = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 3}}
        for i in range(2)]
GOOD = jsonl(ROWS)
TUNING = jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 3)
BOUNDARY = "xyzBOUNDARY"
FORM = f"multipart/form-data; boundary={BOUNDARY}"


def _form(fields: list[tuple[str, str | None, bytes]]) -> bytes:
    """A multipart body; a field's ``disposition`` is written as given (a filename already quoted)."""
    out = io.BytesIO()
    for name, disposition, value in fields:
        out.write(f"--{BOUNDARY}\r\n".encode())
        out.write(f'Content-Disposition: form-data; name="{name}"'.encode())
        if disposition is not None:
            out.write(b"; " + disposition.encode())
        out.write(b"\r\n\r\n" + value + b"\r\n")
    out.write(f"--{BOUNDARY}--\r\n".encode())
    return out.getvalue()


async def _upload(gw, body: bytes) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/files", data=body,
                                                    headers={"Content-Type": FORM}) as r:
        return r.status, await r.json(content_type=None)


async def _gateway(sims, gateway, tmp_path, **batch: Any):
    sim = await sims("vllm", "m")
    return await gateway([model_block("m", "vllm", [sim.url])],
                         batch={"enabled": True, "dir": str(tmp_path / "batch"), **batch})


def _nothing_stored(tmp_path) -> None:
    assert os.listdir(tmp_path / "batch" / "files") == []
    assert os.listdir(tmp_path / "batch" / "tmp") == []


@pytest.mark.parametrize("order", ["file, purpose", "file, expires_after, purpose", "expires_after, file, purpose"])
async def test_the_file_may_come_before_its_purpose(sims, gateway, tmp_path, order):
    gw = await _gateway(sims, gateway, tmp_path)
    parts = {"file": ("file", 'filename="in.jsonl"', GOOD), "purpose": ("purpose", None, b"batch"),
             "expires_after": [("expires_after[anchor]", None, b"created_at"),
                               ("expires_after[seconds]", None, b"3600")]}
    fields: list[tuple[str, str | None, bytes]] = []
    for name in order.split(", "):
        got = parts[name]
        fields += got if isinstance(got, list) else [got]
    status, body = await _upload(gw, _form(fields))
    assert status == 200, body
    assert (body["purpose"], body["filename"], body["bytes"]) == ("batch", "in.jsonl", len(GOOD))
    if "expires_after" in order:
        assert body["expires_at"] == body["created_at"] + 3600
    c = openai_client(gw)
    assert (await c.files.content(body["id"])).content == GOOD
    assert [f.id for f in (await c.files.list()).data] == [body["id"]]
    assert os.listdir(tmp_path / "batch" / "tmp") == []


@pytest.mark.parametrize(("case", "fields", "status", "param", "code"), [
    ("purpose after, not batch", [("file", 'filename="t.jsonl"', TUNING), ("purpose", None, b"fine-tune")],
     400, "purpose", "invalid_value"),
    ("purpose after, not batch, batch lines", [("file", 'filename="t.jsonl"', GOOD), ("purpose", None, b"user_data")],
     400, "purpose", "invalid_value"),
    ("no purpose", [("file", 'filename="t.jsonl"', GOOD)], 400, "purpose", "missing_required_parameter"),
    ("no purpose, not batch lines", [("file", 'filename="t.jsonl"', TUNING)], 400, "purpose",
     "missing_required_parameter"),
    ("purpose after, batch, bad line", [("file", 'filename="t.jsonl"', TUNING), ("purpose", None, b"batch")],
     400, "custom_id", "missing_required_parameter"),
    ("purpose after, not batch, bad name", [("file", 'filename="../t.jsonl"', GOOD), ("purpose", None, b"fine-tune")],
     400, "purpose", "invalid_value"),
    ("purpose after, not batch, no name", [("file", None, TUNING), ("purpose", None, b"fine-tune")],
     400, "purpose", "invalid_value"),
    ("no purpose, bad name", [("file", 'filename="../t.jsonl"', GOOD)], 400, "purpose", "missing_required_parameter"),
    ("purpose after, batch, bad name", [("file", 'filename="../t.jsonl"', GOOD), ("purpose", None, b"batch")],
     400, "file", "invalid_filename"),
    ("purpose after, too large", [("file", 'filename="t.jsonl"', GOOD * 300), ("purpose", None, b"batch")],
     413, "file", "file_too_large"),
    ("purpose after, bad expires_after", [("file", 'filename="t.jsonl"', GOOD), ("expires_after[days]", None, b"1"),
                                          ("purpose", None, b"batch")], 400, "expires_after.days", "unknown_parameter"),
])
async def test_a_file_before_its_purpose_is_judged_on_the_whole_form(sims, gateway, tmp_path, case, fields, status,
                                                                     param, code):
    """A purpose told after the file is judged first, as one told before it: a file for another
    purpose (a fine-tuning file) is refused for its purpose, not for its first line, and one without
    a purpose for its missing purpose; a batch file's own faults are its answer. Nothing is stored."""
    gw = await _gateway(sims, gateway, tmp_path, max_file_bytes=20_000)
    got, body = await _upload(gw, _form(fields))
    assert (got, body["error"]["param"], body["error"]["code"]) == (status, param, code), body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (await openai_client(gw).files.list()).data == []
    _nothing_stored(tmp_path)


NAMES = ['say "hi".jsonl', 'caf\u00e9 "x".jsonl', "plain.jsonl", "50% off.jsonl", "a%2522.jsonl", "a'b.jsonl"]


@pytest.mark.parametrize("name", NAMES)
async def test_the_sdks_filename_is_stored_as_the_client_gave_it(sims, gateway, tmp_path, name):
    """The openai SDK writes a ``"`` of a filename as ``%22`` (WHATWG's encoding; a ``%`` it sends as it is)."""
    gw = await _gateway(sims, gateway, tmp_path)
    c = openai_client(gw)
    f = await c.files.create(file=(name, GOOD), purpose="batch")
    assert f.filename == name
    assert (await c.files.retrieve(f.id)).filename == name
    assert [x.filename for x in (await c.files.list()).data] == [name]


@pytest.mark.parametrize(("disposition", "name"), [
    ('filename="say \\"hi\\".jsonl"', 'say "hi".jsonl'),            # curl before 7.81: a quoted-pair
    ('filename="say %22hi%22.jsonl"', 'say "hi".jsonl'),            # curl since 7.81, browsers: WHATWG
    ("filename*=UTF-8''say%20%22hi%22.jsonl", 'say "hi".jsonl'),    # RFC 5987 (RFC 7578 §4.2 forbids it; read)
    ("filename*=UTF-8''a%2522.jsonl", "a%22.jsonl"),                # decoded once
    ('filename="a%2522.jsonl"', "a%2522.jsonl"),                    # a % is not encoded: %25 is no escape here
])
async def test_a_raw_forms_filename_is_stored_as_the_client_gave_it(sims, gateway, tmp_path, disposition, name):
    gw = await _gateway(sims, gateway, tmp_path)
    status, body = await _upload(gw, _form([("purpose", None, b"batch"), ("file", disposition, GOOD)]))
    assert status == 200, body
    assert body["filename"] == name
    assert (await openai_client(gw).files.retrieve(body["id"])).filename == name


@pytest.mark.parametrize("disposition", ['filename="a%0Ab.jsonl"', 'filename="a%0db.jsonl"'])
async def test_a_filename_encoding_a_line_break_is_refused(sims, gateway, tmp_path, disposition):
    """A browser writes a line break of a filename as ``%0A`` or ``%0D``: read as the name, it holds a
    control character, refused as one written raw is."""
    gw = await _gateway(sims, gateway, tmp_path)
    status, body = await _upload(gw, _form([("purpose", None, b"batch"), ("file", disposition, GOOD)]))
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "file", "invalid_filename"), body
    _nothing_stored(tmp_path)


@pytest.mark.parametrize("name", NAMES)
async def test_the_content_download_names_the_file_in_content_disposition(sims, gateway, tmp_path, name):
    """RFC 6266: ``filename*=UTF-8''`` with the name percent-encoded, after a ``filename`` of plain
    ASCII for clients that read no ``filename*``; aiohttp's reader gives the name back."""
    gw = await _gateway(sims, gateway, tmp_path)
    c = openai_client(gw)
    f = await c.files.create(file=(name, GOOD), purpose="batch")
    for method in ("GET", "HEAD"):
        async with aiohttp.ClientSession() as s, s.request(method, f"{gw.url}/v1/files/{f.id}/content") as r:
            assert r.status == 200
            disposition = r.headers["Content-Disposition"]
            assert disposition.isascii()
            assert r.content_disposition is not None and r.content_disposition.type == "attachment"
            assert r.content_disposition.filename == name, disposition
            params = dict(p.strip().split("=", 1) for p in disposition.split(";")[1:])
            assert params["filename*"].startswith("UTF-8''")
            assert unquote(params["filename*"][7:], "utf-8", "strict") == name
            fallback = params["filename"]
            assert fallback.startswith('"') and fallback.endswith('"') and '"' not in fallback[1:-1]
            assert "\\" not in fallback and "%" not in fallback
    assert (await c.files.content(f.id)).content == GOOD


async def test_a_plain_name_is_given_alike_in_both_forms(sims, gateway, tmp_path):
    gw = await _gateway(sims, gateway, tmp_path)
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", GOOD), purpose="batch")
    for headers in ({}, {"Range": "bytes=0-9"}):
        async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/v1/files/{f.id}/content", headers=headers) as r:
            assert r.status == (206 if headers else 200)
            assert r.headers["Content-Disposition"] == "attachment; filename=\"in.jsonl\"; filename*=UTF-8''in.jsonl"
