"""What processes tell each other about routing, on the wire (MessagePack through msgspec).

One message is a ``Batch``: the facts one process learned in one event-loop turn (or, towards
Redis, in one flush interval), with its sender's name and wall-clock send time (the receiver's
``now - sent`` is the view's lag). Facts are plain data, endpoints named by ``endpoint_key``
("model|url": the same in every process that has the endpoint in its pool, from config or
discovery alike):

* ``Insert``: an endpoint was sent a prompt whose prefix-index chain is ``keys``
  (``routers.prefix_index.prefix_keys``: deterministic, so every process has the same keys);
* ``Session``: a session's turn went to an endpoint (``routers.session_map``);
* ``load``: the sender's in-flight count per endpoint, absolute (a lost message or a restarted
  worker is healed by the next one); the local bus carries it, Redis does not (the tenancy
  heartbeat does);
* ``Tokens``: a prompt segment the sender tokenized for KV-events routing, with its token ids
  (``gateway.kv.tokenization``), so a sibling that meets the segment does not tokenize it again;
  the local bus only;
* ``Eject``: the sender's circuit breaker ejected an endpoint for ``open_for`` seconds (0: closed it
  after its trials passed); the siblings do the same (``gateway.resilience.breaker``). The local
  bus only.

``encode`` splits what does not fit in ``max_bytes`` over several batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gateway.endpoints import Endpoint


class Insert(msgspec.Struct, array_like=True):
    ep: str
    keys: list[int]


class Session(msgspec.Struct, array_like=True):
    key: str
    ep: str
    tag: str | None = None


class Tokens(msgspec.Struct, array_like=True):
    model: str
    segment: str
    ids: list[int]


class Eject(msgspec.Struct, array_like=True):
    ep: str
    open_for: float                      # 0: closed
    ejections: int = 0


class Batch(msgspec.Struct, array_like=True):
    sender: str                          # "<gateway group>/<worker index>"
    sent: float                          # the sender's time.time() when it sent the batch
    inserts: list[Insert] = []
    sessions: list[Session] = []
    load: dict[str, int] | None = None   # None: no load in this batch (not "all zero")
    tokens: list[Tokens] = []
    breakers: list[Eject] = []


def endpoint_key(ep: Endpoint) -> str:
    """How processes name an endpoint to each other (as the tenancy heartbeat does)."""
    return f"{ep.model}|{ep.url}"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)


def decode(data: bytes) -> Batch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything but a batch."""
    return _decoder.decode(data)


def tokens_size(model: str, segment: str, ids: list[int]) -> int:
    """About a ``Tokens`` fact's encoded size (its text's characters, 5 bytes per id)."""
    return 16 + len(model) + len(segment) + 5 * len(ids)


def _size(fact: Insert | Session | Tokens) -> int:
    """An upper bound of a fact's encoded size (9 bytes per 64-bit key)."""
    cls = fact.__class__
    if cls is Insert:
        return 16 + len(fact.ep) + 9 * len(fact.keys)      # type: ignore[union-attr]
    if cls is Tokens:
        return tokens_size(fact.model, fact.segment, fact.ids)     # type: ignore[union-attr]
    return 16 + len(fact.key) + len(fact.ep) + len(fact.tag or "")   # type: ignore[union-attr]


def encode(sender: str, sent: float, inserts: Sequence[Insert], sessions: Sequence[Session],
           load: dict[str, int] | None, max_bytes: int, tokens: Sequence[Tokens] = (),
           breakers: Sequence[Eject] = ()) -> list[bytes]:
    """The batches (encoded) that carry these facts, each within ``max_bytes`` unless a single
    fact is larger (it then travels alone; the bus counts it dropped if the socket refuses it)."""
    budget = max_bytes - 64 - len(sender) - (sum(len(k) + 10 for k in load) if load else 0)
    out: list[bytes] = []
    ins: list[Insert] = []
    ses: list[Session] = []
    tok: list[Tokens] = []
    used = 64 * len(breakers)               # a few, small: they go in the first batch
    for fact in (*inserts, *sessions, *tokens):
        n = _size(fact)
        if used + n > budget and (ins or ses or tok or breakers):
            out.append(_encoder.encode(Batch(sender, sent, ins, ses, load, tok, list(breakers))))
            load = None
            ins, ses, tok, breakers = [], [], [], ()
            used = 0
        cls = fact.__class__
        if cls is Insert:
            ins.append(fact)         # type: ignore[arg-type]
        elif cls is Session:
            ses.append(fact)         # type: ignore[arg-type]
        else:
            tok.append(fact)         # type: ignore[arg-type]
        used += n
    if ins or ses or tok or breakers or load is not None or not out:
        out.append(_encoder.encode(Batch(sender, sent, ins, ses, load, tok, list(breakers))))
    return out
