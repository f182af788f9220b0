"""The responses: config block: defaults and errors that name the key."""

from __future__ import annotations

import pytest

from gateway.config.schema import ConfigError, parse_config


def test_defaults_are_engine_state_and_auto_backend():
    r = parse_config("{}").responses
    assert (r.state, r.backend, r.affinity_ttl_s) == ("engine", "auto", 86400.0)
    assert r.history.max_response_bytes == 1 << 20


@pytest.mark.parametrize("text,message", [
    ("responses: {state: both}", "responses.state"),
    ("responses: {backend: redis}", "responses.backend: redis needs state.redis_url"),
    ("responses: {affinity_ttl_s: 0}", "responses.affinity_ttl_s"),
    ("responses: {history: {max_response_bytes: 10}}", "responses.history.max_response_bytes"),
    ("responses: {history: {max_response_bytes: 4096, max_total_bytes: 2048}}",
     "responses.history.max_total_bytes: must be at least history.max_response_bytes"),
    ("responses: {colour: red}", "responses.colour: unknown key"),
])
def test_bad_values_name_the_key(text, message):
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="c.yaml")
    assert message in str(ei.value)
