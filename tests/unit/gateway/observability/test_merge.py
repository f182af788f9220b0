"""``/metrics`` with several workers: their expositions merged into the gateway's (pure text in, text out)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_parse
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.schema import config_from_dict
from gateway.observability.merge import (
    GAUGE_RULES,
    SUM,
    endpoints_of,
    gauge_rule,
    merge,
    merge_texts,
    openmetrics,
    parse,
    render,
    without_endpoints,
)
from gateway.observability.metrics import GatewayMetrics
from gateway.server.app import GATEWAY_KEY, build_app
from tests.support.metrics import sample_map

TINY_TOKENIZER = Path(__file__).resolve().parents[4] / "enginesim" / "tokenizer_data" / "tiny"


def worker(requests: dict[tuple[str, str], int], ttft: list[float], in_flight: int, ready: int,
           lag: list[float] = ()) -> str:
    """One worker's exposition: its requests, TTFTs and loop lags, its in-flight count, and how it
    sees one endpoint ``e1``."""
    m = GatewayMetrics()
    for (model, status), n in requests.items():
        m.requests.labels(model, status, "least-request").inc(n)
    for v in ttft:
        m.ttft.labels("m").observe(v)
    for v in lag:
        m.loop_lag.observe(v)
    ep = SimpleNamespace(model="m", name="e1", engine="vllm", role="aggregated", roleset=None, in_flight=in_flight,
                         ready=bool(ready), prefill_in_flight=0, pending_decode=0, token_active=0.0, token_kv=0.0,
                         metrics=None)
    m.attach_live_state(lambda: [ep], {"m": in_flight})
    return m.render().decode()


def value(page: bytes, name: str, **labels: str) -> float:
    return sample_map(page)[(name, tuple(sorted(labels.items())))]


def test_one_exposition_comes_back_unchanged():
    text = worker({("m", "200"): 3}, [0.2], 1, 1)
    assert merge_texts([text]).decode() == text


class Frozen:
    """A registry's families collected once (the process's figures do not move between two
    renders)."""

    def __init__(self, registry) -> None:
        self.families = list(registry.collect())

    def collect(self):
        return self.families


def test_a_page_in_openmetrics_is_what_prometheus_client_writes_of_the_registry():
    """A worker's registry in OpenMetrics is what prometheus_client's parser reads (a histogram's
    ``_created`` with its series' other samples); the text a worker exposes, parsed and written in
    OpenMetrics, is byte for byte what the OpenMetrics encoder writes of the registry itself (a
    counter's and a histogram's ``_created`` in their family); the merge of two workers is one OpenMetrics page
    its parser reads, each family once, the sums kept."""
    m = GatewayMetrics()
    m.requests.labels("m", "200", "least-request").inc(3)
    m.requests.labels("x", "404", "least-request").inc()
    for v in (0.02, 0.3):
        m.ttft.labels("m").observe(v)
        m.ttft.labels("x").observe(v)
    m.loop_lag.observe(0.001)
    frozen = Frozen(m.registry)
    assert list(openmetrics_parse(openmetrics_latest(frozen).decode()))     # one worker's own page
    text = generate_latest(frozen).decode()
    assert render(openmetrics(parse(text)), openmetrics_latest) == openmetrics_latest(frozen)

    a = worker({("m", "200"): 3, ("m", "500"): 1}, [0.02, 0.3], 1, 1, lag=[0.001])
    b = worker({("m", "200"): 4, ("x", "404"): 2}, [0.3], 2, 1, lag=[0.5])
    page = render(openmetrics(merge([a, b])), openmetrics_latest).decode()
    assert page.endswith("# EOF\n")
    families = list(openmetrics_parse(page))
    names = [f.name for f in families]
    assert len(names) == len(set(names)) and not [n for n in names if n.endswith("_created")]
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    labels = (("model", "m"), ("status", "200"), ("strategy", "least-request"))
    assert got[("switchyard_requests_total", labels)] == 7
    assert ("switchyard_requests_created", labels) in got
    assert got[("switchyard_time_to_first_token_seconds_count", (("model", "m"),))] == 3


def test_counters_and_histograms_add_up_by_label_set():
    a = worker({("m", "200"): 3, ("m", "500"): 1}, [0.02, 0.3], 1, 1, lag=[0.001])
    b = worker({("m", "200"): 4, ("x", "404"): 2}, [0.3], 2, 1, lag=[0.5])
    page = merge_texts([a, b])
    labels = {"strategy": "least-request"}
    assert value(page, "switchyard_requests_total", model="m", status="200", **labels) == 7
    assert value(page, "switchyard_requests_total", model="m", status="500", **labels) == 1   # only in a
    assert value(page, "switchyard_requests_total", model="x", status="404", **labels) == 2   # only in b
    ttft = "switchyard_time_to_first_token_seconds"
    assert value(page, f"{ttft}_count", model="m") == 3
    assert value(page, f"{ttft}_sum", model="m") == pytest.approx(0.62)
    assert value(page, f"{ttft}_bucket", model="m", le="0.025") == 1
    assert value(page, f"{ttft}_bucket", model="m", le="0.3") == 3
    assert value(page, f"{ttft}_bucket", model="m", le="+Inf") == 3
    assert value(page, "switchyard_event_loop_lag_seconds_count") == 2
    # the _created series say when a series first started
    created = [s.value for f in text_string_to_metric_families(a) for s in f.samples
               if s.name == "switchyard_requests_created" and s.labels["status"] == "200"]
    assert value(page, "switchyard_requests_created", model="m", status="200", **labels) == min(created)


def test_gauges_add_up_or_not_as_their_meaning_says():
    a = worker({}, [], 3, 1)
    b = worker({}, [], 4, 0)
    page = merge_texts([a, b])
    assert value(page, "switchyard_in_flight_requests", model="m") == 7          # each worker's own requests
    assert value(page, "switchyard_endpoint_in_flight_requests", endpoint="e1", model="m") == 7
    assert value(page, "switchyard_endpoint_ready", endpoint="e1", model="m") == 1   # one endpoint, seen twice
    starts = [s.value for t in (a, b) for f in text_string_to_metric_families(t) for s in f.samples
              if s.name == "process_start_time_seconds"]
    if starts:          # the process collector reads /proc
        assert value(page, "process_start_time_seconds") == min(starts)
        assert value(page, "process_max_fds") == max(s.value for t in (a, b) for f in text_string_to_metric_families(t)
                                                     for s in f.samples if s.name == "process_max_fds")


def test_each_family_is_described_once():
    page = merge_texts([worker({("m", "200"): 1}, [0.1], 1, 1), worker({("m", "200"): 1}, [0.1], 1, 1)]).decode()
    assert page.count("# TYPE switchyard_requests_total counter") == 1
    assert page.count("# HELP switchyard_time_to_first_token_seconds ") == 1
    assert page.count("# TYPE switchyard_endpoint_ready gauge") == 1
    names = [f.name for f in text_string_to_metric_families(page)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", ['m "q"', "m\\", "m\\n", "m\nline", "modèle 模型", "m\r\u2028}{,=#"])
def test_label_values_a_text_exposition_escapes_come_back_as_they_were(name):
    """A model's name (a config's, any string) through two workers' texts and the merge: quotes,
    backslashes and line breaks escaped as the text format says, each series once, summed."""
    a, b = worker({(name, "200"): 2}, [0.1], 1, 1), worker({(name, "200"): 3, ("m", "200"): 1}, [0.2], 0, 1)
    page = merge_texts([a, b]).decode()
    assert value(page, "switchyard_requests_total", model=name, status="200", strategy="least-request") == 5
    assert value(page, "switchyard_requests_total", model="m", status="200", strategy="least-request") == 1
    series = [(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(page) for s in f.samples]
    assert len(series) == len(set(series))
    assert merge_texts([page]).decode() == page          # what a sibling re-reads is the same page


# gauges that count what each worker holds of its own, and are summed
ADDITIVE = {
    "switchyard_in_flight_requests", "switchyard_endpoint_in_flight_requests", "switchyard_pd_prefill_in_flight",
    "switchyard_pd_pending_decode", "switchyard_pd_token_load_active_tokens", "switchyard_pd_token_load_kv_tokens",
    "switchyard_event_loop_tasks", "switchyard_client_connections", "switchyard_admission_queue_depth",
    "switchyard_admission_queue_bytes", "switchyard_admission_drain_rate", "switchyard_endpoint_admission_headroom",
    "switchyard_responses_state_entries", "process_virtual_memory_bytes", "process_resident_memory_bytes",
    "process_open_fds", "switchyard_batch_lines_in_flight", "switchyard_client_connections_limit",
    "switchyard_upstream_connections",
}


async def test_every_gauge_the_gateway_exports_is_classified():
    """A new gauge must say how workers' values combine: summed (listed here) or in GAUGE_RULES."""
    cfg = config_from_dict({
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:9"], "adapters": {"a": "/x"}},
                   {"name": "k", "endpoints": ["http://127.0.0.1:9"], "tokenizer": str(TINY_TOKENIZER),
                    "kv_events": {"enabled": True}}],
        "auth": {"api_keys": [{"key": "sk-x", "user": "u"}]}, "admission": {"enabled": True},
        "batch": {"enabled": True}})
    registry = build_app(cfg)[GATEWAY_KEY].metrics.registry
    gauges = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())
              if f.type == "gauge" and not f.name.endswith("_created")}
    unclassified = {g for g in gauges if g not in ADDITIVE and g not in GAUGE_RULES}
    assert not unclassified, f"say how these combine over workers (gateway/observability/merge.py): {unclassified}"
    assert all(gauge_rule(g) == SUM for g in ADDITIVE)


def test_a_restarted_worker_carries_its_predecessors_counts_not_its_gauges(tmp_path):
    """What a dead worker last reported (its own exposition, then what it carried): its counters and
    histograms go on in its successor's exposition (the gateway's sums never fall), its gauges (what
    that process held) do not."""
    from gateway.server.siblings import CARRIED, gone_counts

    path = tmp_path / "metrics-0.prom"
    assert gone_counts(str(path)) == []
    earlier = merge_texts([worker({("m", "200"): 2}, [0.3], in_flight=0, ready=1)]).decode()
    path.write_bytes(worker({("m", "200"): 5}, [0.2, 0.4], in_flight=3, ready=1).encode() + CARRIED
                     + merge_texts([[f for f in parse(earlier) if f.type != "gauge"]]))
    carried = gone_counts(str(path))
    fresh = worker({("m", "200"): 1}, [0.1], in_flight=1, ready=1)
    page = merge_texts([fresh, carried])
    assert value(page, "switchyard_requests_total", model="m", status="200", strategy="least-request") == 8
    assert value(page, "switchyard_time_to_first_token_seconds_count", model="m") == 4
    assert value(page, "switchyard_in_flight_requests", model="m") == 1      # the living worker's only
    path.write_text("not an exposition {{{")
    assert gone_counts(str(path)) == []


def counter_page(values: dict[str, float]) -> str:
    """An exposition of one counter, ``switchyard_engine_scrapes_total``, by endpoint."""
    m = GatewayMetrics()
    for ep, v in values.items():
        m.scrapes.labels("m", ep, "ok").inc(v)
    return m.render().decode()


def test_sums_do_not_depend_on_the_order_the_workers_are_read_in():
    """Whichever worker answers, its own exposition comes first: a float sum that depended on the
    order could come out an ulp lower than the scrape before, and Prometheus reads that as a reset."""
    a, b, c = (counter_page({"e1": v}) for v in (0.1, 0.2, 0.3))
    sums = {value(merge_texts(order), "switchyard_engine_scrapes_total", model="m", endpoint="e1", result="ok")
            for order in ([a, b, c], [b, c, a], [c, b, a])}
    assert sums == {0.6}


def test_what_a_restarted_worker_carries_is_never_below_the_parts_it_stands_for():
    """Its predecessor's own counts and what that one carried, added once: rounded up, since the
    gateway's sum had them as two parts and must not come out an ulp lower with one."""
    (fam,) = [f for f in merge([counter_page({"e1": 0.1}), counter_page({"e1": 0.2})], upward=True)
              if f.name == "switchyard_engine_scrapes"]
    total = next(s.value for s in fam.samples if s.name.endswith("_total"))
    assert Fraction(total) >= Fraction(0.1) + Fraction(0.2)


def test_series_of_endpoints_no_one_exports_are_left_out():
    fams = parse(counter_page({"e1": 3, "e2": 4}))
    assert endpoints_of(fams) == {("m", "e1"), ("m", "e2")}
    kept = without_endpoints(fams, {("m", "e1")})
    assert endpoints_of(kept) == {("m", "e1")}
    assert endpoints_of(fams) == {("m", "e1"), ("m", "e2")}       # the input is left as it was


def test_discovery_metrics_of_workers_merge_as_one_discovery_seen_by_each():
    """Every worker runs its own discovery: their list and watch requests add up (the API server
    served each), a pod counts once (each worker holds the same pods), and the last sync is the
    worker that heard from the API server the longest ago (one stuck worker is not hidden by the
    other's fresh time)."""
    from prometheus_client import CollectorRegistry

    from k8s.metrics import DiscoveryMetrics

    def one(last: float, routable: int, lists: int) -> str:
        reg = CollectorRegistry()
        m = DiscoveryMetrics(reg, ["llm"], lambda: ({("llama", "routable"): routable}, 1))
        for _ in range(lists):
            m.ended("list", "ok")
        m.last_sync["llm"] = last
        return generate_latest(reg).decode()

    got = sample_map(merge_texts([one(1000.0, 2, 3), one(1300.0, 2, 1)]).decode())
    assert got[("switchyard_kubernetes_requests_total", (("result", "ok"), ("verb", "list")))] == 4
    assert got[("switchyard_kubernetes_pods", (("model", "llama"), ("state", "routable")))] == 2
    assert got[("switchyard_kubernetes_pods_skipped", ())] == 1
    assert got[("switchyard_kubernetes_last_sync_timestamp_seconds", (("watched_namespace", "llm"),))] == 1000.0


def test_an_outage_every_worker_counts_is_one():
    """Each worker counts the shared state's outages on its own connection: the gateway's count is the
    largest of theirs, not their sum."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    def counted(n: int) -> str:
        r = CollectorRegistry()
        Counter("switchyard_state_outages", "", ["mode"], registry=r).labels("standalone").inc(n)
        Counter("switchyard_state_unavailable", "", ["policy", "reason"], registry=r).labels("open", "oom").inc(n)
        return generate_latest(r).decode()

    page = merge_texts([counted(1), counted(1)])
    assert value(page, "switchyard_state_outages_total", mode="standalone") == 1
    assert value(page, "switchyard_state_unavailable_total", policy="open", reason="oom") == 2    # requests: summed
    assert value(merge_texts([counted(1), counted(3)]), "switchyard_state_outages_total", mode="standalone") == 3


async def test_an_ejection_after_every_worker_was_restarted_is_counted(tmp_path):
    """Two workers each count an endpoint's ejection (one decided it, the other adopted it): the
    gateway's count is 1. Both are restarted in turn, each new worker carrying its predecessor's
    count, and the endpoint is ejected again: 2. A counter taken as the largest of the workers'
    is the largest of what each worker's index counted over its restarts, its own count and what it
    carries added up; taken as the largest of all those parts, it stayed at 1."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from gateway.server.siblings import Siblings
    from gateway.server.workers import WorkerInfo

    def ejected(n: int) -> bytes:
        r = CollectorRegistry()
        c = Counter("switchyard_breaker_transitions", "", ["model", "endpoint", "from_state", "to_state"], registry=r)
        if n:
            c.labels("m", "e1", "closed", "open").inc(n)
        return generate_latest(r)

    def pair(counts: list[int]) -> list[Siblings]:
        out: list[Siblings] = []
        for i, n in enumerate(counts):
            async def answer(kind: str, i=i, n=n) -> bytes:
                return out[i].own(ejected(n))
            out.append(Siblings(WorkerInfo(index=i, count=2, run_dir=str(tmp_path)), answer))
        return out

    first = pair([1, 1])
    for s in first:
        await s.start()
    try:
        page = await first[0].metrics(ejected(1))
        assert value(page, "switchyard_breaker_transitions_total", model="m", endpoint="e1",
                     from_state="closed", to_state="open") == 1
    finally:
        for s in first:
            await s.stop()
    second = pair([1, 1])          # both restarted, each carrying its predecessor's count; one ejection more
    for s in second:
        await s.start()
    try:
        page = await second[1].metrics(ejected(1))
        assert value(page, "switchyard_breaker_transitions_total", model="m", endpoint="e1",
                     from_state="closed", to_state="open") == 2
    finally:
        for s in second:
            await s.stop()
