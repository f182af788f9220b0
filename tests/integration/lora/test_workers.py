"""LoRA adapters behind ``--workers 2``: a worker's adapter loads and unloads are told to its
sibling over the local bus, so the sibling neither loads an adapter again that is already there
nor sends requests to an engine that no longer has it (with discovery off, it would never learn)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from enginesim.server import RECEIVED_KEY
from tests.support.gateway_process import gateway_process, get_new, metric_total, per_worker, post_new
from tests.support.lora import LORA_SIM, MSG
from tests.support.ports import listen_port
from tests.support.waiting import wait_for


def config(port: int, url: str, lora: str, adapters: str = "a: org/a, b: org/b") -> str:
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
            "health: {interval_s: 0.5}\n"
            f"lora: {{discovery_interval_s: 0, {lora}}}\n"
            f"models: [{{name: m, engine: vllm, endpoints: ['{url}'], adapters: {{{adapters}}}}}]\n")


async def spread(port: int, model: str, n: int = 12) -> list[tuple[int, str]]:
    """``n`` requests for ``model``, one after another, each on a new connection (the kernel spreads
    them over both workers): each one's status and error message."""
    out = []
    for _ in range(n):
        status, _, body = await post_new(port, "/v1/chat/completions", {"model": model, "messages": MSG, "max_tokens": 2})
        out.append((status, body.get("error", {}).get("message", "") if isinstance(body, dict) else body))
    return out


def calls(sim, path: str) -> int:
    return sum(r["path"] == path for r in sim.app[RECEIVED_KEY])


async def on_engine_for_both(port: int, ready: dict[str, int]) -> bool:
    """Whether both workers list each adapter of ``ready`` with that many ready endpoints."""
    for answer in (await per_worker(port, 2, "/v1/models")).values():
        listed = {m["id"]: m.get("ready_endpoints") for m in json.loads(answer)["data"]}
        if any(listed.get(name) != n for name, n in ready.items()):
            return False
    return True


@pytest.mark.timeout(120)
async def test_an_adapter_one_worker_loaded_is_not_loaded_again_by_its_sibling(sims, tmp_path):
    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "max_adapters_per_endpoint: 0"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        assert await spread(port, "a", 1) == [(200, "")]
        # the load's news on the bus (it leaves at once) reached the sibling: a loaded machine may
        # keep it on its way longer than any fixed pause
        assert await wait_for(lambda: on_engine_for_both(port, {"a": 1}), timeout=20)
        assert await spread(port, "a") == [(200, "")] * 12
        listed = await per_worker(port, 2, "/v1/models")
    assert calls(sim, "/v1/load_lora_adapter") == 1
    for answer in listed.values():               # both workers list it on the engine
        a = next(m for m in json.loads(answer)["data"] if m["id"] == "a")
        assert a["ready_endpoints"] == 1, answer


@pytest.mark.timeout(120)
async def test_an_adapter_one_worker_unloaded_is_loaded_again_by_its_sibling_not_met_missing(sims, tmp_path):
    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "max_adapters_per_endpoint: 1"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        for model in ("a", "b", "a", "b"):       # each unloads the other for room (capacity)
            assert await spread(port, model) == [(200, "")] * 12, model
            other = "b" if model == "a" else "a"     # the news of both reached the sibling
            assert await wait_for(lambda m=model, o=other: on_engine_for_both(port, {m: 1, o: 0}), timeout=20)
    assert calls(sim, "/v1/load_lora_adapter") == 4
    assert calls(sim, "/v1/unload_lora_adapter") == 3


async def worker_session(port: int, not_pid: int | None = None) -> tuple[aiohttp.ClientSession, int]:
    """A session whose one kept-alive connection is with a worker (not ``not_pid``): it and its pid."""
    while True:
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
            pid = (await r.json())["gateway"]["pid"]
        if pid != not_pid:
            return s, pid
        await s.close()


@pytest.mark.timeout(120)
async def test_an_adapter_in_use_on_one_worker_is_not_unloaded_as_idle_by_the_other(sims, tmp_path):
    """A client kept alive on one worker uses an adapter the other loaded: the loader hears of the
    uses, so it does not unload the adapter as idle under the client (which would then load it again)."""
    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    # the loader hears of a use at the user's next idle pass (every idle_unload_s / 2): a use is at
    # most 1 s old plus the gap between two uses when the loader weighs it, against 2 s, so a worker
    # stalled for most of a second does not make a use in progress look idle (with 1 s, a stall of
    # a quarter of a second did)
    path.write_text(config(port, sim.url, "idle_unload_s: 2.0"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        loader, pid = await worker_session(port)
        user, _ = await worker_session(port, pid)
        body = {"model": "a", "messages": MSG, "max_tokens": 2}
        try:
            async with loader.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                assert r.status == 200
            for _ in range(15):                       # 3 s of use (past idle_unload_s), on the other worker only
                async with user.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                await asyncio.sleep(0.2)
        finally:
            await loader.close()
            await user.close()
        assert calls(sim, "/v1/unload_lora_adapter") == 0
        assert calls(sim, "/v1/load_lora_adapter") == 1
        # unused: unloaded as idle by the pass after idle_unload_s, whenever a loaded machine runs it
        assert await wait_for(lambda: calls(sim, "/v1/unload_lora_adapter") >= 1, timeout=30.0)


async def busy_heard(port: int) -> bool:
    """Whether a worker took in its sibling's adapters in flight (``/metrics`` sums the workers'
    counts, and only the worker with streams has any to tell)."""
    page = (await get_new(port, "/metrics"))[1]
    return metric_total(page, "switchyard_view_facts_applied_total", kind="busy") >= 1


async def open_stream(session: aiohttp.ClientSession, port: int, model: str) -> aiohttp.ClientResponse:
    """A stream for ``model`` on ``session``'s worker that the engine holds after its first token
    (``stall_after``) until the client leaves: returned once that token is read."""
    body = {"model": model, "messages": MSG, "max_tokens": 50, "stream": True}
    r = await session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                           headers={"x-sim-fault": "stall_after=1:inf"})
    assert r.status == 200, await r.text()
    while not (await r.content.readline()).startswith(b"data: {"):
        pass
    return r


@pytest.mark.timeout(120)
async def test_an_adapter_streaming_on_one_worker_is_not_unloaded_for_room_by_the_other(sims, tmp_path):
    """Streams for ``a`` run on one worker; a request for ``b`` on the other, at one adapter an
    endpoint: that worker knows ``a`` is in flight on its sibling, so it does not unload ``a`` from
    under the streams (it answers 503 full, as for its own), and loads ``b`` once they end."""
    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "max_adapters_per_endpoint: 1"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        streamer, pid = await worker_session(port)
        other, _ = await worker_session(port, pid)
        body = {"model": "b", "messages": MSG, "max_tokens": 2}
        try:
            streams = [await open_stream(streamer, port, "a")]
            # the sibling's word that a is in flight there (bounded: without it the request below tells)
            await wait_for(lambda: busy_heard(port), timeout=5)
            async with other.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                status, headers, text = r.status, r.headers, await r.text()
            assert calls(sim, "/v1/unload_lora_adapter") == 0, "a was unloaded under its streams"
            assert status == 503 and headers.get("x-error-lora-load") == "full", text
            for s in streams:
                s.close()
            status = 0
            async with asyncio.timeout(10):           # the sibling hears the streams end
                while status != 200:
                    async with other.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                        status = r.status
                        assert status in (200, 503), await r.text()
        finally:
            await streamer.close()
            await other.close()
    assert calls(sim, "/v1/unload_lora_adapter") == 1


LOAD = "/v1/load_lora_adapter"
FAILING = "a: org/a, bad: /nonexistent/adapters/bad"     # an absolute path missing on disk: the engine's 404


async def load_news_heard(port: int) -> bool:
    """Whether a worker took in its sibling's word of a load it started or ended (``/metrics`` sums
    the workers' counts)."""
    page = (await get_new(port, "/metrics"))[1]
    return metric_total(page, "switchyard_view_facts_applied_total", kind="lora_load") >= 1


async def ask(session: aiohttp.ClientSession, port: int, model: str) -> tuple[int, str, str]:
    """A chat request for ``model`` on ``session``'s worker: status, ``x-error-lora-load``, body."""
    body = {"model": model, "messages": MSG, "max_tokens": 2}
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        return r.status, r.headers.get("x-error-lora-load", ""), await r.text()


@pytest.mark.timeout(120)
async def test_a_load_failure_one_worker_met_cools_the_endpoint_down_in_its_sibling_too(sims, tmp_path):
    """One worker's load of an adapter fails: its sibling hears of the failure and of its cooldown,
    so it does not ask the engine again, and answers the cooldown's 503 as for a failure of its own."""
    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "failure_cooldown_s: 60", FAILING))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        first, pid = await worker_session(port)
        second, _ = await worker_session(port, pid)
        try:
            status, why, text = await ask(first, port, "bad")
            assert (status, why) == (502, "error"), text
            await wait_for(lambda: load_news_heard(port), timeout=5)     # bounded: without it the request below loads
            status, why, text = await ask(second, port, "bad")
            assert calls(sim, LOAD) == 1, "the sibling asked the failing engine again"
            assert (status, why) == (503, "cooldown"), text
            page = (await get_new(port, "/metrics"))[1]
        finally:
            await first.close()
            await second.close()
    assert metric_total(page, "switchyard_lora_loads_total", adapter="bad", result="error") == 1
    assert metric_total(page, "switchyard_lora_loads_total", adapter="bad", result="cooldown") == 1


async def load_under_way(sim, port: int, first: aiohttp.ClientSession, model: str) -> asyncio.Task:
    """``first``'s request for ``model``, sent in the background once the engine (whose load calls
    answer after seconds) has its load call and the sibling may have heard the load start."""
    task = asyncio.create_task(ask(first, port, model))
    await wait_for(lambda: calls(sim, LOAD) == 1, timeout=10)
    await wait_for(lambda: load_news_heard(port), timeout=1)      # bounded: without it the sibling loads
    assert calls(sim, LOAD) == 1 and not task.done(), "the first load was not under way"
    return task


@pytest.mark.timeout(120)
async def test_a_load_under_way_in_one_worker_is_awaited_by_its_sibling_not_made_again(sims, tmp_path):
    """A request for an adapter reaches the sibling while the first worker's load of it is under
    way: the sibling waits for that load's outcome rather than asking the engine too."""
    sim = await sims("vllm", "m", **LORA_SIM, lora_load_call_ms=2000)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "load_timeout_s: 60"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        first, pid = await worker_session(port)
        second, _ = await worker_session(port, pid)
        try:
            loading = await load_under_way(sim, port, first, "a")
            status, _, text = await ask(second, port, "a")
            assert calls(sim, LOAD) == 1, "the sibling made a load call of its own"
            assert status == 200, text
            status, _, text = await loading
            assert status == 200, text
            page = (await get_new(port, "/metrics"))[1]
        finally:
            await first.close()
            await second.close()
    assert metric_total(page, "switchyard_lora_loads_total", adapter="a", result="ok") == 1
    assert metric_total(page, "switchyard_lora_load_waits_total", adapter="a", outcome="loaded") == 1


@pytest.mark.timeout(120)
async def test_a_load_under_way_in_one_worker_that_fails_is_the_siblings_cooldown(sims, tmp_path):
    """The first worker's load fails while the sibling waits on it: the sibling does not ask the
    engine either, and answers the cooldown's 503 with its Retry-After; nor does either worker ask
    again within the cooldown."""
    sim = await sims("vllm", "m", **LORA_SIM, lora_load_call_ms=2000)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "load_timeout_s: 60, failure_cooldown_s: 60", FAILING))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        first, pid = await worker_session(port)
        second, _ = await worker_session(port, pid)
        try:
            loading = await load_under_way(sim, port, first, "bad")
            status, why, text, retry = await ask_retry(second, port, "bad")
            assert calls(sim, LOAD) == 1, "the sibling made a load call of its own"
            assert (status, why) == (503, "cooldown"), text
            assert 0 < int(retry) <= 60, retry
            status, why, text = await loading
            assert (status, why) == (502, "error"), text
            for session in (first, second, first, second):      # within the cooldown, on either worker
                status, why, text, retry = await ask_retry(session, port, "bad")
                assert (status, why) == (503, "cooldown"), text
                assert 0 < int(retry) <= 60, retry
            assert calls(sim, LOAD) == 1, "the engine was asked again within the cooldown"
            page = (await get_new(port, "/metrics"))[1]
        finally:
            await first.close()
            await second.close()
    assert metric_total(page, "switchyard_lora_load_waits_total", adapter="bad", outcome="failed") == 1
    assert metric_total(page, "switchyard_lora_load_waits_total", adapter="bad") == 1
    assert metric_total(page, "switchyard_lora_loads_total", adapter="bad", result="error") == 1
    assert metric_total(page, "switchyard_lora_loads_total", adapter="bad", result="cooldown") == 5


async def ask_retry(session: aiohttp.ClientSession, port: int, model: str) -> tuple[int, str, str, str]:
    """``ask``, and the answer's ``Retry-After``."""
    body = {"model": model, "messages": MSG, "max_tokens": 2}
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        return r.status, r.headers.get("x-error-lora-load", ""), await r.text(), r.headers.get("Retry-After", "")


@pytest.mark.timeout(120)
async def test_a_load_under_way_in_one_worker_refused_as_full_lets_its_sibling_ask_again(sims, tmp_path):
    """The first worker's load is refused as full (the engine's one registered adapter is none of
    the gateway's to unload) while the sibling waits on it: no cooldown follows such a refusal, so
    the sibling's wait ends without an outcome (``ended``) and it asks the engine itself, which
    refuses it too."""
    sim = await sims("vllm", "m", **LORA_SIM, lora_load_call_ms=2000, max_loaded_loras=1,
                     lora_modules=("other=org/other",))
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, sim.url, "load_timeout_s: 60, failure_cooldown_s: 60"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        first, pid = await worker_session(port)
        second, _ = await worker_session(port, pid)
        try:
            loading = await load_under_way(sim, port, first, "a")
            status, why, text = await ask(second, port, "a")
            assert (status, why) == (502, "error") and "No free adapter slots." in text, text
            status, why, text = await loading
            assert (status, why) == (502, "error") and "No free adapter slots." in text, text
            page = (await get_new(port, "/metrics"))[1]
        finally:
            await first.close()
            await second.close()
    assert calls(sim, LOAD) == 2, "the sibling asked once the refusal ended its wait"
    assert metric_total(page, "switchyard_lora_load_waits_total", adapter="a", outcome="ended") == 1
    assert metric_total(page, "switchyard_lora_loads_total", adapter="a", result="cooldown") == 0


def discovery_config(port: int, url: str, interval: float) -> str:
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
            "health: {interval_s: 0.5}\n"
            f"lora: {{discovery_interval_s: {interval}}}\n"
            f"models: [{{name: m, engine: vllm, endpoints: ['{url}']}}]\n")


async def reloaded(proc, port: int, generation: int) -> None:
    """SIGHUP to the parent, and every worker runs ``generation`` (the merged gauge is the smallest)."""
    import signal

    proc.send_signal(signal.SIGHUP)
    async with asyncio.timeout(20):
        while metric_total((await get_new(port, "/metrics"))[1], "switchyard_config_generation") != generation:
            await asyncio.sleep(0.02)


class Arrivals:
    """The requests that reach an in-process engine from now on, by path, read off its recorder as
    they come (the recorder keeps the last 256: polled often, none is missed at a probe's pace)."""

    def __init__(self, sim) -> None:
        self.received = sim.app[RECEIVED_KEY]
        self.seen = {id(e): e for e in self.received}
        self.paths: list[str] = []

    def poll(self) -> list[str]:
        for e in list(self.received):
            if id(e) not in self.seen:
                self.seen[id(e)] = e
                self.paths.append(e["path"])
        return self.paths


@pytest.mark.timeout(120)
async def test_a_reload_that_turns_adapter_discovery_on_starts_it_in_every_worker(sims, tmp_path):
    """``lora`` is a block a reload applies: discovery_interval_s from 0 (off) to a period starts
    reading the engines' /v1/models, so an adapter loaded on the engine by hand becomes routable
    from every worker."""
    import openai

    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(discovery_config(port, sim.url, 0))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2) as proc:
        async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/load_lora_adapter",
                                                        json={"lora_name": "ext", "lora_path": "org/ext"}) as r:
            assert r.status == 200
        assert await spread(port, "ext", 2) == [(404, "The model `ext` does not exist or you do not have access to it.")] * 2

        path.write_text(discovery_config(port, sim.url, 0.1))
        await reloaded(proc, port, 2)

        async def listed_by_both() -> bool:
            views = await per_worker(port, 2, "/v1/models")
            return all(any(m["id"] == "ext" for m in json.loads(v)["data"]) for v in views.values())
        assert await wait_for(listed_by_both, timeout=10), await per_worker(port, 2, "/v1/models")
        for _ in range(6):          # a client each, a connection each: both workers answer
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            assert (await client.chat.completions.create(model="ext", messages=MSG, max_tokens=2)).model == "ext"
            await client.close()


@pytest.mark.timeout(120)
async def test_a_reload_that_turns_adapter_discovery_off_stops_it_in_every_worker(sims, tmp_path):
    """discovery_interval_s back to 0 (off) stops reading the engines' /v1/models, rather than
    reading them without a pause between rounds."""
    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(discovery_config(port, sim.url, 0.1))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2) as proc:
        path.write_text(discovery_config(port, sim.url, 0))
        await reloaded(proc, port, 2)
        arrivals = Arrivals(sim)

        def probes() -> int:
            return arrivals.poll().count("/health")
        assert await wait_for(lambda: probes() >= 3, timeout=20, interval=0.005), arrivals.paths
        models = arrivals.paths.count("/v1/models")
        assert models <= 2, f"{models} reads of /v1/models over three health probes after discovery was turned off"
