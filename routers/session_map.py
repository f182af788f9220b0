"""The session map: which endpoint served a session's previous turn (``SessionMap``).

An agent's or a chat's next turn carries its whole conversation again; the engine that served the
previous turn holds it in its KV cache. ``prefix-cache`` finds that engine through the prefix
index when the prompt is indexed, but an index keyed by prompt text cannot see a session whose
history the gateway expands itself (Responses with the gateway holding the state), whose prefix
was evicted, or that landed on another worker a moment ago. So a request that names its session
is sent where that session went last, unless that endpoint is overloaded (prefix-cache's guards
decide), and the map records every decision.

A request's session (``session_of``), first found wins:

* ``x-session-key`` / ``x-aibrix-session-key``, then the body's ``prompt_cache_key``, then
  ``x-session-id``: the client's own name for the conversation (per model, and per LoRA adapter:
  the same name for two models, or for a base model and an adapter of it, is two sessions). ``prompt_cache_key`` is OpenAI's field (chat completions, Responses)
  for routing requests that share a prefix to one cache; Codex sets it to its conversation's id. It
  is read on every API but Messages (not an Anthropic field), a string only (chat, completions and
  Responses refuse any other value), and goes to the engine
  as it came (vLLM and SGLang ignore it). It comes before ``x-session-id``, which is also what
  ``session-affinity`` answers with (its endpoint's address, one value for all of that endpoint's
  conversations) and a client may echo on every model; the key headers, set for the gateway, win;
* ``previous_response_id`` (Responses; ``InferenceRequest.previous_response_id`` once the gateway
  expanded it into the input): the endpoint that produced that response, recorded when it was
  answered (``r:<id>``; ids are unique, so not per model);
* ``metadata.user_id`` (Anthropic Messages): Anthropic's SDKs and agents (Claude Code puts its
  session id there) name the conversation's end user with it; one user's turns reuse their own
  context, and a user with many parallel conversations is spread by the load guards anyway. On the
  other APIs ``metadata`` is the caller's own tags (OpenAI stores them with the answer), so a tag
  named ``user_id`` there names no session.

Whose: with auth on (``InferenceRequest.tenant``, the user the API key names), a session key is
that user's (``OWNED``, the user, a 0 byte, the key): two users who name a session alike hold two
sessions, and one user's turns neither steer the other's nor tell them (by a faster answer) what
the other sent. Lineage keys are not: a response id is unique, and its owner is checked where it is
read (gateway/apis/responses.py); the Responses API keeps that owner as the entry's tag.

Bounds: at most ``max_entries`` entries, least recently recorded dropped first; an entry not
recorded again for ``ttl_s`` is forgotten. Keys longer than ``MAX_KEY_CHARS`` are not sessions.
One user holds at most ``user_share`` of ``max_entries`` (``user_max``): a new session past it
drops that user's own least recently recorded one, so a client that names a new session on every
request churns its own sessions, not the other users'. A response's lineage whose tag names its
owner counts against that owner's share too (one user's stored responses in volume churn that
user's own), and keeps its owner when a router records the chain's next turn on it (no tag).
Sessions no API key owns (auth off) share the whole map.

Sharing: ``on_put`` (set by the gateway's shared view) is told of a new or changed entry, and of
an unchanged one at most every quarter TTL (so the other processes' copies do not expire) or once
a quarter of ``max_entries`` entries have been recorded since it was last told (so a full map in
the other processes, which orders it by when it was told, does not drop it first while it is in
use here), with the wall-clock time it tells it at; ``apply`` records another process's entry without telling it
again, unless this map told a later one of the key: two processes that record one session at once
(an agent's parallel calls on two workers, two replicas while Redis was away) each hear the other's
entry, and both keep the later (equal times: the larger URL), where each took the other's and the
session went back and forth between the two endpoints. An entry that replaces or refreshes one is
told after it whatever the clocks say, so a replica whose clock is behind still moves a session.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest

MAX_KEY_CHARS = 256
MESSAGES = "/v1/messages"  # gateway.apis.paths.MESSAGES (routers import only endpoints and request)
RESPONSE = "r:"          # the prefix of lineage keys: previous_response_id → the endpoint that answered
OWNED = "\1"             # the prefix of a session's key when an API key named its user: \1<user>\0<session>

# told of an entry to share: (key, endpoint, tag, the wall-clock time it is told at)
PutListener = Callable[[str, Endpoint, "str | None", float], None]


def session_of(req: InferenceRequest) -> str | None:
    """The request's session key in the map, or None (see the module docstring)."""
    data = req.data
    key = req.session_key
    if not key:
        key = data.get("prompt_cache_key") if req.path != MESSAGES else None
        if key.__class__ is not str or not key:
            key = req.session_id
    if key:
        if len(key) > MAX_KEY_CHARS:
            return None
        name = f"{req.model}\0s:{key}" if req.lora is None else f"{req.model}\0l:{req.lora}\0s:{key}"
        return name if req.tenant is None else f"{OWNED}{req.tenant}\0{name}"
    prev = req.previous_response_id or data.get("previous_response_id")
    if prev.__class__ is str and prev:
        return RESPONSE + prev if len(prev) <= MAX_KEY_CHARS else None
    meta = data.get("metadata") if req.path == MESSAGES else None
    if meta.__class__ is dict:
        uid = meta.get("user_id")
        if uid.__class__ is str and uid and len(uid) <= MAX_KEY_CHARS:
            name = f"{req.model}\0u:{uid}" if req.lora is None else f"{req.model}\0l:{req.lora}\0u:{uid}"
            return name if req.tenant is None else f"{OWNED}{req.tenant}\0{name}"
    return None


class _Entry:
    __slots__ = ("ep", "tag", "touched", "published", "at", "told", "owner")

    def __init__(self, ep: Endpoint, tag: str | None, now: float, at: float, told: int = 0) -> None:
        self.ep = ep
        self.tag = tag
        self.touched = now
        self.published = now
        self.at = at            # wall clock: when the process that recorded it told the others
        self.told = told        # the map's ``recorded`` count when it was last told (or heard of)
        self.owner: str | None = None     # the user whose session it is (an ``OWNED`` key)


class SessionMap:
    """Bounded LRU with a TTL: session key → (endpoint, tag). ``tag`` is an opaque string kept
    with the entry (the Responses API keeps the owner of a response id there)."""

    def __init__(self, ttl_s: float = 1800.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 user_share: float = 0.25) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max(1, max_entries)
        self.user_max = max(1, int(self.max_entries * user_share))
        # each user's keys, least recently recorded first (only users who hold a session)
        self._owned: dict[str, OrderedDict[str, None]] = {}
        self.user_evictions = 0     # sessions a user's new one pushed out of that user's share
        self.clock = clock
        self.wall = wall
        self._d: OrderedDict[str, _Entry] = OrderedDict()
        self.on_put: PutListener | None = None
        self.evictions = 0
        self.recorded = 0       # entries recorded, refreshes included: what moves others ahead of an entry

    def reconfigure(self, ttl_s: float, max_entries: int, user_share: float = 0.25) -> None:
        """New bounds (a reload), applied at once: the least recently recorded entries over
        ``max_entries`` go now, as do those not recorded again for the new ``ttl_s`` and a user's
        least recently recorded over the new ``user_max``, not when new entries push them out (a
        bound lowered to free memory held it until then)."""
        self.ttl_s, self.max_entries = ttl_s, max(1, max_entries)
        self.user_max = cap = max(1, int(self.max_entries * user_share))
        d = self._d
        for keys in list(self._owned.values()):
            while len(keys) > cap:
                del d[keys.popitem(last=False)[0]]
                self.evictions += 1
                self.user_evictions += 1
        over = len(d) - self.max_entries
        while over > 0:
            self._pop_oldest()
            self.evictions += 1
            over -= 1
        cut = self.clock() - self.ttl_s
        while d and next(iter(d.values())).touched < cut:
            self._pop_oldest()

    def __len__(self) -> int:
        return len(self._d)

    def stats(self) -> dict[str, int]:
        """For metrics: entries, evictions (every entry pushed out before its TTL), and those of
        them a user's own share pushed out."""
        return {"entries": len(self._d), "evictions": self.evictions, "user_evictions": self.user_evictions}

    def entry(self, key: str) -> tuple[Endpoint, str | None] | None:
        e = self._d.get(key)
        if e is None:
            return None
        if self.clock() - e.touched > self.ttl_s:
            self._drop(key, e)
            return None
        return e.ep, e.tag

    def get(self, key: str) -> Endpoint | None:
        e = self._d.get(key)
        if e is None:
            return None
        if self.clock() - e.touched > self.ttl_s:
            self._drop(key, e)
            return None
        return e.ep

    def put(self, key: str, ep: Endpoint, tag: str | None = None) -> None:
        """Record a decision of this process; ``on_put`` is told when the others need to know. An
        endpoint that left the pool (a turn answered on it after it left) is recorded as the one a
        reload declared in its place at its URL (``successor``), the same engine; else not at all."""
        while ep.removed:
            if ep.successor is None:
                return
            ep = ep.successor
        now = self.clock()
        e = self._d.get(key)
        self.recorded += 1
        if tag is None and e is not None and e.tag is not None and key.startswith(RESPONSE):
            tag = e.tag         # a router's turn on a response's chain: the response is still its owner's
        if e is not None and e.ep is ep and e.tag == tag:
            e.touched = now
            self._d.move_to_end(key)
            if e.owner is not None:
                self._owned[e.owner].move_to_end(key)
            # the others order their copy by when they were told: once many entries came after it
            # there, a full map would drop it first, however often it is used here
            if now - e.published < self.ttl_s / 4 and (self.recorded - 1 - e.told) * 4 < self.max_entries:
                return
            e.published = now
            e.told = self.recorded
            e.at = max(self.wall(), e.at + 1e-6)
        else:
            # after the entry it replaces, whatever the clocks of the processes that told it
            e = _Entry(ep, tag, now, self.wall() if e is None else max(self.wall(), e.at + 1e-6), self.recorded)
            self._store(key, e)
        if self.on_put is not None:
            self.on_put(key, ep, tag, e.at)

    def apply(self, key: str, ep: Endpoint, tag: str | None = None, at: float | None = None) -> bool:
        """Record another process's entry (not told to ``on_put``). ``at``: the wall-clock time that
        process told it at; an entry of another endpoint this map holds from later (equal: of the
        larger URL) is kept. None: taken whatever this map holds. Whether it was taken."""
        e = self._d.get(key)
        if at is None:
            at = self.wall()
        elif e is not None and e.ep is not ep:
            if e.at > at or (e.at == at and e.ep.url > ep.url):
                return False
        elif e is not None and e.at > at:
            at = e.at
        self.recorded += 1
        self._store(key, _Entry(ep, tag, self.clock(), at, self.recorded))
        return True

    def forget(self, ep: Endpoint, before: float | None = None, lineage: bool = False) -> int:
        """Drop the sessions whose last turn went to ``ep`` (its engine restarted: the conversation's
        cache there is gone), not the lineage of the responses it answered (``RESPONSE`` keys: an
        engine that stores responses is where they are asked for) unless ``lineage`` (the gateway
        holds the responses, so any engine continues a chain and its lineage is a session like any
        other); with ``before`` (wall clock), only those recorded before it. Returns how many.
        O(size)."""
        gone = [(k, e) for k, e in self._d.items()
                if e.ep is ep and (lineage or not k.startswith(RESPONSE)) and (before is None or e.at < before)]
        for k, e in gone:
            self._drop(k, e)
        return len(gone)

    def key_set(self) -> list[str]:
        """The map's keys as they are now, a copy in no particular order: read from the dict's own
        table, a hundred thousand in about a millisecond, where ``keys()`` follows the recency order's
        links (tens of milliseconds a hundred thousand, one loop turn)."""
        return list(dict.keys(self._d))

    def drop_removed(self, keys: list[str]) -> int:
        """Drop the entries of ``keys`` (a part of what ``key_set()`` gave, those still here) whose
        endpoint left the pool (``Endpoint.removed``): no turn goes there again, and the entry would
        keep the endpoint until ``ttl_s``. Returns how many. O(len(keys))."""
        d = self._d
        get = d.get
        n = 0
        for k in keys:
            e = get(k)
            if e is not None and e.ep.removed:
                self._drop(k, e)
                n += 1
        return n

    def rebind(self, old: Endpoint, new: Endpoint) -> int:
        """The sessions (and lineage) of ``old`` are ``new``'s, unchanged otherwise (a reload declared
        ``old``'s engine again with other settings). Returns how many. O(size)."""
        n = 0
        for e in self._d.values():
            if e.ep is old:
                e.ep = new
                n += 1
        return n

    def keys(self) -> list[str]:
        """The map's keys as they are now, a copy (one list of the keys themselves: nothing new for
        the collector to track), for ``export`` to read in parts while the map goes on changing."""
        return list(self._d)

    def export(self, keys: list[str] | None = None) -> list[tuple[str, Endpoint, str | None, float]]:
        """Every live entry (of ``keys``, a part of what ``keys()`` gave, those still here; or of
        the whole map), least recently recorded first: (key, endpoint, tag, when recorded on this
        map's clock), what a sibling catching up merges (``merge``). O(size)."""
        cut = self.clock() - self.ttl_s
        if keys is None:
            return [(k, e.ep, e.tag, e.touched) for k, e in self._d.items() if e.touched >= cut]
        get = self._d.get
        return [(k, e.ep, e.tag, e.touched) for k in keys if (e := get(k)) is not None and e.touched >= cut]

    def merge(self, key: str, ep: Endpoint, tag: str | None, touched: float) -> bool:
        """Another process's entry as it holds it (``export``), kept unless this map recorded the key
        later (not told to ``on_put``); whether it was kept."""
        e = self._d.get(key)
        if (e is not None and e.touched >= touched) or self.clock() - touched > self.ttl_s:
            return False
        self.recorded += 1
        entry = _Entry(ep, tag, touched, self.wall() - (self.clock() - touched), self.recorded)
        entry.published = touched
        self._store(key, entry)
        return True

    def _store(self, key: str, e: _Entry) -> None:
        d = self._d
        if key[0] == OWNED:
            self._own(key, e, key[1:key.index("\0")])
        elif key.startswith(RESPONSE):          # a response's lineage: its owner's, when its tag names one
            old = d.get(key)
            if old is not None and old.owner is not None and old.owner != e.tag:
                self._disown(key, old.owner)
            if e.tag is not None:
                self._own(key, e, e.tag)
        d[key] = e
        d.move_to_end(key)
        over = len(d) - self.max_entries
        while over > 0:
            self._pop_oldest()
            self.evictions += 1
            over -= 1
        # the oldest recorded are at the front: drop the expired ones there (amortised O(1))
        cut = e.touched - self.ttl_s
        while d:
            first = next(iter(d.values()))
            if first.touched >= cut:
                break
            self._pop_oldest()

    def _own(self, key: str, e: _Entry, owner: str) -> None:
        """``key`` (an ``OWNED`` one, or a response's lineage) is recorded now: last of ``owner``'s,
        whose least recently recorded over ``user_max`` goes."""
        e.owner = owner
        keys = self._owned.get(owner)
        if keys is None:
            keys = self._owned[owner] = OrderedDict()
        if key in keys:
            keys.move_to_end(key)
            return
        keys[key] = None
        if len(keys) > self.user_max:
            del self._d[keys.popitem(last=False)[0]]
            self.evictions += 1
            self.user_evictions += 1

    def _pop_oldest(self) -> None:
        key, e = self._d.popitem(last=False)
        if e.owner is not None:
            self._disown(key, e.owner)

    def _drop(self, key: str, e: _Entry) -> None:
        del self._d[key]
        if e.owner is not None:
            self._disown(key, e.owner)

    def _disown(self, key: str, owner: str) -> None:
        keys = self._owned[owner]
        del keys[key]
        if not keys:
            del self._owned[owner]
