"""The job store: files, batches and answered lines in one SQLite database under ``batch.dir``.

Durability is SQLite's: WAL journal, each change one transaction. A batch line's answer is a row
keyed by ``(batch_id, custom_id)`` and inserted with ``INSERT OR IGNORE``, so a line answered twice
(a restart re-runs the lines whose answers were not committed yet) is stored, counted and written
out once. The batch object is kept as its OpenAI JSON document beside an indexed status; every
change to it is a read-modify-write inside ``BEGIN IMMEDIATE``, so the runner's counts and another
worker's cancel never overwrite each other. Lists go by ``created_at`` (whole seconds), then by
``rowid``, which SQLite gives each new row above every row the table holds, so objects made within
one second list in the order they were made. A file deleted or expired leaves its place
(``gone_files``: its ``created_at`` and rowid) for a while, so a list's ``after`` may still name it;
a file's rowid is given above those places too, so a file made after one that went lists after it.

A store written by an older gateway opens as it is: a column added since (``MIGRATIONS``) is added
to its table when the store opens, empty in the rows it already holds.

Everything here is synchronous and runs on one thread per process (``BatchDb``): the event loop
never waits on the disk, and this process has one writer.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, lines INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    doc BLOB NOT NULL, output_ttl_s INTEGER
);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, created_at);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, line_no INTEGER NOT NULL, ok INTEGER NOT NULL,
    line BLOB NOT NULL, PRIMARY KEY (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS results_by_line ON results (batch_id, line_no);
CREATE TABLE IF NOT EXISTS gone_files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, pos INTEGER NOT NULL,
    gone_at INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS gone_files_by_pos ON gone_files (pos);
"""

# a deleted (or expired) file's place in the lists is kept this long, so a list's ``after`` naming
# it goes on from there: the SDKs' paginators name the last file of the page before, which a loop
# that deletes what it lists has just deleted
GONE_KEPT_S = 24 * 3600

# (table, column, its declaration): columns added after the table was first released; a store made
# before one was added gets it when it opens (NULL in its rows: nothing asked)
MIGRATIONS = (
    ("batches", "output_ttl_s", "INTEGER"),     # output_expires_after[seconds] of the batch's output files
    # 1: the document's model is this version's to say (read at validation, or read since); NULL: a
    # batch an older gateway made, whose model (always null then) was never read from its input
    ("batches", "model_read", "INTEGER"),
)

FILE_COLUMNS = "id, owner, filename, purpose, bytes, created_at, expires_at, lines"

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")

# room set aside beside the job store (``<store>.reserve``) for a delete on a full disk: the store
# writes the delete's change before the file's bytes go, so without it a disk that filled up could
# not be freed through the API; a delete's change takes a few pages of the WAL
RESERVE_BYTES = 256 * 1024


class UnknownCursor(Exception):
    """A list's ``after`` that names no object the caller may list (unknown, deleted, another
    user's): a cursor that cannot say where the page starts."""


class FileInUse(Exception):
    """A file a delete would remove is the input of a batch that has not ended."""


class OverBound(Exception):
    """An upload that would take the files stored past a bound: ``which`` is ``user`` (the owner's
    files, ``batch.max_stored_bytes_per_user``) or ``total`` (everyone's, ``batch.max_stored_bytes``);
    ``stored`` the bytes stored now, ``bound`` the bound."""

    def __init__(self, which: str, stored: int, bound: int) -> None:
        super().__init__(which, stored, bound)
        self.which, self.stored, self.bound = which, stored, bound


class Result(tuple):
    """One answered line: (custom_id, line_no, ok, the output line's bytes, its usage: prompt,
    completion, cached and reasoning tokens)."""

    __slots__ = ()

    def __new__(cls, custom_id: str, line_no: int, ok: bool, line: bytes,
                usage: tuple[int, int, int, int] = (0, 0, 0, 0)) -> Result:
        return tuple.__new__(cls, (custom_id, line_no, ok, line, usage))


class BatchStore:
    """The database; every method is one transaction (or one read)."""

    def __init__(self, path: str) -> None:
        # Workers open the same database at the same moment. Turning a new file to WAL and creating
        # the tables read first and then write outside ``BEGIN IMMEDIATE``, and SQLite answers
        # "database is locked" at once (no busy wait) to one of two connections that both try
        # that, so the opening steps take turns under an exclusive flock beside the database.
        with open(path + ".open-lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)         # released when the file closes
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")     # WAL: a process killed loses no commit
                self.db.execute("PRAGMA busy_timeout=30000")     # other workers write too
                self.db.executescript(SCHEMA)
                _migrate(self.db)
            except BaseException:
                self.db.close()
                raise
        self.reserve = path + ".reserve"
        self.keep_reserve()

    def close(self) -> None:
        self.db.close()

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(db)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:       # a COMMIT that failed (no room) may leave it open
                db.execute("ROLLBACK")
            raise
        return out

    def keep_reserve(self) -> None:
        """``RESERVE_BYTES`` set aside beside the store, if they are not and the disk has them (a
        delete that needed them gave them up; the file system's own allocation: no bytes written)."""
        try:
            if os.path.getsize(self.reserve) >= RESERVE_BYTES:
                return
        except OSError:
            pass
        try:
            fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT, 0o600)
        except OSError:
            return
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError:            # no room for it yet: the next delete tries again
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    def _tx_making_room(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``_tx``; when the disk has no room for its change (SQLite's "database or disk is full"),
        tried once more on the room the reserve held."""
        try:
            return self._tx(fn)
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_FULL:
                raise
            try:
                os.unlink(self.reserve)
            except OSError:
                raise e from None
        return self._tx(fn)

    # -- files --------------------------------------------------------------------------------

    def add_file(self, f: dict[str, Any], owner: str, lines: int = 0, per_user: int = 0, total: int = 0) -> None:
        """``per_user``, ``total``: the bounds of the bytes stored (0: none), checked in the insert's
        transaction (``OverBound``), so uploads racing from several workers never store more."""
        def tx(db: sqlite3.Connection) -> None:
            if per_user or total:
                _check_bounds(db, owner, f["bytes"], per_user, total)
            _insert_file(db, f, owner, lines)
        self._tx(tx)

    def check_bounds(self, owner: str, size: int, per_user: int, total: int) -> None:
        """``OverBound`` when ``size`` more bytes of ``owner``'s would pass a bound now (an upload's
        first look, before its bytes are read; ``add_file`` looks again as it stores it)."""
        _check_bounds(self.db, owner, size, per_user, total)

    def stored_bytes(self) -> int:
        """The bytes of every file in the store."""
        return self.db.execute("SELECT IFNULL(SUM(bytes), 0) FROM files").fetchone()[0]

    def file_lines(self, file_id: str) -> int:
        """The requests an uploaded file holds, as its upload counted them (0: unknown)."""
        row = self.db.execute("SELECT lines FROM files WHERE id = ?", (file_id,)).fetchone()
        return row[0] or 0 if row is not None else 0

    def output_files_named(self, owner: str, names: tuple[str, ...]) -> list[str]:
        """The ids of ``owner``'s ``batch_output`` files of these names (the runner names a batch's
        output and error files after the batch)."""
        marks = ", ".join("?" * len(names))
        return [r[0] for r in self.db.execute(
            f"SELECT id FROM files WHERE owner = ? AND purpose = 'batch_output' AND filename IN ({marks})",
            (owner, *names))]

    def get_file(self, file_id: str, owner: str | None) -> dict[str, Any] | None:
        """The file object, None when unknown or (with ``owner``) someone else's."""
        row = self.db.execute("SELECT id, owner, filename, purpose, bytes, created_at, expires_at, lines"
                              " FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None or (owner is not None and row[1] != owner):
            return None
        return _file(row)

    def list_files(self, owner: str | None, purpose: str | None, order: str, after: str | None,
                   limit: int) -> tuple[list[dict[str, Any]], bool]:
        where, args = ["1=1"], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if purpose:
            where.append("purpose = ?")
            args.append(purpose)
        cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        if after is not None:       # an empty one names no object either: a 400, not the first page
            row = self.db.execute("SELECT owner, created_at, rowid FROM files WHERE id = ?", (after,)).fetchone()
            if row is None:             # deleted or expired since it was listed: its place
                row = self.db.execute("SELECT owner, created_at, pos FROM gone_files WHERE id = ?", (after,)).fetchone()
            if row is None or (owner is not None and row[0] != owner):
                raise UnknownCursor(after)
            where.append(f"(created_at, rowid) {cmp} (?, ?)")
            args += [row[1], row[2]]
        rows = self.db.execute(
            "SELECT id, owner, filename, purpose, bytes, created_at, expires_at, lines FROM files"
            f" WHERE {' AND '.join(where)} ORDER BY created_at {direction}, rowid {direction} LIMIT ?",
            (*args, limit + 1)).fetchall()
        return [_file(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, unless_input: bool = False) -> tuple | None:
        """The file leaves the store; its place in the lists stays (``gone_files``) for ``GONE_KEPT_S``.
        ``unless_input``: ``FileInUse`` when it is the input of a batch that has not ended, checked in
        the delete's transaction (another worker may create a batch on it in between). Its row as it
        was (``restore_file`` puts it back), None when the store did not hold it."""
        def tx(db: sqlite3.Connection) -> tuple | None:
            row = db.execute(f"SELECT {FILE_COLUMNS}, rowid FROM files WHERE id = ?", (file_id,)).fetchone()
            if row is None:
                return None
            if unless_input and any(_batch(d)["input_file_id"] == file_id for (d,) in db.execute(
                    f"SELECT doc FROM batches WHERE status IN ({', '.join('?' * len(ACTIVE))})", ACTIVE)):
                raise FileInUse(file_id)
            db.execute("INSERT OR REPLACE INTO gone_files (id, owner, created_at, pos, gone_at) VALUES (?, ?, ?, ?, ?)",
                       (file_id, row[1], row[5], row[8], now_s()))
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            return tuple(row)
        self.keep_reserve()
        return self._tx_making_room(tx)

    def restore_file(self, row: tuple) -> None:
        """A file ``delete_file`` removed (its row as it returned it) back in the store, in its place
        of the lists (its rowid, which no file took meanwhile: a new one is given a rowid above the
        places of gone files): its bytes could not leave the disk."""
        def tx(db: sqlite3.Connection) -> None:
            db.execute(f"INSERT OR IGNORE INTO files ({FILE_COLUMNS}, rowid) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            db.execute("DELETE FROM gone_files WHERE id = ?", (row[0],))
        self._tx(tx)

    def forget_gone(self, before: int) -> int:
        """The places of files gone before ``before`` are forgotten: a cursor naming one is a 400."""
        return self._tx(lambda db: db.execute("DELETE FROM gone_files WHERE gone_at < ?", (before,)).rowcount)

    def expired_files(self, now: int) -> list[str]:
        return [r[0] for r in self.db.execute(
            "SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))]

    def file_ids(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT id FROM files")}

    # -- batches ------------------------------------------------------------------------------

    def add_batch(self, doc: dict[str, Any], owner: str, output_ttl_s: int | None = None,
                  input_stored: bool = False) -> bool:
        """``output_ttl_s``: the seconds its output and error files live (``output_expires_after``),
        None when the batch did not say; kept beside the document, which is OpenAI's batch object.
        ``input_stored``: added only while its input file is in the store, checked in the insert's
        transaction (another worker may delete it in between); whether it was added."""
        def tx(db: sqlite3.Connection) -> bool:
            if input_stored and db.execute("SELECT 1 FROM files WHERE id = ?", (doc["input_file_id"],)).fetchone() is None:
                return False
            db.execute("INSERT INTO batches (id, owner, status, created_at, doc, output_ttl_s, model_read)"
                       " VALUES (?, ?, ?, ?, ?, ?, 1)",
                       (doc["id"], owner, doc["status"], doc["created_at"], orjson.dumps(doc), output_ttl_s))
            return True
        return self._tx(tx)

    def output_ttl(self, batch_id: str) -> int | None:
        """The seconds a batch's output and error files live, as its creation asked; None: not asked."""
        row = self.db.execute("SELECT output_ttl_s FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row is not None else None

    def get_batch(self, batch_id: str, owner: str | None) -> dict[str, Any] | None:
        row = self.db.execute("SELECT owner, doc FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or (owner is not None and row[0] != owner):
            return None
        return _batch(row[1])

    def batch_owner(self, batch_id: str) -> str | None:
        row = self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row is not None else None

    def list_batches(self, owner: str | None, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        where, args = ["1=1"], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if after is not None:
            row = self.db.execute("SELECT owner, created_at, rowid FROM batches WHERE id = ?", (after,)).fetchone()
            if row is None or (owner is not None and row[0] != owner):
                raise UnknownCursor(after)
            where.append("(created_at, rowid) < (?, ?)")
            args += [row[1], row[2]]
        rows = self.db.execute(f"SELECT doc FROM batches WHERE {' AND '.join(where)}"
                               " ORDER BY created_at DESC, rowid DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [_batch(r[0]) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[dict[str, Any]]:
        marks = ",".join("?" * len(ACTIVE))
        return [orjson.loads(r[0]) for r in self.db.execute(
            f"SELECT doc FROM batches WHERE status IN ({marks}) ORDER BY created_at, id", ACTIVE)]

    def status_counts(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall())

    def update_batch(self, batch_id: str, change: Callable[[dict[str, Any]], bool],
                     model_read: bool = False) -> dict[str, Any] | None:
        """Apply ``change`` to the stored document (it returns whether it changed anything); the
        document as stored afterwards, None when the batch is unknown. ``model_read``: the change
        sets the batch's ``model`` as read from its input (its validation)."""
        def tx(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute("SELECT doc FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            doc = orjson.loads(row[0])
            if change(doc):
                db.execute("UPDATE batches SET status = ?, doc = ?, model_read = CASE WHEN ? THEN 1 ELSE model_read END"
                           " WHERE id = ?", (doc["status"], orjson.dumps(doc), int(model_read), batch_id))
            return doc
        return self._tx(tx)

    def models_unread(self, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` documents of batches an older gateway validated without reading their
        model (``model_read`` NULL), past validation (a batch still validating has it read then)."""
        return [orjson.loads(r[0]) for r in self.db.execute(
            "SELECT doc FROM batches WHERE model_read IS NULL AND status != 'validating' ORDER BY rowid LIMIT ?",
            (limit,))]

    def set_model_read(self, batch_id: str, model: str | None) -> dict[str, Any] | None:
        """A batch an older gateway made: its ``model``, read from its input since (None: several
        models, or its input is gone), stored once; the document afterwards."""
        def tx(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute("SELECT doc, model_read FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            doc = orjson.loads(row[0])
            if row[1] is None:
                if doc.get("model") is None:
                    doc["model"] = model
                db.execute("UPDATE batches SET doc = ?, model_read = 1 WHERE id = ?", (orjson.dumps(doc), batch_id))
            return doc
        return self._tx(tx)

    # -- answered lines -----------------------------------------------------------------------

    def record(self, batch_id: str, results: list[Result]) -> dict[str, Any] | None:
        """Store answered lines (one per custom_id: a line already stored is skipped) and count
        those that were new in the batch's document, in one transaction."""
        def tx(db: sqlite3.Connection) -> dict[str, Any] | None:
            ok = failed = p = c = cached = reasoning = 0
            for custom_id, line_no, good, line, usage in results:
                cur = db.execute("INSERT OR IGNORE INTO results (batch_id, custom_id, line_no, ok, line)"
                                 " VALUES (?, ?, ?, ?, ?)", (batch_id, custom_id, line_no, int(good), line))
                if cur.rowcount:
                    if good:
                        ok += 1
                    else:
                        failed += 1
                    p, c, cached, reasoning = p + usage[0], c + usage[1], cached + usage[2], reasoning + usage[3]
            row = db.execute("SELECT doc FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            doc = orjson.loads(row[0])
            if ok or failed:
                counts = doc["request_counts"]
                counts["completed"] += ok
                counts["failed"] += failed
                u = doc["usage"]
                u["input_tokens"] += p
                u["output_tokens"] += c
                u["total_tokens"] += p + c
                u["input_tokens_details"]["cached_tokens"] += cached
                u["output_tokens_details"]["reasoning_tokens"] += reasoning
                db.execute("UPDATE batches SET doc = ? WHERE id = ?", (orjson.dumps(doc), batch_id))
            return doc
        return self._tx(tx)

    def answered_in(self, batch_id: str, first: int, last: int) -> set[int]:
        """The line numbers in ``[first, last]`` that have an answer."""
        return {r[0] for r in self.db.execute(
            "SELECT line_no FROM results WHERE batch_id = ? AND line_no BETWEEN ? AND ?", (batch_id, first, last))}

    def result_lines(self, batch_id: str, ok: bool) -> Iterator[bytes]:
        """The stored output (or error) lines in input order, read lazily: memory stays flat."""
        cur = self.db.execute("SELECT line FROM results WHERE batch_id = ? AND ok = ? ORDER BY line_no",
                              (batch_id, int(ok)))
        while rows := cur.fetchmany(512):
            for (line,) in rows:
                yield line

    def count_results(self, batch_id: str, ok: bool) -> int:
        return self.db.execute("SELECT COUNT(*) FROM results WHERE batch_id = ? AND ok = ?",
                               (batch_id, int(ok))).fetchone()[0]

    def drop_results(self, batch_id: str) -> None:
        """A finished batch's lines, once its output and error files are written."""
        self._tx(lambda db: db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,)))

    def drop_ended_results(self) -> int:
        """The lines of every batch that ended, dropped (how many): a runner stopped between storing a
        batch's end and ``drop_results`` (killed, or failed on the drop) left them, and no runner
        takes that batch on again."""
        marks = ", ".join("?" * len(TERMINAL))
        return self._tx(lambda db: db.execute(
            f"DELETE FROM results WHERE batch_id IN (SELECT id FROM batches WHERE status IN ({marks}))",
            TERMINAL).rowcount)


def _insert_file(db: sqlite3.Connection, f: dict[str, Any], owner: str, lines: int) -> None:
    # its rowid above every file's and every gone file's place: SQLite gives the highest rowid of a
    # deleted row to the next one, which would list it before a cursor naming that row
    db.execute(
        "INSERT INTO files (rowid, id, owner, filename, purpose, bytes, created_at, expires_at, lines)"
        " VALUES (1 + MAX(IFNULL((SELECT MAX(rowid) FROM files), 0), IFNULL((SELECT MAX(pos) FROM gone_files), 0)),"
        " ?, ?, ?, ?, ?, ?, ?, ?)",
        (f["id"], owner, f["filename"], f["purpose"], f["bytes"], f["created_at"], f["expires_at"], lines))


def _check_bounds(db: sqlite3.Connection, owner: str, size: int, per_user: int, total: int) -> None:
    """``OverBound`` when ``size`` more bytes of ``owner``'s would pass ``per_user`` (the owner's
    files) or ``total`` (everyone's); 0: no bound."""
    if per_user:
        mine = db.execute("SELECT IFNULL(SUM(bytes), 0) FROM files WHERE owner = ?", (owner,)).fetchone()[0]
        if mine + size > per_user:
            raise OverBound("user", mine, per_user)
    if total:
        everyone = db.execute("SELECT IFNULL(SUM(bytes), 0) FROM files").fetchone()[0]
        if everyone + size > total:
            raise OverBound("total", everyone, total)


def _migrate(db: sqlite3.Connection) -> None:
    """The columns of ``MIGRATIONS`` a store made before them lacks, added (the caller holds the
    open lock, so two processes do not both add one)."""
    for table, column, decl in MIGRATIONS:
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def _batch(raw: bytes) -> dict[str, Any]:
    """A stored batch object; one an older gateway stored without ``model`` has it, null."""
    doc = orjson.loads(raw)
    doc.setdefault("model", None)
    return doc


def _file(row: tuple) -> dict[str, Any]:
    fid, _owner, filename, purpose, size, created, expires, _lines = row
    return {"id": fid, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": expires, "status_details": None}


class BatchDb:
    """The store on its own thread: ``await db.run(BatchStore.method, *args)``. One thread, so this
    process has one writer and calls are applied in the order they were made."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")
        self.store: BatchStore | None = None

    async def open(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self.store = await self.call(BatchStore, os.path.join(self.dir, "batches.sqlite3"))

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run(self, method: Callable[..., T], *args: Any) -> T:
        """``method`` (a ``BatchStore`` method, unbound) on the store."""
        assert self.store is not None
        return await self.call(method, self.store, *args)

    async def close(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            await self.call(store.close)
        self._pool.shutdown(wait=True)


def now_s() -> int:
    return int(time.time())
