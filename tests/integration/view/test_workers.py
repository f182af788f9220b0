"""``--workers 2``: the workers route on one view (prefix index, sessions, in-flight counts).

A real ``python -m gateway --workers 2`` in front of simulated engines; every request on a new
connection, so the kernel spreads them over both workers. Without the shared view, a worker that
did not route a conversation's earlier turns would not know where its prefix is, and a session's
requests would scatter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.view.service import watcher_of
from tests.support.gateway_process import (
    gateway_process,
    get_new,
    kill_a_worker,
    metric_total,
    per_worker,
    post_new,
)
from tests.support.http import sim_state
from tests.support.ports import listen_port
from tests.support.waiting import until

SYSTEM = "You are the switchyard's dispatcher; keep every train on its own track. " * 8


def config(port: int, urls: list[str], extra: str = "") -> str:
    eps = ", ".join(f"'{u}'" for u in urls)
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
            "health: {interval_s: 0.5}\n"
            "routing: {strategy: prefix-cache, prefix_block_chars: 64}\n"
            f"models: [{{name: m, engine: vllm, endpoints: [{eps}]}}]\n{extra}")


async def converse(port: int, turns: int, tag: str, headers: dict[str, str] | None = None) -> list[str]:
    """A conversation's turns, each on a new connection; the engine of each turn."""
    messages = [{"role": "system", "content": f"{tag}: {SYSTEM}"}]
    served = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: which track does the {tag} train take? " * 2})
        status, head, body = await post_new(port, "/v1/chat/completions",
                                            {"model": "m", "messages": messages, "max_tokens": 4}, headers)
        assert status == 200, body
        served.append(head["target-pod"])
        messages.append(body["choices"][0]["message"])
    return served


@pytest.mark.timeout(120)
async def test_a_conversation_stays_on_the_engine_of_its_first_turn_across_workers(sims, tmp_path):
    engines = [await sims("vllm", "m") for _ in range(4)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines]))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        for c in range(4):
            served = await converse(port, 6, f"conversation {c}")
            assert len(set(served)) == 1, served          # the prefix learned on one worker, used by the other
        pages = await per_worker(port, 2)
    # both workers routed turns and applied the other's insertions
    for page in pages.values():
        assert metric_total(page, "switchyard_view_facts_applied_total", source="worker", kind="insert") > 0
        assert metric_total(page, "switchyard_view_lag_seconds_count", source="worker") > 0


@pytest.mark.timeout(120)
async def test_session_keyed_requests_stay_on_one_engine_across_workers(sims, tmp_path):
    engines = [await sims("vllm", "m") for _ in range(4)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines]))
    sessions, turns = 6, 6
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        for s in range(sessions):
            served = []
            for t in range(turns):
                # shorter than one prefix block: only the session map can keep them together
                status, head, body = await post_new(port, "/v1/chat/completions",
                                                    {"model": "m", "messages": [{"role": "user", "content": f"hi {t}"}],
                                                     "max_tokens": 2}, {"x-session-key": f"agent-{s}"})
                assert status == 200, body
                served.append(head["target-pod"])
            assert len(set(served)) == 1, (s, served)
        pages = await per_worker(port, 2)
    # /metrics is the whole gateway's, whichever worker answers
    assert all(metric_total(p, "switchyard_routing_session_total", outcome="kept") == sessions * (turns - 1)
               for p in pages.values())
    assert all(metric_total(p, "switchyard_view_facts_applied_total", source="worker", kind="session") > 0
               for p in pages.values())


@pytest.mark.timeout(120)
async def test_the_openai_clients_prompt_cache_key_keeps_a_conversation_on_one_engine_across_workers(sims, tmp_path):
    """OpenAI's ``prompt_cache_key`` (Codex sets it to its conversation's id) names the session: the
    turns of one key stay on one engine whichever worker takes them, and the engine gets the field
    as the client sent it."""
    import httpx2
    from openai import AsyncOpenAI

    engines = [await sims("vllm", "m") for _ in range(4)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines]))
    sessions, turns = 4, 5
    # no keep-alive: every turn on a new connection, so the kernel spreads them over both workers
    http = httpx2.AsyncClient(limits=httpx2.Limits(max_keepalive_connections=0))
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, http_client=http)
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        try:
            for s in range(sessions):
                served = []
                for t in range(turns):
                    # shorter than one prefix block: only the session map can keep them together
                    raw = await client.chat.completions.with_raw_response.create(
                        model="m", max_tokens=2, messages=[{"role": "user", "content": f"hi {t}"}],
                        prompt_cache_key=f"conv-{s}")
                    assert raw.parse().choices[0].message.content
                    served.append(raw.headers["target-pod"])
                assert len(set(served)) == 1, (s, served)
            pages = await per_worker(port, 2)
        finally:
            await client.close()
    assert all(metric_total(p, "switchyard_routing_session_total", outcome="kept") == sessions * (turns - 1)
               for p in pages.values())
    keys = [r["body"]["prompt_cache_key"] for e in engines for r in (await sim_state(e.url))["received"]
            if r["path"] == "/v1/chat/completions"]
    assert sorted(keys) == sorted(f"conv-{s}" for s in range(sessions) for _ in range(turns))


@pytest.mark.timeout(120)
async def test_each_worker_sees_the_requests_in_flight_on_the_other(sims, tmp_path):
    engines = [await sims("vllm", "m", itl_ms=50.0) for _ in range(2)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines]).replace("prefix-cache", "least-request"))
    streams = 6
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) for _ in range(streams)]
        responses = []
        try:
            for s in sessions:     # long streams, each on its own connection: both workers hold some
                r = await s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json={"model": "m", "messages": [{"role": "user", "content": "go"}],
                                       "max_tokens": 2000, "stream": True, "ignore_eos": True})
                assert r.status == 200
                responses.append(r)

            async def everyone_sees(total: int) -> bool:
                # the status page is the gateway's, whichever worker answers: its own requests plus
                # its siblings', none of them counted as another replica's
                views = await per_worker(port, 2, "/status.json")
                counts = [sum(ep["in_flight"] for ep in v["endpoints"]) for v in views.values()]
                remote = [sum(ep["remote_in_flight"] for ep in v["endpoints"]) for v in views.values()]
                return all(c == total for c in counts) and not any(remote)

            await until(lambda: everyone_sees(streams), timeout=20)
            # and each worker's own routing saw its sibling's requests: the load facts it applied
            pages = await per_worker(port, 2)
            assert all(metric_total(p, "switchyard_view_facts_applied_total", source="worker", kind="load") > 0
                       for p in pages.values())
        finally:
            for r in responses:
                r.close()
            for s in sessions:
                with contextlib.suppress(Exception):
                    await s.close()
        await until(lambda: everyone_sees(0), timeout=20)
        await asyncio.sleep(0)


async def responses_chains(ports: list[int], chains: int, steps: int) -> None:
    """Chains of ``previous_response_id``, each step on a new connection to ``ports[step % len]``;
    every step of a chain on one engine."""
    for chain in range(chains):
        prev, served = None, []
        for t in range(steps):
            body = {"model": "m", "input": f"chain {chain} step {t}", "max_output_tokens": 4}
            if prev is not None:
                body["previous_response_id"] = prev
            status, head, answer = await post_new(ports[t % len(ports)], "/v1/responses", body)
            assert status == 200, answer
            served.append(head["target-pod"])
            prev = answer["id"]
        assert len(set(served)) == 1, served


@pytest.mark.timeout(120)
async def test_a_responses_chain_in_engine_state_is_followed_by_either_worker(sims, tmp_path):
    """Engine state, memory backend: the follow-up must reach the engine holding the response, and
    the worker it lands on finds it in the shared view (a session kept)."""
    engines = [await sims("vllm", "m", enable_responses_store=True) for _ in range(4)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines], "responses: {state: engine}\n"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        await responses_chains([port], 3, 6)
        pages = await per_worker(port, 2)
    assert all(metric_total(p, "switchyard_routing_session_total", outcome="kept") == 3 * 5 for p in pages.values())


@pytest.mark.timeout(120)
async def test_on_kv_events_a_worker_finds_the_tokens_its_sibling_made(sims, tmp_path):
    """KV-events routing, the openai SDK asking for no keep-alive (the kernel picks a worker per call):
    the prompt segments one worker tokenized reach the other's token cache, and a conversation
    stays on the engine that holds it whichever worker takes each turn."""
    import openai

    from enginesim.tiny_tokenizer import TINY_DIR

    tok = str(TINY_DIR)
    engines = [await sims("vllm", model="m", tokenizer=tok, kv_events_port=0, kv_events_replay_port=0,
                          kv_blocks=4096) for _ in range(2)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    eps = ", ".join(f"'{e.url}'" for e in engines)
    eps = ", ".join(f"{{url: '{e.url}', kv_events: {{port: {e.engine.kv_events.port}, "
                    f"replay_port: {e.engine.kv_events.replay_port}}}}}" for e in engines)
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
        "health: {interval_s: 0.5}\n"
        f"models: [{{name: m, engine: vllm, strategy: prefix-cache, tokenizer: '{tok}', endpoints: [{eps}],\n"
        "  kv_events: {enabled: true, stall_timeout_s: 5.0}}]\n")
    system = "You are the yard master; " + " ".join(f"track {i} takes freight {i % 7}" for i in range(150))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                    default_headers={"Connection": "close"})
        try:
            # both workers subscribed to both engines' events (events published before a subscriber
            # connects never reach it)
            await until(lambda: all(e.engine.kv_events.subscriptions >= 2 for e in engines), timeout=20)
            for c in range(3):
                messages = [{"role": "system", "content": f"conversation {c}. {system}"}]
                served = []
                for turn in range(6):
                    messages.append({"role": "user", "content": f"turn {turn}: where does train {c} go next?"})
                    raw = await client.chat.completions.with_raw_response.create(
                        model="m", messages=messages, max_tokens=4)
                    served.append(raw.headers["target-pod"])
                    messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
                assert len(set(served)) == 1, served
        finally:
            await client.close()
        pages = await per_worker(port, 2)
    # a worker cached segments its sibling tokenized, and both routed on events (no fallback to the
    # approximate index for want of tokens)
    assert sum(metric_total(p, "switchyard_view_facts_applied_total", source="worker", kind="tokens")
               for p in pages.values()) > 0
    assert all(metric_total(p, "switchyard_kv_events_fallbacks_total", reason="tokenize_error") == 0
               for p in pages.values())


@pytest.mark.timeout(120)
async def test_two_workers_probe_scrape_and_read_each_engines_adapters_once_per_interval_not_once_per_worker(
        sims, tmp_path):
    from enginesim.server import RECEIVED_KEY
    from tests.integration.server.test_workers import children_of, own_metrics, sibling_sockets
    engines = [await sims("vllm", "m", enable_lora=True, lora_modules=(f"ad{i}=/loras/ad{i}",)) for i in range(3)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines])
                    .replace("health: {interval_s: 0.5}", "health: {interval_s: 0.2}\nscrape: {interval_s: 0.2}\n"
                             "lora: {discovery_interval_s: 0.2}"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2) as proc:
        # each worker's first rounds are its own, until it hears the watcher's; then the watcher's
        # alone: settled once, between two reads of each worker's own counts (not the merged page),
        # each engine was probed and scraped twice or more by one worker and not at all by the other
        sockets = sibling_sockets(children_of(proc.pid))
        assert len(sockets) == 2, sockets

        async def rounds() -> dict:
            pages = {pid: await own_metrics(sock) for pid, sock in sockets.items()}
            return {(pid, kind, e.url): metric_total(page, name, endpoint=e.url.removeprefix("http://"))
                    for pid, page in pages.items() for e in engines
                    for kind, name in (("probe", "switchyard_health_probes_total"),
                                       ("scrape", "switchyard_engine_scrapes_total"))}

        async def settled(last: list) -> bool:
            now = await rounds()
            was, last[:] = (last[0] if last else None), [now]
            if was is None:
                return False
            grew = {k: now[k] - was[k] for k in now}
            return all(min(grew[(pid, kind, e.url)] for pid in sockets) == 0
                       and max(grew[(pid, kind, e.url)] for pid in sockets) >= 2
                       for kind in ("probe", "scrape") for e in engines)
        last: list = []
        await until(lambda: settled(last), timeout=30, interval=0.5)
        # the window is ten of the watchers' rounds, counted, not 2 s of a clock a busy machine stretches
        before = await rounds()
        for e in engines:
            e.app[RECEIVED_KEY].clear()

        async def watchers_made(n: int) -> dict | None:
            now = await rounds()
            made = {(kind, e.url): max(now[(pid, kind, e.url)] - before[(pid, kind, e.url)] for pid in sockets)
                    for kind in ("probe", "scrape") for e in engines}
            return made if min(made.values()) >= n else None
        made = await until(lambda: watchers_made(10), timeout=30, interval=0.1)
        got = [{p: sum(r["path"] == p for r in e.app[RECEIVED_KEY]) for p in ("/metrics", "/health", "/v1/models")}
               for e in engines]
        pages = {pid: await own_metrics(sock) for pid, sock in sockets.items()}
        listed = await per_worker(port, 2, "/v1/models")
    # one round per interval reaches each engine (as many as its watcher made, ten or a few more
    # by the time they are read; discovery's on a timer of the same period), where each worker's
    # own rounds made twice that
    rounds_made = max(made.values())
    for counts in got:
        assert all(2 <= n <= rounds_made + 3 for n in counts.values()), (got, made)
    # each worker adopted its sibling's snapshots, probes and lists (its own page, not the merged
    # one); when one worker happens to watch all three engines (a hash of their random ports), only
    # its sibling has any to adopt
    split = len({watcher_of(f"m|{e.url}", 2) for e in engines}) == 2
    for kind in ("scrape", "probe", "models"):
        applied = [metric_total(page, "switchyard_view_facts_applied_total", source="worker", kind=kind)
                   for page in pages.values()]
        assert (all if split else any)(n > 0 for n in applied), (kind, applied)
    for answer in listed.values():                # every worker knows every engine's adapter, asked or told
        assert {"ad0", "ad1", "ad2"} <= {m["id"] for m in json.loads(answer)["data"]}, answer


async def first_turns(port: int, tags: list[str]) -> dict[str, tuple[str, list[dict]]]:
    """Each conversation's first turn (a session-keyed one-liner and a prompt of its own): its engine
    and its messages so far."""
    out = {}
    for tag in tags:
        messages = [{"role": "system", "content": f"{tag}: {SYSTEM}"}, {"role": "user", "content": f"where does {tag} go?"}]
        status, head, body = await post_new(port, "/v1/chat/completions",
                                            {"model": "m", "messages": messages, "max_tokens": 4}, {"x-session-key": tag})
        assert status == 200, body
        out[tag] = (head["target-pod"], [*messages, body["choices"][0]["message"]])
    return out


async def moved_on_next_turns(port: int, started: dict[str, tuple[str, list[dict]]], turns: int) -> list[str]:
    """The conversations whose next turns (each on a new connection) went elsewhere than their first:
    a session's one-liner (only the session map knows it) and the prompt's next turn (the prefix index)."""
    moved = []
    for tag, (engine, messages) in started.items():
        for t in range(turns):
            status, head, body = await post_new(port, "/v1/chat/completions",
                                                {"model": "m", "messages": [{"role": "user", "content": f"hi {t}"}],
                                                 "max_tokens": 2}, {"x-session-key": tag})
            assert status == 200, body
            if head["target-pod"] != engine:
                moved.append(f"{tag} session turn {t}: {engine} -> {head['target-pod']}")
            longer = [*messages, {"role": "user", "content": f"and turn {t} of {tag}?"}]
            status, head, body = await post_new(port, "/v1/chat/completions",
                                                {"model": "m", "messages": longer, "max_tokens": 2})
            assert status == 200, body
            if head["target-pod"] != engine:
                moved.append(f"{tag} prompt turn {t}: {engine} -> {head['target-pod']}")
    return moved


@pytest.mark.timeout(120)
async def test_a_restarted_worker_catches_up_on_the_sessions_and_prefixes_its_siblings_know(sims, tmp_path):
    """A worker killed outright and started again by the parent knows, before it serves, where the
    conversations routed before its death went: without that, the next turns it took scattered."""
    engines = [await sims("vllm", "m") for _ in range(4)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines]))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2) as proc:
        started = await first_turns(port, [f"agent {i}" for i in range(10)])
        assert len({engine for engine, _ in started.values()}) > 1
        await kill_a_worker(proc, port)
        moved = await moved_on_next_turns(port, started, 2)
        assert not moved, moved
        pages = await per_worker(port, 2)
    assert all(metric_total(p, "switchyard_view_catch_ups_total", reason="start", result="applied") >= 1
               for p in pages.values())


@pytest.mark.timeout(120)
async def test_a_worker_stopped_while_its_sibling_routes_catches_up_on_what_it_missed(sims, tmp_path):
    """A worker whose event loop does not run (SIGSTOP here; a long stall alike) lets its bus queue
    fill, and its sibling's insertions and sessions beyond it are lost on the way: once it runs
    again it notices the gap in the sibling's batches and catches up, so the conversations the
    sibling routed meanwhile stay on their engines whichever worker takes their next turns."""
    from tests.integration.server.test_workers import children_of

    queue = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    engines = [await sims("vllm", "m") for _ in range(4)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines]))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2) as proc:
        victim = children_of(proc.pid)[0]
        os.kill(victim, signal.SIGSTOP)
        started: dict[str, tuple[str, list[dict]]] = {}
        waiting = []
        try:
            # each first turn on a new connection: those the kernel hands the stopped worker wait for
            # it, the others are routed by its sibling, a batch of facts each
            async def begin(tag: str) -> None:
                started.update(await first_turns(port, [tag]))

            n = 0
            while len(started) < 3 * queue:
                waiting.append(asyncio.ensure_future(begin(f"conversation {n}")))
                n += 1
                await asyncio.sleep(0.02)
            served_meanwhile = dict(started)
        finally:
            os.kill(victim, signal.SIGCONT)
        await asyncio.gather(*waiting)
        page = (await per_worker(port, 2)).popitem()[1]
        assert metric_total(page, "switchyard_view_messages_dropped_total", reason="peer_full") > 0
        moved = await moved_on_next_turns(port, served_meanwhile, 1)
        assert not moved, moved
        pages = await per_worker(port, 2)
    assert all(metric_total(p, "switchyard_view_catch_ups_total", reason="gap", result="applied") >= 1
               for p in pages.values())


def lint(page: str) -> list[str]:
    """What ``promtool check metrics`` (promlint) says of an exposition's families about the names
    and labels reserved to histograms and summaries, counters' suffix and help texts."""
    problems = []
    for fam in text_string_to_metric_families(page):
        labels = {name for s in fam.samples for name in s.labels}
        if fam.type != "summary" and "quantile" in labels:
            problems.append(f'{fam.name}: non-summary metrics should not have "quantile" label')
        if fam.type != "histogram" and "le" in labels:
            problems.append(f'{fam.name}: non-histogram metrics should not have "le" label')
        if not fam.documentation:
            problems.append(f"{fam.name}: no help text")
    return problems


@pytest.mark.timeout(60)
async def test_the_merged_exposition_keeps_the_labels_prometheus_reserves(sims, tmp_path):
    engine = await sims("vllm", "m")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [engine.url]))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        await converse(port, 2, "lint")

        async def lag_shown() -> str | None:     # the workers' batches to each other: the recent lag
            page = (await get_new(port, "/metrics"))[1]
            return page if "switchyard_view_lag_recent_seconds{" in page else None

        page = await until(lag_shown)
    assert lint(page) == []


@pytest.mark.timeout(120)
async def test_one_ejection_counts_one_transition_whichever_workers_ejected_or_adopted_it(sims, tmp_path):
    good = await sims("vllm", "m")
    sick = await sims("vllm", "m", fault="status=500")
    sick_name = sick.url.split("//")[1]
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
                   "routing: {strategy: round-robin}\n"
                   "breaker: {consecutive_faults: 1, base_ejection_s: 300, max_ejection_percent: 50}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sick.url}', '{good.url}']}}]\n")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        async def open_in_both() -> bool:
            assert (await post_new(port, "/v1/chat/completions", body))[0] == 200    # the sick one's 500 retried
            docs = await per_worker(port, 2, "/status.json")
            return all(ep["breaker"] == "open" for doc in docs.values() for ep in doc["endpoints"]
                       if ep["name"] == sick_name)
        await until(open_in_both, timeout=20)
        for page in (await per_worker(port, 2)).values():      # whichever worker answers
            assert metric_total(page, "switchyard_breaker_transitions_total", endpoint=sick_name,
                                from_state="closed", to_state="open") == 1
            assert metric_total(page, "switchyard_breaker_state", endpoint=sick_name) == 1


@pytest.mark.timeout(120)
async def test_a_full_session_map_drops_the_same_least_recently_seen_session_in_both_workers(sims, tmp_path):
    """With the session map full, the session a new one pushes out is the least recently seen by the
    gateway, not by one worker: a session whose turns keep reaching one worker (its keep-alive
    connection) stays in its sibling's copy too, and its next turn there is kept on its engine."""
    engines = [await sims("vllm", "m") for _ in range(2)]
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(config(port, [e.url for e in engines]).replace("prefix_block_chars: 64",
                                                                       "prefix_block_chars: 64, session_max_entries: 8"))
    async with gateway_process(path, port, "--workers", "2", ready_workers=2), contextlib.AsyncExitStack() as stack:
        conns: dict[int, aiohttp.ClientSession] = {}      # a keep-alive connection to each worker
        while len(conns) < 2:
            s = await stack.enter_async_context(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)))
            async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                conns.setdefault((await r.json())["gateway"]["pid"], s)
        a, b = conns.values()

        async def turn(s: aiohttp.ClientSession, key: str) -> str:
            # shorter than one prefix block: only the session map can keep it on its engine
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"x-session-key": key},
                              json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
                return r.headers["target-pod"]

        async def total(name: str, **labels: str) -> float:
            async with a.get(f"http://127.0.0.1:{port}/metrics") as r:
                return metric_total(await r.text(), name, **labels)

        home = await turn(a, "agent")
        for i in range(6):
            await turn(a, f"other-{i}")
        assert await turn(a, "agent") == home               # seen again: the most recent of the 8
        for i in range(6, 8):
            await turn(a, f"other-{i}")                     # the 9th pushes out other-0, seen least recently
        # every session worker a recorded has reached worker b (batches arrive in order)
        async def applied() -> bool:
            return await total("switchyard_view_facts_applied_total", source="worker", kind="session") >= 9
        await until(applied, timeout=20, interval=0.05)
        kept = await total("switchyard_routing_session_total", outcome="kept")
        assert await turn(b, "agent") == home
        assert await total("switchyard_routing_session_total", outcome="kept") == kept + 1
