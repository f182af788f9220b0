"""Where and when a batch's lines start, and how a batch ends when things around it go wrong: a line
that names an alias meets the headroom of the alias's targets; a model with no ready endpoint holds
its lines (they wait, not fail); a model without room does not hold back the lines of other models
in the same file; an input file whose time is up is kept while a batch reads it; a batch cancelled
before it was validated counts its lines; one cancelled once its input cannot be read ends cancelled,
and the runner goes on; a malformed part header of an upload is a 400; a line a retry moved to another
endpoint is no longer the one an interactive request stops on the first; the lines of a model whose
ready endpoints the routing refuses every time (prefill and decode pods routed whole) spend their
attempts and end in the error file, where those of a P/D model with no ready pair wait for one; lines
start as often as max_lines_per_s allows; a batch being validated, or whose files are being written,
holds up no other batch; an interactive request stops every batch line it would wait behind."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest
import structlog.testing

from tests.support.batch import jsonl, run_to_end
from tests.support.factories import model_block, pd_model, pd_pair, roleset, sim_pod
from tests.support.http import openai_client, sim_state
from tests.support.metrics import metric
from tests.support.tenancy import ALICE, KEYS
from tests.support.waiting import until

# two lines a model's endpoint at a time: capacity 3, one slot kept for interactive requests
ROOM = {"endpoint_capacity": 3, "reserve_slots": 1}


def cfg(tmp_path, **over: Any) -> dict[str, Any]:
    return {"enabled": True, "dir": str(tmp_path / "batch"), "poll_interval_s": 0.05, "retry_backoff_s": 0.05,
            **ROOM, **over}


def rows(models: list[str], max_tokens: int = 3) -> list[dict[str, Any]]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": m, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": max_tokens}}
            for i, m in enumerate(models)]


async def create(c, data: list[dict[str, Any]]):
    f = await c.files.create(file=("in.jsonl", jsonl(data)), purpose="batch")
    return await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


async def test_lines_that_name_an_alias_meet_its_targets_headroom(sims, gateway, tmp_path):
    sim = await sims("vllm", "m", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path),
                       aliases=[{"name": "fast", "targets": [{"model": "m"}]}])
    c = openai_client(gw)
    b = await create(c, rows(["fast"] * 10, max_tokens=15))
    most = 0

    async def done() -> bool:
        nonlocal most
        state = await sim_state(sim.url)
        most = max(most, len(state["running"]) + len(state["waiting"]))
        return (await c.batches.retrieve(b.id)).status == "completed"

    await until(done, timeout=30, interval=0.02)
    b = await c.batches.retrieve(b.id)
    assert (b.request_counts.completed, b.request_counts.failed) == (10, 0)
    assert 1 <= most <= 2, most          # the engine never held more than the alias's target's room


async def test_a_model_with_no_ready_endpoint_holds_its_lines_until_one_is_back(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    c = openai_client(gw)
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/_sim/config", json={"dead": True}) as r:
            assert r.status == 200
        await until(lambda: not gw.gw.pool.ready("m"), timeout=10)
        with structlog.testing.capture_logs() as logs:
            b = await create(c, rows(["m"] * 6))
            await asyncio.sleep(1.0)              # not ready: the lines wait, none fails
        assert [(e["model"], e["reason"]) for e in logs if e["event"].startswith("batch lines of a model wait")] \
            == [("m", "no ready endpoint")], logs
        now = await c.batches.retrieve(b.id)
        assert now.status == "in_progress" and now.request_counts.failed == 0
        async with s.post(sim.url + "/_sim/config", json={"dead": False}) as r:
            assert r.status == 200
    b = await run_to_end(c, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (6, 0)


async def _a_line_held_before_its_route_waits_uncounted(gw, dead: str, unready) -> list[tuple[int, str | None]]:
    """One line of model ``m`` (one attempt), held by the test between the runner's room check and
    its route while the engine at ``dead`` dies, until ``unready()``: its 503 spends no attempt, the
    batch stays in progress, and once the engine is back the line completes. The answers the line
    got, (status, ``x-error-no-model-backends``), in order."""
    from gateway.server.app import BATCH_KEY

    service = gw.runner.app[BATCH_KEY]
    await until(lambda: service.runner is not None, timeout=10)
    runner = service.runner
    real = runner.submit
    started, go = asyncio.Event(), asyncio.Event()
    answers: list[tuple[int, str | None]] = []

    async def submit(req):
        if not started.is_set():            # the first line: between the room check and the route
            started.set()
            await go.wait()
        resp = await real(req)
        answers.append((resp.status, resp.headers.get("x-error-no-model-backends")))
        return resp

    runner.submit = submit
    c = openai_client(gw)
    b = await create(c, rows(["m"]))
    await asyncio.wait_for(started.wait(), 10)
    async with aiohttp.ClientSession() as s:
        async with s.post(dead + "/_sim/config", json={"dead": True}) as r:
            assert r.status == 200
        await until(unready, timeout=10)
        go.set()
        await until(lambda: bool(answers), timeout=10)
        assert [a[0] for a in answers] == [503]
        assert metric(await gw.metrics_text(), "switchyard_batch_lines_total", model="m", outcome="retried") == 1
        now = await c.batches.retrieve(b.id)
        assert now.status == "in_progress" and (now.request_counts.completed, now.request_counts.failed) == (0, 0)
        async with s.post(dead + "/_sim/config", json={"dead": False}) as r:
            assert r.status == 200
    b = await run_to_end(c, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (1, 0), b
    assert [a[0] for a in answers] == [503, 200]
    return answers


async def test_a_line_whose_engine_goes_unready_after_its_start_waits_uncounted(sims, gateway, tmp_path):
    """The runner starts a line where its model has room; the engine goes unready before the line is
    routed (held there by the test), so the gateway answers it 503 no ready endpoint. That is not the
    line's fault, nor its engine's: it waits for a ready endpoint, as a line that found none at its
    start does, and spends no attempt (one is all it has here)."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, max_attempts=1))
    answers = await _a_line_held_before_its_route_waits_uncounted(gw, sim.url, lambda: not gw.gw.pool.ready("m"))
    assert answers[0] == (503, "true")      # the gateway's no ready endpoint


async def _every_line_spends_its_attempts_on_a_503(gw, message: str) -> None:
    """Three lines of model ``m``, two attempts each, every attempt a 503 whose message holds
    ``message``: the batch completes with every line in the error file, and nothing stays charged
    (the lines, the model, the endpoints, a P/D prefill, the runner)."""
    from gateway.server.app import BATCH_KEY

    c = openai_client(gw)
    b = await run_to_end(c, (await create(c, rows(["m"] * 3))).id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (3, 0, 3), b
    assert b.output_file_id is None and b.error_file_id is not None
    lines = [orjson.loads(x) for x in (await c.files.content(b.error_file_id)).content.splitlines()]
    assert [x["custom_id"] for x in lines] == ["req-0", "req-1", "req-2"]
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 503, x
        err = x["response"]["body"]["error"]
        assert err["code"] == "service_unavailable" and message in err["message"], err
    text = await gw.metrics_text()
    assert metric(text, "switchyard_batch_lines_total", model="m", outcome="retried") == 3     # one counted retry each
    assert metric(text, "switchyard_batch_lines_total", model="m", outcome="failed") == 3
    assert metric(text, "switchyard_batch_lines_in_flight", model="m") == 0
    assert metric(text, "switchyard_in_flight_requests", model="m") == 0
    assert metric(text, "switchyard_endpoint_in_flight_requests") == 0
    assert metric(text, "switchyard_pd_prefill_in_flight") == 0
    runner = gw.runner.app[BATCH_KEY].runner
    assert runner.in_flight.get("m", 0) == 0 and not runner.placed and not runner.lines_on and not runner.jobs
    assert all(ep.in_flight == 0 for ep in gw.gw.pool.endpoints())


async def test_lines_of_a_model_whose_only_pods_are_prefill_and_decode_routed_whole_end_in_the_error_file(
        emu, sims, gateway, tmp_path):
    """A model whose only endpoints are prefill and decode pods, and whose strategy routes whole
    requests (the config's, for discovered pods: no static endpoint to check it against at start).
    Its endpoints are ready, so the batch's headroom finds room and its lines start; the routing
    refuses every one of them, the gateway's 503 no ready endpoint (``x-error-no-model-backends``)
    while the model has ready endpoints. That is not a model waiting for a ready endpoint: each
    attempt counts, and once ``max_attempts`` are spent the 503 and its message are the line's answer
    in the error file. The batch completes, every line failed, nothing left charged."""

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    p, d = await sims("vllm", "m", role="prefill"), await sims("vllm", "m", role="decode")
    sim_pod(emu, "m-prefill-0", p, "m", **{"role-name": "prefill", "roleset-name": "rs"})
    sim_pod(emu, "m-decode-0", d, "m", **{"role-name": "decode", "roleset-name": "rs"})
    gw = await gateway([{"name": "m", "engine": "vllm", "strategy": "least-request"}],
                       batch=cfg(tmp_path, max_attempts=2),
                       kubernetes={"enabled": True, "kubeconfig": str(kubeconfig), "namespaces": ["llm"]})
    await until(lambda: sorted(ep.role for ep in gw.gw.pool.ready("m")) == ["decode", "prefill"], timeout=10)
    await _every_line_spends_its_attempts_on_a_503(
        gw, "no ready endpoint for model m (prefill/decode endpoints need the pd strategy)")
    assert (await sim_state(p.url))["running"] == [] and (await sim_state(d.url))["running"] == []


async def _dispatches(runner, n: int) -> None:
    """Until the runner's dispatch ran ``n`` more times (each a look at every waiting line)."""
    real, seen = runner._dispatch, asyncio.Event()
    left = n

    def dispatch() -> None:
        nonlocal left
        real()
        left -= 1
        if left <= 0:
            seen.set()

    runner._dispatch = dispatch
    try:
        await asyncio.wait_for(seen.wait(), 10)
    finally:
        runner._dispatch = real


@pytest.mark.parametrize("down", ["decode", "prefill"])
async def test_lines_of_a_pd_model_whose_decodes_or_prefills_are_all_down_wait_until_a_pair_is_ready(
        sims, gateway, tmp_path, down):
    """A model served by prefill/decode pairs alone, whose decode engines are all unready while a
    prefill is ready (or the other way round): no pair can serve a line, so its lines wait, as the
    lines of a model with no ready endpoint do; none starts (the ready engine sees none) and none
    spends an attempt. Once the engine is ready again, they start by themselves and every line is
    answered 200; the wait counted no retry. The runner logs the wait once, with why, and once as
    it ends."""
    from gateway.server.app import BATCH_KEY

    p, d = await pd_pair(sims, "vllm")
    dead, alive = (d, p) if down == "decode" else (p, d)
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])], batch=cfg(tmp_path, max_attempts=1),
                       health={"interval_s": 0.1, "timeout_s": 1, "unhealthy_threshold": 1})
    service = gw.runner.app[BATCH_KEY]
    await until(lambda: service.runner is not None, timeout=10)
    runner = service.runner
    c = openai_client(gw)
    async with aiohttp.ClientSession() as s:
        async with s.post(dead.url + "/_sim/config", json={"dead": True}) as r:
            assert r.status == 200
        await until(lambda: [ep.url for ep in gw.gw.pool.ready("m")] == [alive.url], timeout=10)
        with structlog.testing.capture_logs() as logs:
            b = await create(c, rows(["m"] * 3))
            await _held_until_a_pair(gw, c, runner, b, alive)
        waits = [e for e in logs if e["event"].startswith("batch lines of a model wait")]
        assert [(e["model"], e["reason"], e["log_level"]) for e in waits] == [
            ("m", "no ready prefill/decode pair", "warning")], logs
        with structlog.testing.capture_logs() as logs:
            async with s.post(dead.url + "/_sim/config", json={"dead": False}) as r:
                assert r.status == 200
            b = await run_to_end(c, b.id)
        assert [e["model"] for e in logs if e["event"] == "batch lines of a model can run again"] == ["m"], logs
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (3, 0), b
    lines = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).content.splitlines()]
    assert [(x["custom_id"], x["response"]["status_code"]) for x in lines] == [
        ("req-0", 200), ("req-1", 200), ("req-2", 200)]
    text = await gw.metrics_text()
    assert metric(text, "switchyard_batch_lines_total", model="m", outcome="retried") == 0
    assert metric(text, "switchyard_batch_lines_total", model="m", outcome="completed") == 3


async def _held_until_a_pair(gw, c, runner, b, alive) -> None:
    """Batch ``b``'s three lines read and looked at by the runner a few times, and none started:
    none reached the engine still ready (``alive``), none was counted."""

    async def read() -> bool:      # the runner read the lines (or, where they did not wait, ended them)
        job = runner.jobs.get(b.id)
        if job is None:
            return (await c.batches.retrieve(b.id)).status not in ("validating", "in_progress")
        return job.doc["status"] == "in_progress" and job.eof and len(job.ready) == 3

    await until(read, timeout=10)
    await _dispatches(runner, 5)
    now = await c.batches.retrieve(b.id)
    assert now.status == "in_progress" and (now.request_counts.completed, now.request_counts.failed) == (0, 0)
    assert runner.in_flight.get("m", 0) == 0
    assert (await sim_state(alive.url))["counts"]["started"] == 0
    assert metric(await gw.metrics_text(), "switchyard_batch_lines_total", model="m") == 0


async def test_lines_of_discovered_prefill_and_decode_pods_wait_while_their_decode_is_down(
        emu, sims, gateway, tmp_path):
    """Prefill and decode pods found by discovery, whose model names no strategy: the gateway routes
    it with the P/D strategy, so the batch counts its pairs as for a model with ``rolesets``. While
    the decode pod's engine is down, its lines wait, none started; once it is back, every line is
    answered 200, no retry counted."""
    from gateway.server.app import BATCH_KEY

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    p, d = await pd_pair(sims, "vllm")
    sim_pod(emu, "m-prefill-0", p, "m", **{"role-name": "prefill", "roleset-name": "rs"})
    sim_pod(emu, "m-decode-0", d, "m", **{"role-name": "decode", "roleset-name": "rs"})
    gw = await gateway([{"name": "m", "engine": "vllm"}], batch=cfg(tmp_path, max_attempts=1),
                       kubernetes={"enabled": True, "kubeconfig": str(kubeconfig), "namespaces": ["llm"]},
                       health={"interval_s": 0.1, "timeout_s": 1, "unhealthy_threshold": 1})
    await until(lambda: sorted(ep.role for ep in gw.gw.pool.ready("m")) == ["decode", "prefill"], timeout=10)
    service = gw.runner.app[BATCH_KEY]
    await until(lambda: service.runner is not None, timeout=10)
    c = openai_client(gw)
    async with aiohttp.ClientSession() as s:
        async with s.post(d.url + "/_sim/config", json={"dead": True}) as r:
            assert r.status == 200
        await until(lambda: [ep.role for ep in gw.gw.pool.ready("m")] == ["prefill"], timeout=10)
        b = await create(c, rows(["m"] * 3))
        await _held_until_a_pair(gw, c, service.runner, b, p)
        async with s.post(d.url + "/_sim/config", json={"dead": False}) as r:
            assert r.status == 200
    b = await run_to_end(c, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (3, 0), b
    text = await gw.metrics_text()
    assert metric(text, "switchyard_batch_lines_total", model="m", outcome="retried") == 0
    assert metric(text, "switchyard_batch_lines_total", model="m", outcome="completed") == 3


async def test_a_pd_line_whose_decode_goes_unready_after_its_start_waits_uncounted(sims, gateway, tmp_path):
    """The runner starts a line of a P/D model while its pair is ready; the decode goes unready
    before the line is routed (held there by the test), so the routing finds no pair and answers it
    503. The model has no usable pair now: the line waits for one, as a line that found none at its
    start does, and spends no attempt (one is all it has here)."""
    p, d = await pd_pair(sims, "vllm")
    gw = await gateway([pd_model("vllm", [roleset("vllm", p, d)])], batch=cfg(tmp_path, max_attempts=1),
                       health={"interval_s": 0.1, "timeout_s": 1, "unhealthy_threshold": 1})
    await _a_line_held_before_its_route_waits_uncounted(
        gw, d.url, lambda: [ep.role for ep in gw.gw.pool.ready("m")] == ["prefill"])


async def test_a_model_without_room_does_not_hold_back_another_models_lines(sims, gateway, tmp_path):
    slow = await sims("vllm", "slow", itl_ms=40.0)
    fast = await sims("vllm", "fast")
    gw = await gateway([model_block("slow", "vllm", [slow.url]), model_block("fast", "vllm", [fast.url])],
                       batch=cfg(tmp_path))
    c = openai_client(gw)
    data = rows(["slow", "fast"] * 8, max_tokens=3)
    # the first four slow lines 1.6 s each, two at a time: the third and fourth end 3.2 s in; the slow
    # lines after them wait for room whatever their length, so they are short
    for r in [r for r in data if r["body"]["model"] == "slow"][:4]:
        r["body"]["max_tokens"] = 40
    b = await create(c, data)

    async def fast_done() -> bool:
        return (await sim_state(fast.url))["counts"]["completed"] >= 8

    await until(fast_done, timeout=30, interval=0.02)
    assert (await sim_state(slow.url))["counts"]["completed"] <= 2     # the fast lines did not wait for them
    b = await run_to_end(c, b.id)
    assert (b.request_counts.completed, b.request_counts.failed) == (16, 0)


async def test_lines_start_as_often_as_max_lines_per_s_allows(sims, gateway, tmp_path):
    """``batch.max_lines_per_s`` spaces a model's starts 1/rate apart: the runner wakes for the next
    start the cap allows, not only at its next poll of the store (``poll_interval_s``) or when a
    line ends. Here no line ends (the engine holds each before its first token): at 100 lines a
    second, twenty start within a fraction of a second of the batch's validation."""
    sim = await sims("vllm", "m", fault="stall_before_first=inf")
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch=cfg(tmp_path, poll_interval_s=0.5, max_lines_per_s=100, max_concurrency=64,
                                 endpoint_capacity=64, reserve_slots=0))
    c = openai_client(gw)
    b = await create(c, rows(["m"] * 22))

    async def started() -> bool:
        return len((await sim_state(sim.url))["running"]) >= 20

    # one start a poll would take 9.5 s past the first; the whole wait is within 5 s of the batch's creation
    await until(started, timeout=5, interval=0.02)
    await c.batches.cancel(b.id)
    b = await run_to_end(c, b.id)
    assert b.status == "cancelled" and b.request_counts.total == 22


async def test_an_input_file_past_its_ttl_is_kept_while_its_batch_runs(sims, gateway, tmp_path, monkeypatch):
    import threading

    import openai

    from gateway.batch import runner

    real = runner.read_chunk
    second, go = threading.Event(), threading.Event()

    def held(path: str, offset: int, line_no: int, n: int = 256):
        if offset > 0:                          # the second read waits until the sweep passed the file
            second.set()
            go.wait(30)
        return real(path, offset, line_no, n)

    monkeypatch.setattr(runner, "read_chunk", held)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, file_ttl_s=1))
    c = openai_client(gw)
    n = 300                                   # more than one read of the input (256 lines)
    f = await c.files.create(file=("in.jsonl", jsonl(rows(["m"] * n, max_tokens=3))), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    # a file no batch reads, uploaded after the input, so it expires no sooner: once it is gone, a
    # sweep has found the input expired too, and left it for its batch
    other = await c.files.create(file=("other.jsonl", jsonl(rows(["m"]))), purpose="batch")

    async def swept() -> bool:
        try:
            await c.files.retrieve(other.id)
        except openai.NotFoundError:
            return not (tmp_path / "batch" / "files" / other.id).exists()
        return False

    try:
        assert await asyncio.to_thread(second.wait, 30)
        await until(swept, timeout=20, interval=0.05)
        await until(lambda: time.time() >= f.expires_at + 1, timeout=5)     # completed_at is past it
    finally:
        go.set()
    b = await run_to_end(c, b.id, timeout=90)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.total) == (n, n)
    assert f.expires_at < b.completed_at      # the file's time was up while the batch read it


async def test_a_batch_created_on_a_file_as_the_sweep_finds_it_expired_keeps_it(sims, gateway, tmp_path,
                                                                                 monkeypatch):
    """A file past its ``expires_at`` is in the store until the sweep removes it, and a batch may be
    created on it meanwhile (with ``--workers N``, by another worker on its own connection to the
    job store): one that lands between the sweep's look at the running batches and its delete
    keeps the file, as a delete of the API's does, and runs."""
    from gateway.batch.store import BatchStore

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, file_ttl_s=1))
    c = openai_client(gw)
    path = str(tmp_path / "batch" / "batches.sqlite3")
    f = await c.files.create(file=("in.jsonl", jsonl(rows(["m"] * 3))), purpose="batch")
    real = BatchStore.expired_files
    made: list[str] = []

    def expired_then_a_batch(self, now):
        found = real(self, now)
        if f.id in found and not made:
            made.append("batch_raced")
            doc = {"id": "batch_raced", "object": "batch", "endpoint": "/v1/chat/completions", "errors": None,
                   "input_file_id": f.id, "completion_window": "24h", "status": "validating",
                   "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                   "expires_at": now + 86400, "finalizing_at": None, "completed_at": None, "failed_at": None,
                   "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                   "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": None, "model": None,
                   "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}}
            other = BatchStore(path)
            try:
                assert other.add_batch(doc, "", None, True)
            finally:
                other.close()
        return found

    monkeypatch.setattr(BatchStore, "expired_files", expired_then_a_batch)
    await until(lambda: bool(made), timeout=10, interval=0.05)
    done = await run_to_end(c, "batch_raced")
    assert (done.status, done.request_counts.completed, done.errors) == ("completed", 3, None), done


async def test_a_batch_being_validated_holds_up_no_other_batch(sims, gateway, tmp_path, monkeypatch):
    """A batch's validation reads its whole input file (seconds for one of batch.max_file_bytes): the
    batches already running go on meanwhile: their lines start, their answers are stored, and one
    whose lines are all answered completes."""
    import threading

    from gateway.batch import runner

    real = runner.validate
    slow: list[str] = []
    reading, go = threading.Event(), threading.Event()

    def held(path: str, endpoint: str, *args):
        if slow and path.endswith(slow[0]):
            reading.set()
            go.wait(30)
        return real(path, endpoint, *args)

    monkeypatch.setattr(runner, "validate", held)
    sim = await sims("vllm", "m", itl_ms=10.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    c = openai_client(gw)
    first = await create(c, rows(["m"] * 8, max_tokens=20))    # two at a time: about a second

    async def running() -> bool:
        return (await c.batches.retrieve(first.id)).status == "in_progress"

    await until(running, timeout=10, interval=0.02)
    f = await c.files.create(file=("big.jsonl", jsonl(rows(["m"] * 3))), purpose="batch")
    slow.append(f.id)
    second = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    try:
        assert await asyncio.to_thread(reading.wait, 10)
        done = await run_to_end(c, first.id, timeout=15)
        assert done.status == "completed" and done.request_counts.completed == 8
        assert (await c.batches.retrieve(second.id)).status == "validating"
    finally:
        go.set()
    assert (await run_to_end(c, second.id)).request_counts.completed == 3


async def test_a_batch_whose_files_are_being_written_holds_up_no_other_batch(sims, gateway, tmp_path, monkeypatch):
    """A batch's end writes its output and error files from every answered line (and an expired
    one first names each line it never ran, reading its input): seconds for a large batch. The
    other batches go on meanwhile: one created then is validated, runs and completes."""
    import threading

    from gateway.batch.runner import BatchRunner

    real = BatchRunner._write_outputs
    slow: list[str] = []
    writing, go = threading.Event(), threading.Event()

    def held(self, bid: str, owner: str):
        if slow and bid == slow[0]:
            writing.set()
            go.wait(30)
        return real(self, bid, owner)

    monkeypatch.setattr(BatchRunner, "_write_outputs", held)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    c = openai_client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(rows(["m"] * 2))), purpose="batch")
    first = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    slow.append(first.id)       # before the runner (this loop's) can end it
    try:
        assert await asyncio.to_thread(writing.wait, 10)
        second = await run_to_end(c, (await create(c, rows(["m"] * 3))).id, timeout=15)
        assert second.status == "completed" and second.request_counts.completed == 3
        assert (await c.batches.retrieve(first.id)).status == "finalizing"
    finally:
        go.set()
    assert (await run_to_end(c, first.id)).request_counts.completed == 2


async def test_a_batch_cancelled_before_it_was_validated_counts_its_lines(sims, gateway, tmp_path):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, poll_interval_s=2.0))
    c = openai_client(gw)
    b = await create(c, rows(["m"] * 7))
    await c.batches.cancel(b.id)              # before the runner's next look at the store
    b = await run_to_end(c, b.id)
    assert b.status == "cancelled"
    counts = b.request_counts           # none ran: none completed, none failed, and no file to read
    assert (counts.total, counts.completed, counts.failed) == (7, 0, 0), b
    assert b.output_file_id is None and b.error_file_id is None


@pytest.mark.parametrize("header", [b'Content-Disposition: form-data; name="file"; filename="a\x01.jsonl"',
                                    b"Content-Disposition form-data no colon"])
async def test_a_malformed_part_header_is_a_400(sims, gateway, tmp_path, header):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    body = (b'--XB\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b"--XB\r\n" + header + b"\r\n\r\n" + jsonl(rows(["m"])) + b"\r\n--XB--\r\n")
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/files", data=body,
                                                    headers={"Content-Type": "multipart/form-data; boundary=XB"}) as r:
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"


async def test_an_input_that_cannot_be_read_on_fails_the_batch_and_says_why(sims, gateway, tmp_path, monkeypatch):
    import threading

    from gateway.batch import runner

    monkeypatch.setattr(runner, "HELD_BACK", 8)      # reads stop 8 lines past the ones with room
    real = runner.read_chunk
    second, go = threading.Event(), threading.Event()

    def held(path: str, offset: int, line_no: int, n: int = 256):
        if offset > 0:                          # the second read waits until the file is gone
            second.set()
            go.wait(30)
        return real(path, offset, line_no, n)

    monkeypatch.setattr(runner, "read_chunk", held)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    c = openai_client(gw)
    n = 300                                   # the second read of the input (after 256 lines) fails
    f = await c.files.create(file=("in.jsonl", jsonl(rows(["m"] * n, max_tokens=2))), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def first_read() -> bool:             # a line answered: the first 256 lines were read
        got = await c.batches.retrieve(b.id)
        return got.request_counts is not None and got.request_counts.completed > 0

    try:
        await until(first_read, timeout=20, interval=0.01)
        assert await asyncio.to_thread(second.wait, 30)
        (tmp_path / "batch" / "files" / f.id).unlink()     # the disk lost it
    finally:
        go.set()
    b = await run_to_end(c, b.id, timeout=120)
    assert b.status == "failed" and b.failed_at and b.errors.data[0].code == "file_unreadable"
    answered = b.request_counts.completed + b.request_counts.failed
    assert 0 < answered <= 256 and b.output_file_id


async def test_a_batch_cancelled_once_its_input_cannot_be_read_ends_cancelled_and_the_runner_goes_on(
        sims, gateway, tmp_path):
    """A cancelled batch does not read its input again (the lines it never ran are named nowhere):
    an input lost meanwhile changes nothing of its end, ``cancelled`` with what ran, and the next
    batch runs."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, max_concurrency=1))
    c = openai_client(gw)
    # one line at a time of 10 tokens: the first read's 256 lines keep the runner busy long after the cancel
    f = await c.files.create(file=("in.jsonl", jsonl(rows(["m"] * 300, max_tokens=10))), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def first_answered() -> bool:
        got = await c.batches.retrieve(b.id)
        return got.request_counts is not None and got.request_counts.completed > 0

    await until(first_answered, timeout=20, interval=0.01)
    (tmp_path / "batch" / "files" / f.id).unlink()         # the disk lost it
    assert (await c.batches.cancel(b.id)).status == "cancelling"
    b = await run_to_end(c, b.id, timeout=30)
    assert b.status == "cancelled" and b.cancelled_at and b.errors is None, b
    assert 0 < b.request_counts.completed < 300 and b.request_counts.total == 300 and b.output_file_id
    after = await run_to_end(c, (await create(c, rows(["m"] * 2))).id, timeout=30)
    assert after.status == "completed" and after.request_counts.completed == 2


async def test_no_line_starts_once_a_drain_begins(sims, gateway, tmp_path):
    """From the SIGTERM's drain on, through its delay (the listener still open): the line in flight
    finishes, no other starts; the rest is for the next start (or another worker)."""
    from gateway.server.app import BATCH_KEY, NOT_READY_KEY
    from gateway.server.run import drain_and_stop

    sim = await sims("vllm", "m", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, max_concurrency=1))
    c = openai_client(gw)
    await create(c, rows(["m"] * 20, max_tokens=10))

    async def started() -> bool:
        return (await sim_state(sim.url))["counts"]["started"] >= 2

    await until(started, timeout=20)
    drain = asyncio.create_task(drain_and_stop(gw.runner, gw.runner.app, 5.0, delay=1.5))
    app = gw.runner.app
    # the line running at the drain's start is let finish: the drain has begun and no line is in
    # flight (a line the runner started is counted in flight before it reaches the engine)
    await until(lambda: app[NOT_READY_KEY].is_set() and not any(app[BATCH_KEY].runner.in_flight.values()),
                timeout=10)
    at_drain = (await sim_state(sim.url))["counts"]["started"]
    await asyncio.sleep(0.9)                    # still within the delay: the listener is open
    assert (await sim_state(sim.url))["counts"]["started"] == at_drain
    await drain


async def test_a_runner_that_fails_is_started_again_and_answers_every_line_once(sims, gateway, tmp_path, caplog):
    """A fault the runner does not handle (here the disk full when it writes answered lines) is
    logged and counted, and a runner started again from the job store answers the rest: every
    line once."""
    import errno

    import orjson

    from gateway.server.app import BATCH_KEY
    from tests.support.metrics import metric

    sim = await sims("vllm", "m", itl_ms=5.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, max_concurrency=2))
    service = gw.runner.app[BATCH_KEY]
    await until(lambda: service.runner is not None, timeout=10)
    first = service.runner
    real = first._flush_all
    calls = 0

    async def disk_full() -> None:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        await real()

    first._flush_all = disk_full
    c = openai_client(gw)
    b = await run_to_end(c, (await create(c, rows(["m"] * 30))).id, timeout=60)
    assert service.runner is not first and calls >= 5
    assert b.status == "completed" and b.request_counts.completed == 30 and b.request_counts.failed == 0
    out = [orjson.loads(line) for line in (await c.files.content(b.output_file_id)).content.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(30))
    page = await gw.metrics_text()
    assert metric(page, "switchyard_batch_runner_failures_total") == 1


async def test_the_answered_lines_of_a_batch_that_ended_leave_the_job_store_though_the_runner_stopped_first(
        sims, gateway, tmp_path, monkeypatch):
    """A batch's answered lines are kept in the job store until its files are written and its end
    stored, then dropped. A runner that stops in between (killed, or failed there: here the drop
    meets a disk I/O error) leaves them to the runner started next, which drops the lines of every
    batch that ended; they are not kept for good beside a batch no runner takes on again."""
    import sqlite3

    from gateway.batch.store import BatchStore

    real = BatchStore.drop_results
    failed: list[str] = []

    def drop_fails_once(self, batch_id):
        if not failed:
            failed.append(batch_id)
            raise sqlite3.OperationalError("disk I/O error")
        return real(self, batch_id)

    monkeypatch.setattr(BatchStore, "drop_results", drop_fails_once)
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    c = openai_client(gw)
    b = await run_to_end(c, (await create(c, rows(["m"] * 4))).id)
    assert b.status == "completed" and failed == [b.id]
    db = sqlite3.connect(str(tmp_path / "batch" / "batches.sqlite3"))
    try:
        def left() -> int:
            return db.execute("SELECT COUNT(*) FROM results WHERE batch_id = ?", (b.id,)).fetchone()[0]

        await until(lambda: left() == 0, timeout=10, interval=0.05)
    finally:
        db.close()


async def test_an_interactive_request_stops_every_batch_line_it_would_wait_behind(sims, gateway, tmp_path):
    """Before the gateway learns an engine's capacity (vLLM does not tell it: the gateway learns it
    once it sees the engine queue), batch lines fill ``endpoint_capacity``, here more than the
    engine runs, and the rest wait in the engine's queue. An interactive request routed there
    stops as many of the newest batch lines as it would wait behind, queued ones and one running,
    so it takes a running slot at once: it is answered while the long lines it found run on."""
    from gateway.admission.saturation import baseline

    sim = await sims("vllm", "m", itl_ms=20.0, max_num_seqs=2)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch=cfg(tmp_path, endpoint_capacity=6, reserve_slots=0, max_concurrency=6))
    c = openai_client(gw)
    b = await create(c, rows(["m"] * 6, max_tokens=150))     # 3 s a line
    ep = gw.gw.pool.endpoints("m")[0]

    async def queued() -> bool:
        state = await sim_state(sim.url)
        return len(state["running"]) == 2 and len(state["waiting"]) == 4 and baseline(ep).capacity == 2

    await until(queued, timeout=10, interval=0.02)
    answered = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "now"}],
                                               max_tokens=2)
    assert answered.choices
    state = await sim_state(sim.url)
    assert state["counts"]["completed"] == 1, state["counts"]      # no batch line ended before it
    await c.batches.cancel(b.id)
    assert (await run_to_end(c, b.id)).status == "cancelled"


async def test_a_line_stopped_for_an_interactive_request_is_logged_as_preempted_not_as_a_client_cancel(
        sims, gateway, tmp_path):
    """A batch line that gives its slot to an interactive request goes back to the queue: its request
    log line says so (``error_class: batch_preempted``), and it counts in no client-cancel metric,
    as nobody cancelled it; ``switchyard_batch_lines_total{outcome="preempted"}`` counts it."""
    sim = await sims("vllm", "m", itl_ms=20.0, max_num_seqs=2)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch=cfg(tmp_path, endpoint_capacity=2, reserve_slots=0, max_concurrency=2))
    c = openai_client(gw)
    b = await create(c, rows(["m"] * 2, max_tokens=150))     # 3 s a line

    async def full() -> bool:
        return len((await sim_state(sim.url))["running"]) == 2

    await until(full, timeout=10, interval=0.02)
    with gw.gw.request_log.capture() as logs:
        answered = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "now"}],
                                                   max_tokens=2)
        assert answered.choices

        def stopped() -> list[dict[str, Any]]:
            return [e for e in logs if e.get("batch_id") == b.id]

        await until(stopped, timeout=10)
        (line,) = stopped()
    assert (line["status"], line["error_class"]) == (499, "batch_preempted"), line
    page = await gw.metrics_text()
    assert metric(page, "switchyard_client_cancels_total", model="m") == 0
    assert metric(page, "switchyard_batch_lines_total", model="m", outcome="preempted") == 1
    await c.batches.cancel(b.id)
    assert (await run_to_end(c, b.id)).status == "cancelled"


async def test_lines_stopped_as_the_gateway_stops_are_logged_as_such_not_as_client_cancels(sims, gateway, tmp_path):
    """The lines in flight as the gateway stops are stopped (they run again after its restart):
    each one's log line says the gateway stopped it (``error_class: draining``), and none counts in
    ``switchyard_client_cancels_total``: no client left."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch=cfg(tmp_path, endpoint_capacity=3, reserve_slots=0, max_concurrency=2))
    c = openai_client(gw)
    b = await create(c, rows(["m"] * 2, max_tokens=150))     # 3 s a line

    async def running() -> bool:
        return len((await sim_state(sim.url))["running"]) == 2

    await until(running, timeout=10, interval=0.02)
    with gw.gw.request_log.capture() as logs:
        await gw.runner.cleanup()
    lines = [e for e in logs if e.get("batch_id") == b.id]
    assert [(e["status"], e["error_class"]) for e in lines] == [(499, "draining")] * 2, lines
    assert metric(gw.gw.metrics.render().decode(), "switchyard_client_cancels_total") == 0


async def test_lines_stopped_as_their_batch_expires_are_logged_as_such_not_as_client_cancels(sims, gateway, tmp_path):
    """The lines in flight as their batch's window ends are stopped: each one's log line says the
    batch expired (``error_class: batch_expired``), and none counts in
    ``switchyard_client_cancels_total``: no client left, nor cancelled the batch."""
    from gateway.batch.store import BatchStore
    from gateway.server.app import BATCH_KEY

    sim = await sims("vllm", "m", itl_ms=20.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])],
                       batch=cfg(tmp_path, endpoint_capacity=3, reserve_slots=0, max_concurrency=2))
    c = openai_client(gw)
    b = await create(c, rows(["m"] * 2, max_tokens=150))     # 3 s a line

    async def running() -> bool:
        return len((await sim_state(sim.url))["running"]) == 2

    await until(running, timeout=10, interval=0.02)

    def past(d: dict[str, Any]) -> bool:
        d["expires_at"] = d["created_at"] - 1
        return True

    with gw.gw.request_log.capture() as logs:
        await gw.runner.app[BATCH_KEY].db.run(BatchStore.update_batch, b.id, past)
        done = await run_to_end(c, b.id, timeout=10)
    assert done.status == "expired", done
    lines = [e for e in logs if e.get("batch_id") == b.id]
    assert [(e["status"], e["error_class"]) for e in lines] == [(499, "batch_expired")] * 2, lines
    assert metric(await gw.metrics_text(), "switchyard_client_cancels_total") == 0


async def test_a_line_retried_on_another_endpoint_is_no_longer_one_to_stop_on_the_first(sims, gateway, tmp_path):
    """A line the pipeline moved from one endpoint to another (the first answered 500) runs on the
    second only: an interactive request that finds the first endpoint full afterwards stops the
    line that runs there, not the moved one, which had ended and whose stop would free nothing."""
    a = await sims("vllm", "m", itl_ms=20.0, max_num_seqs=1)
    b = await sims("vllm", "m", itl_ms=20.0, max_num_seqs=1)
    # round-robin: each decision takes the next endpoint, a, b, a, ...; a retry the only other one
    gw = await gateway([model_block("m", "vllm", [a.url, b.url], strategy="round-robin")],
                       batch=cfg(tmp_path, endpoint_capacity=1, reserve_slots=0))
    c = openai_client(gw)
    long_line = await create(c, [{**rows(["m"], max_tokens=300)[0], "custom_id": "long"}])   # on a

    async def a_busy() -> bool:
        return len((await sim_state(a.url))["running"]) == 1

    await until(a_busy, timeout=10)
    await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)  # on b
    async with aiohttp.ClientSession() as s:
        async with s.post(a.url + "/_sim/config", json={"fault": "status=500"}) as r:
            assert r.status == 200
        moved = await run_to_end(c, (await create(c, rows(["m"]))).id)    # a answers 500: moved to b
        assert moved.status == "completed" and moved.request_counts.completed == 1
        async with s.post(a.url + "/_sim/config", json={"fault": ""}) as r:
            assert r.status == 200
    answered = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "now"}],
                                               max_tokens=2)     # to a, full with the long line
    assert answered.choices
    state = await sim_state(a.url)
    assert [i for i in state["aborted_ids"] if "batch_req_" in i], state["counts"]   # the long line gave its slot
    await c.batches.cancel(long_line.id)
    await run_to_end(c, long_line.id)


async def test_a_line_refused_by_its_owners_limit_holds_the_batch_until_the_limit_says(sims, gateway, tmp_path):
    """A 429 of the owner's limits says when to come back (Retry-After): no line of the batch for
    that model starts until then, where each line of the file was tried every retry_backoff_s, the
    whole file over and over (thousands of 429s a second, each one a request log line)."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path), auth=KEYS,
                       limits={"users": {"alice": {"rpm": 2}}})
    c = openai_client(gw, ALICE)
    b = await create(c, rows(["m"] * 200))

    async def refused() -> float:
        return metric(await gw.metrics_text(), "switchyard_rate_limited_total", user="alice")

    await until(refused, timeout=10)          # the minute's two requests went, a line met the limit
    await asyncio.sleep(1.0)                  # most of the minute is left: nothing is tried meanwhile
    assert await refused() <= 2               # the lines in flight when the limit was met (two at a time)
    got = await c.batches.retrieve(b.id)
    assert (got.status, got.request_counts.completed, got.request_counts.failed) == ("in_progress", 2, 0)
    await c.batches.cancel(b.id)
    done = await run_to_end(c, b.id)
    assert (done.status, done.request_counts.completed, done.request_counts.total) == ("cancelled", 2, 200)


async def test_an_output_file_cut_short_by_a_full_disk_leaves_no_partial_file(sims, gateway, tmp_path, monkeypatch):
    """The disk fills while the runner writes a batch's output: the runner is started again and
    writes it whole, and the part it had written is removed, where it stayed in ``tmp/`` until
    the next start, holding the space a full disk lacks."""
    import errno

    from gateway.batch.store import BatchStore

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    real = BatchStore.result_lines
    failed = False

    def disk_full(self, batch_id: str, ok: bool):
        nonlocal failed
        lines = real(self, batch_id, ok)
        if failed:
            yield from lines
            return
        yield next(lines)                   # one line written, then the disk is full
        failed = True
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BatchStore, "result_lines", disk_full)
    c = openai_client(gw)
    b = await run_to_end(c, (await create(c, rows(["m"] * 3))).id, timeout=30)
    assert failed and b.status == "completed" and b.request_counts.completed == 3
    assert len((await c.files.content(b.output_file_id)).content.splitlines()) == 3
    assert metric(await gw.metrics_text(), "switchyard_batch_runner_failures_total") == 1
    assert list((tmp_path / "batch" / "tmp").iterdir()) == []


async def test_a_batch_whose_error_file_could_not_be_written_keeps_one_output_file(sims, gateway, tmp_path,
                                                                                   monkeypatch):
    """The disk fills while the runner writes a batch's error file, its output file written: the
    runner started again writes both, and the output file of the first try goes, where it stayed
    in the owner's files (and on disk) beside the batch's, a batch_output file of no batch."""
    import errno

    from gateway.batch.store import BatchStore

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    real = BatchStore.result_lines
    failed = False

    def disk_full(self, batch_id: str, ok: bool):
        nonlocal failed
        if not ok and not failed:           # the output file is whole; the error file is not
            failed = True
            raise OSError(errno.ENOSPC, "No space left on device")
        yield from real(self, batch_id, ok)

    monkeypatch.setattr(BatchStore, "result_lines", disk_full)
    c = openai_client(gw)
    b = await run_to_end(c, (await create(c, rows(["m", "nope", "m"]))).id, timeout=30)
    assert failed and b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 1)
    outputs = [f.id for f in (await c.files.list(purpose="batch_output")).data]
    assert sorted(outputs) == sorted([b.output_file_id, b.error_file_id])
    assert sorted(p.name for p in (tmp_path / "batch" / "files").iterdir()) == sorted(
        [b.input_file_id, b.output_file_id, b.error_file_id])


def _hold_output_writes(monkeypatch) -> tuple:
    """The runner's first write of a batch's output and error files, held: ``writing`` is set once
    it began, it goes on once ``go`` is set, and ``written`` is set once it ended (later writes are
    not held)."""
    import threading

    from gateway.batch.runner import BatchRunner

    real = BatchRunner._write_outputs
    writing, go, written = threading.Event(), threading.Event(), threading.Event()

    def held(self, bid: str, owner: str):
        if writing.is_set():
            return real(self, bid, owner)
        writing.set()
        go.wait(30)
        try:
            return real(self, bid, owner)
        finally:
            written.set()

    monkeypatch.setattr(BatchRunner, "_write_outputs", held)
    return writing, go, written


async def test_a_gateway_stopped_while_it_writes_a_batchs_files_leaves_the_owner_one_of_each(sims, gateway, tmp_path,
                                                                                           monkeypatch):
    """The gateway is stopped (its runner cancelled, as a SIGTERM's drain does) while the thread
    that writes a finalizing batch's output and error files runs; the thread cannot be interrupted
    and writes them whole, stored, before the batch's end is. The gateway started again on the
    same directory writes them again for the batch: the owner sees one output and one error file,
    those the batch names, and the disk holds no other."""
    sim = await sims("vllm", "m")
    first = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    writing, go, written = _hold_output_writes(monkeypatch)
    c = openai_client(first)
    b = await create(c, rows(["m", "nope", "m"]))
    assert await asyncio.to_thread(writing.wait, 30)
    assert (await c.batches.retrieve(b.id)).status == "finalizing"
    stop = asyncio.create_task(first.runner.cleanup())     # the stop: the runner is cancelled mid-write
    go.set()
    assert await asyncio.to_thread(written.wait, 30)
    await stop
    again = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    c = openai_client(again)
    done = await run_to_end(c, b.id, timeout=30)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    outputs = [f.id for f in (await c.files.list(purpose="batch_output")).data]
    assert sorted(outputs) == sorted([done.output_file_id, done.error_file_id])
    assert sorted(p.name for p in (tmp_path / "batch" / "files").iterdir()) == sorted(
        [done.input_file_id, done.output_file_id, done.error_file_id])


async def test_a_gateway_stopped_while_it_writes_a_batchs_files_keeps_the_runners_lock_until_they_are_written(
        sims, gateway, tmp_path, monkeypatch):
    """Two gateways on one ``batch.dir``: the one that runs batches is stopped while its thread
    writes a finalizing batch's output and error files. It keeps ``runner.lock`` until that write
    has ended (the process waits for the thread as it exits anyway), so the other, which takes the
    lock every 2 s, cannot write the batch's files beside it; then the other finishes the batch,
    and the owner sees one output and one error file."""
    import fcntl
    import os

    from gateway.server.app import BATCH_KEY

    sim = await sims("vllm", "m")
    first = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    service = first.runner.app[BATCH_KEY]
    await until(lambda: service.running, timeout=10)
    second = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    writing, go, _ = _hold_output_writes(monkeypatch)
    c = openai_client(first)
    b = await create(c, rows(["m", "nope", "m"]))
    assert await asyncio.to_thread(writing.wait, 30)
    with structlog.testing.capture_logs() as logs:
        stop = asyncio.create_task(first.runner.cleanup())
        try:
            await until(lambda: stop.done() or any(e["event"].startswith("the batch runner stops once")
                                                   for e in logs), timeout=20)
            fd = os.open(str(tmp_path / "batch" / "runner.lock"), os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        finally:
            go.set()
        await stop
    c = openai_client(second)
    done = await run_to_end(c, b.id, timeout=30)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    outputs = [f.id for f in (await c.files.list(purpose="batch_output")).data]
    assert sorted(outputs) == sorted([done.output_file_id, done.error_file_id])
    assert sorted(p.name for p in (tmp_path / "batch" / "files").iterdir()) == sorted(
        [done.input_file_id, done.output_file_id, done.error_file_id])


async def test_a_batch_left_finalizing_past_its_window_completes(sims, gateway, tmp_path, monkeypatch):
    """A batch whose lines were all answered is left ``finalizing`` by a gateway stopped while it
    wrote its files, and its window (``expires_at``) has passed by the time a gateway takes it on
    again (moved into the past in the store, as 24 hours passing would): it completes, its answers
    in its output and error files, as a batch that finished within its window; ``expired`` is for
    the batch whose requests did not all run in time."""
    import sqlite3


    sim = await sims("vllm", "m")
    first = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    writing, go, _ = _hold_output_writes(monkeypatch)
    c = openai_client(first)
    b = await create(c, rows(["m", "nope", "m"]))
    assert await asyncio.to_thread(writing.wait, 30)
    stop = asyncio.create_task(first.runner.cleanup())
    go.set()
    await stop
    db = sqlite3.connect(str(tmp_path / "batch" / "batches.sqlite3"), timeout=5, isolation_level=None)
    try:
        doc = orjson.loads(db.execute("SELECT doc FROM batches WHERE id = ?", (b.id,)).fetchone()[0])
        assert doc["status"] == "finalizing"
        doc["expires_at"] = doc["created_at"] - 1
        db.execute("UPDATE batches SET doc = ? WHERE id = ?", (orjson.dumps(doc), b.id))
    finally:
        db.close()
    again = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    c = openai_client(again)
    done = await run_to_end(c, b.id, timeout=30)
    counts = done.request_counts
    assert (done.status, counts.total, counts.completed, counts.failed) == ("completed", 3, 2, 1), done
    assert done.completed_at and done.expired_at is None
    out = [orjson.loads(x) for x in (await c.files.content(done.output_file_id)).content.splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-2"]


async def test_the_lines_of_a_discovered_model_wait_while_its_pods_are_not_listed_or_all_gone(
        emu, sims, gateway, tmp_path, monkeypatch):
    """With Kubernetes discovery, a model may be known from its pods alone. A gateway started again
    while its batch runs, whose first list of pods is not in yet, cannot tell such a model from none:
    the lines wait for the list, uncounted, as for a model with no ready endpoint. Once a model the
    batch ran on has lost every pod (a Recreate rollout deletes the old pod before the new one has
    an IP), its lines wait for a new pod, where each was answered 404 model_not_found the moment the
    model was gone."""
    import k8s.discovery
    monkeypatch.setattr(k8s.discovery, "FIRST_LIST_WAIT_S", 0.0)
    sim = await sims("vllm", "llama", itl_ms=15.0)
    sim_pod(emu, "llama-0", sim, "llama")
    path = tmp_path / "kubeconfig"
    path.write_text(emu.kubeconfig())
    kube = {"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"], "retry_backoff_s": 0.05}
    emu.hold_lists()
    try:
        with structlog.testing.capture_logs() as logs:
            gw = await gateway([], kubernetes=kube, batch=cfg(tmp_path, max_attempts=2, max_concurrency=1))
            c = openai_client(gw)
            b = await create(c, rows(["llama"] * 5, max_tokens=8))

            def waits() -> list[tuple[str, str]]:
                return [(e["model"], e["reason"]) for e in logs if e["event"].startswith("batch lines of a model wait")]

            async def waiting_or_failed(n: int) -> bool:
                return len(waits()) >= n or (await c.batches.retrieve(b.id)).request_counts.failed > 0

            await until(lambda: waiting_or_failed(1), timeout=10)
            now = await c.batches.retrieve(b.id)
            assert (now.status, now.request_counts.completed, now.request_counts.failed) == ("in_progress", 0, 0)
            emu.release_lists()

            async def some_done() -> bool:
                return (await c.batches.retrieve(b.id)).request_counts.completed >= 2

            await until(some_done, timeout=10)
            emu.delete_pod("llm", "llama-0")
            await until(lambda: not gw.gw.pool.has_model("llama"), timeout=10)
            await until(lambda: waiting_or_failed(2), timeout=10)
            now = await c.batches.retrieve(b.id)
            assert now.status == "in_progress" and now.request_counts.failed == 0
            assert waits() == [("llama", "pods not listed yet"), ("llama", "no such model")], waits()
            sim_pod(emu, "llama-1", sim, "llama")
            done = await run_to_end(c, b.id)
    finally:
        emu.release_lists()
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 5, 0), done


async def test_the_lines_of_a_model_whose_only_pod_waits_for_its_address_wait_for_it(
        emu, sims, gateway, tmp_path, monkeypatch):
    """A batch for a model only pods serve, created while its one pod is Pending without an address
    (not scheduled yet): the gateway answers the model's requests 503 to retry then, and its batch
    lines wait for the pod, uncounted, as for a model with no ready endpoint, rather than each
    being answered 404 model_not_found; once the pod has its address they run."""
    import k8s.discovery
    monkeypatch.setattr(k8s.discovery, "FIRST_LIST_WAIT_S", 0.0)
    sim = await sims("vllm", "llama")
    emu.create_pod("llm", "llama-0", {"model.aibrix.ai/name": "llama"}, ip=None, ready=False)
    path = tmp_path / "kubeconfig"
    path.write_text(emu.kubeconfig())
    kube = {"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"], "retry_backoff_s": 0.05}
    with structlog.testing.capture_logs() as logs:
        gw = await gateway([], kubernetes=kube, batch=cfg(tmp_path, max_attempts=2, max_concurrency=1))
        await until(lambda: gw.gw.pool.listed and gw.gw.pool.awaited("llama"), timeout=10)
        c = openai_client(gw)
        b = await create(c, rows(["llama"] * 3, max_tokens=4))

        def waits() -> list[tuple[str, str]]:
            return [(e["model"], e["reason"]) for e in logs if e["event"].startswith("batch lines of a model wait")]

        async def waiting_or_failed() -> bool:
            return bool(waits()) or (await c.batches.retrieve(b.id)).request_counts.failed > 0

        await until(waiting_or_failed, timeout=10)
        now = await c.batches.retrieve(b.id)
        assert (now.status, now.request_counts.completed, now.request_counts.failed) == ("in_progress", 0, 0), now
        assert waits() == [("llama", "pods on their way")], waits()
        emu.delete_pod("llm", "llama-0")
        sim_pod(emu, "llama-0", sim, "llama")
        done = await run_to_end(c, b.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 0), done


async def test_a_batch_whose_model_the_gateway_does_not_know_fails_its_validation(sims, gateway, tmp_path):
    """As at OpenAI, a batch whose requests name one model, which the gateway does not serve, fails
    as it is validated, ``model_not_found`` in its ``errors``, none of its requests run or counted,
    where each of its lines was run and answered 404 into the error file."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    c = openai_client(gw)
    b = await run_to_end(c, (await create(c, rows(["nope"] * 3))).id, timeout=10)
    assert b.status == "failed" and b.failed_at and b.model == "nope", b
    assert [(e.code, e.param) for e in b.errors.data] == [("model_not_found", "body.model")], b.errors
    assert "nope" in b.errors.data[0].message
    counts = b.request_counts
    assert (counts.total, counts.completed, counts.failed) == (0, 0, 0)
    assert b.output_file_id is None and b.error_file_id is None


async def test_the_lines_of_a_batch_whose_model_went_wait_for_it_in_a_runner_started_since(sims, gateway, tmp_path):
    """A gateway started again while a batch runs, whose model it does not serve now (its config
    without the model, its pods not back yet), holds the batch's lines for the model to come back,
    as the runner that saw it go does: the model was the batch's when it was validated. They were
    answered 404 model_not_found, the whole batch burnt into its error file by a restart."""
    sim = await sims("vllm", "m", itl_ms=20.0)
    other = await sims("vllm", "other")
    first = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, max_concurrency=1))
    c = openai_client(first)
    b = await create(c, rows(["m"] * 6, max_tokens=10))

    async def one_done() -> bool:
        return (await c.batches.retrieve(b.id)).request_counts.completed >= 1

    await until(one_done, timeout=10)
    await first.runner.cleanup()
    with structlog.testing.capture_logs() as logs:
        second = await gateway([model_block("other", "vllm", [other.url])], batch=cfg(tmp_path, max_concurrency=1))
        c = openai_client(second)

        def waits() -> list[tuple[str, str]]:
            return [(e["model"], e["reason"]) for e in logs if e["event"].startswith("batch lines of a model wait")]

        async def waiting_or_failed() -> bool:
            return bool(waits()) or (await c.batches.retrieve(b.id)).request_counts.failed > 0

        await until(waiting_or_failed, timeout=10)
        now = await c.batches.retrieve(b.id)
        assert (now.status, now.request_counts.failed) == ("in_progress", 0), now
        assert waits() == [("m", "no such model")]
        await second.runner.cleanup()
    third = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path, max_concurrency=1))
    done = await run_to_end(openai_client(third), b.id, timeout=30)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 6, 0), done


async def test_a_cancel_answered_as_the_batchs_end_begins_ends_it_cancelled(sims, gateway, tmp_path, monkeypatch):
    """Every line answered, the runner begins the batch's end (``_finalize``) and a cancel is
    answered ``cancelling`` before that end's first step (the store still says ``in_progress``):
    the batch ends ``cancelled``, as the cancel's answer promised, with every answered line in its
    output file, never ``completed`` from ``cancelling``."""
    from gateway.batch.runner import BatchRunner

    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], batch=cfg(tmp_path))
    real = BatchRunner._finalize
    entered, go = asyncio.Event(), asyncio.Event()

    async def held(self, job, final: str):
        if final == "completed" and not entered.is_set():
            entered.set()
            await go.wait()
        return await real(self, job, final)

    monkeypatch.setattr(BatchRunner, "_finalize", held)
    c = openai_client(gw)
    b = await create(c, rows(["m"] * 3))
    await asyncio.wait_for(entered.wait(), 30)
    assert (await c.batches.cancel(b.id)).status == "cancelling"
    go.set()
    done = await run_to_end(c, b.id)
    assert done.status == "cancelled", done
    assert done.cancelling_at and done.cancelled_at and done.completed_at is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 3, 0)
    out = [orjson.loads(x) for x in (await c.files.content(done.output_file_id)).content.splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]
