"""Reload of a real gateway process: a SIGHUP under steady client traffic swaps endpoints with no
failed request, and with ``--workers 2`` every worker reloads (SIGHUP to the parent, or
``POST /admin/reload`` to any worker)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import sys
from collections import Counter

import aiohttp
import openai
import pytest

from tests.support.gateway_process import per_worker
from tests.support.http import sim_state
from tests.support.lora import LORA_SIM
from tests.support.metrics import metric
from tests.support.ports import listen_port
from tests.support.waiting import sigstop

CHAT = [{"role": "user", "content": "Keep the trains running."}]
TOKEN = "admin-token-for-workers"


def config_text(port: int, urls: list[str], *, extra: str = "", log_level: str = "warning",
                read_timeout_s: float | None = 60.0) -> str:
    """A file these tests write and reload at once: read as it is (``reload_settle_s: 0``; the wait
    for a file written in place is tested on its own), its text waited for as long as a test holds
    it back (``reload_read_timeout_s``; None: the default; the bound is tested on its own)."""
    eps = ", ".join(f"'{u}'" for u in urls)
    read = f"reload_read_timeout_s: {read_timeout_s}, " if read_timeout_s is not None else ""
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            f"server: {{drain_delay_s: 0, shutdown_grace_s: 5, reload_settle_s: 0, {read}log_level: {log_level}}}\n"
            "health: {interval_s: 0.5}\n"
            f"models: [{{name: m, engine: vllm, endpoints: [{eps}]}}]\n{extra}")


@contextlib.asynccontextmanager
async def gateway_process(path, port: int, *args: str):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(path), *args,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        async with aiohttp.ClientSession() as s, asyncio.timeout(30):
            while True:
                try:
                    async with s.get(f"http://127.0.0.1:{port}/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await proc.wait()


async def started(url: str) -> int:
    return (await sim_state(url))["counts"]["started"]


@pytest.mark.timeout(90)
async def test_sighup_under_load_adds_an_endpoint_and_removes_another_with_no_failed_request(sims, tmp_path):
    # streams of ~20 tokens at 5 ms each: requests are always in flight on the endpoint removed
    a, b, c = [await sims("vllm", "m", itl_ms=5.0) for _ in range(3)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config_text(port, [a.url, b.url]))
    async with gateway_process(path, port, "--workers", "1") as proc:
        url = f"http://127.0.0.1:{port}"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        outcomes: Counter[str] = Counter()
        stop = asyncio.Event()

        async def steady(i: int) -> None:
            while not stop.is_set():
                try:
                    if i % 2:
                        stream = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=20,
                                                                      stream=True)
                        finish = [ch.choices[0].finish_reason async for ch in stream if ch.choices]
                        outcomes["ok" if finish[-1] == "length" else "truncated"] += 1
                    else:
                        r = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=5)
                        outcomes["ok" if r.choices[0].message.content else "empty"] += 1
                except Exception as e:      # any failure is counted, and fails the test
                    outcomes[f"{type(e).__name__}: {e}"[:200]] += 1

        clients = [asyncio.create_task(steady(i)) for i in range(6)]
        try:
            while outcomes["ok"] < 30:
                await asyncio.sleep(0.02)
            assert await started(a.url) > 0 and await started(c.url) == 0
            path.write_text(config_text(port, [b.url, c.url]))
            proc.send_signal(signal.SIGHUP)
            async with aiohttp.ClientSession() as s:
                for _ in range(500):
                    async with s.get(url + "/metrics") as r:
                        if metric(await r.text(), "switchyard_config_generation") == 2:
                            break
                    await asyncio.sleep(0.02)
            at_reload = outcomes["ok"]
            a_at_reload = await started(a.url)
            while outcomes["ok"] < at_reload + 60:
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await asyncio.gather(*clients)
        assert set(outcomes) == {"ok"}, outcomes
        assert await started(c.url) > 0                    # the added endpoint takes traffic
        assert await started(a.url) == a_at_reload         # the removed one gets none after the reload

        path.write_text(config_text(port, [b.url, c.url], extra="aliases: [{name: x, targets: [{model: nope}]}]\n"))
        proc.send_signal(signal.SIGHUP)
        async with aiohttp.ClientSession() as s:
            for _ in range(500):
                async with s.get(url + "/metrics") as r:
                    text = await r.text()
                if metric(text, "switchyard_config_reload_total", result="invalid") == 1:
                    break
                await asyncio.sleep(0.02)
        assert metric(text, "switchyard_config_reload_total", result="ok") == 1
        assert metric(text, "switchyard_config_generation") == 2
        assert (await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)).choices
        await client.close()
        proc.send_signal(signal.SIGTERM)
        _, err = await proc.communicate()
    assert b"aliases[0].targets[0].model" in err and b"config reload refused" in err


async def worker_views(port: int, want: int) -> dict[int, set[str]]:
    """pid → the model ids its /v1/models lists, over fresh connections until ``want`` workers answered.
    A connection the kernel reset is tried again: right after a worker is killed, the connections
    SO_REUSEPORT had queued on its listening socket are reset when that socket closes."""
    views: dict[int, set[str]] = {}
    for _ in range(200):
        conn = aiohttp.TCPConnector(limit=1)        # one connection: both answers from one worker
        try:
            async with aiohttp.ClientSession(connector=conn) as s:
                async with s.get(f"http://127.0.0.1:{port}/status.json",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    pid = (await r.json())["gateway"]["pid"]
                async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                    views[pid] = {m["id"] for m in (await r.json())["data"]}
        except (aiohttp.ClientConnectionError, ConnectionResetError):
            await asyncio.sleep(0.02)
            continue
        if len(views) >= want:
            break
    return views


@pytest.mark.timeout(90)
async def test_every_worker_reloads_on_sighup_and_on_admin_reload(sims, tmp_path):
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    auth = f"auth: {{admin_token: {TOKEN}}}\n"
    path.write_text(config_text(port, [sim.url], extra=auth))
    async with gateway_process(path, port, "--workers", "2") as proc:
        assert [v for v in (await worker_views(port, 2)).values()] == [{"m"}, {"m"}]

        path.write_text(config_text(port, [sim.url], extra=auth + "aliases: [{name: one, targets: [{model: m}]}]\n"))
        proc.send_signal(signal.SIGHUP)                                 # to the parent
        for _ in range(100):
            views = await worker_views(port, 2)
            if all(v == {"m", "one"} for v in views.values()):
                break
            await asyncio.sleep(0.05)
        assert len(views) == 2 and all(v == {"m", "one"} for v in views.values()), views

        path.write_text(config_text(port, [sim.url], extra=auth + "aliases: [{name: two, targets: [{model: m}]}]\n"))
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/admin/reload",
                                                        headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            body = await r.json()
        assert r.status == 200 and body["result"] == "ok" and body["generation"] == 3
        views = await worker_views(port, 2)                             # every worker, not only the one asked
        assert len(views) == 2 and all(v == {"m", "two"} for v in views.values()), views
        for _ in range(4):      # two reloads of the gateway, though each worker applied both
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert metric(text, "switchyard_config_reload_total", result="ok") == 2
            assert metric(text, "switchyard_config_generation") == 3

        # a worker that dies is restarted by the parent on the config as reloaded, not as started
        victim = next(iter(views))
        os.kill(victim, signal.SIGKILL)
        for _ in range(200):
            views = await worker_views(port, 2)
            if len(views) == 2 and victim not in views:
                break
            await asyncio.sleep(0.05)
        assert victim not in views and all(v == {"m", "two"} for v in views.values()), views
        assert proc.returncode is None
        for _ in range(4):      # and says so: the gateway's generation (the smallest of its workers') is 3
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert metric(text, "switchyard_config_generation") == 3 and metric(text, "switchyard_workers_scraped") == 2


@pytest.mark.timeout(90)
async def test_an_alias_named_as_an_adapter_is_refused_and_the_adapter_keeps_serving_from_every_worker(sims, tmp_path):
    """An alias takes a request before the LoRA stage sees it: an alias with the name of an adapter
    the config lists would have its targets answer that adapter's requests without the adapter,
    from every worker. The file is refused, as one whose alias has a model's name is."""
    sim = await sims("vllm", "m", **LORA_SIM)
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n")
    text = text.replace("endpoints:", "adapters: {sql: org/sql-lora}, endpoints:")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2") as proc:
        assert len(await worker_views(port, 2)) == 2
        path.write_text(text + "aliases: [{name: sql, targets: [{model: m}]}]\n")
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/admin/reload",
                                                        headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            status, body = r.status, await r.json()
        assert (status, body.get("error", {}).get("param")) == (400, "aliases[0].name"), body
        assert "LoRA adapter" in body["error"]["message"], body
        served = []
        for _ in range(8):      # a client each, so a connection each: the kernel spreads them over the workers
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            raw = await client.chat.completions.with_raw_response.create(model="sql", messages=CHAT, max_tokens=2)
            served.append((raw.parse().model, raw.headers.get("x-served-model")))
            await client.close()
        assert served == [("sql", None)] * 8, served
        views = await worker_views(port, 2)
        assert len(views) == 2 and all(v == {"m", "sql"} for v in views.values()), views
        assert proc.returncode is None


def _catches_sighup(pid: int) -> bool:
    """The process has a handler for SIGHUP (``SigCgt`` in /proc: bit 0 is signal 1)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & 1)
    except OSError:
        pass
    return False


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_sighup_while_the_gateway_starts_is_a_reload_once_it_runs(sims, tmp_path, workers):
    """SIGHUP's default action ends a process: one that came while the gateway was still importing
    and building its app killed it, and one a worker got before its loop handled it was lost while
    the parent had taken the new file. Here it comes as soon as the process has any handler for it
    (long before it serves), after the file changed: the gateway lives, and every worker serves
    the new file's model."""
    sim = await sims("vllm", "m")
    sim2 = await sims("vllm", "m2")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config_text(port, [sim.url]))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", workers, stderr=asyncio.subprocess.DEVNULL)
    try:
        async with asyncio.timeout(30):
            while not _catches_sighup(proc.pid):
                await asyncio.sleep(0.001)
        cfg.write_text(config_text(port, [sim.url]).replace("name: m,", "name: m2,").replace(sim.url, sim2.url))
        proc.send_signal(signal.SIGHUP)
        seen: dict[int, set[str]] = {}
        async with asyncio.timeout(40):
            while len(seen) < int(workers) or any(ids != {"m2"} for ids in seen.values()):
                assert proc.returncode is None, "the gateway died of the SIGHUP"
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                        async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                            pid = (await r.json())["gateway"]["pid"]
                        async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                            seen[pid] = {m["id"] for m in (await r.json())["data"]}
                await asyncio.sleep(0.05)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await proc.wait()


async def pinned_workers(port: int, want: int) -> dict[int, aiohttp.ClientSession]:
    """pid → a session whose one kept-alive connection reaches that worker."""
    sessions: dict[int, aiohttp.ClientSession] = {}
    for _ in range(200):
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with s.get(f"http://127.0.0.1:{port}/status.json", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            pid = (await r.json())["gateway"]["pid"]
        if pid in sessions:
            await s.close()
        else:
            sessions[pid] = s
        if len(sessions) >= want:
            break
    return sessions


@pytest.mark.timeout(90)
async def test_workers_agree_on_the_generation_after_sighups_sent_close_together(sims, tmp_path):
    """SIGHUPs sent a few milliseconds apart are applied a different number of times by the parent
    and by each worker (a signal that comes while one of the same is pending is one); the workers
    still count the same generation, the parent's, so switchyard_config_generation (the smallest
    of theirs) does not show one of them behind for good."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n"))
    async with gateway_process(path, port, "--workers", "2") as proc:
        for i in range(100):
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.001 * (i % 4))
        # at once, the parent and the workers perhaps still applying those: each answer is the reload
        # the parent began after that ask, so the second is the one after the first
        sessions = await pinned_workers(port, 2)
        try:
            answered = []
            for s in sessions.values():     # each reloads every worker, and answers with its own generation
                async with s.post(f"http://127.0.0.1:{port}/admin/reload",
                                  headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    answered.append((await r.json())["generation"])
        finally:
            for s in sessions.values():
                await s.close()
        assert len(answered) == 2 and answered[1] == answered[0] + 1, answered
        # the last reload is applied by the sibling a moment after it answered: the smallest of the
        # workers' generations comes to the parent's, and stays there
        seen: list[float] = []
        async with asyncio.timeout(10):
            while not seen or seen[-1] != answered[1]:
                await asyncio.sleep(0.05)
                conn = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(connector=conn) as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    seen.append(metric(await r.text(), "switchyard_config_generation"))
        assert max(seen) == answered[1], seen         # never past the parent's


@pytest.mark.timeout(90)
async def test_the_status_document_says_which_config_each_worker_runs_and_how_its_last_reload_went(sims, tmp_path):
    """/metrics shows the smallest of the workers' generations, and 0 for the last reload when one
    refused it: that one is behind, not which. /status.json says, for the worker that answered
    (``gateway.config``) and for every worker that reported (``gateway.workers.config``), the
    generation it runs, a digest of that config and how its last reload went. A SIGHUP sent to one
    worker alone reloads it alone, its generation unchanged: the digest tells it apart."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2") as proc:
        sessions = await pinned_workers(port, 2)
        try:
            async def documents() -> dict[int, dict]:
                """Each worker's answer, with its sibling's part in it (one that did not answer
                within its 0.5 s, on a busy machine, is asked again)."""
                out: dict[int, dict] = {}
                async with asyncio.timeout(20):
                    while len(out) < len(sessions):
                        for pid, s in sessions.items():
                            async with s.get(f"http://127.0.0.1:{port}/status.json",
                                             headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                                gateway = (await r.json())["gateway"]
                            if gateway["workers"]["reporting"] == 2:
                                out[pid] = gateway
                return out

            async def until_each(check) -> dict[int, dict]:
                async with asyncio.timeout(10):
                    while True:
                        docs = await documents()
                        if all(check(d["config"]) for d in docs.values()):
                            return docs
                        await asyncio.sleep(0.02)

            async def admin() -> tuple[int, dict]:
                async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/admin/reload",
                                                                headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    return r.status, await r.json()

            def listed(docs: dict[int, dict]) -> list[tuple]:
                """Each answer's list of every worker's (pid, generation, digest, last reload's result)."""
                rows = []
                for d in docs.values():
                    rows.append([(w["pid"], w["generation"], w["digest"], (w["last_reload"] or {}).get("result"))
                                 for w in d["workers"]["config"]])
                return rows

            start = await documents()
            digest = {d["config"]["digest"] for d in start.values()}
            assert len(digest) == 1 and all(d["config"]["generation"] == 1 and d["config"]["last_reload"] is None
                                            for d in start.values()), start
            first = digest.pop()
            whole = sorted((pid, 1, first, None) for pid in sessions)
            assert listed(start) == [whole, whole], start

            path.write_text(text + "aliases: [{name: one, targets: [{model: m}]}]\n")
            assert (await admin())[0] == 200
            # the worker asked answers once it applied the reload, its sibling a moment later: the
            # file is not rewritten before it has read it too
            await until_each(lambda c: c["generation"] == 2)
            path.write_text(text + "aliases: [{name: one, targets: [{model: m}]}]\nno_such_block: 1\n")
            assert (await admin())[0] == 400
            refused = await until_each(lambda c: (c["last_reload"] or {}).get("result") == "invalid")
            second = {d["config"]["digest"] for d in refused.values()}
            assert len(second) == 1 and second != {first}, refused
            for d in refused.values():
                last = d["config"]["last_reload"]
                assert d["config"]["generation"] == 2 and last["trigger"] == "admin", d
                assert last["key_path"] == "no_such_block" and "no_such_block" in last["error"], d
            whole = sorted((pid, 2, *second, "invalid") for pid in sessions)
            assert listed(refused) == [whole, whole], refused

            # a SIGHUP sent to one worker alone reloads nothing there: the parent reads the file for
            # every worker. The parent's next reload moves both to one config
            alone = min(sessions)
            path.write_text(text + "aliases: [{name: two, targets: [{model: m}]}]\n")
            os.kill(alone, signal.SIGHUP)
            async with asyncio.timeout(10):
                while _pending_sighup(alone):
                    await asyncio.sleep(0.01)
            assert listed(await documents()) == [whole, whole]
            proc.send_signal(signal.SIGHUP)
            moved = await until_each(lambda c: c["generation"] == 3)
            third = {d["config"]["digest"] for d in moved.values()}
            assert len(third) == 1 and third.isdisjoint({first, *second}), moved
            whole = sorted((pid, 3, *third, "ok") for pid in sessions)
            async with asyncio.timeout(10):         # each answer with its sibling's part made after it too
                while listed(moved) != [whole, whole]:
                    await asyncio.sleep(0.02)
                    moved = await documents()
        finally:
            for s in sessions.values():
                await s.close()


def _reload_lines(err: bytes) -> list[dict]:
    """The ``config reloaded`` and ``config reload refused`` lines of a JSON log."""
    lines = []
    for raw in err.splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(raw)
            if isinstance(line, dict) and str(line.get("event", "")).startswith("config reload") \
                    and line["event"] != "config reload deferred":
                lines.append(line)
    return lines


@pytest.mark.timeout(90)
async def test_an_admin_reload_says_admin_in_every_worker_and_a_sighup_says_signal(sims, tmp_path):
    """With ``--workers 2`` the worker asked sends SIGHUP to the parent, which signals every worker:
    the answer and every worker's log line still name the trigger, as one process does."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    auth = f"auth: {{admin_token: {TOKEN}}}\n"
    text = config_text(port, [sim.url], extra=auth, log_level="info")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        assert len(await worker_views(port, 2)) == 2
        path.write_text(text + "aliases: [{name: one, targets: [{model: m}]}]\n")
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/admin/reload",
                                                        headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            body = await r.json()
        assert r.status == 200 and body["result"] == "ok" and body["trigger"] == "admin", body
        for _ in range(100):            # every worker applied it
            views = await worker_views(port, 2)
            if len(views) == 2 and all(v == {"m", "one"} for v in views.values()):
                break
            await asyncio.sleep(0.05)
        assert len(views) == 2 and all(v == {"m", "one"} for v in views.values()), views

        path.write_text(text + "aliases: [{name: two, targets: [{model: m}]}]\n")
        proc.send_signal(signal.SIGHUP)                                 # to the parent
        for _ in range(100):
            views = await worker_views(port, 2)
            if len(views) == 2 and all(v == {"m", "two"} for v in views.values()):
                break
            await asyncio.sleep(0.05)
        assert len(views) == 2 and all(v == {"m", "two"} for v in views.values()), views
        proc.send_signal(signal.SIGTERM)
        _, err = await proc.communicate()
    lines = _reload_lines(err)
    by_generation: dict[int, list[str]] = {}
    for line in lines:
        assert line["event"] == "config reloaded", line
        by_generation.setdefault(line["generation"], []).append(line["trigger"])
    assert by_generation == {2: ["admin", "admin"], 3: ["signal", "signal"]}, lines


class LogLines:
    """The JSON lines a gateway process writes to stderr, read as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.lines: list[dict] = []
        self._task = asyncio.ensure_future(self._read(proc.stderr))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            with contextlib.suppress(ValueError):
                line = json.loads(raw)
                if isinstance(line, dict):
                    self.lines.append(line)

    def reloads(self) -> list[dict]:
        """The lines about a reload: applied or refused, the parent's and the workers'."""
        return [line for line in self.lines if str(line.get("event", "")).startswith("config reload")
                and line["event"] != "config reload deferred"]

    async def until(self, count: int) -> list[dict]:
        async with asyncio.timeout(20):
            while len(self.reloads()) < count:
                await asyncio.sleep(0.02)
        return self.reloads()

    async def close(self) -> None:
        async with asyncio.timeout(20):
            await self._task


@pytest.mark.timeout(90)
async def test_a_refused_reload_names_its_trigger_in_the_parents_line_and_every_workers(sims, tmp_path):
    """A file that does not load: the parent says that restarted workers keep the running config,
    each worker that it kept it, and each of these lines names what the reload came from, as the
    lines of an applied reload do: ``signal`` for a SIGHUP, ``admin`` for POST /admin/reload."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        assert len(await worker_views(port, 2)) == 2
        path.write_text(text + "no_such_block: 1\n")
        proc.send_signal(signal.SIGHUP)
        by_signal = await logs.until(3)                 # the parent's line and each worker's
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/admin/reload",
                                                        headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            body = await r.json()
        assert r.status == 400 and body["error"]["code"] == "config_invalid", body
        by_admin = (await logs.until(6))[3:]
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    for lines, trigger in ((by_signal[:3], "signal"), (by_admin, "admin")):
        assert all("refused" in line["event"] for line in lines), lines
        assert sum("restarted workers" in line["event"] for line in lines) == 1, lines     # the parent's
        assert [line.get("trigger") for line in lines] == [trigger] * 3, lines
    assert len(logs.reloads()) == 6, logs.reloads()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_file_whose_yaml_contains_itself_is_refused_and_the_gateway_keeps_serving(sims, tmp_path, workers):
    """An anchor used inside its own node (``aliases: &x [*x]``) loads as a structure without end:
    the reload is refused with the key path where it begins, counted and logged by the parent and
    every worker, as any YAML error is (the parent's line with the key path and result a worker's
    has), and the running config keeps serving."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url])
    path.write_text(text)
    async with gateway_process(path, port, "--workers", workers, "--log-format", "json") as proc:
        logs = LogLines(proc)
        assert len(await worker_views(port, int(workers))) == int(workers)     # every worker serves
        path.write_text(text + "aliases: &x [*x]\n")
        proc.send_signal(signal.SIGHUP)
        lines = await logs.until(int(workers) + (workers != "1"))      # each worker's line, and the parent's
        for _ in range(4):          # a client each, so a connection each: every worker serves
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            assert (await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)).choices
            await client.close()
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            page = await r.text()
        assert metric(page, "switchyard_config_reload_total", result="invalid") == 1
        assert metric(page, "switchyard_config_generation") == 1
        assert proc.returncode is None
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    assert all("refused" in line["event"] and "aliases[0]" in line["error"] for line in lines), lines
    # the parent's line carries what one process's refusal does, as every worker's line does
    assert [(line.get("key_path"), line.get("result"), line.get("trigger"), line.get("generation"))
            for line in lines] == [("aliases[0]", "invalid", "signal", 1)] * len(lines), lines


def _pending_sighup(pid: int) -> bool:
    """A SIGHUP waits for the process (``ShdPnd`` in /proc: bit 0 is signal 1), as for a stopped one."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("ShdPnd:"):
                return bool(int(line.split()[1], 16) & 1)
    return False


@pytest.mark.timeout(90)
async def test_a_workers_own_sighup_while_an_admin_reload_is_on_its_way_reloads_nothing_there(sims, tmp_path):
    """Two reloads close together: a worker asked POST /admin/reload has told the parent, which has
    not yet had the workers reload (here it is stopped meanwhile), when each worker gets a SIGHUP of
    its own (``kill -HUP`` to the process group sends one to every process). The parent reads the
    file for every worker, so a worker's own SIGHUP reloads nothing there (it says so, a warning
    naming the parent), and the admin answer is the gateway's reload once the parent had every
    worker apply it."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        sessions = await pinned_workers(port, 2)
        try:
            (asked, asked_http), (other, _) = sessions.items()
            path.write_text(text + "aliases: [{name: one, targets: [{model: m}]}]\n")
            await sigstop(proc.pid)
            try:
                async def admin() -> tuple[int, dict]:
                    async with asked_http.post(f"http://127.0.0.1:{port}/admin/reload",
                                               headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                        return r.status, await r.json()
                answer = asyncio.ensure_future(admin())
                async with asyncio.timeout(10):         # the worker asked has told the parent
                    while not _pending_sighup(proc.pid):
                        await asyncio.sleep(0.01)
                os.kill(asked, signal.SIGHUP)
                os.kill(other, signal.SIGHUP)
                async with asyncio.timeout(20):
                    while len(own := [line for line in logs.lines
                                      if str(line.get("event", "")).startswith("SIGHUP to a worker")]) < 2:
                        await asyncio.sleep(0.02)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            status, body = await answer
            after = await logs.until(2)
        finally:
            for s in sessions.values():
                await s.close()
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    assert [(line["level"], line["parent_pid"], line["generation"]) for line in own] == \
        [("warning", proc.pid, 1)] * 2, own
    assert [(line["event"], line["trigger"], line["generation"]) for line in after] == \
        [("config reloaded", "admin", 2)] * 2, after
    assert (status, body["trigger"], body["generation"]) == (200, "admin", 2), body
    assert len(logs.reloads()) == 2, logs.reloads()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hook", ["SWITCHYARD_TEST_HOLD_AFTER_BUILD", "SWITCHYARD_TEST_HOLD_AFTER_LISTEN"])
async def test_a_sighup_that_comes_while_the_loop_starts_the_gateway_is_one_reload(sims, tmp_path, hook):
    """A SIGHUP that comes once the event loop runs (its app being built, or listening) but before
    the reload's handler is in place is one reload once the gateway serves: not one for the note the
    start-up's handler took and another for the byte the loop's wakeup pipe got."""
    from tests.integration.server.test_stop_starting import config, events, held_gateway
    from tests.support.waiting import release_held

    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path, port, sim.url)
    async with held_gateway(tmp_path, cfg, hook) as (proc, fifo, log_path):
        cfg.write_text(cfg.read_text() + "aliases: [{name: one, targets: [{model: m}]}]\n")
        proc.send_signal(signal.SIGHUP)
        async with asyncio.timeout(10):             # taken by the process, held where it is
            while _pending_sighup(proc.pid):
                await asyncio.sleep(0.001)
        await release_held(fifo)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        async with asyncio.timeout(20):
            while True:
                # a reload the loop's handler takes runs as a task, once the file is left unchanged
                with contextlib.suppress(openai.APIConnectionError, openai.NotFoundError):
                    answer = await client.chat.completions.create(model="one", messages=CHAT, max_tokens=2)
                    break
                await asyncio.sleep(0.02)
        assert answer.model == "m"
        await client.close()
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            page = await r.text()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await proc.wait()
    lines = [(e["event"], e.get("generation")) for e in events(log_path) if str(e.get("event", "")).startswith("config reload")
             and e["event"] != "config reload deferred"]
    assert lines == [("config reloaded", 2)], lines
    assert metric(page, "switchyard_config_generation") == 2
    assert metric(page, "switchyard_config_reload_total", result="ok") == 1


class HeldReads:
    """The config file as a FIFO: a process that reads it (a reload) waits in its read until the
    test writes the file's text, so the test holds a reload between the parent's start of it and
    its end."""

    def __init__(self, path, tmp_path) -> None:
        self.path = path
        self.tmp_path = tmp_path
        self.open: list[int] = []
        self.made = 0

    def fifo(self) -> None:
        """From now on the file is a FIFO: the next process to read it waits."""
        self.made += 1
        fifo = self.tmp_path / f"fifo-{self.made}"
        os.mkfifo(fifo)
        os.replace(fifo, self.path)

    def file(self, text: str) -> None:
        """From now on the file is a plain file again."""
        staged = self.tmp_path / "staged.yaml"
        staged.write_text(text)
        os.replace(staged, self.path)

    async def reader(self) -> int:
        """The write end of the FIFO, once a process opened it to read."""
        async with asyncio.timeout(20):
            while True:
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as e:        # ENXIO: no reader yet
                    if e.errno != errno.ENXIO:
                        raise
                    await asyncio.sleep(0.01)
                    continue
                self.open.append(fd)
                return fd

    def release(self, fd: int, text: str) -> None:
        """The waiting read gets ``text``, then the end of the file."""
        self.open.remove(fd)
        os.set_blocking(fd, True)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def close(self, text: str) -> None:
        self.file(text)
        for fd in self.open:
            os.close(fd)
        self.open.clear()


@pytest.mark.timeout(90)
async def test_an_admin_reload_is_answered_by_the_parents_reload_that_came_after_it(sims, tmp_path):
    """A worker asked POST /admin/reload while the parent was applying a reload it had begun before
    (here a SIGHUP, held in its read of the file) gets that reload's SIGHUP after the ask: the answer
    is the reload the parent begins for the ask (``admin``, the generation after), not that earlier
    one, whose generation the ask's own reload moves a moment later. Every step is held on an
    event: the config file is a FIFO while the parent reads it, and the workers are stopped while
    the parent's reloads are told."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        sessions = await pinned_workers(port, 2)
        (other, _), (asked, asked_http) = sessions.items()

        async def admin() -> tuple[int, dict]:
            async with asked_http.post(f"http://127.0.0.1:{port}/admin/reload",
                                       headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                return r.status, await r.json()

        held = HeldReads(path, tmp_path)
        stopped: list[int] = []
        answer: asyncio.Future | None = None
        try:
            held.fifo()
            proc.send_signal(signal.SIGHUP)             # a reload the parent begins: it reads the file
            first = await held.reader()
            stopped.append(proc.pid)
            await sigstop(proc.pid)
            answer = asyncio.ensure_future(admin())
            async with asyncio.timeout(10):             # the worker asked has told the parent
                while not _pending_sighup(proc.pid):
                    await asyncio.sleep(0.01)
            for pid in (asked, other):                  # they get the first reload's SIGHUP later
                stopped.append(pid)
                await sigstop(pid)
            held.fifo()
            held.release(first, text)
            os.kill(proc.pid, signal.SIGCONT)
            stopped.remove(proc.pid)
            second = await held.reader()                # the first is told; the ask's reload is held
            held.file(text)
            for pid in (asked, other):
                os.kill(pid, signal.SIGCONT)
                stopped.remove(pid)
            first_applied = await logs.until(2)         # each worker applied the first reload
            held.release(second, text)
            status, body = await answer
            after = (await logs.until(4))[2:]
        finally:
            held.close(text)
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            if answer is not None and not answer.done():
                answer.cancel()
            for s in sessions.values():
                await s.close()
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    assert [(line["trigger"], line["generation"]) for line in first_applied] == [("signal", 2)] * 2, first_applied
    assert (status, body.get("trigger"), body.get("generation")) == (200, "admin", 3), body
    assert [(line["trigger"], line["generation"]) for line in after] == [("admin", 3)] * 2, after


@pytest.mark.timeout(90)
async def test_every_worker_applies_the_file_the_parent_read_though_it_changed_before_they_read_it(sims, tmp_path):
    """A reload reads the file once, in the parent, which hands every worker what it read: a file
    rewritten between the parent's read and a worker's (a ConfigMap updated twice in a row, a worker
    busy when the SIGHUP came) cannot leave the workers on different configs under one generation,
    nor a worker the parent restarts on another config than its siblings. Here the workers are
    stopped until the parent has read the file and signalled them, and the file is rewritten before
    each of them goes on."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info")
    path.write_text(text)

    def alias(name: str) -> str:
        return text + f"aliases: [{{name: {name}, targets: [{{model: m}}]}}]\n"

    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        sessions = await pinned_workers(port, 2)
        stopped: list[int] = []
        try:
            first, second = sessions
            for pid in (first, second):
                stopped.append(pid)
                await sigstop(pid)
            path.write_text(alias("one"))
            proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(10):             # the parent has read the file and told both
                while not (_pending_sighup(first) and _pending_sighup(second)):
                    await asyncio.sleep(0.01)
            for n, (pid, name) in enumerate(((first, "two"), (second, "three")), start=1):
                path.write_text(alias(name))
                os.kill(pid, signal.SIGCONT)
                stopped.remove(pid)
                await logs.until(n)                     # this worker applied the reload
            views, digests = {}, {}
            for pid, s in sessions.items():
                async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                    views[pid] = {m["id"] for m in (await r.json())["data"]}
                async with s.get(f"http://127.0.0.1:{port}/status.json",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    config = (await r.json())["gateway"]["config"]
                digests[pid] = (config["generation"], config["digest"])
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            for s in sessions.values():
                await s.close()
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    assert views == {first: {"m", "one"}, second: {"m", "one"}}, views
    assert len(set(digests.values())) == 1 and {g for g, _ in digests.values()} == {2}, digests
    lines = [(line["event"], line.get("trigger"), line.get("generation")) for line in logs.reloads()]
    assert lines == [("config reloaded", "signal", 2)] * 2, lines


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", ["1", "2"])
async def test_an_applied_reload_logs_the_warnings_a_start_logs_once(sims, tmp_path, workers):
    """A reload to a file with a key that does nothing (a limits.models entry naming no model)
    logs the warning a start with that file logs, once: by the one process, or by the parent of
    --workers 2 for all of them (the workers apply the text it read)."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info")
    path.write_text(text + "limits: {models: {m: {rps: 100}}}\n")
    async with gateway_process(path, port, "--workers", workers, "--log-format", "json") as proc:
        logs = LogLines(proc)
        assert len(await worker_views(port, int(workers))) == int(workers)
        path.write_text(text + "limits: {models: {m: {rps: 100}, lama: {rps: 5}}}\n")
        proc.send_signal(signal.SIGHUP)
        await logs.until(int(workers))          # every worker applied it
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    assert [line["event"] for line in logs.reloads()] == ["config reloaded"] * int(workers), logs.reloads()
    warned = [line for line in logs.lines if str(line.get("event", "")).startswith("config: limits.models.")]
    assert [(line["event"], line["level"], line["file"]) for line in warned] == [
        ("config: limits.models.lama: names no model: this limit applies to no request", "warning", str(path))], warned



@pytest.mark.timeout(90)
async def test_reloads_a_worker_applies_as_one_are_each_counted(sims, tmp_path):
    """Two reloads of the parent's that reach a worker as one SIGHUP are applied there once, at the
    second's generation; the reload counter still counts the gateway's two reloads, as the
    generation rose by two, and a refused one after them once. The workers are stopped while the
    parent applies both; the config file is a FIFO while the parent reads it, so each reload is
    known to be told before the next begins."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        pids = list(await worker_views(port, 2))
        held = HeldReads(path, tmp_path)
        stopped: list[int] = []
        try:
            for pid in pids:
                stopped.append(pid)
                await sigstop(pid)
            held.fifo()
            proc.send_signal(signal.SIGHUP)
            reading = await held.reader()
            for name in ("one", "two"):
                held.release(reading, text + f"aliases: [{{name: {name}, targets: [{{model: m}}]}}]\n")
                held.fifo()
                proc.send_signal(signal.SIGHUP)
                reading = await held.reader()       # the reload before this one is told
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
                stopped.remove(pid)
            applied = await logs.until(2)
            held.release(reading, text + "no_such_block: 1\n")
            refused = (await logs.until(5))[2:]     # the parent's line and each worker's
        finally:
            held.close(text)
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        for _ in range(4):
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
                page = await r.text()
            assert metric(page, "switchyard_config_generation") == 3
            assert metric(page, "switchyard_config_reload_total", result="ok") == 2
            assert metric(page, "switchyard_config_reload_total", result="invalid") == 1
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    assert [(line["event"], line["generation"]) for line in applied] == [("config reloaded", 3)] * 2, applied
    assert all("refused" in line["event"] for line in refused), refused


@pytest.mark.timeout(90)
async def test_a_stop_while_the_parent_waits_for_a_fifos_text_at_a_reload_ends_the_gateway(sims, tmp_path):
    """The config file replaced by a FIFO no one writes: the --workers parent's reload waits for its
    text, and a stop meanwhile still ends the gateway (the reload refused, the workers drained,
    the parent gone). Before, the parent kept waiting in its read after it had stopped the
    workers, and only SIGKILL ended it."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url])
    path.write_text(text)
    held = HeldReads(path, tmp_path)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        held.fifo()
        proc.send_signal(signal.SIGHUP)
        await held.reader()             # the parent has the file open, its text not written
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(20):
                code = await proc.wait()
        finally:
            held.close(text)
        await logs.close()
    assert code == 0
    refused = [line for line in logs.reloads() if "restarted workers" in line["event"]]
    assert len(refused) == 1 and refused[0]["key_path"] == "<file>", logs.reloads()


@pytest.mark.timeout(90)
async def test_a_reload_of_one_process_waits_a_bounded_time_for_a_fifos_text(sims, tmp_path):
    """A reload of one process: the config file replaced by a FIFO no one writes refuses the
    reload once its text has not come for ``server.reload_read_timeout_s`` (here 0.5 s; key path
    <file>), and the gateway goes on serving and stops at SIGTERM. Before, the loop waited in the read for as
    long as no one wrote, answering nothing, and only SIGKILL ended the gateway."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], read_timeout_s=0.5)
    path.write_text(text)
    held = HeldReads(path, tmp_path)
    async with gateway_process(path, port, "--workers", "1", "--log-format", "json") as proc:
        logs = LogLines(proc)
        held.fifo()
        proc.send_signal(signal.SIGHUP)
        await held.reader()             # the gateway has the file open, its text not written
        try:
            lines = await logs.until(1)
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/ready") as r:
                assert r.status == 200
        finally:
            held.close(text)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await proc.wait() == 0
        await logs.close()
    assert [(line["event"], line.get("key_path")) for line in lines] == \
        [("config reload refused; the running config is kept", "<file>")], lines
    assert "no text came" in lines[0]["error"], lines


@pytest.mark.timeout(60)
async def test_a_reload_that_changes_the_files_worker_count_is_refused_as_needing_a_restart(sims, tmp_path):
    """``server.workers`` written in the file, with no ``--workers`` on the command line, is read at
    start only: a reload that changes it is refused (409, ``server.workers``), as for the rest of
    ``server``, and the same file with its first count applies. Before, the count the gateway
    started with was laid over the new file's, so the reload was answered ``ok`` with nothing
    changed while the file said another count than the gateway runs."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    auth = f"auth: {{admin_token: {TOKEN}}}\n"

    def text(workers: int) -> str:
        return config_text(port, [sim.url], extra=auth).replace("log_level: warning}",
                                                                f"log_level: warning, workers: {workers}}}")

    path.write_text(text(1))
    async with gateway_process(path, port), aiohttp.ClientSession() as s:
        admin = {"Authorization": f"Bearer {TOKEN}"}
        path.write_text(text(2))
        async with s.post(f"http://127.0.0.1:{port}/admin/reload", headers=admin) as r:
            body = await r.json()
        assert r.status == 409, body
        assert body["error"]["code"] == "restart_required" and body["error"]["param"] == "server.workers", body
        path.write_text(text(1))
        async with s.post(f"http://127.0.0.1:{port}/admin/reload", headers=admin) as r:
            body = await r.json()
        assert r.status == 200 and body["generation"] == 2, body


@pytest.mark.timeout(90)
async def test_an_admin_reload_is_answered_once_every_worker_applied_it(sims, tmp_path):
    """``POST /admin/reload`` that rotates an API key answers once every worker has the new
    config, so the old key is refused by every worker as soon as the answer came. Here the other
    worker is stopped while the parent tells it of the reload: the worker asked has applied it,
    and still waits; once the other runs again and applies it, the answer comes, and neither
    worker takes the old key. Before, the worker asked answered with its own reload alone, and
    the old key still worked on its sibling until that one got to the reload."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"

    def text(key: str) -> str:
        return config_text(port, [sim.url], log_level="info",
                           extra=f"auth: {{admin_token: {TOKEN}, api_keys: [{{key: {key}}}]}}\n")

    path.write_text(text("sk-old-key-0001"))
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        sessions = await pinned_workers(port, 2)
        (asked, asked_http), (other, other_http) = sessions.items()
        spare = (await pinned_workers(port, 2))     # a second connection to the worker asked
        for pid, s in spare.items():
            if pid != asked:
                await s.close()
        asked_spare = spare[asked]
        answer: asyncio.Future | None = None
        try:
            async def status(s: aiohttp.ClientSession, key: str) -> int:
                async with s.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.status

            assert [await status(s, "sk-old-key-0001") for s in (asked_http, other_http)] == [200, 200]
            path.write_text(text("sk-new-key-0002"))
            await sigstop(other)
            try:
                async def admin() -> tuple[int, dict]:
                    async with asked_http.post(f"http://127.0.0.1:{port}/admin/reload",
                                               headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                        return r.status, await r.json()
                answer = asyncio.ensure_future(admin())
                applied = await logs.until(1)           # the worker asked applied it; the other is stopped
                async with asked_spare.get(f"http://127.0.0.1:{port}/health") as r:
                    assert r.status == 200              # the worker asked serves while it waits
                await asyncio.sleep(0.2)
                assert not answer.done()
            finally:
                os.kill(other, signal.SIGCONT)
            status_code, body = await answer
            assert (status_code, body["generation"]) == (200, 2), body
            for s in (asked_http, other_http):
                assert await status(s, "sk-old-key-0001") == 401
                assert await status(s, "sk-new-key-0002") == 200
        finally:
            os.kill(other, signal.SIGCONT)
            if answer is not None and not answer.done():
                answer.cancel()
            for s in (*sessions.values(), asked_spare):
                await s.close()
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    assert [line["event"] for line in applied] == ["config reloaded"], applied


@pytest.mark.timeout(90)
async def test_requests_are_answered_while_a_reload_of_one_process_reads_and_parses_the_file(sims, tmp_path):
    """A reload reads and parses the file off the event loop (a file near the 4 MiB bound takes
    seconds to parse): requests go on being answered meanwhile. Here the read is held: the file is
    a FIFO whose text comes a line at a time, until a chat request sent after the reload began has
    its answer. Before, the loop was in the reload's read, and the request waited for the reload."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], log_level="info")
    path.write_text(text)
    held = HeldReads(path, tmp_path)
    async with gateway_process(path, port, "--workers", "1", "--log-format", "json") as proc:
        logs = LogLines(proc)
        held.fifo()
        proc.send_signal(signal.SIGHUP)
        fd = await held.reader()            # the reload has the file open and waits for its text
        events: list[str] = []
        answered = asyncio.Event()

        async def trickle() -> None:
            try:
                for _ in range(100):        # a blank line each 0.1 s: the read waits for more text
                    if answered.is_set():
                        break
                    os.write(fd, b"\n")
                    await asyncio.sleep(0.1)
                events.append("the file's text written")
            finally:
                held.release(fd, text)

        writer = asyncio.ensure_future(trickle())
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                              json={"model": "m", "messages": CHAT, "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
            events.append("request answered")
            answered.set()
        await writer
        lines = await logs.until(1)
        held.close(text)
    assert events == ["request answered", "the file's text written"]
    assert [(line["event"], line["generation"]) for line in lines] == [("config reloaded", 2)], lines


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", [1, 2])
async def test_a_reload_waits_until_a_file_written_in_place_is_whole(sims, tmp_path, workers):
    """A file written in place in two steps (an editor that truncates it then writes, ``kubectl
    cp``) and a SIGHUP between them: the first half is valid YAML (the list of endpoints cut after
    the first), and applied it removed the second endpoint (a dropped endpoint until the next reload). The reload waits until the file has
    been left unchanged for ``server.reload_settle_s`` (here the second half is held back, a
    blank line added each 20 ms, until the reload says it waits), logs that it was deferred,
    counts it, and applies the whole file; with ``--workers`` the parent, which reads the file for
    every worker, waits, and every worker counts it."""
    a, b = await sims("vllm", "m"), await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    head = (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: info}\n"
            "health: {interval_s: 0.5}\n"
            "models:\n  - name: m\n    engine: vllm\n    endpoints:\n")
    path.write_text(head + f"      - {a.url}\n      - {b.url}\n")
    async with gateway_process(path, port, "--workers", str(workers), "--log-format", "json") as proc:
        logs = LogLines(proc)
        with open(path, "w") as f:          # in place: truncated, then the first half
            f.write(head + f"      - {a.url}\n")
            f.flush()
            proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(20):
                while not [line for line in logs.lines if str(line.get("event", "")).startswith("config reload")]:
                    f.write("\n")           # a writer still at work: the file changes
                    f.flush()
                    await asyncio.sleep(0.02)
            f.write(f"      - {b.url}\naliases: [{{name: chat, targets: [{{model: m}}]}}]\n")
        await logs.until(workers)
        pages = await per_worker(port, workers)
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    applied = [line for line in logs.lines if line.get("event") == "config reloaded"]
    assert [(line["generation"], line["changed"], line["endpoints_removed"]) for line in applied] == \
        [(2, ["aliases"], [])] * workers, applied
    deferred = [line for line in logs.lines if line.get("event") == "config reload deferred"]
    assert len(deferred) == 1 and deferred[0]["trigger"] == "signal", logs.lines
    assert [metric(page, "switchyard_config_reload_deferred_total") for page in pages.values()] == [1] * workers


@pytest.mark.timeout(90)
async def test_a_worker_that_dies_while_the_parent_reads_the_file_for_a_reload_is_started_again(sims, tmp_path):
    """The --workers parent reads (and parses) the file of a reload while it goes on watching its
    workers: one that dies meanwhile is started again, and applies the reload with its sibling once
    the read ends. Here the file is a FIFO whose text the test holds back until the worker killed
    was started again. Before, the parent read the file in its SIGHUP handler, its watch stopped
    meanwhile: the dead worker was started again only once the reload was over (a file of a few
    MiB takes seconds to parse; a FIFO no one writes, never)."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info")
    path.write_text(text)
    held = HeldReads(path, tmp_path)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        pids = set(await worker_views(port, 2))
        try:
            held.fifo()
            proc.send_signal(signal.SIGHUP)
            reading = await held.reader()       # the parent's reload waits for the file's text
            killed = min(pids)
            os.kill(killed, signal.SIGKILL)
            async with asyncio.timeout(20):     # started again while the read still waits
                while not [line for line in logs.lines if line.get("event") == "worker restarting"]:
                    await asyncio.sleep(0.02)
                while len(serving := set(await worker_views(port, 2))) < 2 or killed in serving:
                    await asyncio.sleep(0.05)
            held.file(text)
            held.release(reading, text + "aliases: [{name: one, targets: [{model: m}]}]\n")
            applied = await logs.until(2)
            views = await worker_views(port, 2)
        finally:
            held.close(text)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            code = await proc.wait()
        await logs.close()
    assert code == 0
    assert [(line["event"], line["generation"]) for line in applied] == [("config reloaded", 2)] * 2, applied
    assert len(views) == 2 and killed not in views and all(v == {"m", "one"} for v in views.values()), views


@pytest.mark.timeout(90)
async def test_an_admin_reload_still_under_way_when_its_wait_ends_is_answered_202_and_then_applied(sims, tmp_path):
    """``POST /admin/reload`` with --workers 2 whose reload is still under way when
    ``server.admin_reload_wait_s`` is over (a file of a few MiB parsing in the parent, then in each
    worker) is answered 202 ``in_progress`` with the generation still serving, and the reload then
    applies in every worker. Here the parent's read is held: the file is a FIFO whose text the test
    writes once the answer came. Before, the answer was 504 reload_timeout, which says the reload
    did not happen, and the reload then applied."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info").replace(
        "reload_settle_s: 0,", "reload_settle_s: 0, admin_reload_wait_s: 1,")
    path.write_text(text)
    held = HeldReads(path, tmp_path)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        await worker_views(port, 2)
        try:
            held.fifo()
            async with aiohttp.ClientSession() as s:
                async def admin() -> tuple[int, dict]:
                    async with s.post(f"http://127.0.0.1:{port}/admin/reload",
                                      headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                        return r.status, await r.json()
                answer = asyncio.ensure_future(admin())
                reading = await held.reader()       # the parent's read waits for the file's text
                status, body = await answer
            held.file(text)
            held.release(reading, text + "aliases: [{name: one, targets: [{model: m}]}]\n")
            applied = await logs.until(2)
            views = await worker_views(port, 2)
        finally:
            held.close(text)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await proc.wait() == 0
        await logs.close()
    assert (status, body.get("result"), body.get("trigger"), body.get("generation")) == \
        (202, "in_progress", "admin", 1), (status, body)
    assert [(line["event"], line["trigger"], line["generation"]) for line in applied] == \
        [("config reloaded", "admin", 2)] * 2, applied
    assert len(views) == 2 and all(v == {"m", "one"} for v in views.values()), views


@pytest.mark.timeout(90)
async def test_an_admin_reload_a_sibling_has_not_applied_when_its_wait_ends_is_answered_202(sims, tmp_path):
    """``POST /admin/reload`` that rotates an API key, with --workers 2: the worker asked applied
    it, its sibling has not when ``server.admin_reload_wait_s`` is over (here it is stopped; a file
    of a few MiB still parsing there is the same): the answer is 202 ``in_progress`` with the new
    generation, since the old key still works on that sibling, and the warning names the wait.
    Before, the answer was 200 ok, which says every worker refuses the old key."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"

    def text(key: str) -> str:
        return config_text(port, [sim.url], log_level="info",
                           extra=f"auth: {{admin_token: {TOKEN}, api_keys: [{{key: {key}}}]}}\n").replace(
            "reload_settle_s: 0,", "reload_settle_s: 0, admin_reload_wait_s: 1,")

    path.write_text(text("sk-old-key-0001"))
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        sessions = await pinned_workers(port, 2)
        (asked, asked_http), (other, other_http) = sessions.items()
        try:
            path.write_text(text("sk-new-key-0002"))
            await sigstop(other)
            try:
                async with asked_http.post(f"http://127.0.0.1:{port}/admin/reload",
                                           headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    status, body = r.status, await r.json()
            finally:
                os.kill(other, signal.SIGCONT)
            await logs.until(2)
        finally:
            for s in sessions.values():
                await s.close()
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await logs.close()
    assert (status, body.get("result"), body.get("generation")) == (202, "in_progress", 2), (status, body)
    warned = [line for line in logs.lines if line.get("event") == "POST /admin/reload answered before every worker applied the reload"]
    assert len(warned) == 1 and warned[0]["waited_s"] == 1, warned


@pytest.mark.timeout(90)
async def test_an_admin_reload_the_stopped_parent_has_not_begun_is_answered_202_queued_and_then_applied(sims, tmp_path):
    """``POST /admin/reload`` with --workers 2 while the parent is stopped (SIGSTOP; a parent busy
    elsewhere is the same): when ``server.admin_reload_wait_s`` is over the parent has not begun
    the reload, which stays asked for (its SIGHUP pending), so the answer is 202 ``queued`` with
    the generation still serving, and once the parent runs again every worker applies it."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info").replace(
        "reload_settle_s: 0,", "reload_settle_s: 0, admin_reload_wait_s: 0.5,")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        await worker_views(port, 2)
        path.write_text(text + "aliases: [{name: one, targets: [{model: m}]}]\n")
        await sigstop(proc.pid)
        try:
            async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/admin/reload",
                                                            headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                status, body = r.status, await r.json()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        applied = await logs.until(2)
        views = await worker_views(port, 2)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await proc.wait() == 0
        await logs.close()
    assert (status, body.get("result"), body.get("trigger"), body.get("generation")) == \
        (202, "queued", "admin", 1), (status, body)
    assert "server.admin_reload_wait_s" in body["message"] and "/status.json" in body["message"], body
    assert [(line["event"], line["trigger"], line["generation"]) for line in applied] == \
        [("config reloaded", "admin", 2)] * 2, applied
    assert len(views) == 2 and all(v == {"m", "one"} for v in views.values()), views


@pytest.mark.timeout(90)
async def test_a_reload_whose_fifo_the_parent_waits_for_is_refused_after_a_bounded_time(sims, tmp_path):
    """The config file replaced by a FIFO no one writes, with --workers 2: the parent's read of a
    reload is refused once no text has come for ``server.reload_read_timeout_s`` (here 0.5 s), logged with
    key path <file> by the parent and every worker and counted as invalid, the running config
    kept; the next reload of a plain file applies."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], log_level="info", read_timeout_s=0.5)
    path.write_text(text)
    held = HeldReads(path, tmp_path)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        await worker_views(port, 2)
        try:
            held.fifo()
            proc.send_signal(signal.SIGHUP)
            await held.reader()             # the parent has the file open, its text not written
            refused = await logs.until(3)
        finally:
            held.close(text + "aliases: [{name: one, targets: [{model: m}]}]\n")
        page = await per_worker(port, 2)
        proc.send_signal(signal.SIGHUP)
        applied = (await logs.until(5))[3:]
        views = await worker_views(port, 2)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await proc.wait() == 0
        await logs.close()
    assert sorted(line["event"] for line in refused) == [
        "config reload refused, restarted workers keep the running config"] + \
        ["config reload refused; the running config is kept"] * 2, refused
    assert all(line["key_path"] == "<file>" and "no text came in 0.5 s" in line["error"] for line in refused), refused
    for text_ in page.values():
        assert metric(text_, "switchyard_config_reload_total", result="invalid") == 1
        assert metric(text_, "switchyard_config_generation") == 1
    assert [(line["event"], line["generation"]) for line in applied] == [("config reloaded", 2)] * 2, applied
    assert len(views) == 2 and all(v == {"m", "one"} for v in views.values()), views


@pytest.mark.timeout(90)
async def test_an_admin_reload_to_a_worker_whose_parent_was_killed_is_refused_503_and_signals_no_one(sims, tmp_path):
    """The --workers parent killed outright (SIGKILL, the OOM killer): each worker drains, and
    still takes requests for ``server.drain_delay_s``. ``POST /admin/reload`` then has no parent to
    read the file for every worker: it is answered 503 ``reload_unavailable``, OpenAI-shaped, and
    no signal is sent to the pid the parent had (which the system may give another process)."""
    sim = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    text = config_text(port, [sim.url], extra=f"auth: {{admin_token: {TOKEN}}}\n", log_level="info").replace(
        "drain_delay_s: 0,", "drain_delay_s: 2,")
    path.write_text(text)
    async with gateway_process(path, port, "--workers", "2", "--log-format", "json") as proc:
        logs = LogLines(proc)
        sessions = await pinned_workers(port, 2)
        try:
            proc.kill()
            async with asyncio.timeout(20):     # reaped (its workers still hold its stderr): its pid names no process
                while proc.returncode is None:
                    await asyncio.sleep(0.01)
            answers = []
            for http in sessions.values():
                async with http.post(f"http://127.0.0.1:{port}/admin/reload",
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    answers.append((r.status, await r.json()))
        finally:
            for s in sessions.values():
                await s.close()
        for pid in sessions:        # a second stop: each ends its drain at once
            os.kill(pid, signal.SIGTERM)
        await logs.close()          # the workers ended: their stderr closed
    assert [(status, body["error"]["code"]) for status, body in answers] == [(503, "reload_unavailable")] * 2, answers
    assert not [line for line in logs.lines if line.get("event") == "internal error"], logs.lines


@pytest.mark.timeout(90)
async def test_every_worker_forgets_the_prefix_entries_of_an_engine_a_sighup_removed(sims, tmp_path):
    """Each worker's prefix index holds every worker's insertions (the shared view); an engine a
    reload removes leaves every worker's index, so ``switchyard_prefix_index_entries`` (the largest
    of the workers') counts the entries of the engine kept only."""
    from tests.support.gateway_process import per_worker

    a, b = [await sims("vllm", "m") for _ in range(2)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    routing = "routing: {strategy: prefix-cache, prefix_block_chars: 64}\n"
    path.write_text(config_text(port, [a.url, b.url], extra=routing))
    async with gateway_process(path, port, "--workers", "2") as proc:
        url = f"http://127.0.0.1:{port}"
        on_a = 0
        for i in range(8):          # prompts of 4 blocks each, on fresh connections (either worker routes each)
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s, s.post(url + "/v1/completions", json={
                    "model": "m", "prompt": f"prompt {i}: " + "x" * 256, "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
                on_a += r.headers["target-pod"] == a.url.removeprefix("http://")

        async def entries() -> list[float]:
            return [metric(text, "switchyard_prefix_index_entries") for text in (await per_worker(port, 2)).values()]

        for _ in range(200):
            if await entries() == [32.0, 32.0]:
                break
            await asyncio.sleep(0.05)
        assert await entries() == [32.0, 32.0]
        path.write_text(config_text(port, [a.url], extra=routing))
        proc.send_signal(signal.SIGHUP)
        for _ in range(200):
            if await entries() == [4.0 * on_a] * 2:
                break
            await asyncio.sleep(0.05)
        assert await entries() == [4.0 * on_a] * 2
