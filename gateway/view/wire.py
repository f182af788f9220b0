"""What processes tell each other about routing, on the wire (MessagePack through msgspec).

One message is a ``Batch``: the facts one process learned in one event-loop turn (or, towards
Redis, in one flush interval), with its sender's name and wall-clock send time (the receiver's
``now - sent`` is the view's lag). Facts are plain data, endpoints named by ``endpoint_key``
("model|url": the same in every process that has the endpoint in its pool, from config or
discovery alike):

* ``Insert``: an endpoint was sent a prompt whose prefix-index chain is ``keys``
  (``routers.prefix_index.prefix_keys``: deterministic, so every process has the same keys);
* ``Session``: a session's turn went to an endpoint (``routers.session_map``), with the sender's
  wall-clock time of it, so two processes that recorded one session at once keep the same one;
* ``load``: the sender's in-flight count per endpoint, absolute (a lost message or a restarted
  worker is healed by the next one); the local bus carries it, Redis does not (the tenancy
  heartbeat does);
* ``Tokens``: a prompt segment the sender tokenized for KV-events routing, with its token ids
  (``gateway.kv.tokenization``), so a sibling that meets the segment does not tokenize it again;
  the local bus only;
* ``Eject``: the sender's circuit breaker ejected an endpoint for ``open_for`` seconds (0: closed it
  after its trials passed); the siblings do the same (``gateway.resilience.breaker``). The local
  bus only; in a whole view (``ViewSnapshot``), an endpoint the sender keeps out, ``open_for`` the
  time left, ``by`` the worker whose ejection it is (whose trials the others await);
* ``Probe`` and ``Scrape``: the outcome of a health probe, and an engine's ``/metrics`` snapshot
  (``EngineMetrics``, MessagePack-encoded as the sender made it), from the worker that watches the
  endpoint (``view.share_monitoring``), with ``known``: the in-flight requests the sender knew of
  on the endpoint when the engine answered (its own and ``remote_in_flight``); ``Served``: the LoRA
  adapters the endpoint's ``/v1/models`` listed when the watcher asked (None: no answer), or
  (``change``) adapters the sender loaded there, unloaded (or found gone) or last used (routed a
  request to, or has one in flight on) at ``asked``. The local bus only;
* ``preempt``: endpoints where the sender routed an interactive request that found no free slot
  while a sibling's batch lines may run there; the worker that runs batches stops its newest line
  on each (``gateway.batch``). The local bus only;
* ``busy``: the LoRA adapters the sender has requests in flight for, per endpoint, all of them
  (absolute, as ``load``), sent when one's count goes from 0 to 1 or back to 0 there and with every
  ``view.heartbeat_s`` while any is; a sibling does not unload those there. The local bus only;
* ``loads``: the LoRA adapter loads the sender makes (``LoraLoad``): one it started
  (``LOAD_STARTED``; said again every ``view.heartbeat_s`` while it is under way), and how each
  ended: loaded (``LOAD_OK``, at ``at``), failed (``LOAD_FAILED``, with the end of its
  ``lora.failure_cooldown_s`` in ``at`` and the engine's message: a sibling does not ask that
  endpoint for that adapter until then), or neither (``LOAD_ENDED``: refused as full, or cut
  short). A sibling that needs the adapter while the load is under way waits for its end rather
  than loading it too. ``at`` is on ``time.monotonic``, the same clock in every worker. Sent at the
  end of the loop turn (not held by ``view.flush_delay_s``), in the first batch. The local bus only;
* ``queued``: the models the sender's admission queue holds requests of, all of them (absolute, as
  ``load``), sent when one's queue fills or empties and with every ``view.heartbeat_s`` while any
  holds some; the worker that runs batches starts no line of those (``gateway.batch``). The local
  bus only;
* ``batches``: the sender's Batch API created or cancelled a batch; the worker that runs batches
  reads the job store at once rather than at its next ``batch.poll_interval_s`` (``gateway.batch``).
  The local bus only;
* ``run`` and ``seq`` (the local bus): the sender's process (a random number, new at each start) and
  how many batches with insertions, sessions or breakers' ejections and closes it has sent so far,
  this one included. A sibling that sees the count jump missed some (its queue was full: stopped,
  or busy) and asks the sender for its whole view (``ViewSnapshot``, over the siblings' stream
  socket), since an insertion, a session or an ejection, unlike a count, is not sent again.

``encode`` splits what does not fit in ``max_bytes`` over several batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from gateway.endpoints import Endpoint, EngineMetrics


class Insert(msgspec.Struct, array_like=True):
    ep: str
    keys: list[int]


class Session(msgspec.Struct, array_like=True):
    key: str
    ep: str
    tag: str | None = None
    at: float = 0.0                      # the sender's time.time() when it recorded it; 0: not said


class Tokens(msgspec.Struct, array_like=True):
    model: str
    segment: str
    ids: list[int]


class Eject(msgspec.Struct, array_like=True):
    ep: str
    open_for: float                      # 0: closed
    ejections: int = 0
    by: int = -1                         # in a whole view: the worker whose ejection it is (-1: not known)


class Probe(msgspec.Struct, array_like=True):
    ep: str
    ok: bool


# ``Scrape.known`` of a sender that has not yet listened to its siblings for ``view.peer_ttl_s``
# (a worker just started or restarted): its remote_in_flight may lack their requests (told over
# the bus, or read from Redis with state.redis_url)
UNCOUNTED = -1


class Scrape(msgspec.Struct, array_like=True):
    ep: str
    known: int                           # the sender's own in-flight at the scrape + its remote_in_flight, or UNCOUNTED
    snapshot: bytes                      # EngineMetrics, MessagePack (``encode_snapshot``)


class Served(msgspec.Struct, array_like=True):
    ep: str
    asked: float                         # the watcher's time.monotonic() when it asked (the same clock in every worker)
    adapters: dict[str, str] | None      # adapter → its base model; None: the endpoint did not answer
    change: int = 0                      # 0: the whole list; LOADED, UNLOADED, USED: the sender did that to these, at ``asked``
    max_model_len: int | None = None     # the whole list's: the model's context length as it listed it (None: none)


LOADED, UNLOADED, USED = 1, 2, 3


class LoraLoad(msgspec.Struct, array_like=True):
    ep: str
    adapter: str
    model: str                           # the adapter's base model
    state: int                           # LOAD_FAILED, LOAD_STARTED, LOAD_OK, LOAD_ENDED
    at: float = 0.0                      # LOAD_FAILED: the cooldown's end; LOAD_OK: when loaded (time.monotonic)
    message: str = ""                    # LOAD_FAILED: the engine's message (cut to MESSAGE_MAX)


LOAD_FAILED, LOAD_STARTED, LOAD_OK, LOAD_ENDED = 1, 2, 3, 4
MESSAGE_MAX = 512                        # characters of an engine's message a LoraLoad carries


class Batch(msgspec.Struct, array_like=True):
    sender: str                          # "<gateway group>/<worker index>"
    sent: float                          # the sender's time.time() when it sent the batch
    inserts: list[Insert] = []
    sessions: list[Session] = []
    load: dict[str, int] | None = None   # None: no load in this batch (not "all zero")
    tokens: list[Tokens] = []
    breakers: list[Eject] = []
    probes: list[Probe] = []
    scrapes: list[Scrape] = []
    served: list[Served] = []
    preempt: list[str] = []              # endpoint keys: an interactive request found no free slot there
    run: int = 0                         # the sender's process (random, new at each start); 0: not numbered
    seq: int = 0                         # batches with inserts, sessions or breakers the sender has sent, this one included
    # endpoint key → the LoRA adapters the sender has requests in flight for there, all of them
    # (absolute: the next one heals a lost one); None: not in this batch, {}: none anywhere
    busy: dict[str, list[str]] | None = None
    loads: list[LoraLoad] = []           # LoRA adapter loads' outcomes (a few, small: in the first batch)
    # the models the sender's admission queue holds requests of, all of them (absolute); None: not in
    # this batch, []: none
    queued: list[str] | None = None
    batches: bool = False                # the sender created or cancelled a batch: the runner reads the store


class ViewSnapshot(msgspec.Struct, array_like=True):
    """A worker's whole view, for a sibling catching up (it started, or missed batches): its
    sessions and prefix-index blocks with their times on ``time.monotonic`` (the machine's clock,
    the same in every worker), and ``run``/``seq`` as its next batch would carry them; in the first
    part, what it has in flight and the endpoints its breakers keep out (``Eject``, ``open_for``
    the time left of the ejection)."""

    run: int
    seq: int
    eps: list[str] = []                  # endpoint keys, referred to by position in ``sessions``
    sessions: list[tuple[str, int, str | None, float]] = []     # key, endpoint, tag, last recorded
    slots: dict[int, str] = {}           # the prefix index's endpoints by slot
    blocks: list[list[int]] = []         # [block key, slot, at_ms, slot, at_ms, ...]
    load: dict[str, int] = {}            # the first part: the sender's requests in flight by endpoint key,
    busy: dict[str, list[str]] = {}      # and the LoRA adapters it has requests in flight for, by endpoint key
    breakers: list[Eject] = []           # and the endpoints its breakers keep out, each with its ejection's time left


def endpoint_key(ep: Endpoint) -> str:
    """How processes name an endpoint to each other (as the tenancy heartbeat does)."""
    return f"{ep.model}|{ep.url}"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)
_snapshot_decoder = msgspec.msgpack.Decoder(EngineMetrics)
_view_decoder = msgspec.msgpack.Decoder(ViewSnapshot)


def encode_view(snap: ViewSnapshot) -> bytes:
    """One part of a whole view, framed: its length (4 bytes, big-endian), then the part. A view
    goes as several parts, the first with ``run``, ``seq``, ``eps`` and ``slots``, the others with
    some of its rows each, so that neither end holds its loop for the whole of it."""
    data = _encoder.encode(snap)
    return len(data).to_bytes(4, "big") + data


def view_parts(data: bytes) -> Iterator[ViewSnapshot]:
    """The parts of a whole view (``encode_view``), decoded one at a time as they are read. Raises
    ``msgspec.DecodeError`` (a ``ValueError``) on anything but view parts (a cut one included)."""
    view = memoryview(data)
    at = 0
    while at < len(view):
        if at + 4 > len(view):
            raise msgspec.DecodeError("a view part cut short")
        n = int.from_bytes(view[at:at + 4], "big")
        if at + 4 + n > len(view):
            raise msgspec.DecodeError("a view part cut short")
        yield _view_decoder.decode(view[at + 4:at + 4 + n])
        at += 4 + n


def decode_view(data: bytes) -> ViewSnapshot:
    """A whole view's parts (``encode_view``) as one snapshot (tests, small views)."""
    parts = list(view_parts(data))
    if not parts:
        raise msgspec.DecodeError("no view part")
    head = parts[0]
    return ViewSnapshot(head.run, head.seq, head.eps, [r for p in parts for r in p.sessions], head.slots,
                        [r for p in parts for r in p.blocks])


def encode_snapshot(m: EngineMetrics) -> bytes:
    return _encoder.encode(m)


def decode_snapshot(data: bytes) -> EngineMetrics:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything but a snapshot."""
    return _snapshot_decoder.decode(data)


def decode(data: bytes) -> Batch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything but a batch."""
    return _decoder.decode(data)


def tokens_size(model: str, segment: str, ids: list[int]) -> int:
    """About a ``Tokens`` fact's encoded size (its text's characters, 5 bytes per id)."""
    return 16 + len(model) + len(segment) + 5 * len(ids)


def _size(fact: Insert | Session | Tokens | Probe | Scrape | Served) -> int:
    """An upper bound of a fact's encoded size (9 bytes per 64-bit key)."""
    cls = fact.__class__
    if cls is Served:
        return 33 + len(fact.ep) + sum(len(a) + len(b) + 8 for a, b in (fact.adapters or {}).items())  # type: ignore[union-attr]
    if cls is Scrape:
        return 24 + len(fact.ep) + len(fact.snapshot)      # type: ignore[union-attr]
    if cls is Probe:
        return 8 + len(fact.ep)                            # type: ignore[union-attr]
    if cls is Insert:
        return 16 + len(fact.ep) + 9 * len(fact.keys)      # type: ignore[union-attr]
    if cls is Tokens:
        return tokens_size(fact.model, fact.segment, fact.ids)     # type: ignore[union-attr]
    return 25 + len(fact.key) + len(fact.ep) + len(fact.tag or "")   # type: ignore[union-attr]


def encode(sender: str, sent: float, inserts: Sequence[Insert], sessions: Sequence[Session],
           load: dict[str, int] | None, max_bytes: int, tokens: Sequence[Tokens] = (),
           breakers: Sequence[Eject] = (), probes: Sequence[Probe] = (),
           scrapes: Sequence[Scrape] = (), served: Sequence[Served] = (), preempt: Sequence[str] = (),
           busy: dict[str, list[str]] | None = None, loads: Sequence[LoraLoad] = (),
           queued: list[str] | None = None, batches: bool = False) -> list[bytes]:
    """The batches (encoded) that carry these facts, each within ``max_bytes`` unless a single
    fact is larger (it then travels alone; the bus counts it dropped if the socket refuses it)."""
    return encode_numbered(sender, sent, inserts, sessions, load, max_bytes, tokens, breakers, probes, scrapes,
                           served, preempt, busy=busy, loads=loads, queued=queued, batches=batches)[0]


def encode_numbered(sender: str, sent: float, inserts: Sequence[Insert], sessions: Sequence[Session],
                    load: dict[str, int] | None, max_bytes: int, tokens: Sequence[Tokens] = (),
                    breakers: Sequence[Eject] = (), probes: Sequence[Probe] = (),
                    scrapes: Sequence[Scrape] = (), served: Sequence[Served] = (), preempt: Sequence[str] = (),
                    run: int = 0, seq: int = 0, busy: dict[str, list[str]] | None = None,
                    loads: Sequence[LoraLoad] = (), queued: list[str] | None = None,
                    batches: bool = False) -> tuple[list[bytes], int]:
    """``encode``, each batch carrying ``run`` and its number (``seq``, counting the batches with
    insertions, sessions or breakers' ejections and closes; with ``run`` 0 nothing is numbered);
    returns the batches and the last
    number given. ``load``, ``busy``, ``breakers``, ``preempt``, ``loads``, ``queued`` and ``batches`` ride
    in the first."""
    budget = max_bytes - 64 - len(sender) - (sum(len(k) + 10 for k in load) if load else 0) \
        - (sum(len(k) + 8 + sum(len(a) + 4 for a in v) for k, v in busy.items()) if busy else 0) \
        - (sum(len(m) + 4 for m in queued) if queued else 0)
    out: list[bytes] = []
    lists: dict[type, list] = {Insert: [], Session: [], Tokens: [], Probe: [], Scrape: [], Served: []}
    used = 64 * len(breakers) + sum(len(k) + 8 for k in preempt) \
        + sum(32 + len(f.ep) + len(f.adapter) + len(f.model) + 4 * len(f.message) for f in loads)    # a few, small: in the first batch

    def batch() -> bytes:
        nonlocal seq
        if run and (lists[Insert] or lists[Session] or breakers):
            seq += 1
        return _encoder.encode(Batch(sender, sent, lists[Insert], lists[Session], load, lists[Tokens],
                                     list(breakers), lists[Probe], lists[Scrape], lists[Served], list(preempt),
                                     run, seq, busy, list(loads), queued, batches))

    for fact in (*inserts, *sessions, *tokens, *probes, *scrapes, *served):
        n = _size(fact)
        if used + n > budget and (breakers or preempt or loads or batches or any(lists.values())):
            out.append(batch())
            load = busy = queued = None
            batches = False
            lists = {Insert: [], Session: [], Tokens: [], Probe: [], Scrape: [], Served: []}
            breakers = preempt = loads = ()
            used = 0
        lists[fact.__class__].append(fact)
        used += n
    if any(lists.values()) or breakers or preempt or loads or batches or load is not None or busy is not None \
            or queued is not None or not out:
        out.append(batch())
    return out, seq
