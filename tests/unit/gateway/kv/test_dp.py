"""Data-parallel engines behind one endpoint: ``data_parallel_size`` (config, endpoint entries, the pod
annotation), one subscriber per rank on ``port + rank``, and clearing one rank's entries only."""

from __future__ import annotations

from functools import partial

import msgspec
import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.config.schema import ConfigError
from gateway.endpoints import Endpoint
from gateway.kv.events import KVEventsManager, Subscriber
from gateway.kv.index import EventIndex
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer
from gateway.kv.wire import decode_batch, rank_of
from k8s.pods import parse_kv_events
from tests.support.factories import block_stored, one_model

TOK = str(TINY_DIR)
enc = msgspec.msgpack.encode


_stored = partial(block_stored, lora_id=None, medium="GPU", lora_name=None)


AT_ONE_ENDPOINT = {"tokenizer": TOK, "endpoints": ["http://127.0.0.1:8000"]}


def test_data_parallel_size_defaults_to_one_and_is_validated():
    assert KVEventsConfig().data_parallel_size == 1
    assert one_model({**AT_ONE_ENDPOINT, "kv_events": {"enabled": True, "data_parallel_size": 4}}).models[0].kv_events.data_parallel_size == 4
    for block, says in (({"data_parallel_size": 0}, r"models\[0\].kv_events.data_parallel_size"),
                        ({"port": 65535, "data_parallel_size": 2}, "beyond 65535"),
                        ({"replay_port": 65534, "data_parallel_size": 3}, "replay_port 65534")):
        with pytest.raises(ConfigError, match=says):
            one_model({**AT_ONE_ENDPOINT, "kv_events": {"enabled": True, **block}})


def test_endpoint_entries_take_data_parallel_size_and_check_the_ports_it_spans():
    cfg = one_model({**AT_ONE_ENDPOINT, "kv_events": {"enabled": True, "port": 6000},
                   "endpoints": [{"url": "http://127.0.0.1:8000", "kv_events": {"data_parallel_size": 2}}]})
    (ep,) = cfg.models[0].endpoints
    assert dict(ep.kv_events.items()) == {"data_parallel_size": 2}
    with pytest.raises(ConfigError, match=r"models\[0\].endpoints\[0\].kv_events.data_parallel_size"):
        one_model({**AT_ONE_ENDPOINT, "endpoints": [{"url": "http://127.0.0.1:8000", "kv_events": {"data_parallel_size": 0}}]})
    # the entry's ranks with the model's port (or the other way round) must stay within TCP ports
    with pytest.raises(ConfigError, match="endpoint http://127.0.0.1:8000 kv_events: port 65535"):
        one_model({**AT_ONE_ENDPOINT, "kv_events": {"enabled": True, "data_parallel_size": 2},
                 "endpoints": [{"url": "http://127.0.0.1:8000", "kv_events": {"port": 65535}}]})


def test_the_annotation_takes_data_parallel_size():
    assert parse_kv_events('{"port": 6000, "data_parallel_size": 4}') == (("port", 6000), ("data_parallel_size", 4))
    for bad in ('{"data_parallel_size": 0}', '{"data_parallel_size": "2"}', '{"data_parallel_size": true}'):
        with pytest.raises(ValueError, match="bad key 'data_parallel_size'"):
            parse_kv_events(bad)
    with pytest.raises(ValueError, match="replay_port \\+ data_parallel_size"):
        parse_kv_events('{"replay_port": 65535, "data_parallel_size": 2}')
    s = KVEventsConfig().with_annotation({"port": 7000, "data_parallel_size": 3})
    assert (s.enabled, s.port, s.data_parallel_size) == (True, 7000, 3)


def test_each_rank_subscribes_on_its_offset_ports():
    manager = KVEventsManager.__new__(KVEventsManager)          # addresses only, no sockets
    s = KVEventsConfig(enabled=True, port=6000, replay_port=6100, data_parallel_size=3)
    idx = EventIndex({}, lambda m: s)
    st = idx.track(Endpoint(url="http://10.0.0.1:8000", model="m"), s)
    subs = [Subscriber(manager, st, r) for r in range(3)]
    assert [x.pub_addr for x in subs] == [f"tcp://10.0.0.1:{6000 + r}" for r in range(3)]
    assert [x.replay_addr for x in subs] == [f"tcp://10.0.0.1:{6100 + r}" for r in range(3)]
    one = Subscriber(manager, st)
    assert (one.pub_addr, one.replay_addr, one.rank) == ("tcp://10.0.0.1:6000", "tcp://10.0.0.1:6100", None)


def test_the_port_names_the_rank_whatever_the_batch_says():
    # an engine that leaves data_parallel_rank null is still told apart by the port it publishes on
    payload = enc({"ts": 0, "events": [_stored([5], 4, list(range(16)))], "data_parallel_rank": None})
    assert decode_batch(payload).events[0].block_hashes == [5]
    (ev,) = decode_batch(payload, 2).events
    assert ev.block_hashes == [(2, 5)] and ev.parent_block_hash == (2, 4)
    assert decode_batch(payload, 0).events[0].block_hashes == [5]
    assert [rank_of(h) for h in (5, b"\x05", (2, 5), (1, b"\x05"))] == [0, 0, 2, 1]


def test_clearing_one_rank_keeps_the_others():
    s = KVEventsConfig(enabled=True, speculative_ttl_s=0, data_parallel_size=3)
    idx = EventIndex({"m": ModelTokenizer(TINY_DIR)}, lambda m: s)
    a = idx.track(Endpoint(url="http://10.0.0.1:8000", model="m"), s)
    b = idx.track(Endpoint(url="http://10.0.0.2:8000", model="m"), s)
    shared, own = list(range(32)), list(range(100, 132))

    def feed(st, rank, *events):
        idx.apply(st, decode_batch(enc({"ts": 0, "events": list(events), "data_parallel_rank": rank}), rank), rank)

    for rank in (0, 1, 2):
        feed(a, rank, _stored([1, 2], None, shared))            # every rank of a holds the shared prefix
    feed(a, 1, _stored([10, 11], None, own))                    # rank 1 alone holds its own prefix
    feed(b, 1, _stored([10, 11], None, own))                    # so does rank 1 of another endpoint
    key_own = a.emap[(1, 10)]
    assert len(a.emap) == 8 and idx._holders[key_own] == a.bit | b.bit

    idx.clear_rank(a, 1)                                        # a gap or restart on a's rank 1
    assert set(a.emap) == {1, 2, (2, 1), (2, 2)}
    assert idx._holders[key_own] == b.bit                       # b's rank 1 is untouched
    assert len(b.emap) == 2
    assert idx._holders[a.emap[1]] & a.bit                      # ranks 0 and 2 still hold the shared prefix

    idx.clear_rank(a, 0)                                        # rank 0's plain hashes
    assert set(a.emap) == {(2, 1), (2, 2)}
    feed(a, 2, {"type": "AllBlocksCleared"})                    # rank 2's cache reset: rank 2 only
    assert not a.emap and not a.owned and len(b.emap) == 2
    feed(b, None, {"type": "AllBlocksCleared"})                 # one publisher: the whole endpoint
    assert not b.emap and not idx._holders


def test_a_rank_whose_publisher_port_is_another_ranks_replay_port_is_refused():
    """Rank r binds port + r and replay_port + r on the engine's host: two ranges that overlap
    name a port two sockets would bind, which no engine can start with (`Address already in
    use`), so the config says so rather than subscribe to a publisher that cannot be there."""
    for block, says in (({"port": 5557, "replay_port": 5558, "data_parallel_size": 2},
                         "port 5557-5558 and replay_port 5558-5559 overlap"),
                        ({"port": 6000, "replay_port": 6000}, "port 6000 and replay_port 6000 overlap"),
                        ({"port": 6003, "replay_port": 6000, "data_parallel_size": 4},
                         "port 6003-6006 and replay_port 6000-6003 overlap")):
        with pytest.raises(ConfigError, match=says):
            one_model({**AT_ONE_ENDPOINT, "kv_events": {"enabled": True, **block}})
    # side by side is fine, either way round
    for block in ({"port": 5557, "replay_port": 5559, "data_parallel_size": 2},
                  {"port": 6004, "replay_port": 6000, "data_parallel_size": 4}):
        one_model({**AT_ONE_ENDPOINT, "kv_events": {"enabled": True, **block}})
    # an endpoint's entry laid over the model's block is judged with it, and so is a pod's annotation
    with pytest.raises(ConfigError, match="endpoint http://127.0.0.1:8000 kv_events: port 5557-5558 and replay_port"):
        one_model({**AT_ONE_ENDPOINT, "kv_events": {"enabled": True, "replay_port": 5558},
                   "endpoints": [{"url": "http://127.0.0.1:8000", "kv_events": {"data_parallel_size": 2}}]})
    with pytest.raises(ValueError, match="overlap"):
        KVEventsConfig(replay_port=5558).with_annotation({"data_parallel_size": 4})
    # an annotation that gives both ports is refused by discovery as it reads it, as a bad port is
    with pytest.raises(ValueError, match="annotation switchyard.io/kv-events: port 5557-5560 and replay_port 5558-5561 overlap"):
        parse_kv_events('{"port": 5557, "replay_port": 5558, "data_parallel_size": 4}')
    assert parse_kv_events('{"port": 5557, "replay_port": 5567, "data_parallel_size": 4}')
