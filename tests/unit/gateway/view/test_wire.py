"""The view's messages: round trip, and batches split to fit a datagram."""

from __future__ import annotations

import pytest

from gateway.view.wire import (
    LOAD_FAILED,
    LOAD_OK,
    LOAD_STARTED,
    Batch,
    Insert,
    LoraLoad,
    Session,
    decode,
    encode,
)


def test_a_batch_round_trips_with_64_bit_keys():
    ins = [Insert("m|http://a:1", [1, 2**64 - 1, 2**63])]
    ses = [Session("m\0s:k", "m|http://a:1", None), Session("r:resp_1", "m|http://b:1", "alice")]
    (one,) = encode("g/0", 12.5, ins, ses, {"m|http://a:1": 3}, 60_000)
    b = decode(one)
    assert b == Batch("g/0", 12.5, ins, ses, {"m|http://a:1": 3})


def test_what_does_not_fit_is_split_and_the_load_travels_once():
    ins = [Insert(f"m|http://a:{i}", list(range(i * 100, i * 100 + 100))) for i in range(20)]   # ~1 KB each
    out = encode("g/1", 1.0, ins, [Session("k", "e")], {"e": 1}, 4096)
    assert len(out) > 1 and all(len(p) <= 4096 for p in out)
    batches = [decode(p) for p in out]
    assert [i for b in batches for i in b.inserts] == ins
    assert [s.key for b in batches for s in b.sessions] == ["k"]
    assert [b.load for b in batches if b.load is not None] == [{"e": 1}]


def test_an_empty_flush_with_load_is_one_batch_and_garbage_is_refused():
    (only,) = encode("g/0", 1.0, [], [], {}, 1000)
    assert decode(only).load == {}
    with pytest.raises(ValueError):
        decode(b"\x93not a batch")


def test_probes_and_engine_snapshots_round_trip_and_are_split_to_fit():
    from gateway.endpoints import EngineMetrics
    from gateway.view.wire import Probe, Scrape, decode_snapshot, encode_snapshot

    snap = EngineMetrics(scraped_at=123.25, running=3.0, waiting=1.0, kv_usage=0.5, block_size=16,
                         lora_running=frozenset({"a", "b"}), gateway_in_flight=2)
    assert decode_snapshot(encode_snapshot(snap)) == snap
    scrapes = [Scrape(f"m|http://e:{i}", i, encode_snapshot(snap)) for i in range(40)]
    probes = [Probe(f"m|http://e:{i}", i % 2 == 0) for i in range(40)]
    out = encode("g/0", 1.0, [], [], None, 2048, probes=probes, scrapes=scrapes)
    assert len(out) > 1 and all(len(p) <= 2048 for p in out)
    batches = [decode(p) for p in out]
    assert [p for b in batches for p in b.probes] == probes
    assert [s for b in batches for s in b.scrapes] == scrapes
    with pytest.raises(ValueError):
        decode_snapshot(b"\x93\x01\x02\x03")


def test_preemption_requests_travel_once_in_the_first_batch():
    ins = [Insert(f"m|http://a:{i}", list(range(i * 100, i * 100 + 100))) for i in range(20)]
    out = encode("g/1", 1.0, ins, [], None, 4096, preempt=["m|http://a:1", "m|http://a:1"])
    batches = [decode(p) for p in out]
    assert len(batches) > 1 and batches[0].preempt == ["m|http://a:1", "m|http://a:1"]
    assert all(b.preempt == [] for b in batches[1:])
    (alone,) = encode("g/1", 1.0, [], [], None, 4096, preempt=["m|http://b:2"])
    assert decode(alone).preempt == ["m|http://b:2"]


def test_batches_with_insertions_or_sessions_are_numbered_and_a_view_snapshot_round_trips():
    from gateway.view.wire import ViewSnapshot, decode_view, encode_numbered, encode_view

    ins = [Insert(f"m|http://a:{i}", list(range(i * 100, i * 100 + 100))) for i in range(20)]
    out, seq = encode_numbered("g/1", 1.0, ins, [], {"e": 1}, 4096, run=7, seq=41)
    batches = [decode(p) for p in out]
    assert [b.seq for b in batches] == list(range(42, 42 + len(out))) and seq == 41 + len(out)
    assert {b.run for b in batches} == {7}
    (load_only,), same = encode_numbered("g/1", 1.0, [], [], {"e": 2}, 4096, run=7, seq=seq)
    assert same == seq and decode(load_only).seq == seq        # a count alone takes no number
    snap = ViewSnapshot(7, seq, ["m|http://a:1"], [("m\0s:k", 0, None, 12.5)], {3: "m|http://a:1"},
                        [[2**64 - 1, 3, 1234]])
    assert decode_view(encode_view(snap)) == snap
    with pytest.raises(ValueError):
        decode_view(b"\x93not a view")


def test_a_view_goes_in_parts_decoded_one_at_a_time_and_a_cut_part_is_refused():
    from gateway.view.wire import ViewSnapshot, decode_view, encode_view, view_parts

    head = encode_view(ViewSnapshot(7, 3, ["m|http://a:1"], [], {0: "m|http://a:1"}))
    rest = [encode_view(ViewSnapshot(0, 0, sessions=[(f"k{i}", 0, None, 1.0)])) for i in range(3)]
    rest.append(encode_view(ViewSnapshot(0, 0, blocks=[[5, 0, 99]])))
    data = head + b"".join(rest)
    parts = view_parts(data)
    assert next(parts).run == 7                          # read before the rest is decoded
    assert [p.sessions[0][0] for p in list(parts)[:3]] == ["k0", "k1", "k2"]
    whole = decode_view(data)
    assert (whole.run, whole.seq, len(whole.sessions), whole.blocks) == (7, 3, 3, [[5, 0, 99]])
    for cut in (data[:-1], data[:2]):
        with pytest.raises(ValueError):
            list(view_parts(cut))


def test_adapters_in_flight_travel_once_in_the_first_batch_and_a_batch_of_either_layout_decodes():
    import msgspec

    ins = [Insert(f"m|http://a:{i}", list(range(i * 100, i * 100 + 100))) for i in range(20)]
    busy = {"m|http://a:1": ["sql", "chat"]}
    out = encode("g/1", 1.0, ins, [], None, 4096, busy=busy)
    assert len(out) > 1 and all(len(p) <= 4096 for p in out)
    assert [b.busy for b in map(decode, out)] == [busy] + [None] * (len(out) - 1)
    (none,) = encode("g/1", 1.0, [], [], None, 4096, busy={})
    assert decode(none).busy == {}
    # a sibling of the version before (no busy, nor what came after) and one of a later version (a field more) both decode
    enc = msgspec.msgpack.Encoder()
    older = msgspec.msgpack.decode(out[0])[:-4]
    assert decode(enc.encode(older)).busy is None and decode(enc.encode(older)).inserts == decode(out[0]).inserts
    newer = [*msgspec.msgpack.decode(out[0]), {"unknown": 1}]
    assert decode(enc.encode(newer)).busy == busy


def test_adapter_load_outcomes_travel_once_in_the_first_batch_and_a_batch_of_either_layout_decodes():
    import msgspec

    ins = [Insert(f"m|http://a:{i}", list(range(i * 100, i * 100 + 100))) for i in range(20)]
    loads = [LoraLoad("m|http://a:1", "sql", "m", LOAD_FAILED, 1234.5, "No adapter found for /x"),
             LoraLoad("m|http://a:2", "chat", "m", LOAD_STARTED),
             LoraLoad("m|http://a:3", "chat", "m", LOAD_OK, 99.0)]
    out = encode("g/1", 1.0, ins, [], None, 4096, loads=loads)
    assert len(out) > 1 and all(len(p) <= 4096 for p in out)
    assert [b.loads for b in map(decode, out)] == [loads] + [[]] * (len(out) - 1)
    (alone,) = encode("g/1", 1.0, [], [], None, 4096, loads=loads)
    assert decode(alone).loads == loads and decode(alone).loads[1].message == "" and decode(alone).loads[1].at == 0.0
    # a sibling of the version before (no loads, nor what came after) and one of a later version (a field more) both decode
    enc = msgspec.msgpack.Encoder()
    older = msgspec.msgpack.decode(out[0])[:-3]
    assert decode(enc.encode(older)).loads == [] and decode(enc.encode(older)).inserts == decode(out[0]).inserts
    newer = [*msgspec.msgpack.decode(out[0]), {"unknown": 1}]
    assert decode(enc.encode(newer)).loads == loads


def test_the_models_queued_travel_once_in_the_first_batch_and_a_batch_of_either_layout_decodes():
    import msgspec

    ins = [Insert(f"m|http://a:{i}", list(range(i * 100, i * 100 + 100))) for i in range(20)]
    out = encode("g/1", 1.0, ins, [], None, 4096, queued=["m", "n"])
    assert len(out) > 1 and all(len(p) <= 4096 for p in out)
    assert [b.queued for b in map(decode, out)] == [["m", "n"]] + [None] * (len(out) - 1)
    (none,) = encode("g/1", 1.0, [], [], None, 4096, queued=[])
    assert decode(none).queued == []
    # a sibling of the version before (no queued, nor what came after) and one of a later version (a field more) both decode
    enc = msgspec.msgpack.Encoder()
    older = msgspec.msgpack.decode(out[0])[:-2]
    assert decode(enc.encode(older)).queued is None and decode(enc.encode(older)).inserts == decode(out[0]).inserts
    newer = [*msgspec.msgpack.decode(out[0]), {"unknown": 1}]
    assert decode(enc.encode(newer)).queued == ["m", "n"]


def test_a_batch_created_or_cancelled_travels_once_in_the_first_batch_and_a_batch_of_either_layout_decodes():
    import msgspec

    ins = [Insert(f"m|http://a:{i}", list(range(i * 100, i * 100 + 100))) for i in range(20)]
    out = encode("g/1", 1.0, ins, [], None, 4096, batches=True)
    assert len(out) > 1 and all(len(p) <= 4096 for p in out)
    assert [b.batches for b in map(decode, out)] == [True] + [False] * (len(out) - 1)
    (alone,) = encode("g/1", 1.0, [], [], None, 4096, batches=True)
    assert decode(alone).batches is True
    # a sibling of the version before (no batches) and one of a later version (a field more) both decode
    enc = msgspec.msgpack.Encoder()
    older = msgspec.msgpack.decode(out[0])[:-1]
    assert decode(enc.encode(older)).batches is False and decode(enc.encode(older)).inserts == decode(out[0]).inserts
    newer = [*msgspec.msgpack.decode(out[0]), {"unknown": 1}]
    assert decode(enc.encode(newer)).batches is True
