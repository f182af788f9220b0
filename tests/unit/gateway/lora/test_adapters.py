"""Which endpoint a load goes to under ``max_adapters_per_endpoint`` and which adapter makes room:
pure choices of gateway/lora/adapters.py, no engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.config.schema import config_from_dict
from gateway.endpoints import Endpoint, EndpointPool
from gateway.lora.adapters import Lora, LoraMetrics, _PairAdapterInFlight
from gateway.pipeline.ledger import AdapterInFlight

ADAPTERS = {"a": "org/a", "b": "org/b", "c": "org/c"}


def make(cap: int = 2, n: int = 2) -> tuple[Lora, list[Endpoint]]:
    urls = [f"http://10.0.0.{i}:8000" for i in range(1, n + 1)]
    cfg = config_from_dict({"models": [{"name": "m", "endpoints": urls, "adapters": ADAPTERS}],
                            "lora": {"max_adapters_per_endpoint": cap}}, source="<test>")
    pool = EndpointPool()
    eps = [pool.add(Endpoint(url=u, model="m")) for u in urls]
    now = [100.0]
    lora = Lora(cfg, pool, upstream=None, metrics=LoraMetrics(CollectorRegistry()), clock=lambda: now[0])
    return lora, eps


def test_victim_is_the_least_recently_used_configured_adapter_with_nothing_in_flight():
    lora, (ep, _) = make()
    ep.adapters.served = {"a": "m", "b": "m", "found": "m"}      # "found": discovered, not in the config
    ep.adapters.recent = {"b": 1.0, "a": 2.0}
    assert lora._victim(ep, keep="c") == "b"
    charge = AdapterInFlight(ep, "b")
    assert lora._victim(ep, keep="c") == "a"
    assert lora._victim(ep, keep="a") is None                   # b in flight, "found" not the gateway's
    charge.release()
    lora._loaded_at[(id(ep), "b")] = 50.0                       # a fresh load counts as a use
    assert lora._victim(ep, keep="c") == "a"


def test_target_prefers_room_then_an_endpoint_with_something_to_unload():
    lora, (full, roomy) = make(cap=1)
    full.adapters.served = {"a": "m"}
    roomy.in_flight = 5                                         # busier, but under the cap
    assert lora.target([full, roomy], "b") is roomy
    lora._pending[id(roomy)] = {"c"}                            # a load on its way counts
    assert lora.target([full, roomy], "b") is full              # a can go
    held = AdapterInFlight(full, "a")
    assert lora.target([full, roomy], "b") is None              # nothing may go anywhere
    held.release()


def test_no_cap_leaves_target_as_before():
    lora, (x, y) = make(cap=0)
    x.adapters.served = {"a": "m", "b": "m", "c": "m"}
    y.in_flight = 1
    assert lora.target([x, y], "z") is x


def test_a_pd_charge_counts_on_both_legs_until_released():
    lora, (p, d) = make()
    charge = _PairAdapterInFlight(p, d, "a")
    assert p.adapters.in_flight == {"a": 1} and d.adapters.in_flight == {"a": 1}
    charge.release()
    charge.release()
    assert p.adapters.in_flight == {} and d.adapters.in_flight == {}


def test_an_endpoint_that_left_the_pool_leaves_no_cooldown_or_load_behind():
    """They are keyed by id(): a new endpoint at a freed address would inherit them."""
    lora, (ep, other) = make()
    for d in (lora._loaded_at, lora._unloaded_at):
        d[(id(ep), "a")] = d[(id(other), "a")] = 1.0
    lora._cooldown[(id(ep), "b")] = (200.0, "failed")
    lora.pool.remove(ep)
    assert [k[0] for k in (*lora._loaded_at, *lora._unloaded_at, *lora._cooldown)] == [id(other)] * 2


def make_clocked() -> tuple[Lora, list[Endpoint], list[float]]:
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    cfg = config_from_dict({"models": [{"name": "m", "endpoints": urls, "adapters": ADAPTERS}],
                            "lora": {"load_timeout_s": 30}, "view": {"peer_ttl_s": 1.0}}, source="<test>")
    pool = EndpointPool()
    eps = [pool.add(Endpoint(url=u, model="m")) for u in urls]
    now = [100.0]
    lora = Lora(cfg, pool, upstream=None, metrics=LoraMetrics(CollectorRegistry()), clock=lambda: now[0])
    return lora, eps, now


async def test_a_sibling_load_under_way_is_awaited_until_it_ends_either_way():
    import asyncio

    lora, (ep, other), now = make_clocked()
    assert await lora._await_sibling("m", "a", [ep, other]) is None          # none under way: not waited
    lora.adopt_load_started(other, "a", "g/1", 7)
    waiting = asyncio.ensure_future(lora._await_sibling("m", "a", [ep, other]))
    await asyncio.sleep(0)
    assert not waiting.done()
    lora.adopt_load_ended(other, "a", "m", 100.0)                            # loaded: served there
    assert await waiting is other and other.adapters.served == {"a": "m"}
    lora.adopt_load_started(ep, "b", "g/1", 7)
    waiting = asyncio.ensure_future(lora._await_sibling("m", "b", [ep, other]))
    await asyncio.sleep(0)
    lora.adopt_load_failed(ep, "b", "m", 160.0, "No adapter found")          # failed: its cooldown is ours
    assert await waiting is ep and "b" not in ep.adapters.served
    assert lora._cooling(ep, "b", now[0]) == (160.0, "No adapter found") and not lora._sibling_loads
    outcomes = {s.labels["outcome"]: s.value for s in next(lora.metrics.load_waits.collect()).samples
                if s.name.endswith("_total")}
    assert outcomes == {"loaded": 1.0, "failed": 1.0}


async def test_a_sibling_that_restarted_or_went_silent_is_not_awaited():
    import asyncio

    lora, (ep, _), now = make_clocked()
    lora.adopt_load_started(ep, "a", "g/1", 7)
    waiting = asyncio.ensure_future(lora._await_sibling("m", "a", [ep]))
    await asyncio.sleep(0)
    lora.sibling_run("g/1", 7)                                                # the same run: still under way
    await asyncio.sleep(0)
    assert not waiting.done()
    lora.sibling_run("g/1", 9)                                                # restarted: that load is gone
    assert await waiting is ep and not lora._sibling_loads
    lora.adopt_load_started(ep, "a", "g/1", 9)
    now[0] += 1.5                                                             # not heard for peer_ttl_s
    assert await lora._await_sibling("m", "a", [ep]) is ep and not lora._sibling_loads


def test_target_breaks_ties_at_random_and_keeps_to_the_least_loaded():
    lora, eps = make(cap=0, n=3)
    picks = {lora.target(eps, "a").url for _ in range(200)}
    assert picks == {ep.url for ep in eps}                      # equal: each of them, not the first listed
    eps[0].in_flight = 1
    picks = {lora.target(eps, "a").url for _ in range(200)}
    assert picks == {eps[1].url, eps[2].url}                    # the busier one never
    eps[1].adapters.served = {"b": "m"}                         # fewer adapters held breaks the tie first
    assert {lora.target(eps, "a").url for _ in range(50)} == {eps[2].url}


def test_the_context_length_of_a_model_list_is_its_base_cards():
    """``max_model_len`` of the endpoint's model's card; else of the list's one card without a parent
    (an engine serving its model under another name); None when it lists none or no usable one."""
    from gateway.lora.adapters import model_context

    card = {"id": "m", "object": "model", "root": "org/m", "parent": None, "max_model_len": 8192}
    lora = {"id": "a", "root": "/a", "parent": "m", "max_model_len": None}
    assert model_context({"object": "list", "data": [lora, card]}, "m") == 8192
    assert model_context({"data": [lora, {**card, "id": "served"}]}, "m") == 8192
    assert model_context({"data": [{**card, "id": "x"}, {**card, "id": "y"}]}, "m") is None
    for bad in (None, True, "8192", 0, -1, 1.5):
        assert model_context({"data": [{**card, "max_model_len": bad}]}, "m") is None
    assert model_context({"data": "m"}, "m") is None and model_context([], "m") is None


def test_the_listing_marks_loadable_only_the_adapters_its_parent_may_load():
    """An adapter engines of one model serve that the config lists for another is listed as the
    first model's (its requests go there), which cannot load it: not ``loadable``. The parent is
    the first model (the pool's order) with an endpoint serving it; its ready endpoints are that
    model's only."""
    cfg = config_from_dict({"models": [{"name": "m", "endpoints": ["http://10.0.0.1:8000"]},
                                       {"name": "n", "endpoints": ["http://10.0.0.2:8000"],
                                        "adapters": {"x": "org/x", "y": "org/y"}}]}, source="<test>")
    pool = EndpointPool()
    m1 = pool.add(Endpoint(url="http://10.0.0.1:8000", model="m"))
    n1 = pool.add(Endpoint(url="http://10.0.0.2:8000", model="n"))
    m2 = pool.add(Endpoint(url="http://10.0.0.3:8000", model="m"))
    lora = Lora(cfg, pool, upstream=None, metrics=LoraMetrics(CollectorRegistry()))
    m1.adapters.served = {"x": "m"}
    n1.adapters.served = {"x": "n", "y": "n", "z": "n"}
    m2.adapters.served = {"x": "m", "z": "m"}
    m2.healthy = False
    assert lora.base_of("x") == lora.base_of("z") == "m"
    assert lora.describe() == [
        {"id": "x", "parent": "m", "ready_endpoints": 1},                  # n lists it: m cannot load it
        {"id": "y", "parent": "n", "ready_endpoints": 1, "loadable": True},
        {"id": "z", "parent": "m", "ready_endpoints": 0},                  # n1's is not m's
    ]
    n1.adapters.served = {}
    assert lora.describe()[0] == {"id": "x", "parent": "m", "ready_endpoints": 1}
    m1.adapters.served = m2.adapters.served = {}                           # nobody serves it: n's, loadable
    assert lora.describe()[0] == {"id": "x", "parent": "n", "ready_endpoints": 0, "loadable": True}


def test_endpoints_that_leave_or_restart_in_a_burst_do_not_walk_every_endpoints_bookkeeping():
    """A namespace of pods emptied (or a fleet restarted) takes its endpoints out one at a time:
    each must find its own cooldowns, loads, unloads and siblings' uses, not walk those of every
    endpoint, which made the burst O(endpoints²) once the gateway kept any."""
    n = 2000
    lora, eps = make(cap=0, n=n)
    walked = [0]
    names = ("_cooldown", "_loaded_at", "_unloaded_at", "_sibling_used", "_sibling_loads")
    for name in names:
        kind = type(getattr(lora, name))

        def walk(self, _iter=kind.__iter__):
            for k in _iter(self):
                walked[0] += 1
                yield k

        def items(self, _items=kind.items):
            walked[0] += len(self)
            return _items(self)

        setattr(lora, name, type("Counted", (kind,), {"__iter__": walk, "items": items})())
    for i, ep in enumerate(eps):
        lora.adopt_change(ep, 50.0, {"a": "m"}, True)
        lora.adopt_use(ep, 60.0, {"a": "m", "b": "m"})
        lora.adopt_load_failed(ep, "c", "m", 200.0, "failed")
        lora.adopt_load_started(ep, "b", "g/1", 7)
        if i % 2:
            lora.adopt_change(ep, 70.0, {"a": "m"}, False)
    walked[0] = 0
    for ep in eps[: n // 2]:
        lora.engine_restarted(ep)          # its cooldowns go
    for ep in eps:
        lora.pool.remove(ep)
    assert walked[0] <= 4 * n, f"{n} endpoints that left walked {walked[0]} entries"
    assert not any(getattr(lora, name) for name in names) and not lora._pending
