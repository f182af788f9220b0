"""How long a leg waits for its answer's head: one rule for aggregated, continued and decode legs."""

import pytest

from gateway.config.schema import UpstreamConfig, WatchdogConfig
from gateway.upstream.upstream import head_timeout


@pytest.mark.parametrize(("first_byte", "first_chunk", "response", "stream", "expected"), [
    (300.0, 60.0, 0.0, True, 60.0),       # the watchdog's first-chunk bound is the shorter
    (10.0, 60.0, 0.0, True, 10.0),        # first_byte_timeout_s is the shorter
    (300.0, 0.0, 0.0, True, 300.0),       # the watchdog phase is off
    (300.0, 60.0, 0.0, False, 300.0),     # a non-stream: the whole-answer bound (off by default)
    (300.0, 60.0, 30.0, False, 30.0),
    (0.0, 60.0, 0.0, True, 60.0),
    (0.0, 0.0, 0.0, True, None),          # unbounded
])
def test_the_shorter_bound_applies(first_byte, first_chunk, response, stream, expected):
    wd = WatchdogConfig(first_chunk_timeout_s=first_chunk, response_timeout_s=response)
    assert head_timeout(UpstreamConfig(first_byte_timeout_s=first_byte), wd, stream) == expected


def test_an_unwatched_leg_waits_first_byte_timeout_s():
    assert head_timeout(UpstreamConfig(first_byte_timeout_s=300.0), None, True) == 300.0
    assert head_timeout(UpstreamConfig(first_byte_timeout_s=0.0), None, False) is None
