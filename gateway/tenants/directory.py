"""Keys and users: the configured ones merged with those created at run time (the store).

Keys are never kept in plaintext: a key is known by the hex SHA-256 of its text (its *digest*),
and shown to operators by an ``id`` (the first 16 hex digits of the digest). Looking a presented
key up by its digest means the lookup's timing depends only on the digest, which tells an
attacker nothing about any stored key; the final comparison is constant-time anyway.

Users: a store record wins over ``limits.users`` in the config (so an operator can change a
configured user's limits at run time, and deleting the store record falls back to the config);
users with neither get ``limits.default_user`` (each with their own counters), else no limit.
A configured name (a key's ``user``, a ``limits.users`` entry) is kept as a client's claimed name
is (``gateway.request.claimed_user``): up to 128 characters as it is, else by its digest, so the
request log, the metrics, the status page, a 429 and the engine's ``user`` header name one user the
same way, and a client claiming that long name without auth is that user.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, get_args

from gateway.admission.config import Priority
from gateway.config.schema import AuthConfig, LimitsConfig, UserLimits
from gateway.request import claimed_user

KEY_PREFIX = "sk-sy-"
USER_NAME = re.compile(r"[A-Za-z0-9._@:+\-]{1,128}")
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent")
PRIORITIES = get_args(Priority)        # the admission classes a record may give its user


def key_digest(key: str) -> str:
    # a header's bytes that are not UTF-8 (surrogate escapes) hash as they came: no key matches them
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key() -> str:
    """A fresh API key: 256 random bits, URL-safe, with a recognisable prefix."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer_token(header: str | None) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


def header_field(headers, name: str) -> str | None:
    """A header's value as RFC 9110 section 5.3 reads a field sent on several lines: the lines
    joined with ", ". Authorization and x-api-key are not lists, so two lines of either make a value
    no key matches ("Bearer a, Bearer b"): which line counts is not left to whichever one a reader
    takes (a proxy that checked one line could otherwise have the gateway act on another)."""
    lines = headers.getall(name, ())
    if len(lines) < 2:
        return lines[0] if lines else None
    return ", ".join(lines)


def admin_token_valid(authorization: str | None, digest: str | None) -> bool:
    """Whether ``Authorization: Bearer <token>`` carries the admin token whose digest is ``digest``
    (None or empty: no admin token is configured, so nothing is valid). The one admin check of
    /admin, /admin/reload and the status page."""
    token = bearer_token(authorization)
    return token is not None and bool(digest) and hmac.compare_digest(key_digest(token), digest or "")


class AmbiguousKey(ValueError):
    """A request presented two different API keys, one in each header."""


def presented_key(headers) -> str | None:
    """The API key a client presented: ``Authorization: Bearer <key>`` (OpenAI's clients) or
    ``x-api-key: <key>`` (Anthropic's); each header read whole (``header_field``). Both may be
    sent with the same key; two different keys raise ``AmbiguousKey``: which one names the user
    is not left to a precedence the client (or a proxy in front, which may have checked the other
    one) need not know."""
    token = bearer_token(header_field(headers, "Authorization"))
    other = (header_field(headers, "x-api-key") or "").strip() or None
    if token is not None and other is not None and not hmac.compare_digest(
            token.encode("utf-8", "surrogateescape"), other.encode("utf-8", "surrogateescape")):
        raise AmbiguousKey
    return token or other


@dataclass(frozen=True, slots=True)
class KeyRecord:
    digest: str
    user: str
    name: str = ""
    created: float = 0.0
    source: str = "store"                # config | store

    @property
    def id(self) -> str:
        return self.digest[:16]

    def stored(self) -> dict[str, Any]:
        return {"user": self.user, "name": self.name, "created": self.created}

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "user": self.user, "name": self.name, "created": self.created,
                "source": self.source}

    @classmethod
    def from_stored(cls, digest: str, data: dict[str, Any]) -> KeyRecord:
        return cls(digest=digest, user=str(data["user"]), name=str(data.get("name") or ""),
                   created=float(data.get("created") or 0.0))


def limits_from_stored(data: dict[str, Any]) -> UserLimits:
    """A stored record (memory, Redis); one written before ``models`` existed has no list: every
    model; one written before ``priority`` existed (or naming no class this release knows) has no
    class: the default user's, else ``admission.default_priority``."""
    models = data.get("models")
    priority = data.get("priority")
    return UserLimits(**{f: int(data.get(f) or 0) for f in LIMIT_FIELDS},
                      models=tuple(str(m) for m in models) if isinstance(models, list) and models else None,
                      priority=priority if priority in PRIORITIES else None)


def limits_stored(limits: UserLimits) -> dict[str, Any]:
    """A user's record as stored: the limits, ``models`` when the user has a list and ``priority``
    when it has a class (a record without them is read alike by a replica of an older release)."""
    out: dict[str, Any] = {f: getattr(limits, f) for f in LIMIT_FIELDS}
    if limits.models is not None:
        out["models"] = list(limits.models)
    if limits.priority is not None:
        out["priority"] = limits.priority
    return out


def limits_view(limits: UserLimits) -> dict[str, Any]:
    """A user's record as the admin API shows it: ``models`` (null: every model) and ``priority``
    (null: the default's class) always."""
    return {**limits_stored(limits), "models": list(limits.models) if limits.models is not None else None,
            "priority": limits.priority}


class Directory:
    """The local view of keys and users. Lookups are dict reads; the store part is replaced as a
    whole when read whole, or has the records that changed since put in place (Redis)."""

    def __init__(self, auth: AuthConfig, limits: LimitsConfig) -> None:
        self.reconfigure(auth, limits)
        self.store_keys: dict[str, KeyRecord] = {}
        self.store_users: dict[str, UserLimits] = {}

    def reconfigure(self, auth: AuthConfig, limits: LimitsConfig) -> None:
        """The config part (at start, and at a reload); the store part is kept."""
        self.config_keys: dict[str, KeyRecord] = {
            k.key_sha256: KeyRecord(digest=k.key_sha256, user=claimed_user(k.user) or k.user, name=k.name,
                                    source="config")
            for k in auth.api_keys}
        self.config_users: dict[str, UserLimits] = {claimed_user(u) or u: lim for u, lim in limits.users.items()}
        self.default_user: UserLimits | None = limits.default_user

    # -- hot path ----------------------------------------------------------------------------

    def key(self, digest: str) -> KeyRecord | None:
        rec = self.config_keys.get(digest) or self.store_keys.get(digest)
        if rec is None or not hmac.compare_digest(rec.digest, digest):
            return None
        return rec

    def limits_for(self, user: str | None) -> UserLimits | None:
        """The user's effective limits, or None when nothing limits them."""
        if user is None:
            return None
        lim = self.store_users.get(user) or self.config_users.get(user) or self.default_user
        return lim if lim is not None and lim.any else None

    def models_for(self, user: str | None) -> tuple[str, ...] | None:
        """The names ``user`` may ask for (from the record that gives their limits), or None: every
        model. A request naming no user has no list."""
        if user is None:
            return None
        lim = self.store_users.get(user) or self.config_users.get(user) or self.default_user
        return lim.models if lim is not None else None

    def priority_for(self, user: str | None) -> str | None:
        """The admission class of ``user``'s requests: that of the record that gives their limits
        (a store record over the configured one), else the default user's; None: admission's
        ``default_priority``."""
        lim = (self.store_users.get(user) or self.config_users.get(user)) if user is not None else None
        if lim is not None and lim.priority is not None:
            return lim.priority
        return self.default_user.priority if self.default_user is not None else None

    # -- store mirror ------------------------------------------------------------------------

    def replace_store(self, users: dict[str, UserLimits], keys: dict[str, KeyRecord]) -> None:
        self.store_users = users
        self.store_keys = keys

    def apply_store(self, users: dict[str, UserLimits | None], keys: dict[str, KeyRecord | None]) -> None:
        """What changed in the store since the mirror was read: each record as it is now, None
        for one deleted."""
        for name, lim in users.items():
            if lim is None:
                self.store_users.pop(name, None)
            else:
                self.store_users[name] = lim
        for digest, rec in keys.items():
            if rec is None:
                self.store_keys.pop(digest, None)
            else:
                self.store_keys[digest] = rec

    # -- admin views -------------------------------------------------------------------------

    def user_source(self, name: str) -> str | None:
        if name in self.store_users:
            return "store"
        if name in self.config_users:
            return "config"
        return None

    def user_view(self, name: str) -> dict[str, Any] | None:
        src = self.user_source(name)
        if src is None:
            return None
        lim = self.store_users[name] if src == "store" else self.config_users[name]
        return {"name": name, **limits_view(lim), "source": src,
                "overrides_config": src == "store" and name in self.config_users}

    def users(self) -> list[dict[str, Any]]:
        names = sorted(set(self.config_users) | set(self.store_users))
        return [v for n in names if (v := self.user_view(n)) is not None]

    def keys(self, user: str | None = None) -> list[KeyRecord]:
        out = list(self.config_keys.values()) + [k for d, k in self.store_keys.items() if d not in self.config_keys]
        return sorted((k for k in out if user is None or k.user == user), key=lambda k: (k.user, k.created, k.id))

    def key_by_id(self, key_id: str) -> KeyRecord | None:
        """The key whose id (its digest's first 16 hex digits) is ``key_id``: a configured key
        first, as ``keys`` lists them; one pass, no list made or sorted (an admin call on a store of
        20,000 keys is not 20,000 records sorted)."""
        for k in self.config_keys.values():
            if k.id == key_id:
                return k
        for k in self.store_keys.values():
            if k.id == key_id:
                return k
        return None


def now() -> float:
    return round(time.time(), 3)
