"""Files on disk under ``batch.dir``: ``files/<id>`` holds a file's bytes, ``tmp/`` uploads in progress.

A file's path is made of its id alone (``file-`` and 24 random hex digits): the client's filename is
only a label, checked (no path separators, no ``..``, no control characters) and never joined to a
path. A file appears under ``files/`` by an atomic rename once it is whole and checked, so a
process killed mid-upload leaves at most a temporary file. The process writing a temporary file
holds a ``flock`` on it until the file is renamed or removed, so a process starting on the
directory (a worker restarted, another gateway) removes the ones a dead process left, whose lock
the kernel released, and not those another process is still writing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from aiohttp.multipart import content_disposition_filename, parse_content_disposition

from gateway.batch.store import now_s

_ID = re.compile(r"\Afile-[0-9a-f]{24}\Z")
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f/\\]")
MAX_FILENAME = 255
# what the WHATWG multipart encoder escapes in a filename (browsers, curl since 7.81, httpx: the
# openai SDK's client), and nothing else: a "%" it writes as it is
_FORM_ESCAPE = re.compile(r"%(22|0[aAdD])")
_FORM_ESCAPED = {"22": '"', "0a": "\n", "0d": "\r"}
# RFC 8187's attr-char beyond the letters, digits and "-._~" that quote() always keeps
_ATTR_CHARS = "!#$&+^`|"


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def valid_id(file_id: str) -> bool:
    return _ID.match(file_id) is not None


def path_of(directory: str, file_id: str) -> str:
    if not valid_id(file_id):
        raise ValueError(f"not a file id: {file_id!r}")
    return os.path.join(directory, "files", file_id)


def open_stored(path: str):
    """A stored file's bytes opened for reading (a binary file object), never waiting: what stands
    in its place that is not a regular file (a directory, a FIFO, whose plain open would wait for a
    writer for good, a device) is an ``OSError`` (``EISDIR``, ``EINVAL``), as a file that cannot
    be read (``EACCES``, ``EIO``) is; one that is gone is ``FileNotFoundError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            raise OSError(errno.EINVAL, "Not a regular file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def form_filename(disposition: str | None) -> str | None:
    """The name a form's file part gives (its ``Content-Disposition``), as its client gave it; None
    when it gives none. A ``filename`` has the WHATWG encoder's escapes undone (RFC 7578 §4.2: ``%22``
    a double quote, ``%0A`` and ``%0D`` a line break), and no other percent sign: the encoder writes a
    ``%`` of the name as it is, so ``%41`` is the client's text. A quoted-pair (``\\"``, older curl)
    is undone by the header's parser, and so is a ``filename*`` (RFC 5987; RFC 7578 forbids senders
    it, read where one is sent): it is taken as it decodes, with no escape undone twice."""
    _, params = parse_content_disposition(disposition)
    name = content_disposition_filename(params, "filename")
    if name is None or "filename" not in params or "filename*" in params:
        return name
    return _FORM_ESCAPE.sub(lambda m: _FORM_ESCAPED[m.group(1).lower()], name)


def content_disposition(name: str) -> str:
    """A file's name in its download's ``Content-Disposition`` (RFC 6266 §4.3, Appendix D): the name
    itself in ``filename*`` (UTF-8, percent-encoded: RFC 8187), after a ``filename`` for the clients
    that read no ``filename*``, where a character that is not printable ASCII, or is a ``"``, a
    ``\\`` or a ``%`` (which clients read differently in a quoted name) is a ``_``."""
    plain = "".join(c if " " <= c <= "~" and c not in '"\\%' else "_" for c in name)
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{quote(name.encode('utf-8', 'replace'), safe=_ATTR_CHARS)}"


def filename_problem(name: str) -> str | None:
    """Why ``name`` is not accepted as a filename (None: it is)."""
    if not name or len(name) > MAX_FILENAME:
        return f"filename must have 1 to {MAX_FILENAME} characters"
    if _BAD_NAME.search(name) or name in (".", "..") or name.startswith(".."):
        return "filename must be a plain name: no path separators, no '..', no control characters"
    if not name.isascii():
        try:
            name.encode()
        except UnicodeEncodeError:      # bytes that are not UTF-8, held by the parser as surrogates
            return "filename must be UTF-8 text"
    return None


def prepare(directory: str) -> None:
    """The directory's layout; temporary files a process that died left removed."""
    for sub in ("files", "tmp"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    clear_temps(directory)


# a temporary file is locked just after it is made: one younger than this may not be locked yet
TEMP_GRACE_S = 60.0


def clear_temps(directory: str) -> None:
    """Removes the temporary files no process holds (``claim_temp``: their process died, or a
    version that did not lock them left them) once older than ``TEMP_GRACE_S``; another worker's
    or gateway's upload under way, or a batch's output it writes, is left alone."""
    tmp = os.path.join(directory, "tmp")
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    old = time.time() - TEMP_GRACE_S
    for name in names:
        path = os.path.join(tmp, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)     # a FIFO left there is not waited on
        except OSError:
            continue
        try:
            if os.fstat(fd).st_mtime >= old:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue            # held: a process writes it
            os.unlink(path)         # under the lock: its writer is gone
        except OSError:
            pass
        finally:
            os.close(fd)


def temp_path(directory: str) -> str:
    return os.path.join(directory, "tmp", "upload-" + secrets.token_hex(8))


def claim_temp(directory: str) -> tuple[str, int]:
    """A new temporary file and a descriptor holding its ``flock``: while the caller keeps the
    descriptor open, no process clears the file (``clear_temps``). Remove or rename the file before
    closing the descriptor."""
    path = temp_path(directory)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return path, fd


def lifetime(asked_s: int | None, file_ttl_s: int) -> int:
    """A file's lifetime in seconds (0: none): ``batch.file_ttl_s``, or what the client asked for
    (an upload's ``expires_after``, a batch's ``output_expires_after``) when that is shorter."""
    if asked_s is None:
        return file_ttl_s
    return min(asked_s, file_ttl_s) if file_ttl_s else asked_s


def file_object(file_id: str, filename: str, purpose: str, size: int, ttl_s: int) -> dict[str, Any]:
    created = now_s()
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": created + ttl_s if ttl_s else None,
            "status_details": None}


def publish(directory: str, tmp: str, file_id: str) -> None:
    """The checked upload becomes the file (fsynced, then renamed into place)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path_of(directory, file_id))


def write_lines(directory: str, filename: str, lines: Iterable[bytes], ttl_s: int) -> dict[str, Any]:
    """A batch's output or error file from its lines (streamed: one line in memory at a time)."""
    file_id = new_file_id()
    tmp, held = claim_temp(directory)
    size = 0
    try:
        with open(tmp, "wb") as f:
            for line in lines:
                f.write(line)
                f.write(b"\n")
                size += len(line) + 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path_of(directory, file_id))
    except BaseException:       # a full disk, say: the part written goes, not held until the next start
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        os.close(held)
    return file_object(file_id, filename, "batch_output", size, ttl_s)


def remove(directory: str, file_id: str) -> None:
    try:
        os.unlink(path_of(directory, file_id))
    except (OSError, ValueError):
        pass


def discard(directory: str, file_id: str) -> None:
    """A file's bytes leave the disk; ``OSError`` when they cannot (a read-only directory or file
    system, an I/O error), not when they are gone already."""
    try:
        os.unlink(path_of(directory, file_id))
    except FileNotFoundError:
        pass


STRAY_AGE_S = 600.0


def strays(directory: str, known: set[str]) -> list[str]:
    """Files on disk the store does not know (their process died between the disk and the store),
    older than ``STRAY_AGE_S``: a file is renamed into place just before the store learns of it."""
    base = os.path.join(directory, "files")
    try:
        names = os.listdir(base)
    except OSError:
        return []
    old = time.time() - STRAY_AGE_S
    out = []
    for n in names:
        if valid_id(n) and n not in known:
            try:
                if os.stat(os.path.join(base, n)).st_mtime < old:
                    out.append(n)
            except OSError:
                pass
    return out
