"""``GET /metrics`` as a Prometheus server scrapes it: the body in the text exposition format and a
Content-Type that says which version of it, as prometheus_client's own handler answers."""

from __future__ import annotations

import aiohttp
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families

from tests.support.factories import model_block

# what Prometheus sends (scrape_protocols' default order), which prefers OpenMetrics
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


async def test_the_metrics_page_names_the_text_format_s_version(sims, gateway):
    """The page is the text format 0.0.4 (every name a legacy one, so it reads the same as 1.0.0's
    with underscores), and its Content-Type says so, version included, as prometheus_client's
    handler says for a scrape that does not ask for another format; a scrape that prefers
    OpenMetrics, which the gateway does not write, gets the same, which it accepts."""
    sim = await sims("vllm", "m")
    gw = await gateway([model_block("m", "vllm", [sim.url])])
    plain = choose_encoder("")[1]
    assert "version=0.0.4" in plain
    async with aiohttp.ClientSession() as s:
        for accept in (None, "text/plain", PROMETHEUS_ACCEPT):
            async with s.get(gw.url + "/metrics", headers={"Accept": accept} if accept else {}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == plain, (accept, r.headers["Content-Type"])
                names = {f.name for f in text_string_to_metric_families(await r.text())}
                assert "switchyard_requests" in names or "switchyard_in_flight_requests" in names, accept
