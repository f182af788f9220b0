"""The typed decoders of ``gateway.kv.wire`` (and the untyped path they fall back to): every
encoding decodes as before, well-formed batches never take the untyped path, and nothing but
``WireError`` comes out of a malformed message."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.kv.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    WireError,
    _untyped_batch,
    decode_batch,
)
from tests.support.factories import block_stored, block_stored_array, event_batch

enc = msgspec.msgpack.encode
H32 = b"\x07" * 32


def events_for(encoding, tokens=tuple(range(32))):
    tokens = list(tokens)
    if encoding == "array":
        return [block_stored_array([11, H32], None, tokens, None, "GPU", "ad1"), ["BlockRemoved", [11], "CPU"],
                ["AllBlocksCleared"]]
    return [block_stored([11, H32], None, tokens, lora_id=None, medium="GPU", lora_name="ad1"),
            {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU"}, {"type": "AllBlocksCleared"}]


@pytest.mark.parametrize("encoding", ["map", "vllm", "array"])
def test_each_encoding_decodes_typed_to_the_same_events(encoding):
    d = BatchDecoder()
    b = d.decode(event_batch(encoding if encoding != "vllm" else "array", events_for(encoding)))
    assert (d.typed, d.untyped) == (1, 0)
    assert b.ts == 1.0 and b.dp_rank == 0 and b.unknown == 0
    assert b.events == [BlockStored([11, H32], None, list(range(32)), 16, "ad1", "GPU"),
                        BlockRemoved([11], "CPU"), AllBlocksCleared()]
    assert isinstance(b.events[0].block_hashes[1], bytes)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_the_decoder_follows_a_publisher_that_changes_its_events_form(encoding):
    d = BatchDecoder()
    arrays, maps = events_for("array"), events_for("map")
    for events in (arrays, maps, maps, arrays):
        assert d.decode(event_batch(encoding, events)).events[1] == BlockRemoved([11], "CPU")
    assert (d.typed, d.untyped) == (4, 0)


def test_missing_trailing_fields_take_their_defaults():
    d = BatchDecoder()
    b = d.decode(enc([0, [block_stored_array([1], None, [0] * 16), ["BlockRemoved", [1]]]]))     # no rank either
    assert b.events == [BlockStored([1], None, [0] * 16, 16), BlockRemoved([1])]
    assert b.dp_rank is None and d.untyped == 0
    b = d.decode(enc({"events": [{"type": "BlockRemoved", "block_hashes": [2]}]}))          # no ts, no rank
    assert (b.ts, b.dp_rank, b.events) == (0.0, None, [BlockRemoved([2])])


def test_extra_trailing_fields_and_keys_are_ignored():
    d = BatchDecoder()
    b = d.decode(enc([0, [block_stored_array([1], 9, [0] * 16, 4, "GPU", None, None, 0, "full", None, "newer")], 0]))
    assert b.events == [BlockStored([1], 9, [0] * 16, 16, "4", "GPU", 0, None, 4)]
    b = d.decode(enc([0, [block_stored([1], None, [0] * 16, kv_cache_spec_kind="full", future_field=[1])]]))
    assert b.events == [BlockStored([1], None, [0] * 16, 16)] and d.untyped == 0


@pytest.mark.parametrize("encoding", ["map", "vllm", "array"])
def test_lora_id_names_the_adapter_without_lora_name(encoding):
    ev = block_stored_array([1], None, [0] * 16, 3) if encoding == "array" else block_stored([1], None, [0] * 16, lora_id=3)
    (b,) = decode_batch(event_batch("map" if encoding == "map" else "array", [ev])).events
    assert (b.lora_name, b.lora_id) == ("3", 3)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_unknown_event_types_are_skipped_and_counted(encoding):
    new = ["BlockUpdated", [1], 5] if encoding == "array" else {"type": "BlockUpdated", "block_hashes": [1]}
    known = events_for(encoding)
    d = BatchDecoder()
    b = d.decode(event_batch(encoding, [known[0], new, known[1], new]))
    assert b.unknown == 2 and [type(e) for e in b.events] == [BlockStored, BlockRemoved]
    assert d.untyped == 1


def test_a_publisher_that_needs_the_untyped_path_goes_there_for_a_while_then_tries_again():
    d = BatchDecoder()
    odd = event_batch("map", [{"type": "BlockUpdated"}])
    good = event_batch("map", events_for("map"))
    d.decode(odd)
    for _ in range(64):
        assert d.decode(good).events          # decoded right, untyped
    assert (d.typed, d.untyped) == (0, 65)
    d.decode(good)
    assert d.typed == 1


@pytest.mark.parametrize("rank", [None, 0, 2])
@pytest.mark.parametrize("encoding", ["map", "vllm", "array"])
def test_typed_and_untyped_paths_agree_on_ranks(encoding, rank):
    payload = event_batch("map" if encoding == "map" else "array", events_for(encoding)[:2], rank=rank)
    for port_rank in (None, 1):
        typed = BatchDecoder().decode(payload, port_rank)
        assert typed == _untyped_batch(payload, port_rank)
    tag = rank or 0
    h = BatchDecoder().decode(payload).events[0].block_hashes
    assert h == ([(tag, 11), (tag, H32)] if tag else [11, H32])


_hash = st.one_of(st.integers(0, 2 ** 64 - 1), st.binary(min_size=1, max_size=32))
_opt_str = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "disk", "ad1"]))


@st.composite
def _event(draw):
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    if kind == "AllBlocksCleared":
        return {"type": kind}
    fields = {"block_hashes": draw(st.lists(_hash, max_size=4))}
    if kind == "BlockRemoved":
        for name, value in (("medium", _opt_str), ("group_idx", st.one_of(st.none(), st.integers(0, 3)))):
            if draw(st.booleans()):
                fields[name] = draw(value)
        return {"type": kind, **fields}
    fields |= {"parent_block_hash": draw(st.one_of(st.none(), _hash)),
               "token_ids": draw(st.lists(st.integers(0, 50_000), max_size=40)),
               "block_size": draw(st.sampled_from([4, 16]))}
    for name, value in (("lora_id", st.one_of(st.none(), st.integers(0, 9))), ("medium", _opt_str),
                        ("lora_name", _opt_str),
                        ("extra_keys", st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.text()))))),
                        ("group_idx", st.one_of(st.none(), st.integers(0, 3)))):
        if draw(st.booleans()):
            fields[name] = draw(value)
    return {"type": kind, **fields}


_ORDER = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                          "lora_name", "extra_keys", "group_idx"],
          "BlockRemoved": ["block_hashes", "medium", "group_idx"], "AllBlocksCleared": []}


def _positional(ev: dict) -> list:
    """The event as an array: its fields in order, up to the last one given (the rest left out)."""
    names = _ORDER[ev["type"]]
    last = max((i for i, n in enumerate(names) if n in ev), default=-1)
    return [ev["type"], *(ev.get(n) for n in names[:last + 1])]


@given(st.lists(_event(), max_size=6), st.sampled_from(["map", "vllm", "array"]),
       st.one_of(st.none(), st.integers(0, 3)), st.one_of(st.none(), st.integers(0, 3)))
def test_well_formed_batches_decode_typed_exactly_as_untyped(events, encoding, batch_rank, port_rank):
    if encoding == "array":
        events = [_positional(ev) for ev in events]
    payload = event_batch("map" if encoding == "map" else "array", events, rank=batch_rank)
    d = BatchDecoder()
    assert d.decode(payload, port_rank) == _untyped_batch(payload, port_rank)
    assert (d.typed, d.untyped) == (1, 0)


MALFORMED = [
    b"", b"\xc1", enc(5), enc([1.0, 5]), enc([1.0, [7]]), enc({"events": [{"type": "BlockStored"}]}),
    enc([0, [["BlockStored", [1], None, [0] * 16]]]),                      # too short
    enc([0, [["BlockStored", [[1]], None, [0] * 16, 16]]]),                # a hash that is an array
    enc([0, [["BlockStored", [{"a": 1}], None, [0] * 16, 16]]]),           # ... a map
    enc([0, [["BlockStored", [1], [2], [0] * 16, 16]]]),                   # a parent that is an array
    enc([0, [["BlockStored", [1], None, [[0]] * 16, 16]]]),                # token ids that are not ints
    enc([0, [["BlockStored", [1], None, "tokens", 16]]]),
    enc([0, [["BlockStored", [1], None, [0] * 16, "x"]]]),                 # a block size that is no number
    enc([0, [["BlockStored", [1], None, [0] * 16, 16, None, ["GPU"]]]]),   # a medium that is an array
    enc([0, [["BlockStored", [1], None, [0] * 16, 16, None, None, {"n": 1}]]]),   # ... a lora name
    enc([0, [["BlockRemoved"]]]), enc([0, [["BlockRemoved", 5]]]), enc([0, [["BlockRemoved", [1], 7]]]),
    enc({"events": [{"type": "BlockRemoved"}]}), enc({"events": 5}), enc({"ts": "x", "events": []}),
    enc([0, [5]]), enc([0, [[]]]), enc([0, [[5, 1]]]), enc([0, [], -1]), enc([0, [], True]),
]


@pytest.mark.parametrize("payload", MALFORMED)
def test_malformed_batches_are_wire_errors(payload):
    with pytest.raises(WireError):
        BatchDecoder().decode(payload)


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=4), st.binary(max_size=8),
                    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "events"]))
_value = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                      max_leaves=30)


@given(_value)
def test_any_msgpack_value_decodes_or_is_a_wire_error(value):
    try:
        decode_batch(enc(value))
    except WireError:
        pass


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_are_a_wire_error(payload):
    try:
        decode_batch(payload)
    except WireError:
        pass
