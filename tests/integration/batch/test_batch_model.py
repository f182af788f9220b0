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
