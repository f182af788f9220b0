"""``session-affinity``: keep a conversation on one engine, with no state in the gateway.

* ``x-session-id`` request header = base64 of an endpoint's ``host:port`` (what the previous
  answer returned). If it names a ready candidate, that endpoint is chosen.
* Else the session key: the session-key header (``x-session-key``, or AIBrix's
  ``x-aibrix-session-key``), else the body's ``prompt_cache_key`` (OpenAI's name for the
  conversation, on every API but Messages, as ``prefix-cache`` reads it); opaque, at most 256
  bytes. It picks by rendezvous hashing: FNV-1a 64 over the key, a 0 byte, then the
  address; the highest hash wins, ties to the lexicographically smaller address. Every gateway
  replica computes the same answer from the same candidates (AIBrix's exact function, so mixed
  fleets agree too), and when an endpoint leaves only its own sessions move.
* Else a uniformly random candidate, counted as a fallback (``no_session``; ``session_endpoint_gone``
  when the ``x-session-id`` was undecodable or names no ready endpoint and there is no key;
  ``bad_session_key`` for an over-long key).

The answer always carries ``x-session-id`` for the chosen endpoint, so a client that echoes it
stays put; in a weighted list too (through ``response_headers``), where the pinned endpoint scores
1 and the others 0.
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Sequence

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest
from routers.base import Decision, RouterContext, ScoringRouter
from routers.session_map import MESSAGES

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1
MAX_KEY_BYTES = 256
SESSION_HEADER = "x-session-id"
# rendezvous results remembered per session key (sessions repeat; candidate lists rarely change)
_MEMO_SIZE = 65536
_LISTS = 64


def fnv1a64(data: bytes, h: int = FNV_OFFSET) -> int:
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK
    return h


def encode_session_id(address: str) -> str:
    return base64.b64encode(address.encode()).decode("ascii")


def decode_session_id(value: str) -> str | None:
    try:
        return base64.b64decode(value.strip(), validate=True).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def rendezvous(key: str, candidates: Sequence[Endpoint]) -> Endpoint:
    """Highest FNV-1a-64(key ‖ 0x00 ‖ address); ties go to the smaller address."""
    base = fnv1a64(b"\0", fnv1a64(key.encode()))
    best = candidates[0]
    best_h = -1
    for ep in candidates:
        addr = ep.address
        h = fnv1a64(addr.encode(), base)
        if h > best_h or (h == best_h and addr < best.address):
            best, best_h = ep, h
    return best


class SessionAffinityRouter(ScoringRouter):
    name = "session-affinity"
    polarity = "most"

    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self._choice = ctx.rng.choice
        self._memo: OrderedDict[str, tuple[tuple[Endpoint, ...], Endpoint]] = OrderedDict()
        self._lists: OrderedDict[tuple[Endpoint, ...], tuple[Endpoint, ...]] = OrderedDict()

    def pinned(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> tuple[Endpoint | None, str | None]:
        """The session's endpoint, or ``(None, fallback reason)``."""
        reason = None
        sid = req.session_id
        if sid:
            addr = decode_session_id(sid)
            if addr is not None:
                for ep in candidates:
                    if ep.address == addr:
                        return ep, None
            reason = "session_endpoint_gone"
        key = req.session_key
        if not key and req.path != MESSAGES:
            key = req.data.get("prompt_cache_key")     # a string, or None (parsing refuses any other)
            if key.__class__ is not str:
                key = None
        if key:
            if len(key) > MAX_KEY_BYTES or len(key.encode()) > MAX_KEY_BYTES:
                return None, "bad_session_key"
            return self._rendezvous(key, candidates), None
        return None, reason or "no_session"

    def _rendezvous(self, key: str, candidates: Sequence[Endpoint]) -> Endpoint:
        # Candidate lists are interned (endpoints hash and compare by identity), so a memo entry is
        # (key → (the list it was computed for, the winner)) and a hit is one identity check.
        cands = tuple(candidates)
        canon = self._lists.get(cands)
        if canon is None:
            canon = self._lists[cands] = cands
            if len(self._lists) > _LISTS:
                self._lists.popitem(last=False)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is canon:
            return hit[1]
        ep = rendezvous(key, candidates)
        self._memo[key] = (canon, ep)
        if len(self._memo) > _MEMO_SIZE:
            self._memo.popitem(last=False)
        return ep

    def route(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> Decision:
        ep, reason = self.pinned(req, candidates)
        if ep is None:
            self.ctx.on_fallback(self.name, reason or "no_session")
            ep = self._choice(candidates)
        return Decision(ep, self.name, headers={SESSION_HEADER: encode_session_id(ep.address)})

    def response_headers(self, req: InferenceRequest, ep: Endpoint) -> dict[str, str]:
        """In a weighted list: the chosen endpoint becomes the session's, as when routing alone."""
        return {SESSION_HEADER: encode_session_id(ep.address)}

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float | None]:
        ep, reason = self.pinned(req, candidates)
        if ep is None:
            self.ctx.on_fallback(self.name, reason or "no_session")
            return [None] * len(candidates)
        return [1.0 if c is ep else 0.0 for c in candidates]
