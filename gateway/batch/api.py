"""``/v1/files`` and ``/v1/batches``: OpenAI's Files and Batches API, in OpenAI's shapes.

Every worker answers these (the job store is shared by every process on ``batch.dir``); one of them
runs the batches (``gateway.batch.service``). With API keys on, files and batches belong to the
user whose key created them: another user's are answered 404, as unknown ones. Errors are OpenAI's
``{"error": {...}}`` with a 4xx that says what is wrong; an upload is checked while it arrives and
refused whole (nothing stored) when a line is not a batch request.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import functools
import os
import re
import secrets
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.batch import files as batch_files
from gateway.batch import ranges
from gateway.batch.config import BatchConfig
from gateway.batch.jsonl import ENDPOINTS, LineCheck, LineError, json_type
from gateway.batch.store import ACTIVE, BatchDb, BatchStore, FileInUse, OverBound, UnknownCursor, now_s
from gateway.errors import ErrorClass, GatewayError
from gateway.tenants.service import NoTenancy, Tenancy

log = structlog.get_logger("switchyard.batch")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CHUNK = 256 * 1024
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MULTIPART_SLACK = 64 * 1024        # boundaries and the purpose field around the file's bytes
MAX_METADATA = 16
EXPIRY_KEYS_KEPT = 4               # expires_after[<key>] fields kept: anchor, seconds and the first unknown
FIELD_KEPT = 64                    # bytes kept of a form field other than the file
FIELD_MAX = 64 * 1024              # bytes read of a form field other than the file, whatever the body limit
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)     # OpenAI's range of a file's expires_after[seconds]
# and of a batch's output_expires_after.seconds
_INTEGER = re.compile(r"[+-]?[0-9]+")         # a list's limit, as OpenAI reads one


def _bad(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> GatewayError:
    return GatewayError(status, message, param=param, code=code, error_class=ErrorClass.VALIDATION)


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _open_file(path: str) -> tuple[Any, os.stat_result]:
    fobj = batch_files.open_stored(path)        # closed by the caller, after the answer
    try:
        st = os.fstat(fobj.fileno())
    except BaseException:
        fobj.close()
        raise
    return fobj, st


def _precondition_failed(header: str) -> GatewayError:
    return _bad(f"the precondition in {header} failed: the file's content is not the one it names",
                header, "precondition_failed", 412)


async def _send(request: web.Request, fobj: Any, v: ranges.Validators, filename: str) -> web.StreamResponse:
    """A file's content, as RFC 9110 reads the request's conditionals (§13.2.2) and its Range (§14):
    412 and 416 in OpenAI's shape, 304 without a body, one range a 206 (gateway/batch/ranges.py);
    the bytes (and a HEAD) name ``filename`` in ``Content-Disposition`` (RFC 6266)."""
    h = request.headers
    validators = {"ETag": v.etag, "Last-Modified": _http_date(v.last_modified)}
    if (im := h.get(hdrs.IF_MATCH)) is not None:
        if not ranges.if_match(im, v):
            raise _precondition_failed("If-Match")
    elif (ius := request.if_unmodified_since) is not None and v.last_modified > ius.timestamp():
        raise _precondition_failed("If-Unmodified-Since")
    if (inm := h.get(hdrs.IF_NONE_MATCH)) is not None:
        modified = ranges.if_none_match(inm, v)
    else:
        ims = request.if_modified_since
        modified = ims is None or v.last_modified > ims.timestamp()
    if not modified:
        return web.Response(status=304, headers=validators)
    start, end, status = 0, v.size - 1, 200
    headers = {**validators, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
               "Content-Disposition": batch_files.content_disposition(filename)}
    spec = h.getall(hdrs.RANGE, ())
    if request.method == "GET" and len(spec) == 1:      # §14.2: only GET reads a Range; two are no one
        if_range = h.get(hdrs.IF_RANGE)
        if if_range is None or ranges.if_range_holds(
                if_range, None if ranges.if_range_etag(if_range) else _date(request.if_range), v):
            got = ranges.byte_range(spec[0], v.size)
            if got == ranges.UNSATISFIABLE:
                raise GatewayError(416, f"the Range asks for bytes past the end of the file ({v.size} bytes)",
                                   param="Range", code="range_not_satisfiable",
                                   headers={"Content-Range": f"bytes */{v.size}"}, error_class=ErrorClass.VALIDATION)
            if got is not None:
                start, end = got
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{v.size}"
    resp = web.StreamResponse(status=status, headers=headers)
    resp.content_length = end - start + 1
    await resp.prepare(request)
    if request.method == "HEAD":
        return resp
    left = end - start + 1
    if start:
        await asyncio.to_thread(fobj.seek, start)
    while left > 0:
        chunk = await asyncio.to_thread(fobj.read, min(CHUNK, left))
        if not chunk:           # cannot happen to a published file; the length told cannot be kept
            raise ConnectionResetError("the file ended before its size")
        left -= len(chunk)
        await resp.write(chunk)
    await resp.write_eof()
    return resp


def _date(d: Any) -> float | None:
    return None if d is None else d.timestamp()


def _http_date(seconds: int) -> str:
    return email.utils.formatdate(seconds, usegmt=True)


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    """A list's integer query parameter as OpenAI reads it: digits (a sign before them), from ``lo`` to
    ``hi``; anything else is OpenAI's 400 naming it, with the code that says what is wrong."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if not _INTEGER.fullmatch(raw):
        raise _bad(f"Invalid type for '{name}': expected an integer, but got '{_shown(raw)}' instead.", name,
                   "invalid_type")
    digits = raw.lstrip("+-").lstrip("0") or "0"            # its sign and size are what count
    v = (-1 if raw[0] == "-" else 1) * (int(digits) if len(digits) <= 12 else 10 ** 12)
    if v < lo:
        raise _bad(f"Invalid '{name}': integer below minimum value. Expected a value >= {lo}, but got "
                   f"{_shown(raw)} instead.", name, "integer_below_min_value")
    if v > hi:
        raise _bad(f"Invalid '{name}': integer above maximum value. Expected a value <= {hi}, but got "
                   f"{_shown(raw)} instead.", name, "integer_above_max_value")
    return v


class BatchApi:
    def __init__(self, cfg: BatchConfig, db: BatchDb, tenancy: Tenancy | NoTenancy,
                 on_change: Callable[[dict[str, Any]], None] = lambda doc: None) -> None:
        self.cfg, self.db, self.tenancy = cfg, db, tenancy
        # a batch created or cancelled (its object as stored): this process's runner, if it runs
        # batches, takes it up at once (a cancel stops its lines before the answer goes)
        self.on_change = on_change

    def add_routes(self, app: web.Application, tracked: Callable[[Handler], Handler] = lambda h: h) -> None:
        """``tracked``: what makes a handler's requests count in flight for the drain
        (gateway/server/lifecycle.py ``Lifecycle.tracked``)."""
        r = app.router

        def wrap(handler: Handler) -> Handler:
            return tracked(_stored(handler))
        r.add_post("/v1/files", wrap(self.upload))
        r.add_get("/v1/files", wrap(self.list_files))
        r.add_get("/v1/files/{file_id}", wrap(self.get_file))
        r.add_delete("/v1/files/{file_id}", wrap(self.delete_file))
        r.add_get("/v1/files/{file_id}/content", wrap(self.content))
        r.add_post("/v1/batches", wrap(self.create_batch))
        r.add_get("/v1/batches", wrap(self.list_batches))
        r.add_get("/v1/batches/{batch_id}", wrap(self.get_batch))
        r.add_post("/v1/batches/{batch_id}/cancel", wrap(self.cancel_batch))

    async def _caller(self, request: web.Request) -> tuple[str, str | None]:
        """(the owner of what this request creates, the owner to filter by: None with auth off)."""
        t = await self.tenancy.authenticate(request, None)
        if isinstance(self.tenancy, Tenancy) and self.tenancy.auth_on:
            return t.user or "", t.user or ""
        return "", None

    # -- files --------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        owner, _ = await self._caller(request)
        cfg = self.cfg
        if not request.content_type.startswith("multipart/form-data"):
            raise _bad("expected a multipart/form-data body with the fields 'file' and 'purpose'", "file")
        length = request.content_length
        most = cfg.max_file_bytes + MULTIPART_SLACK     # what a body may hold; the edge refuses a told length above
        if length is not None and length > most:
            raise _bad(f"the file exceeds batch.max_file_bytes ({cfg.max_file_bytes} bytes)", "file",
                       "file_too_large", 413)
        bounds = (cfg.max_stored_bytes_per_user, cfg.max_stored_bytes)
        if any(bounds):     # a first look, before the body is read: no room is known now for its file
            try:
                await self.db.run(BatchStore.check_bounds, owner, max(1, (length or 0) - MULTIPART_SLACK), *bounds)
            except OverBound as e:
                raise _over_bound(e, request) from None
        field_limit = request.client_max_size         # server.max_body_bytes (0: none); FIELD_MAX at most
        # held (locked) until it is published or removed: a process starting on the directory leaves it
        tmp, held = await _claimed(self.db.dir)
        purpose: str | None = None
        expiry: dict[str, str] = {}                   # expires_after[<key>] fields, by key
        expiry_text: str | None = None                # an expires_after field with no key: not an object
        got: tuple[str, int, int, GatewayError | None] | None = None    # (filename, bytes, lines, fault)
        try:
            try:
                reader = await request.multipart()
                while (part := await reader.next()) is not None:
                    # a body of no told length, read as far as a told one may be: each field is
                    # read to 64 KiB at most, but a client sending field after field would
                    # otherwise keep this reading without end
                    if request.content.total_bytes > most:
                        raise _bad(f"the file exceeds batch.max_file_bytes ({cfg.max_file_bytes} bytes)", "file",
                                   "file_too_large", 413)
                    if not isinstance(part, aiohttp.BodyPartReader):
                        raise _bad("nested multipart bodies are not accepted", "file")
                    if part.name == "purpose":
                        purpose = (await _field(part, field_limit)).decode("utf-8", "replace").strip()
                    elif part.name == "expires_after":
                        expiry_text = (await _field(part, field_limit)).decode("utf-8", "replace").strip()
                    elif part.name and part.name.startswith("expires_after[") and part.name.endswith("]"):
                        raw = await _field(part, field_limit)
                        key = part.name[14:-1]
                        if key in expiry or len(expiry) < EXPIRY_KEYS_KEPT:     # the first unknown one is named
                            expiry[key] = raw.decode("utf-8", "replace").strip()
                    elif part.name == "file" and got is None:
                        if purpose is not None:     # told first (the SDKs do): the file is read for it
                            _check_purpose(purpose)
                        got = await self._receive(part, tmp, judged=purpose is not None)
                    else:
                        await _field(part, field_limit)
            except (aiohttp.ClientPayloadError, web.HTTPException, ValueError, AssertionError,
                    asyncio.IncompleteReadError, ConnectionError, HttpProcessingError) as e:
                if isinstance(e, GatewayError):
                    raise
                raise _bad(f"the upload could not be read whole (truncated or malformed multipart body): "
                           f"{type(e).__name__}", "file", "truncated_upload") from None
            if got is None:
                raise _bad("missing multipart field 'file'", "file", "missing_required_parameter")
            if purpose is None:
                raise _bad("missing multipart field 'purpose'", "purpose", "missing_required_parameter")
            _check_purpose(purpose)
            filename, size, lines, fault = got
            if fault is not None:           # the file's own fault, kept while its purpose was not known
                raise fault
            ttl_s = _ttl(expiry_text if expiry_text is not None else expiry or None, cfg.file_ttl_s)
            file_id = batch_files.new_file_id()
            await asyncio.to_thread(batch_files.publish, self.db.dir, tmp, file_id)
            f = batch_files.file_object(file_id, filename, "batch", size, ttl_s)
            try:        # the bounds looked at again in the insert's transaction: uploads racing in other workers count
                await self.db.run(BatchStore.add_file, f, owner, lines, *bounds)
            except BaseException as e:      # not stored: the published file goes too (no orphan)
                await asyncio.shield(asyncio.to_thread(_unlink, batch_files.path_of(self.db.dir, file_id)))
                if isinstance(e, OverBound):
                    raise _over_bound(e, request, size) from None
                raise
            return _json(f)
        finally:
            await asyncio.shield(asyncio.to_thread(_unlink_and_close, tmp, held))

    async def _receive(self, part: aiohttp.BodyPartReader, tmp: str,
                       judged: bool) -> tuple[str, int, int, GatewayError | None]:
        """The file part to ``tmp``, checked line by line as it arrives (a thread writes and checks):
        (its name, bytes, lines, its fault). ``judged``: the purpose, told before the file, is
        batch, and a fault of the file (its name, a line) is raised at once. Told after it (curl -F
        writes the fields in the order given), the purpose is judged first once the form is read: a
        fault is then kept and the rest of the file read to its end, counted against
        ``batch.max_file_bytes``, neither checked nor stored, so a file for another purpose (or none)
        is refused for its purpose whatever it holds, as when the purpose comes first."""
        cfg = self.cfg
        name = batch_files.form_filename(part.headers.get(hdrs.CONTENT_DISPOSITION))
        fault: GatewayError | None = None
        if name is None:
            fault = _bad("the 'file' field must be a file (with a filename)", "file")
        elif problem := batch_files.filename_problem(name):
            fault = _bad(problem, "file", "invalid_filename")
        if fault is not None and judged:
            raise fault
        check = LineCheck(cfg.max_lines, cfg.max_line_bytes)
        size = lines = 0
        f = await asyncio.to_thread(open, tmp, "wb") if fault is None else None
        try:
            while chunk := await part.read_chunk(CHUNK):
                size += len(chunk)
                if size > cfg.max_file_bytes:
                    raise _bad(f"the file exceeds batch.max_file_bytes ({cfg.max_file_bytes} bytes)", "file",
                               "file_too_large", 413)
                if fault is None:
                    try:
                        await asyncio.to_thread(_write_checked, f, check, chunk)
                    except LineError as e:
                        fault = _line_fault(e)
                        if judged:
                            raise fault from None
            if fault is None:
                try:
                    lines = await asyncio.to_thread(check.finish)
                except LineError as e:
                    fault = _line_fault(e)
                    if judged:
                        raise fault from None
        finally:
            if f is not None:
                await asyncio.to_thread(f.close)
        return name or "", size, lines, fault

    async def list_files(self, request: web.Request) -> web.Response:
        _, who = await self._caller(request)
        limit = _int_param(request, "limit", 10_000, 1, 10_000)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise _bad(f"Invalid value: '{_shown(order)}'. Supported values are: 'asc' and 'desc'.", "order",
                       "invalid_value")
        data, more = await self._page(BatchStore.list_files, who, request.query.get("purpose"), order,
                                      request.query.get("after"), limit)
        return _json(_list(data, more))

    async def _file(self, request: web.Request) -> dict[str, Any]:
        _, who = await self._caller(request)
        fid = request.match_info["file_id"]
        f = await self.db.run(BatchStore.get_file, fid, who) if batch_files.valid_id(fid) else None
        if f is None:
            raise GatewayError(404, f"No such File object: {_shown(fid)}", param="id", code="file_not_found")
        return f

    async def get_file(self, request: web.Request) -> web.Response:
        return _json(await self._file(request))

    async def content(self, request: web.Request) -> web.StreamResponse:
        f = await self._file(request)
        path = batch_files.path_of(self.db.dir, f["id"])
        try:
            fobj, st = await asyncio.to_thread(_open_file, path)
        except FileNotFoundError:       # its bytes left the disk: no empty page
            raise GatewayError(404, f"The content of file {f['id']} is no longer stored", param="id",
                               code="file_not_found") from None
        except OSError as e:            # they are there, and cannot be read: the storage fails, not the client
            log.warning("batch storage error", path=request.path, method=request.method, file_id=f["id"],
                        error=str(e))
            raise GatewayError(500, f"The content of file {f['id']} could not be read from the gateway's "
                               f"storage ({e.strerror or e}); try again later.", code="storage_error") from None
        try:
            return await _send(request, fobj, ranges.Validators.of(st), f["filename"])
        finally:
            await asyncio.shield(asyncio.to_thread(fobj.close))

    async def delete_file(self, request: web.Request) -> web.Response:
        f = await self._file(request)
        try:           # in one transaction with the check: another worker may create a batch on it
            row = await self.db.run(BatchStore.delete_file, f["id"], True)
        except FileInUse:
            raise _bad(f"file {f['id']} is the input of a batch still running; cancel the batch first", "id",
                       "file_in_use") from None
        if row is not None and (why := await asyncio.shield(self._discard(row))) is not None:
            log.warning("batch file not deleted: its bytes could not be removed", file_id=f["id"], error=why)
            raise GatewayError(500, f"The bytes of file {f['id']} could not be removed from the gateway's storage "
                               f"({why}); the file is kept: try again later.", code="storage_error")
        return _json({"id": f["id"], "object": "file", "deleted": True})

    async def _discard(self, row: tuple) -> str | None:
        """The bytes of a file the store has just let go of leave the disk; when they cannot, the
        file goes back in the store as it was, and what stopped them is returned (else None): a
        file is deleted whole or not at all, never answered deleted with its bytes left behind."""
        try:
            await asyncio.to_thread(batch_files.discard, self.db.dir, row[0])
        except OSError as e:
            await self.db.run(BatchStore.restore_file, row)
            return e.strerror or str(e)
        return None

    # -- batches ------------------------------------------------------------------------------

    async def create_batch(self, request: web.Request) -> web.Response:
        owner, who = await self._caller(request)
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise _bad("the body is not valid JSON", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object", None, "invalid_json")
        fid = body.get("input_file_id")
        if not isinstance(fid, str) or not fid:
            raise _bad("input_file_id is required", "input_file_id", "missing_required_parameter")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise _bad(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint", "invalid_value")
        window = body.get("completion_window")
        if not isinstance(window, str) or window not in COMPLETION_WINDOWS:
            raise _bad("completion_window must be '24h'", "completion_window", "invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and not _metadata_ok(metadata):
            raise _bad(f"metadata must be an object of at most {MAX_METADATA} string values (keys up to 64 "
                       "characters, values up to 512)", "metadata", "invalid_value")
        output_ttl_s = (_expires_after(body["output_expires_after"], "output_expires_after")
                        if "output_expires_after" in body else None)
        f = await self.db.run(BatchStore.get_file, fid, who) if batch_files.valid_id(fid) else None
        if f is None:
            raise _bad(f"No such File object: {_shown(fid)}", "input_file_id", "file_not_found")
        if f["purpose"] != "batch":
            raise _bad(f"file {fid} was not uploaded with purpose 'batch'", "input_file_id", "invalid_file_purpose")
        now = now_s()
        doc = {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": endpoint, "errors": None,
               "input_file_id": fid, "completion_window": window, "status": "validating",
               "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
               "expires_at": now + COMPLETION_WINDOWS[window], "finalizing_at": None, "completed_at": None,
               "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "model": None,
               "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}}
        # in one transaction with a check of its file: another worker may delete it meanwhile
        if not await self.db.run(BatchStore.add_batch, doc, owner, output_ttl_s, True):
            raise _bad(f"No such File object: {_shown(fid)}", "input_file_id", "file_not_found")
        self.on_change(doc)
        return _json(doc)

    async def list_batches(self, request: web.Request) -> web.Response:
        _, who = await self._caller(request)
        limit = _int_param(request, "limit", 20, 1, 100)
        data, more = await self._page(BatchStore.list_batches, who, request.query.get("after"), limit)
        return _json(_list(data, more))

    async def _page(self, method, *args: Any) -> tuple[list[dict[str, Any]], bool]:
        """A list's page; an ``after`` that names none of the caller's objects is a 400 naming it
        (read as no cursor, it would start the list over: objects the caller already paged past
        would come again as if they came after it)."""
        try:
            return await self.db.run(method, *args)
        except UnknownCursor as e:
            raise _bad(f"Invalid 'after': no object with id '{str(e)[:64]}' to list after.", "after",
                       "invalid_value") from None

    async def _batch(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        _, who = await self._caller(request)
        bid = request.match_info["batch_id"]
        doc = await self.db.run(BatchStore.get_batch, bid, who)
        if doc is None:
            raise GatewayError(404, f"No such Batch object: {_shown(bid)}", param="batch_id", code="batch_not_found")
        return bid, doc

    async def get_batch(self, request: web.Request) -> web.Response:
        return _json((await self._batch(request))[1])

    async def cancel_batch(self, request: web.Request) -> web.Response:
        bid, doc = await self._batch(request)
        now = now_s()

        def cancel(d: dict[str, Any]) -> bool:
            if d["status"] == "validating" or d["status"] == "in_progress" and not _window_ended(d, now):
                d.update(status="cancelling", cancelling_at=now)
                return True
            return False
        doc = await self.db.run(BatchStore.update_batch, bid, cancel) or doc
        if doc["status"] == "in_progress" and _window_ended(doc, now):
            # it has expired: the runner ends it so at its next look, if it has not begun already
            raise _bad("Cannot cancel a batch with status expired", "batch_id", "invalid_batch_state")
        if doc["status"] not in ACTIVE or doc["status"] == "finalizing":
            raise _bad(f"Cannot cancel a batch with status {doc['status']}", "batch_id", "invalid_batch_state")
        self.on_change(doc)
        return _json(doc)


def _over_bound(e: OverBound, request: web.Request, size: int | None = None) -> GatewayError:
    """The answer to an upload past a bound of the bytes stored: the owner's share a 400 they can
    act on (delete files), the total a 507, as a full disk is (the SDKs retry it)."""
    the_file = f", and the file has {size}" if size is not None else ""
    if e.which == "user":
        return _bad(f"The file would exceed your file storage quota: your files take {e.stored} bytes of the "
                    f"{e.bound} that batch.max_stored_bytes_per_user allows{the_file}. Delete files you no longer "
                    "need, or wait for them to expire, and try again.", "file", "storage_quota_exceeded")
    log.warning("batch storage bound reached", path=request.path, stored=e.stored, max_stored_bytes=e.bound)
    return GatewayError(507, f"The gateway has no room left to store this file: its files take {e.stored} bytes "
                        f"of the {e.bound} that batch.max_stored_bytes allows{the_file}; try again later.",
                        code="insufficient_storage")


def _window_ended(doc: dict[str, Any], now: int) -> bool:
    """Whether an in-progress batch has expired: its ``expires_at`` passed, as the runner judges it."""
    return bool(doc.get("expires_at")) and now >= doc["expires_at"]


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)      # a full disk, a quota, a file size limit


def _no_room(e: BaseException) -> str | None:
    """What says ``batch.dir`` has no room for a write (a file's, the job store's), or None."""
    if isinstance(e, OSError) and e.errno in NO_ROOM:
        return e.strerror or str(e)
    if isinstance(e, sqlite3.OperationalError) and getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return str(e)
    return None


# what a disk or file system answers a write (or a read) it refuses for a reason other than room:
# a file system read-only (the kernel remounts one so after an I/O error), a failing disk, batch.dir
# or its tmp/ and files/ made unwritable, removed or moved elsewhere under the gateway
STORAGE_FAULTS = frozenset({errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR,
                            errno.EISDIR, errno.EXDEV, errno.ESTALE, errno.ENXIO, errno.ENODEV})


def _storage_fault(e: BaseException) -> str | None:
    """A disk or file system under ``batch.dir`` that refused an operation (``STORAGE_FAULTS``), or
    None; the job store's own faults are ``_store_io_error``."""
    if isinstance(e, OSError) and not isinstance(e, ConnectionError) and e.errno in STORAGE_FAULTS:
        return e.strerror or str(e)
    return None


def _store_io_error(e: BaseException) -> str | None:
    """SQLite's "disk I/O error" on the job store, or None: a write the disk refused for a reason
    SQLite does not name (a file size limit, a quota: only a full disk is its SQLITE_FULL; a
    failing disk), not a fault of the gateway's."""
    code = getattr(e, "sqlite_errorcode", None)
    if (isinstance(e, sqlite3.OperationalError) and code is not None and code & 0xFF == sqlite3.SQLITE_IOERR
            and code != sqlite3.SQLITE_IOERR_NOMEM):
        return str(e)
    return None


def _stored(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
            ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """``handler``, a write that finds no room under ``batch.dir`` answered as the server's
    condition it is: 507 ``insufficient_storage`` (RFC 4918 §11.5), which the SDKs retry as any 5xx,
    and a warning logged, where it was a 500 ``internal_error`` counted and logged as a bug. What
    the request made is not kept (an upload's temporary file is removed as on any refusal). A
    write of the job store SQLite reports as a disk I/O error is a 500 ``storage_error``, logged
    as a warning too: SQLite does not say which it was, a limit or a failing disk; and so is a
    file's write or read the disk refuses for another reason than room (``STORAGE_FAULTS``: a file
    system read-only, an I/O error), which is the server's storage failing, not a bug."""
    @functools.wraps(handler)
    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except (OSError, sqlite3.OperationalError) as e:
            if (why := _no_room(e)) is not None:
                log.warning("batch storage full", path=request.path, method=request.method, error=why)
                raise GatewayError(507, f"The gateway has no room left to store this request's data ({why}); "
                                   "try again later.", code="insufficient_storage") from None
            if (why := _store_io_error(e) or _storage_fault(e)) is not None:
                log.warning("batch storage error", path=request.path, method=request.method, error=str(e))
                done = "read the stored data" if request.method in ("GET", "HEAD") else "store this request's data"
                raise GatewayError(500, f"The gateway could not {done} ({why}); try again later.",
                                   code="storage_error") from None
            raise
    return run


def _check_purpose(purpose: str) -> None:
    """Only batch input is uploaded here. Checked before the file is read when the form tells the
    purpose first, as OpenAI's SDKs send it: a file for another purpose (a fine-tuning file, whose
    lines are no batch requests) is refused for its purpose, not for its first line."""
    if purpose != "batch":
        raise _bad(f"purpose {_shown(purpose)!r} is not served here: only 'batch'", "purpose", "invalid_value")


def _ttl(expiry: dict[str, str] | str | None, file_ttl_s: int) -> int:
    """An upload's lifetime in seconds (0: none): ``batch.file_ttl_s``, or the ``expires_after`` the
    client asked for when it is shorter. ``expiry`` is the form's ``expires_after[<key>]`` fields by
    key, the text of a plain ``expires_after`` field, or None when the form had neither; it is read
    as a batch's ``output_expires_after`` is, a form's ``seconds`` an integer when its text is one."""
    if expiry is None:
        return file_ttl_s
    value: str | dict[str, Any] = expiry if isinstance(expiry, str) else {
        k: int(v) if k == "seconds" and re.fullmatch(r"-?[0-9]+", v) else v for k, v in expiry.items()}
    return batch_files.lifetime(_expires_after(value, "expires_after", form=True), file_ttl_s)


async def _field(part: aiohttp.BodyPartReader, body_limit: int) -> bytes:
    """A form field other than the file: its first ``FIELD_KEPT`` bytes (the fields read are short
    words and numbers), the rest read and counted, not kept. A field larger than ``body_limit``
    (``server.max_body_bytes``, 0: none) or than ``FIELD_MAX``, whichever is less, is a 413 naming
    it, as a file too large is: the gateway stops reading there. Without ``FIELD_MAX`` a field was
    read to its end, however long, when the body limit was off."""
    by_body = 0 < body_limit <= FIELD_MAX
    limit = body_limit if by_body else FIELD_MAX
    head = bytearray()
    size = 0
    while chunk := await part.read_chunk(CHUNK):
        size += len(chunk)
        if size > limit:
            name = (part.name or "")[:64]
            cap = (f"server.max_body_bytes ({limit} bytes)" if by_body
                   else f"{limit} bytes, the most read of a form field other than 'file'")
            raise _bad(f"the multipart field '{name}' exceeds {cap}", name, "field_too_large", 413)
        if len(head) < FIELD_KEPT:
            head += chunk[:FIELD_KEPT - len(head)]
    return bytes(head)


def _expires_after(value: Any, name: str, form: bool = False) -> int:
    """A batch's ``output_expires_after`` or an upload's ``expires_after`` (``name``) read as OpenAI
    reads it: an object of ``anchor`` (``created_at``: the file's creation) and ``seconds`` (an
    integer from 3600 to 2592000), nothing else; the seconds. Anything else is OpenAI's 400 naming
    the field at fault. ``form``: the value came as form fields, whose values are all text; a
    ``seconds`` that is not an integer is shown as it came."""
    if not isinstance(value, dict):
        raise _bad(f"Invalid type for '{name}': expected an object, but got {json_type(value)} instead.", name,
                   "invalid_type")
    for key in value:
        if key not in ("anchor", "seconds"):
            raise _bad(f"Unknown parameter: '{name}.{str(key)[:64]}'.", f"{name}.{str(key)[:64]}", "unknown_parameter")
    for key in ("anchor", "seconds"):
        if key not in value:
            raise _bad(f"Missing required parameter: '{name}.{key}'.", f"{name}.{key}", "missing_required_parameter")
    anchor = value["anchor"]
    if not isinstance(anchor, str):
        raise _bad(f"Invalid type for '{name}.anchor': expected one of 'created_at', but got {json_type(anchor)}"
                   " instead.", f"{name}.anchor", "invalid_type")
    if anchor != "created_at":
        raise _bad(f"Invalid value: '{_shown(anchor)}'. Supported values are: 'created_at'.", f"{name}.anchor",
                   "invalid_value")
    seconds = value["seconds"]
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        got = f"'{_shown(str(seconds))}'" if form else json_type(seconds)
        raise _bad(f"Invalid type for '{name}.seconds': expected an integer, but got {got} instead.",
                   f"{name}.seconds", "invalid_type")
    lo, hi = EXPIRES_AFTER_S
    if seconds < lo:
        raise _bad(f"Invalid '{name}.seconds': integer below minimum value. Expected a value >= {lo}, but got "
                   f"{_shown(str(seconds))} instead.", f"{name}.seconds", "integer_below_min_value")
    if seconds > hi:
        raise _bad(f"Invalid '{name}.seconds': integer above maximum value. Expected a value <= {hi}, but got "
                   f"{_shown(str(seconds))} instead.", f"{name}.seconds", "integer_above_max_value")
    return seconds


def _shown(value: str) -> str:
    """A client's value in a message, a long one cut in its middle (an id the gateway made, 30
    characters at most, is shown whole)."""
    return value if len(value) <= 40 else f"{value[:18]}...{value[-18:]}"


def _metadata_ok(m: Any) -> bool:
    return (isinstance(m, dict) and len(m) <= MAX_METADATA
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in m.items()))


def _line_fault(e: LineError) -> GatewayError:
    return _bad(f"invalid batch input file: {e.message}", e.param or "file", e.code)


def _write_checked(f, check: LineCheck, chunk: bytes) -> None:
    check.feed(chunk)
    f.write(chunk)


async def _claimed(directory: str) -> tuple[str, int]:
    """A locked temporary file (``files.claim_temp``), made on a thread; one made for a request
    cancelled meanwhile is removed and let go, not left held."""
    claim = asyncio.ensure_future(asyncio.to_thread(batch_files.claim_temp, directory))
    try:
        return await asyncio.shield(claim)
    except asyncio.CancelledError:
        def drop(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is None:
                asyncio.ensure_future(asyncio.to_thread(_unlink_and_close, *t.result()))
        claim.add_done_callback(drop)
        raise


def _unlink_and_close(path: str, fd: int) -> None:
    """An upload's temporary file removed (if it was not published), then its lock let go."""
    try:
        _unlink(path)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
