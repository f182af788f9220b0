"""The routing simulation: deterministic, and it sees what routing changes."""

from __future__ import annotations

from dataclasses import replace

from bench.routing import EngineModel, Workload
from bench.routing_sim import simulate
from enginesim.tiny_tokenizer import TINY_DIR
from gateway.kv.tokenization import ModelTokenizer

W = replace(Workload(), engines=3, duration_s=3.0, warmup_s=0.5, conversation_rate=6.0, unique_rate=1.0,
            system_prompts=4, system_tokens=300, unique_tokens=(100, 200))


def test_simulation_is_deterministic_and_prefix_routing_hits():
    tok = ModelTokenizer(TINY_DIR)
    em = EngineModel()
    first = simulate("prefix-cache+events", W, em, replicas=2, tok=tok)
    again = simulate("prefix-cache+events", W, em, replicas=2, tok=tok)
    assert first == again
    rand = simulate("random", W, em, tok=tok)
    approx = simulate("prefix-cache", W, em, tok=tok)
    assert first.requests == rand.requests == approx.requests > 10
    assert rand.cache_hit < approx.cache_hit <= approx.reachable_hit
    assert first.cache_hit <= first.reachable_hit
