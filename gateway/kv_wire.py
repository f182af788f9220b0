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
engine is told not to shorten it); either is only an identifier here.

Data parallelism: a batch names the engine's ``data_parallel_rank`` (vLLM publishes each rank on
``port + rank``). Hashes of a batch from rank r > 0 are decoded as ``(r, hash)``, so the ranks of one
endpoint never share an entry: a block two ranks hold is attributed to the endpoint until both have
removed it (rank 0, and engines without a rank, keep the plain hash). A subscriber that knows the
rank from the port it listens on passes it to ``decode_batch``, which then qualifies by that rank
whatever the batch says (an engine that leaves ``data_parallel_rank`` null is still told apart). ``extra_keys`` (per block: the
multimodal hashes, LoRA or ``cache_salt`` extras the engine folded into its hash, or null) and the
hybrid-model fields (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) are
accepted in both encodings; ``extra_keys`` is kept on the event. The replay socket (ROUTER)
answers an 8-byte start sequence with ``(seq, payload)`` frames ending with seq -1.

Decoding goes through msgspec's untyped msgpack decoder (one C call per batch) and a small
dispatch on the tag; unknown event types are skipped (counted), so a newer engine's extra events
do not stop the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_decode = msgspec.msgpack.Decoder().decode
END_SEQ = -1

BlockHash = int | bytes | tuple      # (rank, hash) for data-parallel ranks > 0


class WireError(ValueError):
    """A message that is not an event batch."""


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None
    extra_keys: list | None = None      # per block: the extras the engine hashed with its tokens, or None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class Batch:
    ts: float
    events: list[Event]
    dp_rank: int | None
    unknown: int = 0          # events of a type this decoder does not know


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def _hashes(v: Any) -> list[BlockHash]:
    if not isinstance(v, list):
        raise WireError("block_hashes must be an array")
    return v


def _hash(v: Any) -> BlockHash:
    return bytes(v) if isinstance(v, bytearray | memoryview) else v


def _extra(v: Any) -> list | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise WireError("extra_keys must be an array or null")
    return v


def _ranked(ev: Event, rank: int) -> None:
    """Qualify ``ev``'s hashes with a data-parallel rank > 0 (see the module docstring)."""
    if isinstance(ev, BlockStored):
        ev.block_hashes = [(rank, h) for h in ev.block_hashes]
        if ev.parent_block_hash is not None:
            ev.parent_block_hash = (rank, ev.parent_block_hash)
    elif isinstance(ev, BlockRemoved):
        ev.block_hashes = [(rank, h) for h in ev.block_hashes]


def _at(a: list, i: int, default: Any = None) -> Any:
    return a[i] if len(a) > i else default


def _stored_from_array(a: list) -> BlockStored:
    # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...]
    if len(a) < 5:
        raise WireError("BlockStored array too short")
    lora_name = _at(a, 7)
    lora_id = _at(a, 5)
    if lora_name is None and lora_id is not None:      # engines before lora_name: the id names it
        lora_name = str(lora_id)
    return BlockStored(_hashes(a[1]), _hash(a[2]), list(a[3]), int(a[4]), lora_name, _at(a, 6), _at(a, 9),
                       _extra(_at(a, 8)))


def _stored_from_map(m: dict) -> BlockStored:
    try:
        lora_name = m.get("lora_name")
        if lora_name is None and m.get("lora_id") is not None:
            lora_name = str(m["lora_id"])
        return BlockStored(_hashes(m["block_hashes"]), _hash(m.get("parent_block_hash")), list(m["token_ids"]),
                           int(m["block_size"]), lora_name, m.get("medium"), m.get("group_idx"),
                           _extra(m.get("extra_keys")))
    except KeyError as e:
        raise WireError(f"BlockStored without {e.args[0]}") from None


def _event(raw: Any) -> Event | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        if tag == "BlockStored":
            return _stored_from_array(raw)
        if tag == "BlockRemoved":
            return BlockRemoved(_hashes(_at(raw, 1)), _at(raw, 2), _at(raw, 3))
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
            return BlockRemoved(_hashes(raw["block_hashes"]), raw.get("medium"), raw.get("group_idx"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    raise WireError(f"an event must be a tagged array or map, got {type(raw).__name__}")


def rank_of(h: BlockHash) -> int:
    """The data-parallel rank a decoded hash came from (a plain hash: rank 0)."""
    return h[0] if h.__class__ is tuple else 0


def decode_batch(payload: bytes, rank: int | None = None) -> Batch:
    """One msgpack ``EventBatch`` (array or map form, events in either encoding); ``rank``, when
    given, is the rank that qualifies the hashes instead of the batch's ``data_parallel_rank``."""
    try:
        raw = _decode(payload)
    except msgspec.DecodeError as e:
        raise WireError(f"not msgpack: {e}") from None
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
    return Batch(float(ts or 0.0), out, batch_rank, unknown)
