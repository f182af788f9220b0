"""The routing benchmark's reachable-hit oracle (an infinite cache shared by the fleet)."""

from __future__ import annotations

from bench.routing import Sample, Workload, reachable_hit
from enginesim.tiny_tokenizer import TINY_DIR
from gateway.tokenization import ModelTokenizer

SYSTEM = {"role": "system", "content": "You are assistant 3. " + "kqz lo abc the of " * 40}


def _sample(sent: float, ttft: float, messages: list[dict]) -> Sample:
    return Sample(sent=sent, ttft=ttft, e2e=ttft, status=200, messages=messages)


def test_reachable_counts_prefixes_prefilled_before_the_request():
    tok = ModelTokenizer(TINY_DIR)
    first = [SYSTEM, {"role": "user", "content": "question one"}]
    second = [SYSTEM, {"role": "user", "content": "question two"}]
    unique = [{"role": "user", "content": "something else entirely " * 20}]
    a, b, u = (tok.encode(tok.render(m)) for m in (first, second, unique))
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) // 16 * 16
    full_b = 16 * ((len(b) - 1) // 16)              # never the last token
    samples = [_sample(0.0, 0.5, first),
               _sample(0.1, 0.5, second),           # sent while the first was still prefilling
               _sample(1.0, 0.5, second),           # both done by now
               _sample(1.2, 0.5, unique)]
    reach, sent_before = reachable_hit(samples, Workload(warmup_s=0.0, duration_s=100.0), 16)
    total = len(a) + 2 * len(b) + len(u)
    assert reach == full_b / total
    assert sent_before == (common + full_b) / total


def test_only_measured_requests_count_but_all_feed_the_cache():
    w = Workload(warmup_s=1.0, duration_s=100.0)
    first = [SYSTEM, {"role": "user", "content": "question one"}]
    assert reachable_hit([_sample(0.0, 0.1, first)], w, 16) == (0.0, 0.0)
    reach, _ = reachable_hit([_sample(0.0, 0.1, first), _sample(2.0, 0.1, first)], w, 16)
    n = len(ModelTokenizer(TINY_DIR).encode(ModelTokenizer(TINY_DIR).render(first)))
    assert reach == 16 * ((n - 1) // 16) / n
