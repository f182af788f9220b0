"""The job store: one answer per (batch, custom_id) however often a line is answered, counts that
follow, lists with OpenAI's cursors, and output lines streamed in input order."""

from __future__ import annotations

import pytest

from gateway.batch.store import BatchStore, Result, UnknownCursor


def doc(bid: str, created: int = 100, status: str = "in_progress") -> dict:
    return {"id": bid, "status": status, "created_at": created, "request_counts": {"total": 3, "completed": 0, "failed": 0},
            "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}}


def test_a_line_answered_twice_is_stored_and_counted_once(tmp_path):
    s = BatchStore(str(tmp_path / "db"))
    s.add_batch(doc("b1"), "alice")
    s.record("b1", [Result("x", 2, True, b'{"x":1}', (3, 4, 1, 2)), Result("y", 1, False, b'{"y":1}')])
    d = s.record("b1", [Result("x", 2, True, b'{"x":2}', (3, 4, 1, 2)), Result("z", 3, True, b'{"z":1}', (1, 1, 0, 1))])
    assert d["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert d["usage"]["input_tokens"] == 4 and d["usage"]["total_tokens"] == 9
    assert d["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert list(s.result_lines("b1", True)) == [b'{"x":1}', b'{"z":1}']      # input order, the first answer
    assert list(s.result_lines("b1", False)) == [b'{"y":1}']
    assert s.answered_in("b1", 1, 2) == {1, 2}
    # a second connection (another worker) sees the same
    assert BatchStore(str(tmp_path / "db")).get_batch("b1", "alice")["request_counts"]["completed"] == 2


def test_ownership_and_cursor_pagination(tmp_path):
    s = BatchStore(str(tmp_path / "db"))
    for i in range(5):
        s.add_batch(doc(f"b{i}", created=100 + i), "alice" if i % 2 == 0 else "bob")
    assert s.get_batch("b1", "alice") is None and s.get_batch("b1", "bob") is not None
    page, more = s.list_batches("alice", None, 2)
    assert [d["id"] for d in page] == ["b4", "b2"] and more
    page, more = s.list_batches("alice", "b2", 2)
    assert [d["id"] for d in page] == ["b0"] and not more
    assert len(s.list_batches(None, None, 10)[0]) == 5


def fobj(fid: str, created: int = 100) -> dict:
    return {"id": fid, "filename": "in.jsonl", "purpose": "batch", "bytes": 1, "created_at": created, "expires_at": None}


def test_a_gone_files_place_is_a_cursor_of_its_owner_until_forgotten(tmp_path):
    s = BatchStore(str(tmp_path / "db"))
    for i in range(3):
        s.add_file(fobj(f"f{i}"), "alice")
    assert s.delete_file("f1") and not s.delete_file("f1")
    assert [f["id"] for f in s.list_files("alice", None, "desc", "f1", 10)[0]] == ["f0"]
    assert [f["id"] for f in s.list_files("alice", None, "asc", "f1", 10)[0]] == ["f2"]
    with pytest.raises(UnknownCursor):          # another user's file, gone or not, names no place of theirs
        s.list_files("bob", None, "desc", "f1", 10)
    assert s.forget_gone(0) == 0                # gone after that
    s.forget_gone(2 ** 40)
    with pytest.raises(UnknownCursor):
        s.list_files("alice", None, "desc", "f1", 10)


def test_updates_are_read_modify_write(tmp_path):
    s = BatchStore(str(tmp_path / "db"))
    s.add_batch(doc("b1"), "")
    other = BatchStore(str(tmp_path / "db"))
    other.update_batch("b1", lambda d: d.update(status="cancelling") or True)
    d = s.record("b1", [Result("x", 1, True, b"{}")])
    assert d["status"] == "cancelling" and d["request_counts"]["completed"] == 1
    assert [b["id"] for b in s.active_batches()] == ["b1"]
    assert s.status_counts() == {"cancelling": 1}


def _open_at_once(path: str, barrier, answers) -> None:
    barrier.wait()
    try:
        BatchStore(path).close()
        answers.put("")
    except Exception as e:             # noqa: BLE001 - the answer is what the test reads
        answers.put(repr(e))


def test_workers_opening_a_new_database_at_the_same_moment_all_open_it(tmp_path):
    """Two connections that both turn a new file to WAL (or create the tables) at once: SQLite
    answers one of them "database is locked" without waiting, and a worker then failed to start.
    Six processes, released together by a barrier, ten new databases."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    failures = []
    for round_ in range(10):
        barrier, answers = ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(str(tmp_path / f"db{round_}"), barrier, answers))
                 for _ in range(6)]
        for p in procs:
            p.start()
        failures += [a for a in (answers.get(timeout=30) for _ in procs) if a]
        for p in procs:
            p.join(timeout=30)
    assert failures == []
    s = BatchStore(str(tmp_path / "db0"))
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# the batches table as the first release made it, before output_ttl_s
OLD_BATCHES = """
CREATE TABLE batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    doc BLOB NOT NULL
);
"""


def test_a_store_made_before_output_ttl_opens_and_gains_it(tmp_path):
    """A store an older gateway wrote keeps its batches, which asked no output expiry, and takes
    new ones that do; a second opening adds nothing again."""
    import sqlite3

    import orjson
    path = str(tmp_path / "db")
    old = sqlite3.connect(path)
    old.executescript(OLD_BATCHES)
    old.execute("INSERT INTO batches (id, owner, status, created_at, doc) VALUES (?, ?, ?, ?, ?)",
                ("b0", "alice", "completed", 100, orjson.dumps(doc("b0", status="completed"))))
    old.commit()
    old.close()
    s = BatchStore(path)
    assert s.get_batch("b0", "alice")["status"] == "completed"
    assert s.output_ttl("b0") is None
    s.add_batch(doc("b1"), "alice", 7200)
    s.add_batch(doc("b2"), "alice")
    assert (s.output_ttl("b1"), s.output_ttl("b2"), s.output_ttl("unknown")) == (7200, None, None)
    again = BatchStore(path)
    assert again.output_ttl("b1") == 7200
    cols = [r[1] for r in again.db.execute("PRAGMA table_info(batches)")]
    assert cols.count("output_ttl_s") == 1


def test_a_batch_an_older_store_holds_is_listed_as_unread_until_its_model_is_set_once(tmp_path):
    """Batches of a store an older gateway made were never read for their model: they are listed
    (those past validation) until it is set, which happens once; a batch made since is never listed."""
    import sqlite3

    import orjson
    path = str(tmp_path / "db")
    old = sqlite3.connect(path)
    old.executescript(OLD_BATCHES)
    for bid, status in (("b0", "completed"), ("b1", "validating")):
        old.execute("INSERT INTO batches (id, owner, status, created_at, doc) VALUES (?, ?, ?, ?, ?)",
                    (bid, "alice", status, 100, orjson.dumps({**doc(bid, status=status), "model": None})))
    old.commit()
    old.close()
    s = BatchStore(path)
    s.add_batch({**doc("b2", status="completed"), "model": None}, "alice")
    assert [d["id"] for d in s.models_unread(10)] == ["b0"]
    assert s.set_model_read("b0", "m")["model"] == "m"
    assert s.models_unread(10) == []
    assert s.set_model_read("b0", "other")["model"] == "m"          # once
    assert s.get_batch("b0", "alice")["model"] == "m"

    def validated(d: dict) -> bool:
        d.update(status="in_progress", model="n")
        return True
    s.update_batch("b1", validated, model_read=True)             # validated by this version: read then
    assert s.models_unread(10) == []
