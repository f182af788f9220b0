"""Breakers and retries in a real gateway process of ``--workers 2``: an ejection's trials,
whichever worker ejected it and whichever worker the clients' connections reach; the retry budget
when every engine fails."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest

from tests.support.gateway_process import gateway_process, kill_a_worker, metric_total, per_worker, post_new
from tests.support.ports import listen_port
from tests.support.waiting import until

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def sim_config(url: str, **cfg) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/_sim/config", json=cfg) as r:
        assert r.status == 200


async def chats_received(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/_sim/state") as r:
        state = await r.json()
    return sum(1 for e in state["received"] if e.get("path", "").endswith("/chat/completions"))


def config(tmp_path: Path, port: int, urls: list[str], *blocks: str) -> Path:
    """A two-worker test gateway's config: model ``m`` on ``urls``, with ``blocks`` (lines of YAML)."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 1, log_level: warning}\n"
                   + "".join(f"{block}\n" for block in blocks)
                   + f"models: [{{name: m, engine: vllm, endpoints: [{', '.join(repr(u) for u in urls)}]}}]\n")
    return cfg


async def rows_of(port: int, name: str) -> dict[int, dict]:
    """Each worker's (by pid) status-page row of the endpoint ``name``."""
    docs = await per_worker(port, 2, "/status.json")
    return {pid: ep for pid, doc in docs.items() for ep in doc["endpoints"] if ep["name"] == name}


async def on_worker(port: int, pid: int, results: list) -> None:
    """A chat on a connection of its own that the worker ``pid`` accepted; its status goes to ``results``."""
    while True:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
            async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                if (await r.json())["gateway"]["pid"] != pid:
                    continue
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY) as r:
                await r.read()
                results.append(r.status)
                return


@pytest.mark.timeout(120)
async def test_two_workers_send_an_ejected_engine_half_open_trials_not_twice_that_and_close_together(
        sims, tmp_path):
    """An engine's 500 ejects it in one worker, and the other adopts the ejection. Once the engine
    is back (its probes found it down, then up), the gateway lets ``half_open_trials`` (1) requests
    through to it, whichever worker the clients reach, and its first good answer closes the breaker
    in both workers. Each worker sent a trial of its own before: two into an engine that could
    still be sick, where one was configured."""
    good = await sims("vllm", "m")
    sick = await sims("vllm", "m", fault="status=500")
    sick_name = sick.url.split("//")[1]
    port = listen_port()
    cfg = config(tmp_path, port, [sick.url, good.url],
                 "health: {interval_s: 0.2, timeout_s: 1}",
                 "routing: {strategy: round-robin}",
                 "breaker: {consecutive_faults: 1, base_ejection_s: 60, half_open_trials: 1, success_threshold: 1,"
                 " max_ejection_percent: 50}")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        async def sick_in_each(field: str) -> list:
            return [ep[field] for ep in (await rows_of(port, sick_name)).values()]

        async def open_in_both() -> bool:
            assert (await post_new(port, "/v1/chat/completions", BODY))[0] == 200     # the 500 retried
            return await sick_in_each("breaker") == ["open", "open"]
        await until(open_in_both, timeout=20)
        await sim_config(sick.url, dead=True)            # down: the probes see it
        await until(lambda: _all_equal(sick_in_each("healthy"), False), timeout=20)
        await sim_config(sick.url, dead=False, fault="hang=inf")     # back, and its trials hang
        before = await chats_received(sick.url)
        await until(lambda: _all_equal(sick_in_each("breaker"), "half_open"), timeout=20)

        pids = list(await per_worker(port, 2, "/status.json"))
        results: list[int] = []
        tasks = [asyncio.create_task(on_worker(port, pid, results)) for pid in pids for _ in range(4)]
        try:
            async def accounted() -> bool:       # each request answered, or held by the engine
                return len(results) + await chats_received(sick.url) - before == len(tasks)
            await until(accounted, timeout=30)
            assert await chats_received(sick.url) - before == 1
            assert results == [200] * (len(tasks) - 1)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        await sim_config(sick.url, fault="none")          # healthy now: a trial closes it everywhere

        async def closed_in_both() -> bool:
            assert (await post_new(port, "/v1/chat/completions", BODY))[0] == 200
            return await sick_in_each("breaker") == ["closed", "closed"]
        await until(closed_in_both, timeout=20)
        for page in (await per_worker(port, 2)).values():
            assert metric_total(page, "switchyard_breaker_state", endpoint=sick_name) == 0
            assert metric_total(page, "switchyard_breaker_transitions_total", endpoint=sick_name,
                                from_state="half_open", to_state="closed") == 1


async def _all_equal(values, want) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        got = await values
        return len(got) == 2 and all(v == want for v in got)
    return False


@pytest.mark.timeout(120)
async def test_with_every_engine_failing_each_worker_retries_within_its_own_budget(sims, tmp_path):
    """Both engines answer 500 to everything (breakers off). Each worker keeps the model's retry
    budget of its own: with ``budget_percent: 0`` the gateway of two workers retries at most
    2 × ``budget_min`` requests in the window, each worker its ``budget_min``, and refuses the
    rest (``switchyard_retries_denied_total{reason="budget"}``); every client gets the engine's 500."""
    a = await sims("vllm", "m", fault="status=500")
    b = await sims("vllm", "m", fault="status=500")
    port = listen_port()
    cfg = config(tmp_path, port, [a.url, b.url],
                 "breaker: {enabled: false}",
                 "retry: {budget_percent: 0, budget_min: 2, budget_window_s: 600, max_retries: 1}")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        results: list[int] = []
        for pid in await per_worker(port, 2, "/status.json"):
            for _ in range(4):
                await on_worker(port, pid, results)
        assert results == [500] * 8
        for page in (await per_worker(port, 2)).values():      # the workers' counts added up
            assert metric_total(page, "switchyard_retries_total", model="m") == 4
            assert metric_total(page, "switchyard_retries_denied_total", model="m", reason="budget") == 4
    legs = sum([len([e for e in (await _state(u))["received"] if e["path"].endswith("/chat/completions")])
                for u in (a.url, b.url)])
    assert legs == 8 + 4


async def _state(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/_sim/state") as r:
        return await r.json()


@pytest.mark.timeout(120)
async def test_a_restarted_worker_keeps_out_an_engine_its_sibling_ejected(sims, tmp_path):
    """An engine that answers 500 (its ``/health`` fine) is ejected in both workers; one worker is
    killed outright and the parent starts it again. The new worker learns the ejection from its
    sibling before it serves, with what is left of it: no request it takes reaches the sick engine
    (before, each of its first requests went there until its own breaker tripped, the client's
    answer saved only by a retry)."""
    good = await sims("vllm", "m")
    sick = await sims("vllm", "m", fault="status=500")
    sick_name = sick.url.split("//")[1]
    port = listen_port()
    cfg = config(tmp_path, port, [sick.url, good.url],
                 "routing: {strategy: round-robin}",
                 "breaker: {consecutive_faults: 1, base_ejection_s: 300, max_ejection_percent: 50}")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc:
        async def sick_in_each() -> dict[int, dict]:
            return await rows_of(port, sick_name)

        async def open_in_both() -> bool:
            assert (await post_new(port, "/v1/chat/completions", BODY))[0] == 200     # the 500 retried
            return [ep["breaker"] for ep in (await sick_in_each()).values()] == ["open", "open"]
        await until(open_in_both, timeout=20)
        await kill_a_worker(proc, port)
        before = await chats_received(sick.url)
        states = await sick_in_each()
        results: list[int] = []
        for pid in states:
            for _ in range(4):
                await on_worker(port, pid, results)
        assert results == [200] * 8
        assert await chats_received(sick.url) - before == 0
        assert [ep["breaker"] for ep in states.values()] == ["open", "open"]
        for page in (await per_worker(port, 2)).values():
            assert metric_total(page, "switchyard_breaker_state", endpoint=sick_name) == 1
            assert metric_total(page, "switchyard_breaker_transitions_total", endpoint=sick_name,
                                from_state="closed", to_state="open") == 1


@pytest.mark.timeout(120)
async def test_a_worker_restarted_while_an_ejection_is_half_open_does_not_count_its_half_open_again(sims, tmp_path):
    """An engine that answers 500 is ejected in both workers, for 1 s, and both go half-open (no
    request comes meanwhile, so no trial runs), and ``/metrics`` is scraped. One worker is killed and
    the parent starts it again:
    it learns the half-open ejection from its sibling and is half-open at once, but the gateway's
    ``switchyard_breaker_transitions_total`` still counts one move from open to half-open, the
    one each worker made (the new worker goes on from its predecessor's count, which has it).
    Before, the new worker counted it again: 2 for one half-open."""
    good = await sims("vllm", "m")
    sick = await sims("vllm", "m", fault="status=500")
    sick_name = sick.url.split("//")[1]
    port = listen_port()
    cfg = config(tmp_path, port, [sick.url, good.url],
                 "routing: {strategy: round-robin}",
                 "breaker: {consecutive_faults: 1, base_ejection_s: 1, max_ejection_percent: 50}")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc:
        async def sick_in_each() -> list:
            return [ep["breaker"] for ep in (await rows_of(port, sick_name)).values()]

        async def open_somewhere() -> bool:
            assert (await post_new(port, "/v1/chat/completions", BODY))[0] == 200     # the 500 retried
            return "open" in await sick_in_each()
        await until(open_somewhere, timeout=20)          # no request after it: no trial
        await until(lambda: _all_equal(sick_in_each(), "half_open"), timeout=20)
        for page in (await per_worker(port, 2)).values():       # scraped: each worker's count is kept
            assert metric_total(page, "switchyard_breaker_transitions_total", endpoint=sick_name,
                                from_state="open", to_state="half_open") == 1
        await kill_a_worker(proc, port)
        await until(lambda: _all_equal(sick_in_each(), "half_open"), timeout=30)
        for page in (await per_worker(port, 2)).values():
            moves = {(f, t): metric_total(page, "switchyard_breaker_transitions_total", endpoint=sick_name,
                                          from_state=f, to_state=t)
                     for f, t in (("closed", "open"), ("open", "half_open"), ("half_open", "open"),
                                  ("half_open", "closed"))}
            assert moves == {("closed", "open"): 1, ("open", "half_open"): 1, ("half_open", "open"): 0,
                             ("half_open", "closed"): 0}


@pytest.mark.timeout(120)
async def test_workers_that_share_no_view_count_each_ones_ejection_of_an_engine(sims, tmp_path):
    """With ``view.workers: false`` the workers share no breaker: each ejects an engine that answers
    500 on its own first fault, at a moment of its own, and keeps it out on its own. Those are two
    ejections, and the gateway's ``/metrics`` counts two (the workers' counts added up, as for any
    counter of what each worker does alone). Before, it showed the largest of the two, 1, as if one
    worker had told the other of a single ejection."""
    good = await sims("vllm", "m")
    sick = await sims("vllm", "m", fault="status=500")
    sick_name = sick.url.split("//")[1]
    port = listen_port()
    cfg = config(tmp_path, port, [sick.url, good.url],
                 "routing: {strategy: round-robin}",
                 "view: {workers: false}",
                 "breaker: {consecutive_faults: 1, base_ejection_s: 300, max_ejection_percent: 50}")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        async def sick_in_each() -> list:
            return [ep["breaker"] for ep in (await rows_of(port, sick_name)).values()]

        async def open_in_both() -> bool:
            assert (await post_new(port, "/v1/chat/completions", BODY))[0] == 200     # the 500 retried
            return await sick_in_each() == ["open", "open"]
        await until(open_in_both, timeout=20)
        for page in (await per_worker(port, 2)).values():
            assert metric_total(page, "switchyard_upstream_errors_total", endpoint=sick_name) == 2
            assert metric_total(page, "switchyard_breaker_transitions_total", endpoint=sick_name,
                                from_state="closed", to_state="open") == 2
            assert metric_total(page, "switchyard_breaker_state", endpoint=sick_name) == 1


@pytest.mark.timeout(120)
async def test_the_gateway_counts_each_ejection_the_cap_refused_once_not_each_fault(sims, tmp_path):
    """Two engines, one of which may be out (``max_ejection_percent: 50``). The first answers 500
    and is ejected in both workers; then the second fails too, four times in a row in each worker,
    with ``consecutive_faults: 2``. Each worker's breaker decides twice to eject it and the cap
    refuses both times: the gateway's ``switchyard_breaker_ejections_capped_total`` says 4 refused
    ejections. It said 6 before, counting every fault from the second on of an endpoint the cap
    kept in."""
    sick = await sims("vllm", "m", fault="status=500")
    other = await sims("vllm", "m")
    sick_name = sick.url.split("//")[1]
    port = listen_port()
    cfg = config(tmp_path, port, [sick.url, other.url],
                 "routing: {strategy: round-robin}",
                 "retry: {enabled: false}",
                 "breaker: {consecutive_faults: 2, fault_rate: 0, base_ejection_s: 300, max_ejection_percent: 50}")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        async def open_in_both() -> bool:
            await post_new(port, "/v1/chat/completions", BODY)
            return [ep["breaker"] for ep in (await rows_of(port, sick_name)).values()] == ["open", "open"]
        await until(open_in_both, timeout=20)
        await sim_config(other.url, fault="status=500")
        results: list[int] = []
        for pid in await per_worker(port, 2, "/status.json"):
            for _ in range(4):
                await on_worker(port, pid, results)
        assert results == [500] * 8
        for page in (await per_worker(port, 2)).values():
            assert metric_total(page, "switchyard_breaker_ejections_capped_total", model="m") == 4
            assert metric_total(page, "switchyard_breaker_state", endpoint=sick_name) == 1
            assert metric_total(page, "switchyard_breaker_state", endpoint=other.url.split("//")[1]) == 0
