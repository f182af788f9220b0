"""The endpoint pool's per-model summaries (P/D endpoints, a strategy hint) follow endpoints as they
are added and removed, as a scan of the model's endpoints would find them."""

from __future__ import annotations

import random

from gateway.endpoints import Endpoint, EndpointPool


def _scan(pool: EndpointPool, model: str) -> tuple[bool, str | None]:
    eps = pool.endpoints(model)
    hint = next((ep.extra["routing_strategy"] for ep in eps if ep.extra.get("routing_strategy")), None)
    return any(ep.role in ("prefill", "decode") for ep in eps), hint


def test_summaries_follow_adds_and_removes():
    pool = EndpointPool()
    assert not pool.has_pd("m") and pool.strategy_hint("m") is None
    plain = pool.add(Endpoint(url="http://10.0.0.1:8000", model="m"))
    hinted = pool.add(Endpoint(url="http://10.0.0.2:8000", model="m", extra={"routing_strategy": "least-request"}))
    other = pool.add(Endpoint(url="http://10.0.0.3:8000", model="m", extra={"routing_strategy": "prefix-cache"}))
    assert not pool.has_pd("m") and pool.strategy_hint("m") == "least-request"    # the first one found
    prefill = pool.add(Endpoint(url="http://10.0.1.1:8000", model="m", role="prefill"))
    assert pool.has_pd("m") and not pool.has_pd("other-model")
    pool.remove(hinted)
    assert pool.strategy_hint("m") == "prefix-cache"
    pool.remove(prefill)
    pool.remove(other)
    assert not pool.has_pd("m") and pool.strategy_hint("m") is None
    assert pool.has_model("m")
    pool.remove(plain)
    pool.remove(plain)                                  # twice: nothing changes
    assert not pool.has_pd("m") and pool.models() == [] and not pool.has_model("m")


def test_summaries_match_a_scan_through_random_changes():
    rng = random.Random(7)
    pool = EndpointPool()
    live: list[Endpoint] = []
    def change() -> None:
        if live and rng.random() < 0.45:
            pool.remove(live.pop(rng.randrange(len(live))))
        else:
            extra = {"routing_strategy": rng.choice(["", "random", "prefix-cache"])} if rng.random() < 0.3 else {}
            live.append(pool.add(Endpoint(url=f"http://10.0.0.{rng.randrange(1, 60)}:8000",
                                          model=rng.choice(["a", "b"]), role=rng.choice(["aggregated"] * 3 + ["prefill", "decode"]),
                                          extra=extra)))

    for _ in range(400):
        if rng.random() < 0.2:          # some in a batch (a list), ordered at its end; the others one at a time
            with pool.batch():
                for _ in range(rng.randrange(1, 6)):
                    change()
        else:
            change()
        for model in ("a", "b"):
            assert (pool.has_pd(model), pool.strategy_hint(model)) == _scan(pool, model)
            assert pool.has_model(model) == bool(pool.endpoints(model))
            ordered = sorted(pool.endpoints(model), key=lambda e: e.url)     # stable: ties as they came
            assert [ep.turn for ep in ordered] == list(range(len(ordered)))
        assert pool.shares_names() == any(len({e.name for e in pool.endpoints(m)}) < len(pool.endpoints(m))
                                          for m in ("a", "b"))
