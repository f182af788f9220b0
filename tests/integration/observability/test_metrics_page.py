"""``GET /metrics`` as a Prometheus server scrapes it: the body in the format its Accept header
prefers (OpenMetrics, or the text exposition format) and a Content-Type that says which, version
included, as prometheus_client's own handler answers; with one worker and with several."""

from __future__ import annotations

import asyncio
import subprocess

import aiohttp
import pytest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.observability.test_dashboards import promtool
from tests.support.factories import model_block
from tests.support.gateway_process import gateway_process, post_new
from tests.support.metrics import metric
from tests.support.ports import listen_port

# what Prometheus sends (scrape_protocols' default order), which prefers OpenMetrics
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


async def test_the_metrics_page_names_the_text_format_s_version(sims, gateway):
    """The page is the text format 0.0.4 (every name a legacy one, so it reads the same as 1.0.0's
    with underscores), and its Content-Type says so, version included, as prometheus_client's
    handler says for a scrape that does not ask for another format (one that asks for the text
    format 1.0.0 gets that name for the same text, and one whose version is no number the text
    format 0.0.4, not a 500); a scrape that prefers OpenMetrics (Prometheus') gets OpenMetrics
    1.0.0, as that handler answers it."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    plain = choose_encoder("")[1]
    assert "version=0.0.4" in plain
    async with aiohttp.ClientSession() as s:
        for accept in (None, "text/plain", "text/plain;version=0.0.4", "*/*", "text/plain;version=1.0.0"):
            async with s.get(gw.url + "/metrics", headers={"Accept": accept} if accept else {}) as r:
                assert r.status == 200
                want = choose_encoder(accept or "")[1]
                assert r.headers["Content-Type"] == want, (accept, r.headers["Content-Type"])
                assert want == plain or "version=1.0.0" in want
                names = {f.name for f in text_string_to_metric_families(await r.text())}
                assert "switchyard_requests" in names or "switchyard_in_flight_requests" in names, accept
        # a version that is no number (which choose_encoder cannot compare) is one not asked for
        for accept in ("application/openmetrics-text;version=abc", "text/plain;version=x.y"):
            async with s.get(gw.url + "/metrics", headers={"Accept": accept}) as r:
                assert r.status == 200, accept
                assert r.headers["Content-Type"] == plain, (accept, r.headers["Content-Type"])
                assert {f.name for f in text_string_to_metric_families(await r.text())}
        for accept in (PROMETHEUS_ACCEPT, "application/openmetrics-text"):
            async with s.get(gw.url + "/metrics", headers={"Accept": accept}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == choose_encoder(accept)[1], (accept, r.headers["Content-Type"])
                text = await r.text()
                assert text.endswith("# EOF\n")
                names = {f.name for f in om_parse(text)}
                assert "switchyard_in_flight_requests" in names, accept


def stamped(text: str) -> str:
    """An OpenMetrics page with a timestamp on every sample, which ``promtool tsdb create-blocks-from
    openmetrics`` (Prometheus's own OpenMetrics parser) needs."""
    return "".join(line if line.startswith("#") else line.rstrip("\n") + " 1700000000\n"
                   for line in text.splitlines(keepends=True))


async def pages_of_each_worker(port: int, accepts: tuple[str, ...]) -> dict[int, list[tuple[str, str]]]:
    """``/metrics`` as each of the two workers answers it, once per ``Accept``: {pid: [(Content-Type,
    body)]}. A keep-alive connection stays with the worker that accepted it."""
    found: dict[int, list[tuple[str, str]]] = {}
    async with asyncio.timeout(30):
        while len(found) < 2:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                    pid = (await r.json())["gateway"]["pid"]
                if pid in found:
                    continue
                found[pid] = []
                for accept in accepts:
                    async with s.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept}) as r:
                        found[pid].append((r.headers["Content-Type"], await r.text()))
    return found


@pytest.mark.timeout(90)
async def test_two_workers_answer_the_format_a_scrape_asks_for_whole_and_valid(sims, tmp_path):
    """With ``--workers 2``, whichever worker answers: a scrape that prefers OpenMetrics (Prometheus')
    gets the merged page in OpenMetrics 1.0.0 with the Content-Type prometheus_client's
    ``choose_encoder`` names, which prometheus_client's OpenMetrics parser and Prometheus' own
    (promtool) read: each family once, a counter's samples ``_total`` (and ``_created`` in its
    family, not a family of its own), ``# EOF`` last; a scrape that asks for text gets the text
    format 0.0.4 that ``promtool check metrics`` passes without a remark. Both count the requests
    sent."""
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    om_type = choose_encoder(PROMETHEUS_ACCEPT)[1]
    assert om_type.startswith("application/openmetrics-text; version=1.0.0")
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        n = 6
        for _ in range(n):
            status, _, _ = await post_new(port, "/v1/chat/completions",
                                          {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 2})
            assert status == 200
        pages = await pages_of_each_worker(port, (PROMETHEUS_ACCEPT, "text/plain"))
    for pid, ((om_ct, om), (plain_ct, plain)) in pages.items():
        assert om_ct == om_type, (pid, om_ct)
        assert om.endswith("\n# EOF\n"), pid
        families = list(om_parse(om))         # raises on a clash, a family split in two, a bad histogram
        names = [f.name for f in families]
        assert len(names) == len(set(names)), pid
        assert len({line.split()[2] for line in om.splitlines() if line.startswith("# TYPE ")}) == len(names)
        for fam in families:
            if fam.type == "counter":
                assert {s.name for s in fam.samples} <= {fam.name + "_total", fam.name + "_created"}, fam.name
        assert not any(name.endswith("_created") for name in names), pid
        assert metric(plain, "switchyard_requests_total", model="m", status="200") == n
        om_requests = [s.value for f in families for s in f.samples
                       if s.name == "switchyard_requests_total" and s.labels["status"] == "200"]
        assert sum(om_requests) == n, pid
        om_file = tmp_path / f"om-{pid}.txt"
        om_file.write_text(stamped(om))
        r = subprocess.run([promtool(), "tsdb", "create-blocks-from", "openmetrics", str(om_file),
                            str(tmp_path / f"blocks-{pid}")], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "error" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr

        assert plain_ct == choose_encoder("")[1], (pid, plain_ct)
        assert "# EOF" not in plain
        r = subprocess.run([promtool(), "check", "metrics"], input=plain, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


async def test_an_engine_that_is_both_a_prefill_and_a_decode_is_one_series_per_endpoint(sims, gateway):
    """One vLLM engine may be the prefill and the decode of a model (a KV connector with kv_both),
    which the config takes: two endpoints of one name. Each per-endpoint gauge is one series for it
    (labelled by model and endpoint, not role), as Prometheus takes a page (a sample twice is a
    duplicate series, and the scrape fails); ``switchyard_endpoint_info`` names its two roles."""
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "rolesets": [{"name": "rs-0", "prefill": [sim.url],
                                                                       "decode": [sim.url]}]}])
    name = gw.gw.pool.endpoints("m")[0].name
    assert [ep.role for ep in gw.gw.pool.endpoints("m")] == ["prefill", "decode"]
    plain = await gw.metrics_text()
    r = subprocess.run([promtool(), "check", "metrics"], input=plain, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    families = {f.name: f for f in text_string_to_metric_families(plain)}
    for fam in families.values():
        keys = [tuple(sorted(s.labels.items())) + (s.name,) for s in fam.samples]
        assert len(keys) == len(set(keys)), fam.name
    assert [s.value for s in families["switchyard_endpoint_ready"].samples
            if s.labels == {"model": "m", "endpoint": name}] == [1]
    assert sorted(s.labels["role"] for s in families["switchyard_endpoint_info"].samples
                  if s.labels["endpoint"] == name) == ["decode", "prefill"]
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics", headers={"Accept": PROMETHEUS_ACCEPT}) as r:
        om = await r.text()
    assert r.headers["Content-Type"].startswith("application/openmetrics-text") and om.endswith("# EOF\n")
    for fam in om_parse(om):
        keys = [tuple(sorted(s.labels.items())) + (s.name,) for s in fam.samples]
        assert len(keys) == len(set(keys)), fam.name
