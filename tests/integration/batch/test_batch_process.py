"""A real gateway process running a batch: killed with SIGKILL mid-batch and started again on the same
``batch.dir``, it resumes, and the output holds exactly one line per custom_id; with ``--workers 2``
exactly one worker runs the batches while both answer the API, and the other worker's interactive
requests preempt its lines."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import aiohttp
import openai
import orjson
import pytest

from tests.support.batch import jsonl, run_to_end
from tests.support.gateway_process import (
    can_unshare_read_only,
    gateway_process,
    get_new,
    metric_total,
    per_worker,
    unshare_read_only,
)
from tests.support.http import sim_state
from tests.support.ports import listen_port
from tests.support.waiting import until

N = 60


def config_text(port: int, url: str, batch_dir: str, batch: str = "max_concurrency: 4") -> str:
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 2, log_level: warning}\n"
            "health: {interval_s: 0.5}\nscrape: {interval_s: 0.2}\n"
            f"models: [{{name: m, engine: vllm, endpoints: ['{url}']}}]\n"
            f"batch: {{enabled: true, dir: '{batch_dir}', poll_interval_s: 0.05, {batch}}}\n")


def rows(n: int, max_tokens: int = 5) -> list[dict]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"Item {i}"}], "max_tokens": max_tokens}}
            for i in range(n)]


@pytest.mark.timeout(120)
async def test_a_batch_survives_sigkill_and_answers_each_line_once(sims, tmp_path):
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch")))
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    async with gateway_process(cfg, port) as proc:
        f = await c.files.create(file=("in.jsonl", jsonl(rows(N))), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

        async def some_answered() -> bool:
            got = await c.batches.retrieve(b.id)
            return got.request_counts is not None and got.request_counts.completed >= 10

        await until(some_answered, timeout=60, interval=0.02)
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        # its workers get SIGTERM from the kernel (they die with their parent) and close their
        # listeners; until they have, a connection may still land in one's backlog and be reset
        # as it closes, under the new gateway's client
        await until(lambda: _refused(port), timeout=20, interval=0.05)
    async with gateway_process(cfg, port):
        done = await run_to_end(c, b.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (N, N, 0)
        out = [orjson.loads(x) for x in (await c.files.content(done.output_file_id)).content.splitlines()]
        ids = [o["custom_id"] for o in out]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(N)) and len(ids) == len(set(ids))
        assert ids == [f"line-{i}" for i in range(N)]      # in input order
    received = [r for r in (await sim_state(sim.url))["received"] if r["path"] == "/v1/chat/completions"]
    assert len(received) >= N          # lines cut by the kill ran again; none is written twice


@pytest.mark.timeout(120)
async def test_a_batch_of_two_workers_stopped_with_lines_in_flight_resumes_and_answers_each_line_once(sims, tmp_path):
    """SIGTERM to a gateway of ``--workers 2`` while a batch's lines run on the engine (one attempt
    a line: a line cut by the stop and counted would end in the error file), then the gateway
    started again on the same ``batch.dir``: the batch completes, each line once in input order,
    none failed, and nothing stays in flight."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch"), "max_concurrency: 4, max_attempts: 1")
                   .replace("shutdown_grace_s: 2", "shutdown_grace_s: 1"))
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc:
        f = await c.files.create(file=("in.jsonl", jsonl(rows(8, max_tokens=100))), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

        async def running() -> bool:
            return len((await sim_state(sim.url))["running"]) >= 2

        await until(running, timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0
        await until(lambda: _refused(port), timeout=20, interval=0.05)
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        done = await run_to_end(c, b.id)
        counts = done.request_counts
        assert (done.status, counts.total, counts.completed, counts.failed) == ("completed", 8, 8, 0), done
        assert done.error_file_id is None
        out = [orjson.loads(x) for x in (await c.files.content(done.output_file_id)).content.splitlines()]
        assert [o["custom_id"] for o in out] == [f"line-{i}" for i in range(8)]
        assert [f.id for f in (await c.files.list(purpose="batch_output")).data] == [done.output_file_id]
        for page in (await per_worker(port, 2)).values():
            assert metric_total(page, "switchyard_batch_lines_in_flight") == 0
            assert metric_total(page, "switchyard_endpoint_in_flight_requests") == 0


@pytest.mark.timeout(120)
async def test_with_two_workers_one_runs_batches_and_both_answer(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch")))
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        pages = await per_worker(port, 2, "/status.json")
        runs = sorted(p["batch"]["runs_here"] for p in pages.values())
        assert runs == [False, True]
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        f = await c.files.create(file=("in.jsonl", jsonl(rows(8))), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = await run_to_end(c, b.id)
        assert done.status == "completed" and done.request_counts.completed == 8
        for _ in range(4):          # new connections reach either worker: each knows the batch
            assert (await c.batches.retrieve(b.id)).status == "completed"


async def _session_on_worker(port: int, runs_batches: bool) -> aiohttp.ClientSession:
    """A session whose one keep-alive connection is with a worker that runs the batches, or not
    (a connection stays with the worker that accepted it)."""
    async with asyncio.timeout(20):
        while True:
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                if (await r.json())["batch"]["runs_here"] == runs_batches:
                    return s
            await s.close()


async def _refused(port: int) -> bool:
    """Nothing listens on ``port`` any more."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    writer.close()
    return False


@pytest.mark.timeout(120)
async def test_an_interactive_request_of_the_other_worker_takes_a_batch_lines_slot(sims, tmp_path):
    """With ``--workers 2`` one worker runs the batch lines; an interactive request the other one
    routes to an engine they fill stops the newest of them (it goes back to the queue), as a request
    of the runner's own does, instead of waiting in the engine's queue for a line to end."""
    sim = await sims("vllm", "m", itl_ms=20.0, max_num_seqs=2)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    # the lines take both of the engine's slots, 10 s each
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch"),
                               "max_concurrency: 2, endpoint_capacity: 2, reserve_slots: 0"))
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        f = await c.files.create(file=("in.jsonl", jsonl(rows(4, max_tokens=500))), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

        async def full() -> bool:
            return len((await sim_state(sim.url))["running"]) == 2

        await until(full, timeout=30)
        async with await _session_on_worker(port, runs_batches=False) as s, \
                s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "now"}], "max_tokens": 3}) as r:
            assert r.status == 200
        state = await sim_state(sim.url)
        # it was answered with the lines still running: one of them gave it its slot
        assert [i for i in state["aborted_ids"] if "batch_req_" in i], state["counts"]
        await c.batches.cancel(b.id)
        done = await run_to_end(c, b.id)
        counts = done.request_counts
        assert done.status == "cancelled" and counts.total == 4 and counts.completed + counts.failed <= 4


@pytest.mark.timeout(120)
async def test_a_batch_created_and_cancelled_through_the_other_worker_is_taken_up_at_once(sims, tmp_path):
    """With ``--workers 2``, a batch created, then cancelled, through the worker that does not run
    batches is taken up, then stopped, by the one that does as soon as the workers' bus tells it,
    not at its next look at the job store (``poll_interval_s``, here longer than the test)."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch"), "max_concurrency: 1")
                   .replace("poll_interval_s: 0.05", "poll_interval_s: 600"))
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        f = await c.files.create(file=("in.jsonl", jsonl(rows(40, max_tokens=20))), purpose="batch")
        base = f"http://127.0.0.1:{port}/v1/batches"
        async with await _session_on_worker(port, runs_batches=False) as s:
            async with s.post(base, json={"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"}) as r:
                assert r.status == 200
                bid = (await r.json())["id"]

            async def started() -> bool:
                return any(r["path"] == "/v1/chat/completions" for r in (await sim_state(sim.url))["received"])

            await until(started, timeout=30)
            async with s.post(f"{base}/{bid}/cancel") as r:
                assert r.status == 200 and (await r.json())["status"] in ("cancelling", "cancelled")
        done = await run_to_end(c, bid, timeout=30)
        counts = done.request_counts
        assert done.status == "cancelled" and counts.total == 40 and counts.completed < 40
        assert counts.failed == 0       # the lines it never ran are not counted, as OpenAI counts a cancel's


@pytest.mark.timeout(60)
async def test_an_upload_the_disk_has_no_room_for_is_a_507_in_openai_shape(sims, tmp_path):
    """A write of the upload that fails for want of room (a full disk is ENOSPC; here the process's
    file size limit, EFBIG) is the server's condition, not a bug: 507 ``insufficient_storage`` in
    OpenAI's shape, nothing kept, and an upload that fits is taken after it."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch")))
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    big = jsonl([{**r, "body": {**r["body"], "user": "x" * 200_000}} for r in rows(8)])
    async with gateway_process(cfg, port, file_size_limit=1024 * 1024):
        with pytest.raises(openai.APIStatusError) as ei:
            await c.files.create(file=("in.jsonl", big), purpose="batch")
        assert ei.value.status_code == 507, ei.value.body
        assert ei.value.body["code"] == "insufficient_storage" and ei.value.body["type"] == "api_error"
        assert set(ei.value.body) == {"message", "type", "param", "code"}
        assert (await c.files.list()).data == []
        assert list((tmp_path / "batch" / "tmp").iterdir()) == []
        assert metric_total((await get_new(port, "/metrics"))[1], "switchyard_internal_errors_total") == 0
        f = await c.files.create(file=("in.jsonl", jsonl(rows(2))), purpose="batch")
        assert [x.id for x in (await c.files.list()).data] == [f.id]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not can_unshare_read_only(), reason="needs a mount namespace of its own (unshare -Urm)")
async def test_files_are_deleted_to_make_room_on_a_full_disk(sims, tmp_path):
    """``batch.dir`` on a disk filled to its last byte (here by another file on it): an upload is the
    507, and a delete, the way a user frees room through the API, still deletes its file whole,
    though the job store must write the change before the bytes go; an upload fits after it."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    batch_dir = tmp_path / "batch"
    batch_dir.mkdir()
    cfg.write_text(config_text(port, sim.url, str(batch_dir)))
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    async with gateway_process(cfg, port, tmpfs=(str(batch_dir), 2 * 1024 * 1024)) as proc:
        seen = f"/proc/{proc.pid}/root{batch_dir}"          # the directory as the gateway sees it
        small = await c.files.create(file=("small.jsonl", jsonl(rows(2))), purpose="batch")
        large = await c.files.create(file=("large.jsonl", jsonl(rows(400))), purpose="batch")
        filler = os.open(f"{seen}/filler", os.O_WRONLY | os.O_CREAT)       # the disk's last page taken
        try:
            with contextlib.suppress(OSError):
                while True:
                    os.write(filler, b"\0" * 4096)
        finally:
            os.close(filler)
        with pytest.raises(openai.APIStatusError) as ei:
            await c.files.create(file=("in.jsonl", jsonl(rows(2))), purpose="batch")
        assert ei.value.status_code == 507, ei.value.body
        assert (await c.files.delete(small.id)).deleted
        assert [f.id for f in (await c.files.list()).data] == [large.id]
        assert sorted(os.listdir(f"{seen}/files")) == [large.id]
        assert (await c.files.delete(large.id)).deleted
        assert (await c.files.list()).data == [] and os.listdir(f"{seen}/files") == []
        f = await c.files.create(file=("in.jsonl", jsonl(rows(2))), purpose="batch")
        assert [x.id for x in (await c.files.list()).data] == [f.id]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not can_unshare_read_only(), reason="needs a mount namespace of its own (unshare -Urm)")
async def test_an_upload_a_read_only_file_system_refuses_is_a_storage_error(sims, tmp_path):
    """A write of the upload the disk refuses other than for want of room (the file system the
    kernel remounted read-only after an I/O error, EROFS; a failing disk, EIO) is the server's
    storage failing, not a bug: a 500 ``storage_error`` in OpenAI's shape naming the error, not an
    ``internal_error`` counted in switchyard_internal_errors_total; nothing is kept, and the rest of
    the API (the job store beside it) still answers."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch")))
    (tmp_path / "batch" / "tmp").mkdir(parents=True)
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    async with gateway_process(cfg, port, read_only=(str(tmp_path / "batch" / "tmp"),)):
        with pytest.raises(openai.APIStatusError) as ei:
            await c.files.create(file=("in.jsonl", jsonl(rows(2))), purpose="batch")
        assert ei.value.status_code == 500, ei.value.body
        assert (ei.value.body["code"], ei.value.body["type"]) == ("storage_error", "api_error"), ei.value.body
        assert "Read-only file system" in ei.value.body["message"]
        assert set(ei.value.body) == {"message", "type", "param", "code"}
        assert metric_total((await get_new(port, "/metrics"))[1], "switchyard_internal_errors_total") == 0
        assert (await c.files.list()).data == [] and (await c.batches.list()).data == []


@pytest.mark.timeout(60)
async def test_a_write_of_the_job_store_that_sqlite_reports_as_a_disk_io_error_is_a_storage_error(sims, tmp_path):
    """SQLite reports a write of the job store refused by the disk other than for want of space (a
    file size limit, EFBIG, here set on the running process; a quota, EDQUOT; a failing disk, EIO)
    as its "disk I/O error", which cannot say which: a 500 ``storage_error`` in OpenAI's shape,
    logged as a warning, not an ``internal_error`` counted as a bug; nothing is created, and the
    store takes writes again once the disk does."""
    import resource
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch")).replace("log_level: warning", "log_level: error"))
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    async with gateway_process(cfg, port, "--workers", "1"):
        f = await c.files.create(file=("in.jsonl", jsonl(rows(2))), purpose="batch")
        pid = (await get_new(port, "/status.json"))[1]["gateway"]["pid"]       # the one worker
        _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        # no write past a file's first 4 KiB: each write of the job store appends at least a page of
        # 4 KiB and its header to its journal, which a write cut short there cannot hold (the
        # gateway's log, a file here, stays empty at level error)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (4096, hard))
        try:
            with pytest.raises(openai.APIStatusError) as ei:
                await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            assert ei.value.status_code == 500 and ei.value.body["code"] == "storage_error", ei.value.body
            assert ei.value.body["type"] == "api_error" and "disk I/O error" in ei.value.body["message"]
            assert metric_total((await get_new(port, "/metrics"))[1], "switchyard_internal_errors_total") == 0
            assert (await c.batches.list()).data == []
        finally:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert (await run_to_end(c, b.id)).status == "completed"


@pytest.mark.timeout(60)
@pytest.mark.skipif(not can_unshare_read_only(), reason="needs a mount namespace of its own (unshare -Urm)")
@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_batch_dir_the_gateway_cannot_write_stops_its_start_with_one_line(tmp_path, workers):
    """A ``batch.dir`` on a read-only volume (or one the gateway's user may not write) stops the
    gateway as it starts, with one line naming ``batch.dir`` and the error and the exit status of a
    config error, as a port taken does, not a traceback."""
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, "http://127.0.0.1:9", str(tmp_path / "batch")))
    (tmp_path / "batch").mkdir()
    cmd = unshare_read_only((str(tmp_path / "batch"),),
                            [sys.executable, "-m", "gateway", "--config", str(cfg), "--workers", workers])
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(40):
        _, err = await proc.communicate()
    text = err.decode()
    assert "Traceback" not in text, text
    assert f"switchyard: batch.dir {tmp_path / 'batch'} cannot be used" in text and "Read-only file system" in text, text
    assert proc.returncode == 2, text


@pytest.mark.timeout(120)
async def test_no_line_starts_while_the_other_workers_admission_queue_holds_a_request(sims, tmp_path):
    """With ``--workers 2`` the worker that runs the batch lines leaves the engine to interactive
    requests while either worker's admission queue holds one of the model's, not only its own;
    once the queue is empty the lines run."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch"), "max_concurrency: 2, endpoint_capacity: 8")
                   + "admission: {enabled: true, max_in_flight_per_endpoint: 2, queue_timeout_s: 60}\n")
    hold = {"model": "m", "messages": [{"role": "user", "content": "hold"}], "max_tokens": 3}
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        sessions, held = [], []
        try:
            while True:         # the other worker's requests, until its queue holds one
                s = await _session_on_worker(port, runs_batches=False)
                sessions.append(s)
                held.append(asyncio.create_task(s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=hold,
                                                       headers={"x-sim-fault": "stall_before_first=inf"})))

                async def settled() -> tuple[float] | None:
                    queued = metric_total((await get_new(port, "/metrics"))[1], "switchyard_admission_queue_depth")
                    return (queued,) if queued + len((await sim_state(sim.url))["running"]) == len(held) else None
                if (await until(settled, timeout=20))[0]:
                    break
            c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            f = await c.files.create(file=("in.jsonl", jsonl(rows(2))), purpose="batch")
            b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            await asyncio.sleep(1.0)        # twenty passes of the runner's dispatch
            page = (await get_new(port, "/metrics"))[1]
            assert metric_total(page, "switchyard_batch_lines_in_flight") == 0
            assert metric_total(page, "switchyard_admission_queue_depth", priority="sheddable") == 0
            assert not [r for r in (await sim_state(sim.url))["received"] if "batch_req_" in str(r)]
        finally:
            for t in held:
                t.cancel()
            for s in sessions:
                await s.close()
        done = await run_to_end(c, b.id)
        assert done.status == "completed" and done.request_counts.completed == 2


def _upload_head(body_len: int) -> bytes:
    return (f"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
            f"Content-Length: {body_len}\r\n\r\n").encode()


BOUNDARY = "b0undary"


def _upload_body(content: bytes) -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], dict]:
    """One HTTP/1.1 answer with a Content-Length read off a raw connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
    body = await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split()[1]), headers, orjson.loads(body)


@pytest.mark.timeout(60)
async def test_batch_api_requests_under_way_at_sigterm_may_finish_within_the_grace(sims, tmp_path):
    """The drain waits for the batch API's requests as for inference ones: an upload whose body is
    still coming at SIGTERM is taken when the rest comes within ``server.shutdown_grace_s``, one
    still unfinished at the second signal is told the gateway is shutting down (503 in OpenAI's
    shape, its temporary file removed), and a kept-alive connection idle since its last batch API
    answer closes with the listener, as one of inference requests does."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, sim.url, str(tmp_path / "batch"))
                   .replace("shutdown_grace_s: 2", "shutdown_grace_s: 60"))
    body = _upload_body(jsonl(rows(4)))
    tmp = tmp_path / "batch" / "tmp"
    async with gateway_process(cfg, port, "--workers", "1") as proc:
        kept_r, kept_w = await asyncio.open_connection("127.0.0.1", port)     # kept alive, idle at SIGTERM
        kept_w.write(b"GET /v1/files HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _answer(kept_r))[0] == 200
        ups = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for _, w in ups:                # half of each body: the upload handler is reading it
            w.write(_upload_head(len(body)) + body[:len(body) // 2])
        await until(lambda: tmp.is_dir() and len(list(tmp.iterdir())) >= 2, timeout=20)
        proc.send_signal(signal.SIGTERM)
        await until(lambda: _refused(port), timeout=20, interval=0.05)
        async with asyncio.timeout(10):         # closed, not answered: its client asks elsewhere
            assert await kept_r.read(1) == b""
        await asyncio.sleep(1.5)        # past the moment the server's own shutdown would close connections
        (done_r, done_w), (cut_r, cut_w) = ups
        done_w.write(body[len(body) // 2:])
        status, _, f = await _answer(done_r)
        assert status == 200 and f["object"] == "file" and f["purpose"] == "batch", f
        assert proc.returncode is None          # the other upload still holds the drain
        proc.send_signal(signal.SIGINT)         # a second signal: stop now
        status, headers, err = await _answer(cut_r)
        assert (status, headers.get("connection")) == (503, "close"), (status, headers, err)
        assert err["error"]["code"] == "service_unavailable" and "shutting down" in err["error"]["message"]
        assert await proc.wait() == 0
        for w in (kept_w, done_w, cut_w):
            w.close()
    assert list(tmp.iterdir()) == []
    async with gateway_process(cfg, port, "--workers", "1"):       # the file taken in the drain was stored
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [x.id for x in (await c.files.list()).data] == [f["id"]]
        assert (await c.files.content(f["id"])).content == jsonl(rows(4))
