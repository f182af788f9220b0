"""The status page in a real headless Chromium (Debian's ``chromium``, driven over DevTools by
tests/support/cdp.py): it renders a demo-like gateway, follows its traffic without a reload, asks for the
admin token when auth is on, and the browser reports no error on the way.

Every wait is on a DOM condition, checked inside the page, with a bound; the page polls
``/status.json`` every 0.5 s here (``status.refresh_s``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import redis.asyncio as aioredis

from enginesim import start_sim
from gateway.demo import DEMO_ENGINES
from gateway.observability.status import MAX_NAME
from tests.support.cdp import launch_for_test
from tests.support.factories import model_block, pd_model, pd_pair, roleset, sim_pod
from tests.support.status import ADMIN, chat

FAST_PAGE = {"refresh_s": 0.5}


@pytest.fixture(scope="module")
def browser():
    b = launch_for_test()
    yield b
    b.close()


@pytest.fixture
async def page(browser):
    p = await browser.new_page()
    yield p
    await p.close()


async def demo_like(sims, gateway, **blocks):
    """The demo's models, engines and roles (gateway/demo.py), on free ports."""
    models: dict[str, dict] = {}
    pending: dict[str, dict] = {}
    for model, engine, role, _port, _kw, _entry in DEMO_ENGINES:
        sim = await sims(engine, model, role=role)
        m = models.setdefault(model, {"name": model, "engine": engine})
        if role == "aggregated":
            m.setdefault("endpoints", []).append(sim.url)
        else:
            pending.setdefault(model, {})[role] = sim
            if len(pending[model]) == 2:
                m["rolesets"] = [roleset(engine, pending[model]["prefill"], pending[model]["decode"])]
    return await gateway(list(models.values()), status=FAST_PAGE, **blocks)


def q(selector: str) -> str:
    return f"document.querySelector({json.dumps(selector)})"


def cell(model: str, field: str) -> str:
    return q(f'#models tr[data-model="{model}"] td[data-field="{field}"]') + ".textContent"


async def test_the_page_renders_the_demo_gateway_and_follows_its_traffic(sims, gateway, page):
    gw = await demo_like(sims, gateway)
    eps = gw.gw.pool.endpoints()
    models = sorted({m for m, *_ in DEMO_ENGINES})
    await page.navigate(gw.url + "/status")

    rows = await page.wait_for(
        "(() => { const r = [...document.querySelectorAll('#endpoints tbody tr')];"
        f" return r.length === {len(eps)} && r.map(x => x.dataset.model + ' ' + x.dataset.endpoint); }})()")
    assert sorted(rows) == sorted(f"{ep.model} {ep.name}" for ep in eps)
    shown = await page.evaluate("[...document.querySelectorAll('#models tbody tr')].map(r => r.dataset.model)")
    assert sorted(shown) == models
    for m in models:
        assert await page.evaluate(cell(m, "requests")) == "0"
        assert await page.evaluate(cell(m, "ttft_p50")) == "—"
    # the two P/D rolesets, each with its prefill and decode endpoint and their trackers
    cards = await page.wait_for(
        "(() => { const c = [...document.querySelectorAll('#rolesets .card')];"
        " return c.length === 2 && c.map(x => [x.dataset.roleset,"
        " [...x.querySelectorAll('tbody tr')].map(r => r.dataset.role + ' ' + r.dataset.endpoint)]); })()")
    expected = {f"{ep.model}/rs-1": [] for ep in eps if ep.roleset}
    for ep in eps:
        if ep.roleset:
            expected[f"{ep.model}/rs-1"].append(f"{ep.role} {ep.name}")
    assert {k: sorted(v) for k, v in cards} == {k: sorted(v) for k, v in expected.items()}
    # nothing discovered: the endpoints are the config's
    assert await page.evaluate(q("#discovery-source") + ".dataset.source") == "static"
    assert await page.evaluate(q("#discovery-k8s") + ".hidden") is True
    # the engines' metrics arrive with the scraper
    await page.wait_for("[...document.querySelectorAll('#endpoints td[data-field=scraped]')]"
                        ".every(td => td.textContent.endsWith('ago'))")

    for m in models:
        for i in range(2):
            assert await chat(gw, m, stream=True, rid=f"{m}-{i}") == 200
    assert await chat(gw, "no-such-model", rid="missing-0") == 404

    # the page follows without a reload: counts, TTFT, the decisions and the error
    for m in models:
        await page.wait_for(f"{cell(m, 'requests')} === '2' && {cell(m, 'ttft_p50')}.endsWith('s')")
    assert await page.evaluate(cell("demo-llama", "errors")) == "0"
    pd = next(ep for ep in eps if ep.model == "demo-qwen-pd" and ep.role == "prefill")
    await page.wait_for(q('#decisions tr[data-request="demo-qwen-pd-1"] td[data-field="prefill"]')
                        + f".textContent === {json.dumps(pd.name)}")
    status = await page.wait_for(q('#errors tr[data-request="missing-0"] td[data-field="status"]') + ".textContent")
    assert status == "404"
    await page.wait_for(q("#tile-requests") + f".textContent === '{2 * len(models) + 1}'")
    assert await page.text("#tile-errors") == "1"
    assert page.problems == [], "\n".join(page.problems)


async def test_with_auth_the_page_asks_for_the_admin_token(sims, gateway, page):
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], status=FAST_PAGE,
                       auth={"api_keys": [{"key": "sk-alice-0123456789", "user": "alice"}], "admin_token": ADMIN})
    await page.navigate(gw.url + "/status")
    await page.wait_for(f"!{q('#login')}.hidden && {q('#content')}.hidden")
    # the only thing the browser reports is the refused poll itself
    assert page.problems and all("401" in p for p in page.problems), page.problems

    submit = q("#token-input") + ".value = %s; " + q("#login-form") + ".requestSubmit(); true"
    await page.evaluate(submit % json.dumps("not-the-token"))
    await page.wait_for(q("#login-error") + ".textContent.includes('refused')")
    assert await page.evaluate("sessionStorage.length") == 0

    await page.evaluate(submit % json.dumps(ADMIN))
    await page.wait_for(f"{q('#login')}.hidden && document.querySelectorAll('#endpoints tbody tr').length === 1")
    assert await page.evaluate("Object.values(sessionStorage)") == [ADMIN]

    # "Forget token" drops it and asks again
    await page.evaluate(q("#forget") + ".click(); true")
    await page.wait_for(f"!{q('#login')}.hidden")
    assert await page.evaluate("sessionStorage.length") == 0

    # a token in the address is taken, kept for the tab, and removed from the address
    page.problems.clear()
    await page.navigate(gw.url + "/status?token=" + ADMIN)
    await page.wait_for("document.querySelectorAll('#endpoints tbody tr').length === 1")
    assert await page.evaluate("location.search + location.hash") == ""
    assert await page.evaluate("Object.values(sessionStorage)") == [ADMIN]
    assert page.problems == [], "\n".join(page.problems)


async def test_a_link_carries_a_base64_admin_token_as_it_is(sims, gateway, page):
    """An admin token made with ``openssl rand -base64 32`` holds ``+``, ``/`` and ``=``: a link
    with it in ``#token=`` or ``?token=``, as written, gives the page that token. A ``%`` escape is
    read as one (``%20`` a space, which a token may hold inside)."""
    token = "q1+Zx/9Kf+0wTn2=="
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], status=FAST_PAGE, auth={"admin_token": token})
    for link in ("/status#token=" + token, "/status?token=" + token):
        await page.navigate(gw.url + "/health")        # the origin's storage, emptied
        await page.evaluate("sessionStorage.clear(); true")
        await page.navigate(gw.url + link)
        await page.wait_for(f"!{q('#login')}.hidden || document.querySelectorAll('#endpoints tbody tr').length === 1")
        assert await page.evaluate("Object.values(sessionStorage)") == [token], link
        assert await page.evaluate(q("#login") + ".hidden") is True, link
        assert await page.evaluate("location.search + location.hash") == ""
    spaced = "ad min+1"
    gw = await gateway([model_block("m", "vllm", [sim.url])], status=FAST_PAGE, auth={"admin_token": spaced})
    await page.navigate(gw.url + "/health")
    await page.evaluate("sessionStorage.clear(); true")
    await page.navigate(gw.url + "/status#token=ad%20min%2B1")
    await page.wait_for("document.querySelectorAll('#endpoints tbody tr').length === 1")
    assert await page.evaluate("Object.values(sessionStorage)") == [spaced]
    problems = [p for p in page.problems if "/favicon.ico" not in p]      # /health's page asks for one
    assert problems == [], "\n".join(problems)


# The page's poll timer is recorded and run at once (time is not waited for), and its fetch can be
# made to fail as when the gateway is down.
POLL_CLOCK = """window.__delays = []; window.__down = false;
const __setTimeout = window.setTimeout, __fetch = window.fetch;
window.setTimeout = function (fn, ms, ...rest) {
  if (fn && fn.name === "poll") { window.__delays.push(ms); ms = 20; }
  return __setTimeout.call(this, fn, ms, ...rest);
};
window.fetch = function (...args) {
  return window.__down ? Promise.reject(new TypeError("Failed to fetch")) : __fetch.apply(this, args);
};"""


async def test_a_gateway_that_is_down_is_never_polled_more_often_than_refresh_s(sims, gateway, page):
    """The backoff after failed polls lengthens the wait; with a refresh_s above its 10 s cap it
    used to shorten it (every 10 s while down, every 30 s while up)."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], status={"refresh_s": 30})
    await page.send("Page.addScriptToEvaluateOnNewDocument", source=POLL_CLOCK)
    await page.navigate(gw.url + "/status")
    await page.wait_for("window.__delays.length >= 3")
    assert set((await page.evaluate("window.__delays"))[1:]) == {30000}      # up: every refresh_s
    up = await page.evaluate("window.__down = true; window.__delays.length")
    await page.wait_for(f"window.__delays.length >= {up + 5} && " + q("#live-text") + ".textContent.includes('retrying')")
    down = (await page.evaluate("window.__delays"))[up:]
    assert min(down) >= 30000, down
    await page.evaluate("window.__down = false; true")     # back up: polled at refresh_s again
    await page.wait_for(q("#live-text") + ".textContent.startsWith('updated')")


async def test_long_model_and_endpoint_names_leave_every_column_in_view(sims, gateway, page):
    """A Hugging Face model id and a Service's DNS name pushed 8 of the 12 endpoint columns (the
    breaker, load, KV and scrape figures) out of a 1280 px window; the names are cut now, whole in
    their tooltips. The routing decisions and errors name the model, the endpoint and the request
    id too, a client's own (up to 128 characters) or a model name it made up: their status, class,
    message, strategy and endpoint columns stay in view as well."""
    model = "neuralmagic/Meta-Llama-3.1-70B-Instruct-quantized.w4a16-long-context-finetune"
    host = "llama-70b-instruct-decode-0.llama-70b-instruct-decode.inference-production.svc.cluster.local"
    unknown = "<b>made-up</b>-" + "x" * 300
    rid = "r" * 128
    sim = await sims("vllm", model)
    gw = await gateway([model_block(model, "vllm", [sim.url, f"http://{host}:8000"], strategy="round-robin")],
                       status=FAST_PAGE)
    assert await chat(gw, model, rid=rid) == 200
    assert await chat(gw, model, rid=rid[1:] + "-", headers={"x-sim-fault": "status=500"}) >= 500
    assert await chat(gw, unknown, rid=rid) == 404
    await page.navigate(gw.url + "/status")
    await page.wait_for(q("#endpoints tbody tr") + " !== null && "
                        + "document.querySelectorAll('#errors tbody tr').length >= 2 && "
                        + q("#decisions tbody tr") + " !== null")
    assert await page.evaluate("document.querySelectorAll('b').length") == 0
    for table in ("#models", "#endpoints", "#decisions", "#errors"):
        out = await page.evaluate(f"[...document.querySelectorAll('{table} thead th')]"
                                  ".filter(th => th.getBoundingClientRect().right > window.innerWidth)"
                                  ".map(th => th.textContent)")
        assert out == [], (table, out)
    titles = await page.evaluate("[...document.querySelectorAll('#endpoints .clip')].map(e => e.title)")
    assert model in titles and any(host in t for t in titles)
    titles = await page.evaluate("[...document.querySelectorAll('#errors .clip, #decisions .clip')].map(e => e.title)")
    assert {model, unknown[:MAX_NAME] + "…", rid} <= set(titles)        # a client's name kept as status.json cuts it
    assert page.problems == []


async def test_the_discovery_section_shows_kubernetes_fresh_then_stale(emu, sims, gateway, page, tmp_path):
    """Pods from the API server emulator: the watch, the last sync and the pods out of rotation with
    why; once the API server stops answering, the section turns stale and names the error."""
    sim = await sims("vllm", "llama")
    sim_pod(emu, "llama-0", sim, "llama")
    emu.create_pod("llm", "llama-1", {"model.aibrix.ai/name": "llama"}, ready=False)
    emu.create_pod("llm", "odd", {"model.aibrix.ai/name": "llama", "model.aibrix.ai/engine": "trtllm"})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    gw = await gateway([], status=FAST_PAGE, kubernetes={
        "enabled": True, "kubeconfig": str(kubeconfig), "namespaces": ["llm"], "retry_backoff_s": 0.05,
        "watch_timeout_s": 2, "resync_interval_s": 0})
    await page.navigate(gw.url + "/status")
    watch = '#discovery-watches tr[data-worker="0"][data-namespace="llm"] td[data-field="%s"]'
    await page.wait_for(q(watch % "state") + ".textContent === 'watching' && "
                        + q("#discovery-fresh") + ".textContent === 'fresh'")
    assert await page.evaluate(q("#discovery-source") + ".dataset.source") == "kubernetes"
    assert "namespaces llm" in await page.text("#discovery-note")
    assert [await page.text(f'#discovery-watches td[data-field="{f}"]') for f in ("routable", "not_routable", "skipped")] \
        == ["1", "1", "1"]
    pods = await page.evaluate("[...document.querySelectorAll('#discovery-pods tbody tr')]"
                               ".map(r => [r.dataset.pod, r.dataset.state, r.querySelector('[data-field=reason]').textContent])")
    assert pods[0] == ["llm/llama-1", "not routable", "not ready"]
    assert pods[1][:2] == ["llm/odd", "skipped"] and "trtllm" in pods[1][2]

    await emu.close()
    await page.wait_for(q("#discovery-fresh") + ".textContent === 'stale' && "
                        + q(watch % "error") + ".textContent.includes('list connect')", timeout=15)
    assert page.problems == [], "\n".join(page.problems)


async def test_the_tenants_line_says_why_the_shared_state_is_down(sims, gateway, page, redis_server):
    """A Redis out of memory is reachable but takes no writes: the page says which, and clears it."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], status=FAST_PAGE,
                       auth={"api_keys": [{"key": "sk-alice-0123456789", "user": "alice"}], "admin_token": ADMIN},
                       limits={"users": {"alice": {"rpm": 60}}},
                       state={"redis_url": redis_server.url, "sync_interval_s": 0.05})
    await page.navigate(gw.url + "/status?token=" + ADMIN)
    note = q("#tenants-note") + ".textContent"
    await page.wait_for(f"{note}.includes('counters in redis') && !{note}.includes('(')")
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", 1)
        await page.wait_for(f"{note}.includes('counters in redis (REFUSES WRITES: out of memory)')")
        await r.config_set("maxmemory", 0)
        await page.wait_for(f"{note}.includes('counters in redis') && !{note}.includes('REFUSES')")
    finally:
        await r.config_set("maxmemory", 0)
        await r.aclose()
    assert page.problems == [], "\n".join(page.problems)


# the document as a gateway of two workers answers it an hour after its start, from the worker the
# parent started again five seconds ago (its own uptime_s; started_at is the gateway's)
RESTARTED_WORKER = """const __fetch2 = window.fetch;
window.fetch = async function (...args) {
  const r = await __fetch2.apply(this, args);
  if (!String(args[0]).includes("status.json") || !r.ok) return r;
  const doc = await r.json();
  doc.gateway.started_at = doc.gateway.now - 3725;
  doc.gateway.uptime_s = 5.2;
  doc.gateway.workers = Object.assign({}, doc.gateway.workers,
    {count: 2, answered: 1, reporting: 2, restarts: {exited: 1, stalled: 0}});
  return new Response(JSON.stringify(doc), {status: 200, headers: {"Content-Type": "application/json"}});
};"""


async def test_the_heading_s_uptime_is_the_gateway_s_and_a_restarted_worker_s_is_its_own(sims, gateway, page):
    """With several workers, the heading's "up" is the gateway's (since ``started_at``, the same
    whichever worker answers), and the answering worker's own uptime is beside its pid: a worker
    the parent started again does not make the gateway look just started."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])], status=FAST_PAGE)
    await page.send("Page.addScriptToEvaluateOnNewDocument", source=RESTARTED_WORKER)
    await page.navigate(gw.url + "/status")
    meta = await page.wait_for(q("#meta") + ".textContent.includes('answered by worker 1') && "
                               + q("#meta") + ".textContent")
    assert " · up 1h 02m" in meta, meta
    assert f"answered by worker 1 (pid {os.getpid()}, up 0m 05s)" in meta, meta
    assert "workers restarted: 1 exited" in meta, meta
    assert page.problems == [], "\n".join(page.problems)


XSS = '<img src=x onerror="window.__pwned=1">"><svg onload="window.__pwned=2"><script>window.__pwned=3</script>'


async def test_markup_in_what_clients_and_engines_name_is_shown_as_text(sims, gateway, page):
    """A served model's name (as the engine reports it), a model name a client made up, a user
    header, the error message that quotes them: each holds markup that would run a script, and the
    page shows it as text, with the Content-Security-Policy bypassed, so its rendering alone is
    what is checked."""
    model = "m" + XSS
    sim = await sims("vllm", model)
    gw = await gateway([model_block(model, "vllm", [sim.url])], status=FAST_PAGE,
                       limits={"default_user": {"rpm": 100}})
    assert await chat(gw, model, headers={"user": "u" + XSS}) == 200
    assert await chat(gw, "nope" + XSS, rid="unknown-model") == 404
    assert await chat(gw, model, rid="engine-500", headers={"user": "w" + XSS, "x-sim-fault": "status=500"}) >= 500
    await page.send("Page.setBypassCSP", enabled=True)
    await page.navigate(gw.url + "/status")
    await page.wait_for("document.querySelectorAll('#errors tbody tr').length === 2 && "
                        "document.querySelectorAll('#tenants tbody tr').length === 2")
    assert await page.evaluate("window.__pwned === undefined")
    assert await page.evaluate("document.querySelectorAll('main img, main script, main svg:not(.spark)').length") == 0
    shown = await page.evaluate("document.querySelector('main').innerText")
    for text in (model, "nope" + XSS, "u" + XSS, "w" + XSS):
        assert text in shown, text
    assert page.problems == [], "\n".join(page.problems)


async def test_an_engine_that_dies_and_returns_is_shown_down_then_ready(sims, gateway, page):
    a, b = await sims("vllm", "m"), await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [a.url, b.url])], status=FAST_PAGE)
    name = next(ep.name for ep in gw.gw.pool.endpoints() if ep.url.rstrip("/") == a.url.rstrip("/"))
    state = q(f'#endpoints tr[data-endpoint="{name}"] td[data-field="state"]') + ".textContent"
    await page.navigate(gw.url + "/status")
    await page.wait_for(f"{state} === 'ready' && " + q("#tile-endpoints") + ".textContent === '2 / 2'")
    await page.wait_for("[...document.querySelectorAll('#endpoints td[data-field=scraped]')]"
                        ".every(td => td.textContent.endsWith('ago'))")
    assert await chat(gw, "m", stream=True, rid="before") == 200

    back = await restart_sim_after(a, page, state)
    try:
        await page.wait_for(f"{state} === 'ready' && " + q("#tile-endpoints") + ".textContent === '2 / 2'",
                            timeout=30)
        for i in range(4):
            assert await chat(gw, "m", rid=f"after-{i}") == 200
        await page.wait_for(cell("m", "requests") + " === '5'")
        assert page.problems == [], "\n".join(page.problems)
    finally:
        await back.close()


async def restart_sim_after(sim, page, state: str):
    """``sim`` stopped until the page shows its endpoint down, then started again on its port."""
    cfg = sim.cfg
    port = sim.port
    await sim.close()
    await page.wait_for(f"{state} === 'unhealthy' && " + q("#tile-endpoints") + ".textContent === '1 / 2'"
                        " && [...document.querySelectorAll('#rolesets .card h3 .badge')]"
                        ".every(b => b.textContent === 'incomplete')", timeout=30)
    assert page.problems == [], "\n".join(page.problems)
    return await start_sim(dataclasses.replace(cfg, port=port))


async def test_a_decode_that_dies_and_returns_leaves_its_roleset_incomplete_then_ready(sims, gateway, page):
    p, d = await pd_pair(sims, "sglang")
    gw = await gateway([pd_model("sglang", [roleset("sglang", p, d)])], status=FAST_PAGE)
    name = next(ep.name for ep in gw.gw.pool.endpoints() if ep.role == "decode")
    state = q(f'#endpoints tr[data-endpoint="{name}"] td[data-field="state"]') + ".textContent"
    badge = q('#rolesets .card[data-roleset="m/rs-1"] h3 .badge') + ".textContent"
    await page.navigate(gw.url + "/status")
    await page.wait_for(f"{state} === 'ready' && {badge} === 'ready'")
    assert await chat(gw, "m", stream=True, rid="pd-before") == 200

    back = await restart_sim_after(d, page, state)
    try:
        await page.wait_for(f"{state} === 'ready' && {badge} === 'ready' && "
                            + q("#tile-endpoints") + ".textContent === '2 / 2'", timeout=30)
        assert await chat(gw, "m", stream=True, rid="pd-after") == 200
        await page.wait_for(cell("m", "requests") + " === '2'")
        assert page.problems == [], "\n".join(page.problems)
    finally:
        await back.close()
