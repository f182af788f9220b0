"""vLLM's KV-cache event wire format, decoded (SGLang publishes the same).

A publisher sends three frames per message on a ZMQ PUB socket: the topic, the sequence number as
8 bytes big-endian, and a msgpack ``EventBatch``. The batch is ``[ts, events, data_parallel_rank]``
(older engines: a positional array) or ``{"ts", "events", "data_parallel_rank"}`` (a map). Each
event is tagged with its type name, in one of two encodings:

* positional array, the tag first: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]`` (trailing fields left at
  their defaults may be missing), ``["BlockRemoved", block_hashes, medium, group_idx]``,
  ``["AllBlocksCleared"]``;
* a map with ``type`` as the tag: ``{"type": "BlockStored", "block_hashes": [...], ...}``.

A block hash is an int (the low 64 bits of the engine's hash) or bytes (the full hash, when the
engine is told not to shorten it, at most ``MAX_HASH_BYTES``); either is only an identifier here.

Data parallelism: a batch names the engine's ``data_parallel_rank`` (vLLM publishes each rank on
``port + rank``). Hashes of a batch from rank r > 0 are decoded as ``(r, hash)``, so the ranks of one
endpoint never share an entry: a block two ranks hold is attributed to the endpoint until both have
removed it (rank 0, and engines without a rank, keep the plain hash). A subscriber that knows the
rank from the port it listens on passes it to ``decode_batch``, which then qualifies by that rank
whatever the batch says (an engine that leaves ``data_parallel_rank`` null is still told apart). ``extra_keys`` (per block: the
multimodal hashes, LoRA or ``cache_salt`` extras the engine folded into its hash, or null) and the
hybrid-model fields (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) are
accepted in both encodings; ``extra_keys`` is kept on the event, and ``gateway.kv.index`` folds it
into its keys. The replay socket (ROUTER)
answers an 8-byte start sequence with ``(seq, payload)`` frames ending with seq -1.

Decoding is typed: msgspec decodes a batch straight into the event Structs below (one C call, no
Python per event) through one of four decoders, the batch as an array or a map (told by its first
byte) times the events as maps or as arrays (the form that decoded last is tried first). What the
typed decoders refuse (an unknown event type, a field of an unexpected type, a malformed batch) is
decoded again by the untyped path: msgspec's untyped decoder and a small dispatch on the tag, which
skips unknown event types (counted), so a newer engine's extra events do not stop the stream, and
raises ``WireError`` with the reason for anything that is not an event batch. A subscriber that meets
an engine whose batches keep needing the untyped path goes straight to it for a while.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

_decode = msgspec.msgpack.Decoder().decode
END_SEQ = -1

# the longest block hash taken as bytes: engines send a digest of at most 32 bytes (vLLM's sha256 or
# xxhash of a block); a longer one is malformed, as the index holds every hash it is sent, and
# ``max_blocks_per_endpoint`` hashes of a message's size each would be gigabytes
MAX_HASH_BYTES = 256
# the largest block size taken from an engine: vLLM's are 1 to 256 tokens (a hybrid model's attention
# blocks, sized to match its state's pages, larger), SGLang's pages as small. A larger one (a billion)
# makes its message malformed: the endpoint's block size keys every request routed to it
MAX_BLOCK_SIZE = 1 << 16
BlockHash = int | bytes | tuple      # (rank, hash) for data-parallel ranks > 0
_Hash = int | Annotated[bytes, Meta(max_length=MAX_HASH_BYTES)]      # a hash on the wire
_Rank = Annotated[int, Meta(ge=0)]


class WireError(ValueError):
    """A message that is not an event batch."""


_TOO_DEEP = "arrays or maps nested too deeply"


# The events, as ``decode_batch`` returns them. They are also the typed decoders' types for the map
# encoding (tagged by ``type``; keys they do not name, such as the hybrid-model fields, are ignored).
# gc=False: an event holds lists of ints and bytes only, never a cycle.

class BlockStored(Struct, tag_field="type", tag=True, gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None
    extra_keys: list | None = None      # per block: the extras the engine hashed with its tokens, or None
    lora_id: int | None = None          # engines before lora_name: the id names the adapter
    cache_salt: str | None = None       # SGLang: the salt of the request that stored them (its namespace)


class BlockRemoved(Struct, tag_field="type", tag=True, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(Struct, tag_field="type", tag=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(Struct, gc=False):
    ts: float
    events: list[Event]
    dp_rank: int | None
    unknown: int = 0          # events of a type this decoder does not know


# The positional encoding, field for field as the engines write it (trailing fields may be missing,
# extra ones are ignored); turned into the events above after decoding.

class _StoredArray(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None


class _RemovedArray(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedArray(Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _ArrayOfMaps(Struct, array_like=True, gc=False):       # [ts, events, rank], events as maps (vLLM today)
    ts: float | None
    events: list[Event]
    data_parallel_rank: _Rank | None = None


class _ArrayOfArrays(Struct, array_like=True, gc=False):     # [ts, events, rank], events as arrays (older)
    ts: float | None
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: _Rank | None = None


class _MapOfMaps(Struct, gc=False):
    events: list[Event]
    ts: float | None = 0.0
    data_parallel_rank: _Rank | None = None


class _MapOfArrays(Struct, gc=False):
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    ts: float | None = 0.0
    data_parallel_rank: _Rank | None = None


_TYPED = {False: (msgspec.msgpack.Decoder(_ArrayOfMaps).decode, msgspec.msgpack.Decoder(_ArrayOfArrays).decode),
          True: (msgspec.msgpack.Decoder(_MapOfMaps).decode, msgspec.msgpack.Decoder(_MapOfArrays).decode)}
# first bytes of a msgpack map (fixmap, map 16, map 32); anything else is tried as an array
_MAP_BYTES = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_SLOW_SKIP = 64           # batches decoded untyped straight away after one the typed decoders refused


def _from_array(ev: Any) -> Event:
    cls = ev.__class__
    if cls is _RemovedArray:
        return BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    if cls is _StoredArray:
        lora_name = ev.lora_name
        if lora_name is None and ev.lora_id is not None:
            lora_name = str(ev.lora_id)
        extra = ev.extra_keys
        return BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, _block_size(ev.block_size), lora_name,
                           ev.medium, ev.group_idx, extra if extra is None else _extra(extra), ev.lora_id)
    return AllBlocksCleared()


class BatchDecoder:
    """``decode`` as ``decode_batch``, remembering which typed decoder fits this publisher."""

    __slots__ = ("_events_as_arrays", "_skip", "typed", "untyped")

    def __init__(self) -> None:
        self._events_as_arrays = {False: False, True: False}     # per batch form: the events' form that fit
        self._skip = 0
        self.typed = 0            # batches decoded by a typed decoder
        self.untyped = 0          # batches the untyped path decoded (or refused)

    def decode(self, payload: bytes, rank: int | None = None) -> Batch:
        if self._skip:
            self._skip -= 1
        elif payload:
            as_map = payload[0] in _MAP_BYTES
            decoders = _TYPED[as_map]
            first = self._events_as_arrays[as_map]
            for arrays in (first, not first):
                try:
                    raw = decoders[arrays](payload)
                except msgspec.DecodeError:          # a ValidationError too
                    continue
                except RecursionError:               # arrays or maps nested thousands deep
                    raise WireError(_TOO_DEEP) from None
                if arrays != first:
                    self._events_as_arrays[as_map] = arrays
                self.typed += 1
                return _typed_batch(raw, arrays, rank)
            self._skip = _SLOW_SKIP
        self.untyped += 1
        return _untyped_batch(payload, rank)


def _typed_batch(raw: Any, arrays: bool, rank: int | None) -> Batch:
    events = raw.events
    if arrays:
        events = [_from_array(ev) for ev in events]
    else:
        for ev in events:
            if ev.__class__ is BlockStored:
                if ev.lora_id is not None and ev.lora_name is None:    # engines before lora_name
                    ev.lora_name = str(ev.lora_id)
                if ev.extra_keys is not None:
                    _extra(ev.extra_keys)
                if not 0 < ev.block_size <= MAX_BLOCK_SIZE:
                    _block_size(ev.block_size)
    batch_rank = raw.data_parallel_rank
    tag = rank if rank is not None else batch_rank
    if tag:
        for ev in events:
            _ranked(ev, tag)
    return Batch(raw.ts or 0.0, events, batch_rank)


def decode_batch(payload: bytes, rank: int | None = None) -> Batch:
    """One msgpack ``EventBatch`` (array or map form, events in either encoding); ``rank``, when
    given, is the rank that qualifies the hashes instead of the batch's ``data_parallel_rank``.
    Remembers nothing between calls (a subscriber keeps a ``BatchDecoder`` of its own)."""
    return BatchDecoder().decode(payload, rank)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def rank_of(h: BlockHash) -> int:
    """The data-parallel rank a decoded hash came from (a plain hash: rank 0)."""
    return h[0] if h.__class__ is tuple else 0


def _ranked(ev: Event, rank: int) -> None:
    """Qualify ``ev``'s hashes with a data-parallel rank > 0 (see the module docstring)."""
    if ev.__class__ is BlockStored:
        ev.block_hashes = [(rank, h) for h in ev.block_hashes]
        if ev.parent_block_hash is not None:
            ev.parent_block_hash = (rank, ev.parent_block_hash)
    elif ev.__class__ is BlockRemoved:
        ev.block_hashes = [(rank, h) for h in ev.block_hashes]


# -- the untyped path: anything the typed decoders refuse ---------------------------------------------

# It checks what the index relies on (hashes and token ids hashable, names strings) and otherwise
# takes what older engines sent as it is (a block size as a float, a lora_id of any type).

def _is_hash(v: Any) -> bool:
    return (v.__class__ is int) or (isinstance(v, bytes) and len(v) <= MAX_HASH_BYTES)


def _hashes(v: Any) -> list[BlockHash]:
    if not isinstance(v, list):
        raise WireError("block_hashes must be an array")
    if not all(map(_is_hash, v)):
        raise WireError(f"block hashes must be integers or bytes (at most {MAX_HASH_BYTES})")
    return v


def _hash(v: Any) -> BlockHash | None:
    if v is None or _is_hash(v):
        return v
    raise WireError(f"parent_block_hash must be an integer, bytes (at most {MAX_HASH_BYTES}) or null")


def _tokens(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(t.__class__ is int for t in v):
        raise WireError("token_ids must be an array of integers")
    return v


def _name(v: Any, field: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise WireError(f"{field} must be a string or null")


_SCALARS = (str, int, float, bytes, bool)
# how deep a block's extras may nest: vLLM's are an array of names and (feature hash, offset) pairs,
# two deep; checked (and later frozen into tuples) by recursion, which a deeper value would exhaust
_EXTRA_DEPTH = 8


def _extra(v: Any) -> list | None:
    """``extra_keys``: per block, null or an array of scalars and arrays (what the engine hashed)."""
    if v is None:
        return None
    if not isinstance(v, list) or not all(e is None or (e.__class__ is list and _plain(e, 1)) for e in v):
        raise WireError("extra_keys must be an array of arrays (or nulls) of plain values, "
                        f"at most {_EXTRA_DEPTH} deep")
    return v


def _plain(v: list, depth: int) -> bool:
    if depth > _EXTRA_DEPTH:
        return False
    return all(isinstance(x, _SCALARS) or x is None or (x.__class__ is list and _plain(x, depth + 1)) for x in v)


def _block_size(v: Any) -> int:
    if v.__class__ is float and v.is_integer():
        v = int(v)
    if v.__class__ is not int or not 0 < v <= MAX_BLOCK_SIZE:
        raise WireError(f"block_size must be an integer from 1 to {MAX_BLOCK_SIZE}, got {v!r}"[:80])
    return v


def _at(a: list, i: int, default: Any = None) -> Any:
    return a[i] if len(a) > i else default


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, lora_id: Any, medium: Any, lora_name: Any,
            extra: Any, group_idx: Any, cache_salt: Any = None) -> BlockStored:
    lora_name = _name(lora_name, "lora_name")
    if lora_name is None and lora_id is not None:      # engines before lora_name: the id names it
        lora_name = str(lora_id)
    return BlockStored(_hashes(hashes), _hash(parent), _tokens(tokens), _block_size(block_size), lora_name,
                       _name(medium, "medium"), group_idx, _extra(extra), lora_id, _name(cache_salt, "cache_salt"))


def _stored_from_array(a: list) -> BlockStored:
    # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
    #  group_idx, ...]
    if len(a) < 5:
        raise WireError("BlockStored array too short")
    return _stored(a[1], a[2], a[3], a[4], _at(a, 5), _at(a, 6), _at(a, 7), _at(a, 8), _at(a, 9))


def _stored_from_map(m: dict) -> BlockStored:
    try:
        return _stored(m["block_hashes"], m.get("parent_block_hash"), m["token_ids"], m["block_size"],
                       m.get("lora_id"), m.get("medium"), m.get("lora_name"), m.get("extra_keys"), m.get("group_idx"),
                       m.get("cache_salt"))
    except KeyError as e:
        raise WireError(f"BlockStored without {e.args[0]}") from None


def _removed(hashes: Any, medium: Any, group_idx: Any) -> BlockRemoved:
    return BlockRemoved(_hashes(hashes), _name(medium, "medium"), group_idx)


def _event(raw: Any) -> Event | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        if tag == "BlockStored":
            return _stored_from_array(raw)
        if tag == "BlockRemoved":
            return _removed(_at(raw, 1), _at(raw, 2), _at(raw, 3))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if isinstance(raw, dict):
        tag = raw.get("type")
        if tag == "BlockStored":
            return _stored_from_map(raw)
        if tag == "BlockRemoved":
            if "block_hashes" not in raw:
                raise WireError("BlockRemoved without block_hashes")
            return _removed(raw["block_hashes"], raw.get("medium"), raw.get("group_idx"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    raise WireError(f"an event must be a tagged array or map, got {type(raw).__name__}")


def _untyped_batch(payload: bytes, rank: int | None = None) -> Batch:
    try:
        raw = _decode(payload)
    except msgspec.DecodeError as e:
        raise WireError(f"not msgpack: {e}") from None
    except RecursionError:
        raise WireError(_TOO_DEEP) from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, batch_rank = raw[0], raw[1], _at(raw, 2)
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, batch_rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise WireError("an event batch must be [ts, events, dp_rank] or a map with events")
    if not isinstance(events, list):
        raise WireError("events must be an array")
    if batch_rank is not None and (isinstance(batch_rank, bool) or not isinstance(batch_rank, int)
                                   or batch_rank < 0):
        raise WireError(f"data_parallel_rank must be a non-negative integer or null, got {batch_rank!r}")
    tag = rank if rank is not None else batch_rank
    out: list[Event] = []
    unknown = 0
    for e in events:
        try:
            ev = _event(e)
        except (TypeError, ValueError, IndexError) as err:
            raise WireError(f"bad event: {err}") from None
        if ev is None:
            unknown += 1
        else:
            if tag:
                _ranked(ev, tag)
            out.append(ev)
    try:
        return Batch(float(ts or 0.0), out, batch_rank, unknown)
    except (TypeError, ValueError) as err:
        raise WireError(f"bad ts: {err}") from None
