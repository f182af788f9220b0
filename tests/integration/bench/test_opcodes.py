"""bench/opcodes.py: the interpreter's work per request, counted on a real gateway."""

from __future__ import annotations

from bench.opcodes import REPO, by_file, count

# the periodic work that may or may not fire inside the traced window (health probes, engine
# scrapes, LoRA discovery) is not a request's: with six requests counted, one round of it moves
# the count by percents
QUIET = "health: {enabled: false}\nscrape: {enabled: false}\nlora: {discovery_interval_s: 0}\n"


def test_a_request_is_counted_through_the_pipeline_and_the_count_repeats():
    runs = [count(REPO, requests=6, warmup=3, stream=False, workers=1, extra=QUIET) for _ in range(2)]
    for got in runs:
        ops, calls = got["ops"], got["calls"]
        handle = [k for k in calls if k.endswith(":Pipeline.handle")]
        assert handle and 2.0 <= calls[handle[0]] <= 3.0  # an entry and a resume or two a request
        files = by_file(got)
        assert files["gateway/pipeline/pipeline.py"] > 100
        assert files["gateway/upstream/h1client.py"] > 100
        assert 1000 < sum(ops.values()) < 50_000
    a, b = (sum(r["ops"].values()) for r in runs)
    assert abs(a - b) < 0.05 * a                          # counted, not timed: the same run to run
