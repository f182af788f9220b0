"""The conditional disaggregation rules, without sockets: prefill pressure with and without decode
headroom, and the default that always disaggregates."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from gateway.config.schema import config_from_dict
from gateway.endpoints import Endpoint, EngineMetrics
from gateway.pd.decide import PDDecider, PDDecisionMetrics
from gateway.pipeline.context import RequestRecord
from gateway.request import CHAT
from routers.base import Decision, RouterContext
from tests.support.factories import inference_request

VLLM = SimpleNamespace(decode_runs_whole=True, unsplit=lambda ireq, context=None: None)


def setup(**pd):
    cfg = config_from_dict({"models": [{"name": "m", "rolesets": [{"prefill": ["http://p:1"], "decode": ["http://d:1"]}],
                                        **({"pd": pd} if pd else {})}]})
    index = RouterContext(settings=cfg.routing).prefix_index
    decider = PDDecider(cfg, index, PDDecisionMetrics(CollectorRegistry()))
    p = Endpoint(url="http://p:1", model="m", role="prefill", roleset="rs")
    dec = Endpoint(url="http://d:1", model="m", role="decode", roleset="rs")
    return decider, p, dec


def ctx_for(p, d):
    ireq = inference_request(tokens=1000)
    return SimpleNamespace(ireq=ireq, decision=Decision(d, "pd", prefill=p), rec=RequestRecord("r", CHAT, 0.0),
                           after_write=[], api=None)      # a chat request: no API shape of its own


def written(ctx):
    """What ``RequestContext.written`` does once the leg is out."""
    for fn in ctx.after_write:
        fn()
    ctx.after_write.clear()


def test_default_always_disaggregates():
    decider, p, d = setup()
    ctx = ctx_for(p, d)
    decider.decide(ctx, VLLM, [p, d])
    written(ctx)
    assert ctx.decision.prefill is p and ctx.rec.extra["pd_reason"] == "always"


def test_prefill_pressure_runs_whole_only_with_decode_headroom():
    decider, p, d = setup(local_prefill_pressure=2, local_max_decode_kv_usage=0.5)
    p.prefill_in_flight = 3
    ctx = ctx_for(p, d)
    assert decider.decide(ctx, VLLM, [p, d]) == [d]
    assert ctx.decision.prefill is None and ctx.decision.headers["x-pd-decision"] == "decode; reason=prefill_pressure"
    d.metrics = EngineMetrics(scraped_at=time.monotonic(), kv_usage=0.9)      # no headroom
    ctx = ctx_for(p, d)
    decider.decide(ctx, VLLM, [p, d])
    written(ctx)
    assert ctx.decision.prefill is p and ctx.rec.extra["pd_reason"] == "uncached"


def test_decode_recorded_in_the_index_once_the_leg_is_written():
    decider, p, d = setup(disaggregate_min_uncached_tokens=100)
    ctx = ctx_for(p, d)
    decider.decide(ctx, VLLM, [p, d])
    assert "decode_uncached_tokens" not in ctx.rec.extra      # not yet: the leg is not written
    assert decider.index.match(ctx.ireq, [d])[d] == 0.0
    written(ctx)
    assert ctx.rec.extra["decode_uncached_tokens"] == 1000
    assert decider.index.match(ctx.ireq, [d])[d] == 100.0
    again = ctx_for(p, d)                                      # the next turn finds it on the decode
    decider.decide(again, VLLM, [p, d])
    written(again)
    assert again.decision.prefill is None and again.rec.extra["pd_reason"] == "cached_on_decode"
