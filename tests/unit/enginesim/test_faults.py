"""Fault alternatives (``a | b``): each rolls its own probability, in order."""

from __future__ import annotations

import random

from enginesim.faults import NO_FAULT, parse_fault


def test_alternatives_roll_in_order():
    spec = parse_fault("status=500;p=0.5 | drop_after=5;p=0.2")
    assert spec.active and spec.status == 500 and spec.otherwise.drop_after == 5
    draws = iter([0.7, 0.1])          # misses the 500, hits the drop
    hit = spec.roll(lambda: next(draws))
    assert hit is not None and hit.drop_after == 5 and hit.status is None and hit.otherwise is None
    assert spec.roll(lambda: 0.9) is None
    assert spec.roll(lambda: 0.1).status == 500


def test_alternatives_shares():
    spec = parse_fault("status=500;p=0.5|drop_after=5;p=0.2")
    rng = random.Random(7)
    hits = [spec.roll(rng.random) for _ in range(4000)]
    s500 = sum(1 for h in hits if h is not None and h.status == 500) / len(hits)
    drops = sum(1 for h in hits if h is not None and h.drop_after == 5) / len(hits)
    assert 0.45 < s500 < 0.55 and 0.07 < drops < 0.13      # 0.5, and 0.2 of the other half


def test_role_prefixes_in_alternatives_and_none():
    spec = parse_fault("decode.status=503|prefill.hang=1", role="prefill")
    assert spec.status is None and spec.otherwise.hang == 1.0
    assert parse_fault("none") is NO_FAULT


def test_faults_at_a_streams_end():
    spec = parse_fault("stall_at_end=inf")
    assert spec.active and spec.stall_at_end == float("inf") and not spec.drop_at_end
    spec = parse_fault("drop_at_end=1;p=0.5")
    assert spec.active and spec.drop_at_end and spec.probability == 0.5
    assert not parse_fault("drop_at_end=0").active
