"""SGLang P/D, bootstrap: both legs carry the same bootstrap host/port/room and ``rid``.

The bodies are built from the client's bytes: the top-level members the gateway controls are
removed and its own appended, and every other member (messages, tools, ...) goes to the engines
byte for byte. A body that names a controlled key twice is refused before any endpoint is chosen,
since the engine's JSON parser would silently keep the last one.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Annotated, Any, Protocol

import msgspec
import orjson

from gateway.endpoints import Endpoint
from gateway.request import InferenceRequest, usage_stream_options
from handlers.base import AbortSpec, PDPlan, openai_usage
from handlers.base import BodyError as _BodyError


class SGLangPDSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``pd.sglang`` config block."""

    default_bootstrap_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8998   # when neither endpoint nor roleset sets one
    abort_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 3.0        # /abort_request call timeout (0: never abort)
    abort_retry_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0    # a second abort after this delay (0: only one)


# keys the gateway writes into both bodies
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")
# keys the gateway writes or removes in the prefill body
PREFILL_KEYS = ("max_tokens", "max_completion_tokens", "stream", "stream_options", "min_tokens")
CONTROLLED = frozenset(BOOTSTRAP_KEYS + PREFILL_KEYS)

ROOM_LIMIT = 2**63

_NONCE = os.urandom(4).hex()
_COUNTER = itertools.count(1)


class BodyError(_BodyError):
    """The body cannot be split into top-level members (not a JSON object, or a duplicate
    controlled key)."""


def new_rid(request_id: str) -> str:
    """``<request-id>-<16 hex>``: a process nonce and a counter, fixed width, so no rid is a
    prefix of another (SGLang's /abort_request matches by prefix)."""
    return f"{request_id}-{_NONCE}{next(_COUNTER) & 0xFFFFFFFF:08x}"


def new_room(rng: random.Random | None = None) -> int:
    return (rng or random).randrange(ROOM_LIMIT)


def _skip_ws(b: bytes, i: int) -> int:
    n = len(b)
    while i < n and b[i] in b" \t\r\n":
        i += 1
    return i


def _end_of_string(b: bytes, i: int) -> int:
    """``b[i]`` is the opening quote; returns the index after the closing quote."""
    i += 1
    n = len(b)
    while i < n:
        c = b[i]
        if c == 0x5C:       # backslash: skip the escaped byte
            i += 2
            continue
        if c == 0x22:
            return i + 1
        i += 1
    raise BodyError("unterminated string")


def _end_of_value(b: bytes, i: int) -> int:
    n = len(b)
    depth = 0
    while i < n:
        c = b[i]
        if c == 0x22:
            i = _end_of_string(b, i)
            continue
        if c in b"{[":
            depth += 1
        elif c in b"}]":
            if depth == 0:
                return i
            depth -= 1
        elif c == 0x2C and depth == 0:
            return i
        i += 1
    raise BodyError("unterminated value")


def split_members(body: bytes) -> list[tuple[str, bytes]]:
    """Top-level ``(key, raw member bytes)`` pairs of a JSON object, in order. The body must
    already be known to be valid JSON (the gateway parsed it once)."""
    i = _skip_ws(body, 0)
    if i >= len(body) or body[i] != 0x7B:
        raise BodyError("request body is not a JSON object")
    i = _skip_ws(body, i + 1)
    out: list[tuple[str, bytes]] = []
    if i < len(body) and body[i] == 0x7D:
        return out
    while True:
        if body[i] != 0x22:
            raise BodyError("expected a key")
        key_end = _end_of_string(body, i)
        key = orjson.loads(body[i:key_end])
        j = _skip_ws(body, key_end)
        if body[j] != 0x3A:
            raise BodyError("expected ':'")
        v = _skip_ws(body, j + 1)
        end = _end_of_value(body, v)
        member_end = end
        while member_end > v and body[member_end - 1] in b" \t\r\n":
            member_end -= 1
        out.append((key, body[i:member_end]))
        k = _skip_ws(body, end)
        if body[k] == 0x7D:
            return out
        if body[k] != 0x2C:
            raise BodyError("expected ',' or '}'")
        i = _skip_ws(body, k + 1)


def check_members(members: list[tuple[str, bytes]]) -> None:
    seen: set[str] = set()
    for key, _ in members:
        if key in CONTROLLED:
            if key in seen:
                raise BodyError(f'duplicate top-level key "{key}" in SGLang request body')
            seen.add(key)


def _member(key: str, value: Any) -> bytes:
    return orjson.dumps(key) + b":" + orjson.dumps(value)


def build_bodies(members: list[tuple[str, bytes]], *, bootstrap_host: str, bootstrap_port: int,
                 room: int, rid: str, decode_extra: dict[str, Any] | None = None) -> tuple[bytes, bytes]:
    """(prefill body, decode body) from the client's members.

    Both get the bootstrap triple and the rid (client values overwritten). The prefill also gets
    ``max_tokens=1``, ``max_completion_tokens=1``, ``stream=false`` and loses ``stream_options``
    and ``min_tokens``. ``decode_extra`` replaces top-level decode keys (e.g. stream_options when
    the gateway asks for usage).
    """
    boot = [_member("bootstrap_host", bootstrap_host), _member("bootstrap_port", bootstrap_port),
            _member("bootstrap_room", room), _member("rid", rid)]
    extra = decode_extra or {}
    decode_kept = [raw for key, raw in members if key not in BOOTSTRAP_KEYS and key not in extra]
    decode = b"{" + b",".join(decode_kept + [_member(k, v) for k, v in extra.items()] + boot) + b"}"
    prefill_kept = [raw for key, raw in members if key not in CONTROLLED]
    prefill_set = [_member("max_tokens", 1), _member("max_completion_tokens", 1), _member("stream", False)]
    prefill = b"{" + b",".join(prefill_kept + prefill_set + boot) + b"}"
    return prefill, decode


def bootstrap_host_of(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class HasSGLangSettings(Protocol):
    """What the adapter reads of the model's ``pd`` config block."""

    sglang: SGLangPDSettings


class SGLangAdapter:
    """Bootstrap: both legs start together with the same bootstrap triple and gateway-owned rid;
    an abandoned leg is dropped with ``/abort_request {rid}``."""

    engine = "sglang"

    def check_pd_body(self, ireq: InferenceRequest) -> list[tuple[str, bytes]]:
        members = split_members(ireq.body)
        check_members(members)
        return members

    def pd_plan(self, ireq: InferenceRequest, checked: list[tuple[str, bytes]] | None, *, prefill: Endpoint,
                settings: HasSGLangSettings, rng: random.Random) -> PDPlan:
        own = settings.sglang
        members = checked if checked is not None else self.check_pd_body(ireq)
        rid = new_rid(ireq.request_id)
        extra = usage_stream_options(ireq)
        p_body, d_body = build_bodies(
            members, bootstrap_host=bootstrap_host_of(prefill.host),
            bootstrap_port=prefill.bootstrap_port or own.default_bootstrap_port,
            room=new_room(rng), rid=rid, decode_extra=extra)
        abort = AbortSpec("/abort_request", orjson.dumps({"rid": rid}), own.abort_timeout_s, own.abort_retry_delay_s)
        return PDPlan(concurrent=True, prefill_body=p_body, decode_body=d_body, abort=abort,
                      strip_usage=extra is not None, log={"rid": rid})

    def decode_body(self, ireq: InferenceRequest, prefill_answer: bytes, *, prefill: Endpoint,
                    settings: HasSGLangSettings) -> bytes:
        raise NotImplementedError("SGLang plans carry both bodies")

    def usage(self, answer: dict[str, Any]) -> dict[str, Any] | None:
        return openai_usage(answer)


SGLANG = SGLangAdapter()
