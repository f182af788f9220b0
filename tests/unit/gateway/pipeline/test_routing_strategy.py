"""A request's strategy and router (``Routing.strategy``): a model's default is kept per model, and
is the one ``strategy_for`` and ``resolve`` give as the pool's endpoints come and go."""

from __future__ import annotations

import random

from gateway.config.schema import config_from_dict
from gateway.endpoints import Endpoint, EndpointPool
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.routing import Routing
from gateway.server.app import pool_from_config


def _config(**model):
    return config_from_dict({"routing": {"strategy": "random"},
                             "models": [{"name": "m", "endpoints": ["http://10.0.0.1:8000"], **model},
                                        {"name": "n", "endpoints": ["http://10.0.0.2:8000"]}]})


def _routing(cfg, pool: EndpointPool | None = None) -> Routing:
    return Routing(cfg, pool if pool is not None else pool_from_config(cfg), GatewayMetrics())


def _plain(routing: Routing, model: str, header: str | None = None, lora: bool = False):
    return routing.resolve(routing.strategy_for(model, header, lora))


def test_a_models_default_follows_the_pools_endpoints():
    routing = _routing(_config())
    pool = routing.pool
    assert routing.strategy("m", None) == _plain(routing, "m") and routing.strategy("m", None)[0] == "random"
    hinted = pool.add(Endpoint(url="http://10.0.0.3:8000", model="m", extra={"routing_strategy": "least-request"}))
    assert routing.strategy("m", None)[0] == "least-request"        # a discovered pod's hint, seen at once
    assert routing.strategy("n", None)[0] == "random"
    prefill = pool.add(Endpoint(url="http://10.0.1.1:8000", model="n", role="prefill"))
    assert routing.strategy("n", None)[0] == "pd"                   # P/D endpoints came
    pool.remove(prefill)
    pool.remove(hinted)
    assert routing.strategy("m", None)[0] == "random" and routing.strategy("n", None)[0] == "random"


def test_a_header_or_an_adapter_is_read_per_request():
    routing = _routing(_config())
    assert routing.strategy("m", None)[0] == "random"
    assert routing.strategy("m", " least-request ")[0] == "least-request"
    assert routing.strategy("m", None)[0] == "random"
    assert routing.strategy("m", None, lora=True) == _plain(routing, "m", None, True)


def test_a_reload_reads_its_own_config():
    first = _routing(_config())
    assert first.strategy("m", None)[0] == "random"
    second = _routing(_config(strategy="least-request"), first.pool)
    second.keep_state(first)
    assert second.strategy("m", None)[0] == "least-request"
    locked = _routing(_config(lock_strategy="round-robin"), first.pool)
    assert locked.strategy("m", "least-request")[0] == "round-robin"


def test_the_kept_default_matches_a_fresh_reading_through_random_changes():
    rng = random.Random(11)
    routing = _routing(_config())
    pool, live = routing.pool, []
    for i in range(300):
        if live and rng.random() < 0.45:
            pool.remove(live.pop(rng.randrange(len(live))))
        else:
            extra = {"routing_strategy": rng.choice(["", "least-request", "prefix-cache"])} if rng.random() < 0.3 else {}
            live.append(pool.add(Endpoint(url=f"http://10.1.{i // 200}.{i % 200 + 1}:8000", model=rng.choice("mn"),
                                          role=rng.choice(["aggregated"] * 3 + ["prefill", "decode"]), extra=extra)))
        for model in "mn":
            assert routing.strategy(model, None) == _plain(routing, model)


def test_a_decisions_latency_counts_under_its_strategys_label_kept_per_spelling():
    routing = _routing(_config())
    m = routing.metrics
    for spec in ("prefix-cache:3,least-request:2", "least-request:1,prefix-cache:5", "random"):
        routing._report(None, None, spec, 0.001)
    label = m.child(m.routing, "least-request,prefix-cache")
    assert label.counts and sum(label.counts) == 2 and sum(m.child(m.routing, "random").counts) == 1
    assert routing._latency["prefix-cache:3,least-request:2"] is label
    for i in range(256 - 3):
        routing._latency_child(f"random:{i}")
    assert len(routing._latency) == 256
    routing._latency_child("random:x")
    assert len(routing._latency) == 1        # bounded: cleared when full
