"""The Files and Batches API end to end, driven by the openai SDK against simulated vLLM and SGLang
engines: chat, completions and embeddings batches, refused lines in the error file, cancel,
ownership with API keys, and hostile uploads answered 4xx in OpenAI's shape."""

from __future__ import annotations

import asyncio
import io
import os
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from enginesim import SimConfig, start_sim
from tests.support.batch import jsonl, run_to_end
from tests.support.edge import assert_openai_error, exchange, parse_responses, request
from tests.support.factories import model_block
from tests.support.fake_engine import fake_engine
from tests.support.http import openai_client, sim_state
from tests.support.metrics import metric as sample
from tests.support.tenancy import ALICE, BOB, KEYS
from tests.support.waiting import until

BODIES = {
    "/v1/chat/completions": lambda i: {"model": "m", "messages": [{"role": "user", "content": f"Say {i}"}],
                                       "max_tokens": 3},
    "/v1/completions": lambda i: {"model": "m", "prompt": f"Count to {i}", "max_tokens": 3},
    "/v1/embeddings": lambda i: {"model": "m", "input": f"text {i}"},
}


def lines(endpoint: str, n: int, **over: Any) -> list[dict[str, Any]]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": BODIES[endpoint](i), **over}
            for i in range(n)]


def batch_cfg(tmp_path) -> dict[str, Any]:
    return {"enabled": True, "dir": str(tmp_path / "batch"), "poll_interval_s": 0.05, "retry_backoff_s": 0.05}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("endpoint", list(BODIES))
async def test_a_batch_runs_through_the_sdk(sims, gateway, tmp_path, engine, endpoint):
    sim = await sims(engine, "m")
    gw = await gateway([model_block("m", engine, [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(lines(endpoint, 5))), purpose="batch")
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "batch" and f.filename == "in.jsonl"
    assert (await c.files.retrieve(f.id)).bytes == f.bytes
    b = await c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                               metadata={"job": "nightly"})
    assert b.status == "validating" and b.id.startswith("batch_") and b.metadata == {"job": "nightly"}
    b = await run_to_end(c, b.id)
    assert b.status == "completed", b
    assert b.request_counts.total == 5 and b.request_counts.completed == 5 and b.request_counts.failed == 0
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.error_file_id is None
    out = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"req-{i}" for i in range(5)]
    made = await c.files.retrieve(b.output_file_id)        # named as OpenAI names it: the batch's id, once
    assert made.filename == f"{b.id}_output.jsonl" and made.purpose == "batch_output"
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["request_id"].startswith("batch_req_")
        body = o["response"]["body"]
        assert body["object"] == ("list" if endpoint == "/v1/embeddings" else
                                  "chat.completion" if endpoint == "/v1/chat/completions" else "text_completion")
    assert b.usage is not None and b.usage.input_tokens > 0
    got = [r for r in (await sim_state(sim.url))["received"] if r["path"] == endpoint]
    assert len(got) == 5
    text = await gw.metrics_text()
    assert 'switchyard_batch_lines_total{model="m",outcome="completed"} 5.0' in text
    assert 'switchyard_batches{status="completed"} 1.0' in text
    listed = await c.batches.list(limit=10)
    assert [x.id for x in listed.data] == [b.id]


async def test_refused_lines_go_to_the_error_file(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 3)
    rows[1]["body"]["model"] = "no-such-model"
    rows[2]["body"]["max_tokens"] = -1          # the engine refuses it
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    with gw.gw.request_log.capture() as logs:
        b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                        completion_window="24h")).id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (1, 2)
    # each line's request log line names its batch and its custom_id, refused lines too
    logged = {e["custom_id"]: e for e in logs if e["event"] == "request" and e.get("batch_id") == b.id}
    assert sorted(logged) == ["req-0", "req-1", "req-2"]
    assert (logged["req-0"]["status"], logged["req-1"]["status"], logged["req-2"]["status"]) == (200, 404, 400)
    out = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()]
    err = {e["custom_id"]: e for e in (orjson.loads(x) for x in (await c.files.content(b.error_file_id)).content.splitlines())}
    assert [o["custom_id"] for o in out] == ["req-0"]
    assert err["req-1"]["response"]["status_code"] == 404
    assert err["req-1"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert err["req-2"]["response"]["status_code"] == 400


async def test_a_line_without_a_model_and_one_naming_an_empty_model_are_told_apart(sims, gateway, tmp_path):
    """A body with no ``model`` misses a required parameter; one whose ``model`` is "" has it, with
    an empty value: neither names a model that does not exist (``model_not_found``). A batch line
    is answered as the plain ``/v1/chat/completions`` path answers the same body."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    msgs = [{"role": "user", "content": "hi"}]
    want = {"absent": (400, "missing_required_parameter", "Missing required parameter: 'model'."),
            "empty": (400, "empty_string", "Invalid 'model': empty string. Expected a string with minimum "
                                           "length 1, but got an empty string instead.")}
    with pytest.raises(openai.BadRequestError) as ei:
        await c.chat.completions.create(model=openai.NOT_GIVEN, messages=msgs)     # sent without one
    assert (ei.value.status_code, ei.value.body["code"], ei.value.body["message"]) == want["absent"]
    assert ei.value.body["param"] == "model" and ei.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as ei:
        await c.chat.completions.create(model="", messages=msgs)
    assert (ei.value.status_code, ei.value.body["code"], ei.value.body["message"]) == want["empty"]
    assert ei.value.body["param"] == "model" and ei.value.body["type"] == "invalid_request_error"
    rows = lines("/v1/chat/completions", 3)
    del rows[1]["body"]["model"]
    rows[2]["body"]["model"] = ""
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (1, 2)
    err = {e["custom_id"]: e for e in (orjson.loads(x) for x in (await c.files.content(b.error_file_id)).content.splitlines())}
    for cid, case in (("req-1", "absent"), ("req-2", "empty")):
        resp = err[cid]["response"]
        got = resp["body"]["error"]
        assert (resp["status_code"], got["code"], got["message"]) == want[case], (cid, resp)
        assert got["param"] == "model"


async def test_a_line_asking_for_binary_embeddings_is_refused(sims, gateway, tmp_path):
    """A batch line's answer is written as JSON in the output file: vLLM's binary embeddings
    (``encoding_format`` "bytes" or "bytes_only", the vectors' bytes and a ``metadata`` header)
    have no place there, so such a line is a 400 naming the field, without an engine asked;
    "base64" is the compact form a batch takes."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    rows = lines("/v1/embeddings", 3)
    rows[1]["body"]["encoding_format"] = "bytes"
    rows[2]["body"]["encoding_format"] = "bytes_only"
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                                    completion_window="24h")).id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (1, 2)
    err = {e["custom_id"]: e for e in (orjson.loads(x) for x in (await c.files.content(b.error_file_id)).content.splitlines())}
    assert sorted(err) == ["req-1", "req-2"]
    for e in err.values():
        assert e["response"]["status_code"] == 400
        assert e["response"]["body"]["error"]["param"] == "encoding_format", e
    assert len([r for r in (await sim_state(sim.url))["received"] if r["path"] == "/v1/embeddings"]) == 1


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
async def test_a_line_asking_for_a_stream_is_refused_and_the_batch_goes_on(sims, gateway, tmp_path, endpoint):
    """A batch line is answered with one JSON body in the output file, so a line asking for a
    stream (``stream`` true, or a word pydantic reads as true) is a 400 naming ``stream`` in the
    error file, no engine asked, as OpenAI's Batch API refuses it; ``stream: false`` (with or
    without ``stream_options``) runs, and the other lines run."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    rows = lines(endpoint, 4)
    rows[1]["body"]["stream"] = True
    rows[2]["body"]["stream"] = "yes"
    rows[3]["body"].update(stream=False, stream_options={"include_usage": True})
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint=endpoint,
                                                    completion_window="24h")).id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 2), b
    out = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-3"]
    err = {e["custom_id"]: e for e in (orjson.loads(x) for x in (await c.files.content(b.error_file_id)).content.splitlines())}
    assert sorted(err) == ["req-1", "req-2"]
    for e in err.values():
        assert e["response"]["status_code"] == 400, e
        assert e["response"]["body"]["error"]["param"] == "stream", e
        assert e["response"]["body"]["error"]["type"] == "invalid_request_error", e
    assert len([r for r in (await sim_state(sim.url))["received"] if r["path"] == endpoint]) == 2


# the usage of an answer with reasoning: vLLM's (with a reasoning parser) in completion_tokens_details,
# SGLang's beside prompt_tokens
REASONING_USAGE = {
    "vllm": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
             "completion_tokens_details": {"reasoning_tokens": 4}},
    "sglang": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "reasoning_tokens": 4,
               "completion_tokens_details": None},
}


@pytest.mark.parametrize("engine", list(REASONING_USAGE))
async def test_a_batchs_usage_counts_the_reasoning_tokens_its_lines_answers_report(gateway, tmp_path, engine):
    """The batch's ``usage.output_tokens_details.reasoning_tokens`` adds up the reasoning tokens
    the engines report for its lines, as its input and output tokens add up theirs."""
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "42", "reasoning_content": "think"}}],
            "usage": REASONING_USAGE[engine]})

    async with fake_engine(chat) as url:
        gw = await gateway([model_block("m", engine, [url])], scrape={"enabled": False}, batch=batch_cfg(tmp_path))
        c = openai_client(gw)
        f = await c.files.create(file=("in.jsonl", jsonl(lines("/v1/chat/completions", 3))), purpose="batch")
        b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                        completion_window="24h")).id)
    assert b.status == "completed" and b.request_counts.completed == 3, b
    assert (b.usage.input_tokens, b.usage.output_tokens, b.usage.total_tokens) == (15, 21, 36), b.usage
    assert b.usage.output_tokens_details.reasoning_tokens == 12, b.usage


async def test_lines_naming_models_that_do_not_exist_count_under_one_label(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 31)
    for i, row in enumerate(rows[1:]):
        row["body"]["model"] = f"made-up-{i}"
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (1, 30)
    text = await gw.metrics_text()
    for metric, named in (("switchyard_batch_lines_total", {"m", "-"}), ("switchyard_batch_lines_in_flight", {"m"})):
        labels = {line.split('model="')[1].split('"')[0] for line in text.splitlines() if line.startswith(metric + "{")}
        assert labels == named, metric      # '-' names no model: none of its lines runs, so no gauge
    assert 'switchyard_batch_lines_total{model="-",outcome="failed"} 30.0' in text


async def test_a_line_whose_url_is_not_the_endpoint_fails_the_batch(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 2) + lines("/v1/embeddings", 1)
    rows[2]["custom_id"] = "emb"
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "failed" and b.failed_at
    assert [(e.code, e.line, e.param) for e in b.errors.data] == [("mismatched_url", 3, "url")]
    # a batch refused whole holds no requests, as OpenAI counts one that failed validation
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (0, 0, 0)
    assert (await sim_state(sim.url))["received"] == [] or all(
        r["path"] != "/v1/chat/completions" for r in (await sim_state(sim.url))["received"])


async def _slow_batch(sims, gateway, tmp_path):
    """A 20-line batch on a slow engine, one line at a time, once its first line reached the engine:
    (gateway, client, input rows, batch)."""
    sim = await sims("vllm", "m", itl_ms=50.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch={**batch_cfg(tmp_path), "max_concurrency": 1})
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 20)
    for r in rows:
        r["body"]["max_tokens"] = 20
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    await until(lambda: _received(sim.url), timeout=20)
    return gw, c, rows, b


async def _ran_once(c, b, rows) -> None:
    """A cancelled batch: each line it ran is in its output file once, the others in neither file."""
    assert b.error_file_id is None, b
    done = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()] \
        if b.output_file_id else []
    ids = [o["custom_id"] for o in done]
    assert len(ids) == len(set(ids)) == b.request_counts.completed and set(ids) <= {r["custom_id"] for r in rows}


async def _every_line_once(c, b, rows, code: str) -> None:
    """Each input line is in the output file or, with error ``code``, in the error file: once."""
    errs = [orjson.loads(x) for x in (await c.files.content(b.error_file_id)).content.splitlines()]
    assert errs and {e["error"]["code"] for e in errs} == {code}
    done = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()] \
        if b.output_file_id else []
    assert sorted(o["custom_id"] for o in done + errs) == sorted(r["custom_id"] for r in rows)


async def test_cancel_stops_the_batch_and_accounts_for_every_line(sims, gateway, tmp_path):
    gw, c, rows, b = await _slow_batch(sims, gateway, tmp_path)
    cancelling = await c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    b = await run_to_end(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    counts = b.request_counts
    assert counts.total == 20 and counts.failed == 0 and counts.completed < 20
    await _ran_once(c, b, rows)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.batches.cancel(b.id)
    assert ei.value.body["code"] == "invalid_batch_state"
    # the lines it never ran count nowhere: they were not answered
    page = await gw.metrics_text()
    assert sample(page, "switchyard_batch_lines_total", model="m", outcome="failed") == 0
    assert sample(page, "switchyard_batch_lines_total", model="-") == 0


async def test_a_cancelled_batch_counts_and_names_only_the_lines_that_ran(sims, gateway, tmp_path):
    """As OpenAI documents a cancelled batch: its results so far in its output file, and in its
    ``request_counts`` the lines that completed and those that failed, out of its ``total``; a line
    it never ran neither completed nor failed, and has no answer to put in the error file."""
    gw, c, rows, b = await _slow_batch(sims, gateway, tmp_path)
    await c.batches.cancel(b.id)
    b = await run_to_end(c, b.id)
    counts = b.request_counts
    assert b.status == "cancelled" and counts.total == 20 and counts.failed == 0, b
    assert counts.completed < 20          # the line in flight at the cancel was stopped
    done = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()] \
        if b.output_file_id else []
    assert len(done) == counts.completed and b.error_file_id is None, b
    page = await gw.metrics_text()
    assert sample(page, "switchyard_batch_lines_total", model="m", outcome="failed") == 0


async def test_no_line_reaches_the_engine_once_a_cancel_is_answered(sims, gateway, tmp_path):
    """A cancel takes effect in the worker that runs the batch before it is answered: no line of the
    batch is sent to the engine after the answer, however long the runner's poll_interval_s (a
    batch created is taken up at once too, not at the runner's next look at the store)."""
    sim = await sims("vllm", "m", itl_ms=5.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch={**batch_cfg(tmp_path), "poll_interval_s": 5.0, "max_concurrency": 1})
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 200)
    for r in rows:
        r["body"]["max_tokens"] = 4
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def sent() -> int:
        return sum(r["path"] == "/v1/chat/completions" for r in (await sim_state(sim.url))["received"])
    await until(lambda: _at_least(sent, 3), timeout=15)
    cancelling = await c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    before = await sent()
    b = await run_to_end(c, b.id, timeout=15)
    assert b.status == "cancelled" and b.request_counts.total == 200
    assert await sent() == before
    await _ran_once(c, b, rows)


async def _at_least(count, n: int) -> bool:
    return await count() >= n


async def test_the_input_of_a_batch_not_ended_is_kept_and_a_second_cancel_is_answered_alike(sims, gateway,
                                                                                          tmp_path, monkeypatch):
    """Deleting the input file of a batch still running (cancelling too: its end's files are held
    back while the test looks) is a 400 ``file_in_use`` naming it, and the file stays; a cancel of
    a batch already cancelling answers it as it is; once the batch has ended, its input can be
    deleted and its output file still holds what ran."""
    import threading

    from gateway.batch.runner import BatchRunner

    real = BatchRunner._write_outputs
    go = threading.Event()

    def held(self, bid: str, owner: str):
        go.wait(30)
        return real(self, bid, owner)

    monkeypatch.setattr(BatchRunner, "_write_outputs", held)
    gw, c, rows, b = await _slow_batch(sims, gateway, tmp_path)
    try:
        with pytest.raises(openai.BadRequestError) as ei:
            await c.files.delete(b.input_file_id)
        assert (ei.value.body["type"], ei.value.body["code"], ei.value.body["param"]) == (
            "invalid_request_error", "file_in_use", "id")
        first = await c.batches.cancel(b.id)
        again = await c.batches.cancel(b.id)
        assert again.status == "cancelling" and again.cancelling_at == first.cancelling_at
        with pytest.raises(openai.BadRequestError) as ei:
            await c.files.delete(b.input_file_id)
        assert ei.value.body["code"] == "file_in_use"
    finally:
        go.set()
    b = await run_to_end(c, b.id)
    assert b.status == "cancelled"
    assert (await c.files.retrieve(b.input_file_id)).id == b.input_file_id
    assert (await c.files.delete(b.input_file_id)).deleted
    await _ran_once(c, b, rows)


async def test_a_delete_and_a_batch_on_the_same_file_from_two_workers_do_not_both_succeed(sims, gateway, tmp_path,
                                                                                            monkeypatch):
    """With ``--workers N`` each worker answers the API on its own connection to the job store: a
    DELETE of a file and a batch created on it may meet between one's check and its write (here
    the other worker's step is taken on a connection of its own right there). Either the batch is
    refused, 400 ``file_not_found``, nothing created; or the delete is, 400 ``file_in_use``, the
    file kept and the batch run; never a batch created on a file deleted under it."""
    from gateway.batch import files as batch_files
    from gateway.batch.store import BatchStore

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    path = str(tmp_path / "batch" / "batches.sqlite3")

    def other_worker(step):
        other = BatchStore(path)
        try:
            step(other)
        finally:
            other.close()

    # the delete lands between the batch's check of its file and the batch's write
    f = await c.files.create(file=("in.jsonl", jsonl(lines("/v1/chat/completions", 2))), purpose="batch")
    real_add = BatchStore.add_batch

    def add_after_a_delete(self, *args):
        other_worker(lambda o: o.delete_file(f.id))
        batch_files.remove(str(tmp_path / "batch"), f.id)
        return real_add(self, *args)

    monkeypatch.setattr(BatchStore, "add_batch", add_after_a_delete)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (ei.value.body["code"], ei.value.body["param"]) == ("file_not_found", "input_file_id")
    assert (await c.batches.list()).data == []
    monkeypatch.setattr(BatchStore, "add_batch", real_add)

    # the batch lands between the delete's check of the file and the delete
    f = await c.files.create(file=("in.jsonl", jsonl(lines("/v1/chat/completions", 2))), purpose="batch")
    real_delete = BatchStore.delete_file
    made: list[str] = []

    def delete_after_a_batch(self, file_id, *args):
        if not made:
            made.append("batch_raced")
            doc = {"id": "batch_raced", "object": "batch", "endpoint": "/v1/chat/completions", "errors": None,
                   "input_file_id": file_id, "completion_window": "24h", "status": "validating",
                   "output_file_id": None, "error_file_id": None, "created_at": 1, "in_progress_at": None,
                   "expires_at": 2 ** 40, "finalizing_at": None, "completed_at": None, "failed_at": None,
                   "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                   "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": None, "model": None,
                   "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}}
            other_worker(lambda o: real_add(o, doc, ""))
        return real_delete(self, file_id, *args)

    monkeypatch.setattr(BatchStore, "delete_file", delete_after_a_batch)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.files.delete(f.id)
    assert (ei.value.body["code"], ei.value.body["param"]) == ("file_in_use", "id")
    assert (await c.files.retrieve(f.id)).id == f.id
    done = await run_to_end(c, "batch_raced")
    assert (done.status, done.request_counts.completed) == ("completed", 2), done


async def _received(url: str) -> bool:
    return any(r["path"] == "/v1/chat/completions" for r in (await sim_state(url))["received"])


async def test_files_and_batches_belong_to_their_creator(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path), auth=KEYS,
                       limits={"users": {"alice": {"tpm": 1_000_000}}})
    alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)
    f = await alice.files.create(file=("in.jsonl", jsonl(lines("/v1/chat/completions", 2))), purpose="batch")
    b = await alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (bob.files.retrieve(f.id), bob.files.content(f.id), bob.files.delete(f.id),
                 bob.batches.retrieve(b.id), bob.batches.cancel(b.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    with pytest.raises(openai.BadRequestError) as ei:
        await bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert ei.value.body["code"] == "file_not_found"
    assert (await bob.files.list()).data == [] and (await bob.batches.list()).data == []
    with pytest.raises(openai.AuthenticationError):
        await openai_client(gw, "sk-wrong").files.list()
    b = await run_to_end(alice, b.id)
    assert b.status == "completed" and b.request_counts.completed == 2
    # the lines ran as alice: her token counter was charged
    text = await gw.metrics_text()
    assert 'switchyard_user_tokens_total{kind="prompt",user="alice"}' in text
    assert {x.id for x in (await alice.files.list()).data} == {f.id, b.output_file_id}
    deleted = await alice.files.delete(b.output_file_id)
    assert deleted.deleted and deleted.id == b.output_file_id
    with pytest.raises(openai.NotFoundError):
        await alice.files.retrieve(b.output_file_id)


async def test_stored_bytes_are_bounded_per_user_and_in_total(sims, gateway, tmp_path):
    """``batch.max_stored_bytes_per_user`` bounds the bytes of one user's files (uploads, output and
    error files), ``batch.max_stored_bytes`` everyone's: an upload past a user's share is a 400
    ``storage_quota_exceeded`` naming the share, one past the total a 507 ``insufficient_storage``
    (as a full disk is), nothing stored either way; a delete makes room. A batch's output and
    error files are written whatever the bounds (refusing them would lose answered lines): they
    count, so the uploads after them are refused sooner."""
    data = jsonl(lines("/v1/chat/completions", 2))
    size = len(data)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       batch={**batch_cfg(tmp_path), "max_stored_bytes_per_user": 3 * size + size // 2,
                              "max_stored_bytes": 4 * size + size // 2})
    alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)
    mine = [await alice.files.create(file=("in.jsonl", data), purpose="batch") for _ in range(3)]
    with pytest.raises(openai.BadRequestError) as ei:
        await alice.files.create(file=("in.jsonl", data), purpose="batch")
    body = ei.value.body
    assert (body["type"], body["code"], body["param"]) == ("invalid_request_error", "storage_quota_exceeded", "file")
    assert "batch.max_stored_bytes_per_user" in body["message"], body
    assert len((await alice.files.list()).data) == 3
    await bob.files.create(file=("in.jsonl", data), purpose="batch")        # his share is his own
    with pytest.raises(openai.InternalServerError) as ei:                   # the total is everyone's
        await bob.files.create(file=("in.jsonl", data), purpose="batch")
    body = ei.value.body
    assert ei.value.status_code == 507 and (body["type"], body["code"]) == ("api_error", "insufficient_storage")
    assert "batch.max_stored_bytes" in body["message"], body
    assert len((await bob.files.list()).data) == 1
    assert sorted(os.listdir(tmp_path / "batch" / "files")) == sorted(
        [f.id for f in mine] + [x.id for x in (await bob.files.list()).data])

    async def stored(n: int) -> bool:
        return sample(await gw.metrics_text(), "switchyard_batch_stored_bytes") == n
    await until(lambda: stored(4 * size), timeout=10)
    assert (await alice.files.delete(mine[2].id)).deleted                  # room again
    await bob.files.create(file=("in.jsonl", data), purpose="batch")
    # alice's batch writes its output whatever her share, which it takes her past
    b = await run_to_end(alice, (await alice.batches.create(input_file_id=mine[0].id, endpoint="/v1/chat/completions",
                                                            completion_window="24h")).id)
    assert b.status == "completed" and b.output_file_id
    out = (await alice.files.retrieve(b.output_file_id)).bytes
    await until(lambda: stored(4 * size + out), timeout=10)


async def test_uploads_racing_at_a_bound_from_two_workers_do_not_both_land(sims, gateway, tmp_path, monkeypatch):
    """The bound is checked in the transaction that stores the file: another worker's upload that
    lands between this one's first look and its write (here stored on a connection of its own right
    there) is counted, and this one is refused, its bytes removed: the files stored never hold more
    than the bound."""
    from gateway.batch import files as batch_files
    from gateway.batch.store import BatchStore

    data = jsonl(lines("/v1/chat/completions", 2))
    size = len(data)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth=KEYS,
                       batch={**batch_cfg(tmp_path), "max_stored_bytes_per_user": 2 * size + size // 2})
    alice = openai_client(gw, ALICE)
    await alice.files.create(file=("in.jsonl", data), purpose="batch")
    real = batch_files.publish
    raced: list[str] = []

    def publish_after_another(directory, tmp, file_id):
        if not raced:
            raced.append(batch_files.new_file_id())
            other = BatchStore(str(tmp_path / "batch" / "batches.sqlite3"))
            try:
                other.add_file(batch_files.file_object(raced[0], "other.jsonl", "batch", size, 0), "alice", 2)
            finally:
                other.close()
        return real(directory, tmp, file_id)

    monkeypatch.setattr(batch_files, "publish", publish_after_another)
    with pytest.raises(openai.BadRequestError) as ei:
        await alice.files.create(file=("in.jsonl", data), purpose="batch")
    assert ei.value.body["code"] == "storage_quota_exceeded"
    listed = (await alice.files.list()).data
    assert len(listed) == 2 and raced[0] in {f.id for f in listed}
    assert sorted(os.listdir(tmp_path / "batch" / "files")) == sorted(f.id for f in listed if f.id != raced[0])


async def _post_raw(gw, path: str, data: bytes, content_type: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(gw.url + path, data=data,
                                                    headers={"Content-Type": content_type}) as r:
        return r.status, await r.json(content_type=None)


def _multipart(fields: list[tuple[str, str | None, bytes]], boundary: str = "xyzBOUNDARY", close: bool = True) -> bytes:
    out = io.BytesIO()
    for name, filename, value in fields:
        out.write(f"--{boundary}\r\n".encode())
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out.write(f"Content-Disposition: {disp}\r\n\r\n".encode())
        out.write(value + b"\r\n")
    if close:
        out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue()


GOOD = jsonl(lines("/v1/chat/completions", 2))


@pytest.mark.parametrize(("case", "fields", "status", "code"), [
    ("wrong purpose", [("purpose", None, b"fine-tune"), ("file", "a.jsonl", GOOD)], 400, "invalid_value"),
    ("missing file", [("purpose", None, b"batch")], 400, "missing_required_parameter"),
    ("missing purpose", [("file", "a.jsonl", GOOD)], 400, "missing_required_parameter"),
    ("path traversal", [("purpose", None, b"batch"), ("file", "../../etc/passwd", GOOD)], 400, "invalid_filename"),
    ("not utf-8", [("purpose", None, b"batch"), ("file", "a.jsonl", b'{"custom_id": "\xff"}\n')], 400,
     "invalid_encoding"),
    ("invalid json", [("purpose", None, b"batch"), ("file", "a.jsonl", b'{"custom_id": \n')], 400, "invalid_json"),
    ("body not an object", [("purpose", None, b"batch"), ("file", "a.jsonl", jsonl(
        [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": [1]}]))], 400, "invalid_value"),
    ("duplicate custom_id", [("purpose", None, b"batch"), ("file", "a.jsonl", jsonl(
        lines("/v1/chat/completions", 2, custom_id="same")))], 400, "duplicate_custom_id"),
    ("custom_id too long", [("purpose", None, b"batch"), ("file", "a.jsonl", jsonl(
        lines("/v1/chat/completions", 1, custom_id="c" * 513)))], 400, "string_above_max_length"),
    ("too many lines", [("purpose", None, b"batch"), ("file", "a.jsonl", jsonl(lines("/v1/chat/completions", 4)))],
     400, "too_many_lines"),
    ("line too long", [("purpose", None, b"batch"), ("file", "a.jsonl", jsonl(
        [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"x": "y" * 5000}}]))],
     400, "line_too_long"),
    ("too large", [("purpose", None, b"batch"), ("file", "a.jsonl", GOOD * 200)], 413, "file_too_large"),
    ("empty", [("purpose", None, b"batch"), ("file", "a.jsonl", b"\n")], 400, "empty_file"),
])
async def test_hostile_uploads_are_refused_in_openai_shape(sims, gateway, tmp_path, case, fields, status, code):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch={**batch_cfg(tmp_path), "max_lines": 3, "max_line_bytes": 4096, "max_file_bytes": 20_000})
    got, body = await _post_raw(gw, "/v1/files", _multipart(fields), "multipart/form-data; boundary=xyzBOUNDARY")
    assert (got, body["error"]["code"]) == (status, code), body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (await openai_client(gw).files.list()).data == []
    assert list((tmp_path / "batch" / "tmp").iterdir()) == []


@pytest.mark.parametrize("purpose", ["fine-tune", "batch_output", "user_data"])
async def test_a_purpose_other_than_batch_is_the_answer_whatever_the_file_holds(sims, gateway, tmp_path, purpose):
    """The SDK sends ``purpose`` before the file: an upload for another purpose (a fine-tuning file,
    say, whose lines are no batch requests) is refused for its purpose, named as the param at fault,
    not for a line of a file the API never serves."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    tuning = jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 3)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.files.create(file=("train.jsonl", tuning), purpose=purpose)
    assert (ei.value.body["param"], ei.value.body["code"]) == ("purpose", "invalid_value"), ei.value.body
    assert purpose in ei.value.body["message"]
    assert (await c.files.list()).data == []
    assert list((tmp_path / "batch" / "tmp").iterdir()) == []


async def test_a_file_too_large_is_one_413_whether_its_length_is_told_or_not(sims, gateway, tmp_path):
    """An upload whose Content-Length already says its file cannot fit is refused before it is read
    (at the edge), a chunked one once its bytes pass the limit (by the Files API): one answer."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"max_body_bytes": 65_536},
                       batch={**batch_cfg(tmp_path), "max_file_bytes": 100_000})
    big = jsonl(lines("/v1/chat/completions", 3000))
    assert len(big) > 200_000
    with pytest.raises(openai.APIStatusError) as ei:
        await openai_client(gw).files.create(file=("in.jsonl", big), purpose="batch")
    told = (ei.value.status_code, ei.value.body)
    body = _multipart([("purpose", None, b"batch"), ("file", "in.jsonl", big)])

    async def pieces():
        for i in range(0, len(body), 16_384):
            yield body[i:i + 16_384]

    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/files", data=pieces(),
                                                    headers={"Content-Type": "multipart/form-data; boundary=xyzBOUNDARY"}) as r:
        chunked = (r.status, (await r.json())["error"])
    assert told == chunked
    assert told[0] == 413 and (told[1]["code"], told[1]["param"]) == ("file_too_large", "file")
    assert "batch.max_file_bytes (100000 bytes)" in told[1]["message"]
    assert (await openai_client(gw).files.list()).data == []


async def test_truncated_and_malformed_uploads_and_bad_batch_requests(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    truncated = _multipart([("purpose", None, b"batch"), ("file", "a.jsonl", GOOD)], close=False)[:-10]
    status, body = await _post_raw(gw, "/v1/files", truncated, "multipart/form-data; boundary=xyzBOUNDARY")
    assert status == 400 and body["error"]["code"] in ("truncated_upload", "invalid_json"), body
    status, body = await _post_raw(gw, "/v1/files", b'{"purpose": "batch"}', "application/json")
    assert status == 400 and body["error"]["param"] == "file"
    f = await c.files.create(file=("in.jsonl", GOOD), purpose="batch")
    for kw, param, code in (({"input_file_id": "file-000000000000000000000000"}, "input_file_id", "file_not_found"),
                            ({"input_file_id": "../etc"}, "input_file_id", "file_not_found"),
                            ({"endpoint": "/v1/responses"}, "endpoint", "invalid_value"),
                            ({"completion_window": "1h"}, "completion_window", "invalid_value"),
                            ({"completion_window": ["24h"]}, "completion_window", "invalid_value"),
                            ({"completion_window": {"24h": 1}}, "completion_window", "invalid_value"),
                            ({"endpoint": ["/v1/chat/completions"]}, "endpoint", "invalid_value"),
                            ({"endpoint": {}}, "endpoint", "invalid_value"),
                            ({"metadata": {"k": "v" * 600}}, "metadata", "invalid_value")):
        args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kw}
        with pytest.raises(openai.BadRequestError) as ei:
            await c.batches.create(**args)
        assert (ei.value.body["param"], ei.value.body["code"]) == (param, code)
    for call in (c.files.retrieve("file-nope"), c.batches.retrieve("batch_nope"), c.batches.cancel("batch_nope")):
        with pytest.raises(openai.NotFoundError):
            await call
    # an id a client made up, thousands of characters long, is named in the message cut short, not echoed whole
    made_up = "x" * 6000
    for call in (c.files.retrieve("file-" + made_up), c.files.content("file-" + made_up),
                 c.files.delete("file-" + made_up), c.batches.retrieve("batch_" + made_up),
                 c.batches.cancel("batch_" + made_up)):
        with pytest.raises(openai.NotFoundError) as ei:
            await call
        assert len(ei.value.body["message"]) < 100, ei.value.body["message"][:100]
    with pytest.raises(openai.BadRequestError) as ei:
        await c.batches.create(input_file_id="file-" + made_up * 100, endpoint="/v1/chat/completions",
                               completion_window="24h")
    assert ei.value.body["code"] == "file_not_found" and len(ei.value.body["message"]) < 100
    status, body = await _post_raw(gw, "/v1/batches", b"[1", "application/json")
    assert status == 400 and body["error"]["code"] == "invalid_json"


def _age(tmp_path, bid: str) -> None:
    """The stored batch's ``expires_at`` moved into the past while it is in progress, as 24 hours
    passing would: read and written in one transaction, as the store does (between a plain read
    and the write, the runner may finish the batch, and the write would put it back in progress)."""
    import sqlite3

    db = sqlite3.connect(str(tmp_path / "batch" / "batches.sqlite3"), timeout=5, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        doc = orjson.loads(db.execute("SELECT doc FROM batches WHERE id = ?", (bid,)).fetchone()[0])
        if doc["status"] == "in_progress":
            doc["expires_at"] = doc["created_at"] - 1
            db.execute("UPDATE batches SET doc = ? WHERE id = ?", (orjson.dumps(doc), bid))
        db.execute("COMMIT")
    finally:
        db.close()


async def test_a_batch_past_its_window_expires_and_says_so_for_every_line_left(sims, gateway, tmp_path):
    """``completion_window`` is 24 h: the test moves the stored batch's ``expires_at`` into the past
    (as 24 hours passing would) while its lines run on a slow engine."""
    gw, c, rows, b = await _slow_batch(sims, gateway, tmp_path)
    assert b.expires_at == b.created_at + 24 * 3600

    async def expired() -> bool:
        _age(tmp_path, b.id)     # the runner rewrites the doc as lines finish: set it until it is seen
        return (await c.batches.retrieve(b.id)).status == "expired"

    await until(expired, timeout=20)
    b = await c.batches.retrieve(b.id)
    assert b.expired_at and b.request_counts.total == 20 and b.request_counts.completed < 20
    await _every_line_once(c, b, rows, "batch_expired")
    page = await gw.metrics_text()
    assert sample(page, "switchyard_batch_lines_total", model="m", outcome="failed") == b.request_counts.failed


async def test_a_cancel_once_the_window_ended_is_refused_and_the_batch_expires(sims, gateway, tmp_path):
    """An in-progress batch whose ``expires_at`` passed has expired, whether or not the runner's
    look at the store has seen it yet: a cancel then is the 400 ``invalid_batch_state`` (an answer
    ``cancelling`` would promise an end ``cancelled`` that the expiry under way does not keep), and
    the batch ends ``expired``, every line not answered named in its error file."""
    gw, c, rows, b = await _slow_batch(sims, gateway, tmp_path)
    _age(tmp_path, b.id)
    with pytest.raises(openai.BadRequestError) as e:
        await c.batches.cancel(b.id)
    assert e.value.status_code == 400 and e.value.body["code"] == "invalid_batch_state", e.value.body
    b = await run_to_end(c, b.id)
    assert b.status == "expired" and b.cancelling_at is None and b.cancelled_at is None, b
    await _every_line_once(c, b, rows, "batch_expired")


async def test_files_past_their_ttl_leave_the_store_and_the_disk(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch={**batch_cfg(tmp_path), "file_ttl_s": 2})
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(lines("/v1/chat/completions", 2))), purpose="batch")
    assert f.expires_at == f.created_at + 2
    on_disk = tmp_path / "batch" / "files" / f.id
    assert on_disk.exists()

    async def gone() -> bool:
        try:
            await c.files.retrieve(f.id)
        except openai.NotFoundError:
            return not on_disk.exists()
        return False

    await until(gone, timeout=15)


async def test_an_engine_that_dies_mid_batch_costs_no_line(sims, gateway, tmp_path):
    """The lines in flight on an engine that stops are retried (a broken connection is retryable)
    on the other one: every line is answered once, none fails."""
    a = await sims("vllm", "m", itl_ms=30.0)
    b_sim = await sims("vllm", "m", itl_ms=30.0)
    gw = await gateway([model_block("m", "vllm", [a.url, b_sim.url])],
                       batch={**batch_cfg(tmp_path), "max_concurrency": 4})
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 24)
    for r in rows:
        r["body"]["max_tokens"] = 8
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    await until(lambda: _received(a.url), timeout=20)
    await a.close()                        # mid-line: its connections drop
    b = await run_to_end(c, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (24, 0)
    out = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)
    assert b.error_file_id is None
    text = await gw.metrics_text()       # the pipeline moved the broken lines to the other engine
    retried = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith('switchyard_retries_total{model="m"}')]
    assert retried and retried[0] >= 1


async def test_an_engine_down_until_its_probes_notice_loses_no_line(sims, gateway, tmp_path):
    """A model's one engine dies mid-batch, and its health probes take longer to notice (up to 1 s
    here, 10 s at the defaults) than a line's attempts last (0.3 s here, 3 s at the defaults).
    Meanwhile the lines the runner starts meet a 502: the gateway cannot connect to any engine, so
    no engine ran them, as when no endpoint is ready; they wait and run once the engine is back,
    and none goes to the error file. Before, each such 502 counted as an attempt, the lines churned
    through them at once, and most of the batch ended in the error file."""
    sim = await sims("vllm", "m", itl_ms=10.0)
    port = sim.port
    gw = await gateway([model_block("m", "vllm", [sim.url])], health={"interval_s": 0.5, "unhealthy_threshold": 2},
                       batch={**batch_cfg(tmp_path), "retry_backoff_s": 0.1, "max_concurrency": 4})
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 200)
    for r in rows:
        r["body"]["max_tokens"] = 5
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def some_answered() -> bool:
        return (await c.batches.retrieve(b.id)).request_counts.completed >= 10

    await until(some_answered, timeout=30, interval=0.01)
    await sim.close()
    ep = gw.gw.pool.endpoints("m")[0]
    await until(lambda: not ep.ready, timeout=20)
    back = await start_sim(SimConfig(engine="vllm", model="m", port=port, host="127.0.0.1", itl_ms=10.0))
    try:
        b = await run_to_end(c, b.id, timeout=90)
        errors = [] if b.error_file_id is None else (await c.files.content(b.error_file_id)).content.splitlines()
        assert b.status == "completed", b
        assert (b.request_counts.completed, b.request_counts.failed) == (200, 0), errors[:2]
        out = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()]
        assert [o["custom_id"] for o in out] == [r["custom_id"] for r in rows]
    finally:
        await back.close()
    # the lines no engine took were tried again uncounted: a line counts only what reached an engine
    text = await gw.metrics_text()
    assert sample(text, "switchyard_batch_lines_total", model="m", outcome="failed") == 0


async def test_a_cursor_that_names_no_object_of_the_caller_is_a_400(sims, gateway, tmp_path):
    """``after`` must name an object of the caller's list: an unknown id (a typo, another user's)
    is a 400 naming the parameter, where it was ignored and the first page came
    again, which a paginator reads as more objects. An empty ``after`` (``?after=``, a client
    that sent the ``last_id`` of no page) names none either, as on the input items of a response."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path), auth=KEYS)
    alice, bob = openai_client(gw, ALICE), openai_client(gw, BOB)
    f = await alice.files.create(file=("in.jsonl", GOOD), purpose="batch")
    b = await alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (await alice.files.list(after=f.id)).data == [] and (await alice.batches.list(after=b.id)).data == []
    for call in (lambda: alice.files.list(after="file-000000000000000000000000"),
                 lambda: alice.batches.list(after="batch_nope"),
                 lambda: bob.files.list(after=f.id), lambda: bob.batches.list(after=b.id),
                 lambda: alice.files.list(after=""), lambda: alice.batches.list(after="")):
        with pytest.raises(openai.BadRequestError) as ei:
            await call()
        assert (ei.value.body["param"], ei.value.body["code"]) == ("after", "invalid_value")
        assert ei.value.body["type"] == "invalid_request_error"


async def test_a_list_query_out_of_its_range_is_named_as_openai_names_it(sims, gateway, tmp_path):
    """A list's ``limit`` that is not an integer, or outside its range, and an ``order`` that is
    not asc or desc are OpenAI's 400 naming the parameter with the code that says what is wrong
    (as the gateway's other lists answer them), not read as another number: ``1_0`` is not ten."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    cases = [
        ("/v1/batches?limit=0", "limit", "integer_below_min_value",
         "Invalid 'limit': integer below minimum value. Expected a value >= 1, but got 0 instead."),
        ("/v1/batches?limit=101", "limit", "integer_above_max_value",
         "Invalid 'limit': integer above maximum value. Expected a value <= 100, but got 101 instead."),
        ("/v1/batches?limit=1_0", "limit", "invalid_type",
         "Invalid type for 'limit': expected an integer, but got '1_0' instead."),
        ("/v1/files?limit=10001", "limit", "integer_above_max_value",
         "Invalid 'limit': integer above maximum value. Expected a value <= 10000, but got 10001 instead."),
        ("/v1/files?limit=-1", "limit", "integer_below_min_value",
         "Invalid 'limit': integer below minimum value. Expected a value >= 1, but got -1 instead."),
        ("/v1/files?limit=%205", "limit", "invalid_type",
         "Invalid type for 'limit': expected an integer, but got ' 5' instead."),
        ("/v1/files?order=up", "order", "invalid_value", "Invalid value: 'up'. Supported values are: 'asc' and 'desc'."),
    ]
    async with aiohttp.ClientSession() as s:
        for path, param, code, message in cases:
            async with s.get(gw.url + path) as r:
                status, body = r.status, await r.json()
            assert status == 400, (path, body)
            assert body["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                     "code": code}, path
        async with s.get(gw.url + "/v1/batches?limit=%2B000000000000000000000100") as r:     # 100, however written
            assert r.status == 200, await r.text()


async def test_a_file_written_by_a_windows_tool_runs(sims, gateway, tmp_path):
    """A UTF-8 byte order mark and CRLF line ends, as Windows tools write JSONL: accepted, and every
    line runs (the first one too)."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    data = b"\xef\xbb\xbf" + jsonl(lines("/v1/chat/completions", 3)).replace(b"\n", b"\r\n")
    f = await c.files.create(file=("in.jsonl", data), purpose="batch")
    assert f.bytes == len(data) and (await c.files.content(f.id)).content == data
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "completed" and (b.request_counts.total, b.request_counts.completed) == (3, 3), b
    out = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]


def _line_of(size: int, cid: str) -> bytes:
    """A chat line of exactly ``size`` bytes, its line end not counted."""
    row = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}}
    row["body"]["messages"][0]["content"] = "x" * (size - len(orjson.dumps(row)))
    line = orjson.dumps(row)
    assert len(line) == size
    return line


@pytest.mark.parametrize("end", [b"\n", b"\r\n"], ids=["lf", "crlf"])
async def test_a_line_of_max_line_bytes_is_taken_whatever_its_line_end(sims, gateway, tmp_path, end):
    """``batch.max_line_bytes`` bounds a line, not its line end: a line of exactly that many bytes
    is taken and runs whether it ends in LF or CRLF (the first line behind a byte order mark too),
    and one byte more is refused naming it, alike."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch={**batch_cfg(tmp_path), "max_line_bytes": 4096})
    c = openai_client(gw)
    data = b"\xef\xbb\xbf" + b"".join(_line_of(4096, f"req-{i}") + end for i in range(3))
    f = await c.files.create(file=("in.jsonl", data), purpose="batch")
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "completed" and (b.request_counts.total, b.request_counts.completed) == (3, 3), b
    with pytest.raises(openai.BadRequestError) as ei:
        await c.files.create(file=("in.jsonl", _line_of(4096, "a") + end + _line_of(4097, "b") + end),
                             purpose="batch")
    assert (ei.value.body["code"], ei.value.body["message"]) == (
        "line_too_long", "invalid batch input file: line 2 is longer than 4096 bytes")


async def test_objects_created_in_one_second_list_in_the_order_they_were_created(sims, gateway, tmp_path,
                                                                                monkeypatch):
    """``created_at`` counts whole seconds: files and batches created within one second list in
    the order they were made (newest first; files oldest first with ``order=asc``), page after page,
    where they came in the order of their random ids."""
    from gateway.batch import api, files

    second = api.now_s()
    monkeypatch.setattr(api, "now_s", lambda: second)        # every object made in the same second
    monkeypatch.setattr(files, "now_s", lambda: second)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    made = [(await c.files.create(file=(f"in{i}.jsonl", GOOD), purpose="batch")).id for i in range(8)]
    batches = [(await c.batches.create(input_file_id=made[0], endpoint="/v1/chat/completions",
                                       completion_window="24h")).id for _ in range(8)]
    assert [f.id async for f in c.files.list(purpose="batch", order="asc", limit=3)] == made
    assert [f.id async for f in c.files.list(purpose="batch", limit=3)] == made[::-1]
    assert [b.id async for b in c.batches.list(limit=3)] == batches[::-1]


@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_files_deleted_as_they_are_listed_page_after_page_are_all_deleted(sims, gateway, tmp_path,
                                                                                monkeypatch, order):
    """The SDK's paginator asks for each next page after the last file of the page before, so a loop
    that deletes every file it lists (a clean-up) names a file it deleted as ``after``: the list
    goes on from where that file was, where the second page was a 400. A file made after the deleted
    one (within its second) still lists after it."""
    from gateway.batch import api, files

    second = api.now_s()
    monkeypatch.setattr(api, "now_s", lambda: second)        # every object made in the same second
    monkeypatch.setattr(files, "now_s", lambda: second)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    made = [(await c.files.create(file=(f"in{i}.jsonl", GOOD), purpose="batch")).id for i in range(7)]
    gone = []
    async for f in c.files.list(order=order, limit=2):
        await c.files.delete(f.id)
        gone.append(f.id)
    assert gone == (made if order == "asc" else made[::-1])
    assert (await c.files.list()).data == []
    first = (await c.files.create(file=("a.jsonl", GOOD), purpose="batch")).id
    last = (await c.files.create(file=("b.jsonl", GOOD), purpose="batch")).id
    await c.files.delete(last)              # the newest file goes; the next one is made after it
    after = (await c.files.create(file=("c.jsonl", GOOD), purpose="batch")).id
    page = await c.files.list(order=order, after=last)
    assert [f.id for f in page.data] == ([after] if order == "asc" else [first])
    with pytest.raises(openai.BadRequestError):          # an id that never named a file: still a 400
        await c.files.list(after="file-000000000000000000000000")


async def test_an_upload_expires_when_its_expires_after_says(sims, gateway, tmp_path):
    """``expires_after`` (anchor ``created_at``, 3600 to 2592000 seconds) sets when the uploaded
    file expires and leaves the disk, if before ``batch.file_ttl_s``.
    It was not read: the file stayed for ``file_ttl_s`` (30 days) whatever the client asked."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", GOOD), purpose="batch",
                             expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    assert (await c.files.retrieve(f.id)).expires_at == f.created_at + 3600
    longer = await c.files.create(file=("in.jsonl", GOOD), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 2592000})
    assert longer.expires_at == longer.created_at + 30 * 24 * 3600     # file_ttl_s's 30 days is the most
    assert {x.id for x in (await c.files.list()).data} == {f.id, longer.id}


@pytest.mark.parametrize(("value", "param", "code", "says"), [
    ("1h", "expires_after", "invalid_type", "expected an object"),
    ({"seconds": 3600}, "expires_after.anchor", "missing_required_parameter", "expires_after.anchor"),
    ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor", "invalid_value",
     "Supported values are: 'created_at'"),
    ({"anchor": "", "seconds": 3600}, "expires_after.anchor", "invalid_value", "Supported values are: 'created_at'"),
    ({"anchor": "created_at"}, "expires_after.seconds", "missing_required_parameter", "expires_after.seconds"),
    ({"anchor": "created_at", "seconds": None}, "expires_after.seconds", "missing_required_parameter",
     "expires_after.seconds"),
    ({"anchor": "created_at", "seconds": "1h"}, "expires_after.seconds", "invalid_type", "expected an integer"),
    ({"anchor": "created_at", "seconds": 3600.5}, "expires_after.seconds", "invalid_type", "expected an integer"),
    ({"anchor": "created_at", "seconds": True}, "expires_after.seconds", "invalid_type", "expected an integer"),
    ({"anchor": "created_at", "seconds": 60}, "expires_after.seconds", "integer_below_min_value", ">= 3600"),
    ({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds", "integer_below_min_value", ">= 3600"),
    ({"anchor": "created_at", "seconds": -1}, "expires_after.seconds", "integer_below_min_value", ">= 3600"),
    ({"anchor": "created_at", "seconds": 2592001}, "expires_after.seconds", "integer_above_max_value",
     "<= 2592000"),
    ({"anchor": "created_at", "seconds": 10**40}, "expires_after.seconds", "integer_above_max_value", "<= 2592000"),
    ({"anchor": "created_at", "seconds": 3600, "days": 1}, "expires_after.days", "unknown_parameter",
     "expires_after.days"),
])
async def test_a_bad_expires_after_is_a_400_naming_the_field_and_stores_nothing(sims, gateway, tmp_path, value,
                                                                                 param, code, says):
    """An upload's ``expires_after`` form fields are read as OpenAI reads them, and as a batch's
    ``output_expires_after`` is: ``param`` names the field at fault (``expires_after``, ``.anchor``,
    ``.seconds`` or the unknown key), ``code`` says what is wrong and the message the allowed value
    or bound. Every bad value was one 400 with ``param: "expires_after"``, ``code: "invalid_value"``."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    with pytest.raises(openai.BadRequestError) as ei:
        await c.files.create(file=("in.jsonl", GOOD), purpose="batch", expires_after=value)  # type: ignore[arg-type]
    err = ei.value.body
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert set(err) == {"message", "type", "param", "code"}
    assert says in err["message"], err
    assert (await c.files.list()).data == []
    assert list((tmp_path / "batch" / "tmp").iterdir()) == []
    assert list((tmp_path / "batch" / "files").iterdir()) == []


async def test_a_file_whose_bytes_are_gone_is_a_404_in_openais_shape(sims, gateway, tmp_path):
    """The store names a file whose bytes left the disk (lost, or removed by hand): its content is a
    404 ``file_not_found`` the SDK reads, as an unknown file's is, not an empty page."""
    from gateway.batch import files as batch_files
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(lines("/v1/completions", 1))), purpose="batch")
    os.unlink(batch_files.path_of(str(tmp_path / "batch"), f.id))
    with pytest.raises(openai.NotFoundError) as ei:
        await c.files.content(f.id)
    assert ei.value.body["code"] == "file_not_found" and f.id in ei.value.body["message"]


async def test_a_delete_whose_bytes_cannot_leave_the_disk_keeps_the_file_and_says_so(sims, gateway, tmp_path):
    """A DELETE whose unlink of the file's bytes fails (a directory made read-only under a gateway
    not run as root, a file system remounted read-only, an I/O error: here its path is a directory,
    which unlink refuses as it refuses those) is a 500 in OpenAI's shape, not ``deleted: true`` over
    bytes left on the disk: the file stays as it was, retrievable, its content read, in its place
    of the list; a DELETE once the disk lets the bytes go removes both."""
    from gateway.batch import files as batch_files
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    data = jsonl(lines("/v1/completions", 1))
    f = await c.files.create(file=("in.jsonl", data), purpose="batch")
    g = await c.files.create(file=("in.jsonl", data), purpose="batch")
    path = batch_files.path_of(str(tmp_path / "batch"), f.id)
    os.rename(path, path + ".aside")
    os.mkdir(path)
    with pytest.raises(openai.InternalServerError) as ei:
        await c.files.delete(f.id)
    assert ei.value.status_code == 500 and ei.value.body["code"] == "storage_error", ei.value.body
    assert f.id in ei.value.body["message"] and set(ei.value.body) == {"message", "type", "param", "code"}
    assert sample(await gw.metrics_text(), "switchyard_internal_errors_total") == 0
    os.rmdir(path)
    os.rename(path + ".aside", path)
    assert (await c.files.retrieve(f.id)).id == f.id
    assert (await c.files.content(f.id)).content == data
    assert [x.id for x in (await c.files.list()).data] == [g.id, f.id]
    assert [x.id for x in (await c.files.list(after=g.id)).data] == [f.id]
    assert (await c.files.delete(f.id)).deleted
    assert not os.path.exists(path)
    assert [x.id for x in (await c.files.list()).data] == [g.id]


async def test_a_line_is_sheddable_when_clients_priority_headers_are_not_honoured(sims, gateway, tmp_path):
    """``admission.priority_header: false`` keeps clients from naming their class; a batch line's
    ``sheddable`` is the gateway's own, and its lines still go as the lowest class."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path),
                       admission={"enabled": True, "priority_header": False})
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(lines("/v1/completions", 2))), purpose="batch")
    with gw.gw.request_log.capture() as logs:
        b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                        completion_window="24h")).id)
        assert b.status == "completed"
        await c.completions.create(model="m", prompt="x", max_tokens=1, extra_headers={"x-priority": "sheddable"})
    got = sorted((x.get("batch_id") is not None, x.get("priority")) for x in logs if x["event"] == "request")
    assert got == [(False, "standard"), (True, "sheddable"), (True, "sheddable")]


async def test_a_batchs_output_files_expire_when_its_output_expires_after_says(sims, gateway, tmp_path):
    """``output_expires_after`` (anchor ``created_at``: the output file's creation, not the batch's;
    3600 to 2592000 seconds) sets the ``expires_at`` of the batch's output and error files, if before
    ``batch.file_ttl_s``; the batch object carries no field for it, as OpenAI's does not. It was not
    read: both files stayed for ``file_ttl_s`` (30 days) whatever the client asked."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 2) + [{"custom_id": "nope", "method": "POST", "url": "/v1/chat/completions",
                                                "body": {"model": "absent", "messages": []}}]
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert "output_expires_after" not in b.to_dict()
    b = await run_to_end(c, b.id)
    assert b.status == "completed" and b.output_file_id and b.error_file_id, b
    assert "output_expires_after" not in b.to_dict()
    for fid in (b.output_file_id, b.error_file_id):
        made = await c.files.retrieve(fid)
        assert made.expires_at == made.created_at + 7200, made
    listed = {x.id: x.expires_at for x in (await c.files.list()).data}
    assert listed[f.id] == f.created_at + 30 * 24 * 3600       # the input keeps its own expiry
    made = await c.files.retrieve(b.output_file_id)
    assert listed[b.output_file_id] == made.created_at + 7200
    # the longest OpenAI takes, beyond file_ttl_s's 30 days: file_ttl_s is the most
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h", output_expires_after={
                                                        "anchor": "created_at", "seconds": 2592000})).id)
    made = await c.files.retrieve(b.output_file_id)
    assert made.expires_at == made.created_at + 30 * 24 * 3600


async def test_output_files_expiring_before_file_ttl_leave_the_store_and_the_disk(sims, gateway, tmp_path):
    """The sweep removes a batch's output and error files once their ``expires_at`` (here
    ``file_ttl_s``, shorter than ``output_expires_after``'s 3600 s) has passed."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch={**batch_cfg(tmp_path), "file_ttl_s": 3})
    c = openai_client(gw)
    rows = lines("/v1/completions", 1) + [{"custom_id": "nope", "method": "POST", "url": "/v1/completions",
                                           "body": {"model": "absent", "prompt": "x"}}]
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                    completion_window="24h", output_expires_after={
                                                        "anchor": "created_at", "seconds": 3600})).id)
    made = [await c.files.retrieve(fid) for fid in (b.output_file_id, b.error_file_id)]
    assert [m.expires_at - m.created_at for m in made] == [3, 3]

    async def gone() -> bool:
        left = {x.id for x in (await c.files.list()).data}
        return not left & {b.output_file_id, b.error_file_id} and not any(
            (tmp_path / "batch" / "files" / m.id).exists() for m in made)

    await until(gone, timeout=20)


@pytest.mark.parametrize(("value", "param", "code"), [
    ("1h", "output_expires_after", "invalid_type"),
    (None, "output_expires_after", "invalid_type"),
    ([3600], "output_expires_after", "invalid_type"),
    ({"seconds": 3600}, "output_expires_after.anchor", "missing_required_parameter"),
    ({"anchor": "last_active_at", "seconds": 3600}, "output_expires_after.anchor", "invalid_value"),
    ({"anchor": 1, "seconds": 3600}, "output_expires_after.anchor", "invalid_type"),
    ({"anchor": "created_at"}, "output_expires_after.seconds", "missing_required_parameter"),
    ({"anchor": "created_at", "seconds": "3600"}, "output_expires_after.seconds", "invalid_type"),
    ({"anchor": "created_at", "seconds": 3600.5}, "output_expires_after.seconds", "invalid_type"),
    ({"anchor": "created_at", "seconds": True}, "output_expires_after.seconds", "invalid_type"),
    ({"anchor": "created_at", "seconds": None}, "output_expires_after.seconds", "invalid_type"),
    ({"anchor": "created_at", "seconds": 3599}, "output_expires_after.seconds", "integer_below_min_value"),
    ({"anchor": "created_at", "seconds": -1}, "output_expires_after.seconds", "integer_below_min_value"),
    ({"anchor": "created_at", "seconds": 2592001}, "output_expires_after.seconds", "integer_above_max_value"),
    ({"anchor": "created_at", "seconds": 10**12}, "output_expires_after.seconds", "integer_above_max_value"),
    ({"anchor": "created_at", "seconds": 3600, "days": 1}, "output_expires_after.days", "unknown_parameter"),
])
async def test_a_bad_output_expires_after_is_a_400_naming_it_and_creates_nothing(sims, gateway, tmp_path, value,
                                                                                   param, code):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", GOOD), purpose="batch")
    with pytest.raises(openai.BadRequestError) as ei:
        await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               extra_body={"output_expires_after": value})
    err = ei.value.body
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert param in err["message"] or code == "invalid_value", err
    assert (await c.batches.list()).data == []


@pytest.mark.parametrize(("case", "field", "chunked"), [
    ("purpose", "purpose", False),
    ("purpose, chunked", "purpose", True),
    ("expires_after", "expires_after[seconds]", False),
    ("a field the API does not read", "note", False),
])
async def test_a_form_field_beyond_the_body_limit_is_a_413_naming_it(sims, gateway, tmp_path, case, field, chunked):
    """A multipart field other than ``file`` larger than ``server.max_body_bytes`` is a 413 naming
    it, whether the body's length is told or not, and nothing is stored; the connection answers the
    next upload. It was a 400 ``truncated_upload`` (``purpose``, ``expires_after``), or read whole and
    passed over (a field the API does not read)."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"max_body_bytes": 65_536},
                       batch=batch_cfg(tmp_path))
    fields = [("purpose", None, b"batch"), (field, None, b"7" * 70_000), ("file", "a.jsonl", GOOD)]
    if field == "purpose":
        fields = fields[1:]
    body = _multipart(fields)

    async def pieces():
        for i in range(0, len(body), 16_384):
            yield body[i:i + 16_384]

    headers = {"Content-Type": "multipart/form-data; boundary=xyzBOUNDARY"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        async with s.post(gw.url + "/v1/files", data=pieces() if chunked else body, headers=headers) as r:
            status, err = r.status, (await r.json())["error"]
        assert status == 413, err
        assert (err["param"], err["code"], err["type"]) == (field, "field_too_large", "invalid_request_error"), err
        assert "server.max_body_bytes (65536 bytes)" in err["message"]
        async with s.post(gw.url + "/v1/files", data=_multipart([("purpose", None, b"batch"), ("file", "a.jsonl", GOOD)]),
                          headers=headers) as r:
            assert r.status == 200, await r.text()
            kept = (await r.json())["id"]
    assert [f.id for f in (await openai_client(gw).files.list()).data] == [kept]
    assert list((tmp_path / "batch" / "tmp").iterdir()) == []


@pytest.mark.parametrize("field", ["expires_after[k{}]", "note{}"])
async def test_a_chunked_upload_of_endless_small_fields_is_a_413_once_past_the_upload_limit(sims, gateway, tmp_path,
                                                                                           field):
    """A body of no told length is read no further than one whose Content-Length is refused at once
    (``batch.max_file_bytes`` and 64 KiB of form around it), however its bytes are cut into fields,
    and answered as that one is. Each small field is within its own 64 KiB, so before, the upload
    was read to its end however long (keeping each ``expires_after[...]`` key it named), then
    refused for an unknown key or stored. The next upload is answered."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch={**batch_cfg(tmp_path), "max_file_bytes": 20_000})

    async def pieces():
        yield _multipart([("purpose", None, b"batch")], close=False)
        for i in range(40_000):         # 3 MB of fields, far past the 84 KiB the upload may hold
            yield _multipart([(field.format(i), None, b"1")], close=False)
        yield _multipart([("file", "a.jsonl", GOOD)])

    headers = {"Content-Type": "multipart/form-data; boundary=xyzBOUNDARY"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        async with s.post(gw.url + "/v1/files", data=pieces(), headers=headers) as r:
            status, answer = r.status, await r.json()
        assert status == 413, answer
        err = answer["error"]
        assert (err["param"], err["code"]) == ("file", "file_too_large"), err
        assert "batch.max_file_bytes (20000 bytes)" in err["message"]
        async with s.post(gw.url + "/v1/files", data=_multipart([("purpose", None, b"batch"), ("file", "a.jsonl", GOOD)]),
                          headers=headers) as r:
            assert r.status == 200, await r.text()
            kept = (await r.json())["id"]
    assert [f.id for f in (await openai_client(gw).files.list()).data] == [kept]
    assert list((tmp_path / "batch" / "tmp").iterdir()) == []


async def test_a_field_beyond_the_default_body_limit_is_a_413(sims, gateway, tmp_path):
    """As the limit is by default: a 17 MiB ``purpose``."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    status, body = await _post_raw(gw, "/v1/files", _multipart([("purpose", None, b"b" * (17 << 20)),
                                                                ("file", "a.jsonl", GOOD)]),
                                   "multipart/form-data; boundary=xyzBOUNDARY")
    assert (status, body["error"]["param"], body["error"]["code"]) == (413, "purpose", "field_too_large"), body
    assert (await openai_client(gw).files.list()).data == []


async def test_uploads_are_read_when_the_body_limit_is_off(sims, gateway, tmp_path):
    """``server.max_body_bytes: 0`` is no limit; every upload was a 400 ``truncated_upload``, its
    ``purpose`` field read as if no byte of it were allowed."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"max_body_bytes": 0}, batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", GOOD), purpose="batch",
                             expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.purpose == "batch" and f.expires_at == f.created_at + 3600
    b = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "completed" and b.request_counts.completed == 2, b


@pytest.mark.parametrize(("field", "max_body_bytes"), [
    ("a field the API does not read", 0),
    ("purpose", 0),
    ("expires_after[seconds]", 0),
    ("a field the API does not read", 16 << 20),
])
async def test_a_form_field_is_read_up_to_64_kib_whatever_the_body_limit(sims, gateway, tmp_path, field,
                                                                       max_body_bytes):
    """A multipart field other than ``file`` is read up to 64 KiB (65536 bytes), with the body limit
    off (``server.max_body_bytes: 0``) or above that: past it, a chunked upload is a 413 naming the
    field, nothing is stored, and the connection answers the next upload, whose unread field of
    exactly 64 KiB is taken. With the limit off, a field was read to its end however long it was
    (one the API does not read passed over, ``purpose`` and ``expires_after`` then judged)."""
    name = "note" if field.startswith("a field") else field
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"max_body_bytes": max_body_bytes},
                       batch=batch_cfg(tmp_path))
    fields = [("purpose", None, b"batch"), (name, None, b"7" * (1 << 20)), ("file", "a.jsonl", GOOD)]
    if name == "purpose":
        fields = fields[1:]

    def pieces(body: bytes):
        async def gen():
            for i in range(0, len(body), 16_384):
                yield body[i:i + 16_384]
        return gen()

    headers = {"Content-Type": "multipart/form-data; boundary=xyzBOUNDARY"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        async with s.post(gw.url + "/v1/files", data=pieces(_multipart(fields)), headers=headers) as r:
            status, err = r.status, (await r.json())["error"]
        assert status == 413, err
        assert (err["param"], err["code"], err["type"]) == (name, "field_too_large", "invalid_request_error"), err
        assert "65536 bytes" in err["message"], err
        at_cap = _multipart([("purpose", None, b"batch"), ("note", None, b"7" * 65_536), ("file", "a.jsonl", GOOD)])
        async with s.post(gw.url + "/v1/files", data=pieces(at_cap), headers=headers) as r:
            assert r.status == 200, await r.text()
            kept = (await r.json())["id"]
    assert [f.id for f in (await openai_client(gw).files.list()).data] == [kept]
    assert list((tmp_path / "batch" / "tmp").iterdir()) == []


async def test_an_upload_or_a_batch_whose_x_gzip_body_does_not_decode_is_the_400_of_gzip_s(sims, gateway, tmp_path):
    """The Files and Batches handlers read their body through aiohttp's request: one in x-gzip that is
    not gzip gets the answer a gzip one gets (the 400 bad_body, the connection closed), where it was
    a 500 ``internal_error``, the decoder's error taken for a bug of the handler's."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    for path, ctype in (("/v1/files", "multipart/form-data; boundary=xyzBOUNDARY"), ("/v1/batches", "application/json")):
        answers = {}
        for coding in ("gzip", "x-gzip"):
            ex = await exchange(gw.port, request("POST", path, b"0123456789", {"Content-Encoding": coding,
                                                                              "Content-Type": ctype}), wait=5.0)
            assert len(ex.responses) == 1 and ex.closed, (path, coding, [r.status for r in ex.responses])
            err = assert_openai_error(ex.first, 400)
            answers[coding] = (err["code"], err["message"], ex.first.headers.get("connection"))
        assert answers["x-gzip"] == answers["gzip"] and answers["gzip"][0] == "bad_body", (path, answers)
    assert (await openai_client(gw).files.list()).data == []


def _chunks(body: bytes, size: int = 16_384) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


async def test_a_chunked_body_over_its_limit_on_the_files_and_batches_paths_has_its_413_s_line(sims, gateway,
                                                                                              tmp_path):
    """A body too large has one request log line with its 413 whether its length is told (the edge's
    answer) or not: a chunked upload past batch.max_file_bytes (the Files API's 413), a chunked
    batch body past server.max_body_bytes (aiohttp's own 413, which the error middleware shapes), with
    ``method``, the path, the request id the answer carries, ``error_class: http`` and the answer's
    message. Neither had a line; the Files and Batches calls served have none, as before."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], server={"max_body_bytes": 65_536},
                       batch={**batch_cfg(tmp_path), "max_file_bytes": 20_000})
    upload = _multipart([("purpose", None, b"batch"), ("file", "in.jsonl", jsonl(lines("/v1/chat/completions", 300)))])
    cases = [
        ("/v1/files", "multipart/form-data; boundary=xyzBOUNDARY", upload, "file_too_large"),
        ("/v1/batches", "application/json", b"{" + b" " * 100_000 + b"}", "body_too_large"),
    ]
    with gw.gw.request_log.capture() as got:
        for path, ctype, body, code in cases:
            head = (f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: {ctype}\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n").encode()
            ex = await exchange(gw.port, head + _chunks(body), wait=5.0, until_close=False, responses=1)
            err = assert_openai_error(ex.first, 413)
            assert err["code"] == code, (path, err)
            rid = ex.first.headers["request-id"]
            await until(lambda rid=rid: any(x["request_id"] == rid for x in got), timeout=5.0, interval=0.01)
            mine = [x for x in got if x["request_id"] == rid]
            assert [(x["path"], x["method"], x["status"], x["error_class"], x["error"]) for x in mine] == [
                (path, "POST", 413, "http", err["message"])], mine
            assert mine[0]["duration_ms"] >= 0
        # a call served writes none
        await openai_client(gw).files.list()
    assert [x["path"] for x in got] == [path for path, *_ in cases], got


async def test_a_process_starting_on_the_dir_leaves_an_upload_under_way_alone(sims, gateway, tmp_path):
    """A worker restarted, or a second gateway started, on the same ``batch.dir`` removes the
    temporary files a process that died left there, not the one another process is still writing
    an upload to: the upload, half sent as the second gateway starts, completes as the file it
    sent; an orphan a dead process left is removed (by the sweep of the gateway that runs batches,
    or by the one starting)."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
    temp = tmp_path / "batch" / "tmp"
    orphan = temp / "upload-0123456789abcdef"          # left by a process that died mid-upload
    orphan.write_bytes(b"half a file")
    os.utime(orphan, (1, 1))
    data = jsonl(lines("/v1/chat/completions", 2000))
    body = _multipart([("purpose", None, b"batch"), ("file", "in.jsonl", data)])
    cut = body.index(data) + len(data) // 2
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(request("POST", "/v1/files", body[:cut], {
            "Content-Type": "multipart/form-data; boundary=xyzBOUNDARY", "Content-Length": str(len(body))}))
        await writer.drain()
        await until(lambda: set(os.listdir(temp)) - {orphan.name}, timeout=10)     # the upload's
        await gateway([model_block("m", "vllm", [sim.url])], batch=batch_cfg(tmp_path))
        assert not orphan.exists()
        writer.write(body[cut:])
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
        resp = parse_responses(head + await reader.read(65536), eof=False)[0][0]
    finally:
        writer.close()
    assert resp.status == 200, resp.body
    f = resp.json()
    assert (await openai_client(gw).files.content(f["id"])).content == data
    assert os.listdir(temp) == []


async def test_without_batch_the_files_and_batches_paths_say_the_api_is_off_and_which_key_turns_it_on(sims, gateway):
    """A gateway without ``batch.enabled`` answers the Files and Batches paths 404, as paths it does
    not serve, with a message that names the Batch API as off and the key that turns it on, so a
    user trying the SDK's calls learns why; another path nothing serves is still an unknown path."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    c = openai_client(gw)
    calls = {"batches.list": lambda: c.batches.list(),
             "files.list": lambda: c.files.list(),
             "files.create": lambda: c.files.create(file=("in.jsonl", jsonl(lines("/v1/embeddings", 1))),
                                                    purpose="batch"),
             "files.content": lambda: c.files.content("file-abc"),
             "batches.create": lambda: c.batches.create(input_file_id="file-abc", endpoint="/v1/chat/completions",
                                                        completion_window="24h"),
             "batches.cancel": lambda: c.batches.cancel("batch_abc")}
    for name, call in calls.items():
        with pytest.raises(openai.NotFoundError) as e:
            await call()
        assert e.value.status_code == 404, name
        message = e.value.body["message"]
        assert "Batch API" in message and "batch.enabled" in message and "off" in message, (name, message)
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/filesystem") as r:
            body = await r.json()
            assert (r.status, body["error"]["message"]) == (404, "unknown path /v1/filesystem"), body


async def test_the_lines_in_flight_series_of_a_model_a_reload_removed_goes_once_none_runs(sims, gateway, tmp_path):
    """``switchyard_batch_lines_in_flight{model}``: a model that ran batch lines keeps its series (0
    between batches) while it is served; once a reload removes it, and no line of it runs, its series
    goes, as admission's gauges of a removed model do; lines naming no model leave none either."""
    import msgspec

    from gateway.server.app import RELOAD_KEY

    a, b = await sims("vllm", "m"), await sims("vllm", "gone")
    gw = await gateway([model_block("m", "vllm", [a.url]), model_block("gone", "vllm", [b.url])],
                       batch=batch_cfg(tmp_path))
    c = openai_client(gw)
    rows = lines("/v1/chat/completions", 3)
    rows[1]["body"]["model"] = "gone"
    rows[2]["body"]["model"] = "made-up"
    f = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    bt = await run_to_end(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                     completion_window="24h")).id)
    assert (bt.request_counts.completed, bt.request_counts.failed) == (2, 1)
    text = await gw.metrics_text()
    assert sample(text, "switchyard_batch_lines_in_flight", model="gone") == 0
    reloader = gw.runner.app[RELOAD_KEY]
    config = reloader.live.config
    assert reloader.reload("test", msgspec.structs.replace(
        config, models=[m for m in config.models if m.name != "gone"])).result == "ok"
    text = await gw.metrics_text()
    flying = {line.split('model="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("switchyard_batch_lines_in_flight{")}
    assert flying == {"m"}, flying
