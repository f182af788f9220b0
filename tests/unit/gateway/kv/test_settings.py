"""An endpoint's own ``kv_events`` (its publisher's ports), laid over its model's block."""

from __future__ import annotations

import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.config.schema import ConfigError
from gateway.kv.events import KVEventsManager
from gateway.kv.settings import KVEventsConfig
from gateway.server.reload import declared_endpoints
from tests.support.factories import one_model

TOK = str(TINY_DIR)


def _settings(cfg) -> dict[str, KVEventsConfig | None]:
    by_model = {m.name: m.kv_events for m in cfg.models}
    manager = KVEventsManager.__new__(KVEventsManager)      # only endpoint_settings, no sockets
    manager.settings = by_model.get
    return {ep.url: manager.endpoint_settings(ep) for ep in declared_endpoints(cfg)}


def test_endpoints_on_one_host_publish_on_ports_of_their_own():
    cfg = one_model({"tokenizer": TOK, "kv_events": {"enabled": True, "replay_port": 5558, "stall_timeout_s": 3},
                   "endpoints": ["http://127.0.0.1:8000",
                                 {"url": "http://127.0.0.1:8001", "kv_events": {"port": 5567, "replay_port": 5568}},
                                 {"url": "http://127.0.0.1:8002", "kv_events": {"topic": "kv@b"}}]})
    s = _settings(cfg)
    assert (s["http://127.0.0.1:8000"].port, s["http://127.0.0.1:8000"].replay_port) == (5557, 5558)
    assert (s["http://127.0.0.1:8001"].port, s["http://127.0.0.1:8001"].replay_port) == (5567, 5568)
    assert s["http://127.0.0.1:8001"].stall_timeout_s == 3         # the model's other keys are kept
    assert (s["http://127.0.0.1:8002"].port, s["http://127.0.0.1:8002"].topic) == (5557, "kv@b")


def test_an_endpoint_entry_alone_turns_events_on_for_that_endpoint():
    cfg = one_model({"tokenizer": TOK, "rolesets": [{"name": "rs", "prefill": [
        {"url": "http://127.0.0.1:8000", "kv_events": {"port": 6000}}], "decode": ["http://127.0.0.1:8001"]}]})
    assert cfg.models[0].wants_kv_events
    s = _settings(cfg)
    assert s["http://127.0.0.1:8000"].enabled and s["http://127.0.0.1:8000"].port == 6000
    assert s["http://127.0.0.1:8001"] is None


@pytest.mark.parametrize(("entry", "error"), [
    ({"port": 0}, "models[0].endpoints[0].kv_events.port"),
    ({"prot": 1}, "models[0].endpoints[0].kv_events"),
])
def test_bad_endpoint_entries_name_the_key(entry, error):
    with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace("]", r"\]")):
        one_model({"tokenizer": TOK, "endpoints": [{"url": "http://127.0.0.1:8000", "kv_events": entry}]})


def test_an_endpoint_entry_needs_the_tokenizer():
    with pytest.raises(ConfigError, match="tokenizer"):
        one_model({"endpoints": [{"url": "http://127.0.0.1:8000", "kv_events": {"port": 6000}}]})
