"""The batch object's ``model``: the model its lines name, known once the batch is validated, kept in
the job store across a restart; a file whose lines name several models runs each line on its own
model (OpenAI takes one model per batch), and its batch names none."""

from __future__ import annotations

from typing import Any

import orjson

from tests.support.batch import jsonl, run_to_end
from tests.support.factories import model_block
from tests.support.http import openai_client
from tests.support.waiting import until


def rows(models: list[str], max_tokens: int = 3, url: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": url,
             "body": {"model": m, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": max_tokens}}
            for i, m in enumerate(models)]


def batch_cfg(tmp_path, **over: Any) -> dict[str, Any]:
    return {"enabled": True, "dir": str(tmp_path / "batch"), "poll_interval_s": 0.05, "retry_backoff_s": 0.05, **over}


async def test_a_batchs_model_is_the_one_its_lines_name(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(rows(["m"] * 3))), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "validating" and b.model is None         # not read yet
    done = await run_to_end(c, b.id)
    assert (done.status, done.request_counts.completed) == ("completed", 3), done
    assert done.model == "m"
    assert [x.model for x in (await c.batches.list()).data] == ["m"]


async def test_a_batch_refused_at_validation_names_its_model_too(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    lines = rows(["m", "m"])
    lines[1]["url"] = "/v1/completions"
    f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    done = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h")).id)
    assert (done.status, done.model) == ("failed", "m"), done


async def test_a_batchs_model_is_kept_across_a_restart(sims, gateway, tmp_path):
    sim = await sims("vllm", "m", itl_ms=20.0)
    first = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path, max_concurrency=1))
    c = openai_client(first)
    f = await c.files.create(file=("in.jsonl", jsonl(rows(["m"] * 6, max_tokens=20))), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def running() -> bool:
        return (await c.batches.retrieve(b.id)).status == "in_progress"

    await until(running, timeout=30)
    assert (await c.batches.retrieve(b.id)).model == "m"
    await first.runner.cleanup()
    again = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(again)
    assert (await c.batches.retrieve(b.id)).model == "m"         # read from the job store
    done = await run_to_end(c, b.id)
    assert (done.status, done.request_counts.completed, done.model) == ("completed", 6, "m"), done


async def test_lines_naming_several_models_each_run_on_theirs_and_the_batch_names_none(sims, gateway, tmp_path):
    a, b = await sims("vllm", "a"), await sims("sglang", "b")
    gw = await gateway([model_block("a", "vllm", [a.url]), model_block("b", "sglang", [b.url])],
                       batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(rows(["a", "b", "a", "b"]))), purpose="batch")
    done = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h")).id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 4, 0), done
    assert done.model is None
    out = [orjson.loads(x) for x in (await c.files.content(done.output_file_id)).content.splitlines()]
    assert [o["response"]["body"]["model"] for o in out] == ["a", "b", "a", "b"]


# the batches table as a gateway before the model's reading made it: no column saying the model was read
OLD_BATCHES = """
CREATE TABLE batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    doc BLOB NOT NULL, output_ttl_s INTEGER
);
CREATE INDEX batches_by_owner ON batches (owner, created_at);
CREATE INDEX batches_by_status ON batches (status);
"""


def old_batch(bid: str, fid: str, status: str, created: int, validated: bool, **more: Any) -> dict[str, Any]:
    """A batch object as a gateway before the model's reading stored it: ``model`` null whatever its lines name."""
    return {"id": bid, "object": "batch", "endpoint": "/v1/chat/completions", "errors": None, "input_file_id": fid,
            "completion_window": "24h", "status": status, "output_file_id": None, "error_file_id": None,
            "created_at": created, "in_progress_at": created if validated else None, "expires_at": created + 86400,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": None, "model": None,
            "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}, **more}


async def test_a_batch_an_older_version_stored_gets_its_model_read_from_its_input(sims, gateway, tmp_path):
    """A job store an older gateway wrote, whose batches all say ``model: null``: the gateway reads
    each validated batch's model from its input file once, in the background, and keeps it; a
    batch cancelled before validation, one whose lines name several models and one whose input is
    gone keep null; a stored object without ``model`` at all shows it null."""
    import sqlite3

    sim = await sims("vllm", "m")
    first = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(first)
    one = await c.files.create(file=("one.jsonl", jsonl(rows(["m"] * 3))), purpose="batch")
    many = await c.files.create(file=("many.jsonl", jsonl(rows(["m", "x", "m"]))), purpose="batch")
    gone = await c.files.create(file=("gone.jsonl", jsonl(rows(["m"]))), purpose="batch")
    await c.files.delete(gone.id)
    await first.runner.cleanup()

    db = sqlite3.connect(str(tmp_path / "batch" / "batches.sqlite3"))
    db.executescript("DROP TABLE batches;" + OLD_BATCHES)
    old = [old_batch("batch_old1", one.id, "completed", 1000, True),
           old_batch("batch_old2", many.id, "completed", 1001, True),
           old_batch("batch_old3", gone.id, "completed", 1002, True),
           old_batch("batch_old4", one.id, "cancelled", 1003, False, cancelled_at=1003),
           old_batch("batch_old5", one.id, "failed", 1004, False, failed_at=1004)]
    del old[1]["model"]                 # older still: no model at all
    for doc in old:
        db.execute("INSERT INTO batches (id, owner, status, created_at, doc) VALUES (?, ?, ?, ?, ?)",
                   (doc["id"], "", doc["status"], doc["created_at"], orjson.dumps(doc)))
    db.commit()
    db.close()

    again = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(again)

    async def read() -> bool:           # the last of them: read one after the other, in the store's order
        return (await c.batches.retrieve("batch_old5")).model == "m"     # failed at validation: its lines were read

    assert await until(read, timeout=30)
    listed = {b.id: b.model for b in (await c.batches.list()).data}
    assert listed == {"batch_old1": "m", "batch_old2": None, "batch_old3": None, "batch_old4": None,
                      "batch_old5": "m"}, listed
    raw = (await c.batches.with_raw_response.retrieve("batch_old2")).http_response.json()
    assert "model" in raw and raw["model"] is None
    db = sqlite3.connect(str(tmp_path / "batch" / "batches.sqlite3"))
    try:
        assert db.execute("SELECT COUNT(*) FROM batches WHERE model_read IS NULL").fetchone()[0] == 0
    finally:
        db.close()
