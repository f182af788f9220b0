"""The in-memory state backend: one replica, no I/O, the default.

Same semantics as the Redis backend (``redis_state``), so tests of either describe both: windows
start at their first hit, checks read everything and charge only when all pass. Nothing here
awaits, so a check-and-charge cannot interleave with another request's.

Expired windows are dropped when touched and swept every ``SWEEP_S``, so the table stays bounded
by the number of users active in the last minute (users may be client-chosen when auth is off).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.config.schema import UserLimits
from gateway.tenants.directory import KeyRecord, limits_from_stored, limits_stored
from gateway.tenants.limits import MODEL_WINDOW_MS, USER_WINDOW_MS, AdmitQuery, AdmitResult

SWEEP_S = 10.0


class MemoryState:
    remote = False
    up = True
    healthy = True
    down_reason = None

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._windows: dict[tuple[str, str], list] = {}     # (kind, name) → [count, expires_at]
        self._concurrent: dict[str, int] = {}
        self._next_sweep = clock() + SWEEP_S
        self.users: dict[str, UserLimits] = {}
        self.keys: dict[str, KeyRecord] = {}
        self.version = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    # -- counters ----------------------------------------------------------------------------

    def _read(self, kind: str, name: str, now: float) -> tuple[int, int]:
        w = self._windows.get((kind, name))
        if w is None:
            return 0, 0
        if w[1] <= now:
            del self._windows[(kind, name)]
            return 0, 0
        return w[0], int((w[1] - now) * 1000)

    def _add(self, kind: str, name: str, n: int, window_ms: int, now: float) -> tuple[int, int]:
        w = self._windows.get((kind, name))
        if w is None or w[1] <= now:
            w = self._windows[(kind, name)] = [0, now + window_ms / 1000]
        w[0] += n
        return w[0], int((w[1] - now) * 1000)

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + SWEEP_S
        for k in [k for k, w in self._windows.items() if w[1] <= now]:
            del self._windows[k]

    async def admit(self, q: AdmitQuery) -> AdmitResult:
        now = self._clock()
        if now >= self._next_sweep:
            self._sweep(now)
        lim, user = q.limits, q.user or ""
        r = AdmitResult()
        rpm = lim.rpm if lim else 0
        tpm = lim.tpm if lim else 0
        conc = lim.max_concurrent if lim else 0
        if rpm:
            r.requests, r.requests_reset_ms = self._read("rpm", user, now)
        if tpm:
            r.tokens, r.tokens_reset_ms = self._read("tpm", user, now)
        if q.model_rps:
            r.model_requests, r.model_reset_ms = self._read("rps", q.model, now)
        if conc:
            r.concurrent = self._concurrent.get(user, 0)
        if q.model_rps and r.model_requests >= q.model_rps:
            r.reason = "model_rps"
        elif rpm and r.requests >= rpm:
            r.reason = "rpm"
        elif tpm and r.tokens >= tpm:
            r.reason = "tpm"
        elif conc and r.concurrent >= conc:
            r.reason = "concurrency"
        else:
            if rpm:
                r.requests, r.requests_reset_ms = self._add("rpm", user, 1, USER_WINDOW_MS, now)
            if q.model_rps:
                r.model_requests, r.model_reset_ms = self._add("rps", q.model, 1, MODEL_WINDOW_MS, now)
            if conc:
                r.concurrent = self._concurrent[user] = r.concurrent + 1
                r.acquired = True
        return r

    def uncount(self, user: str, counted: tuple[float | None, float | None, str]) -> None:
        """A request counted in the user's RPM window and the model's RPS window (ending at the
        given monotonic times) that no engine saw: the count back, in the windows it was counted in."""
        rpm_end, rps_end, model = counted
        for kind, name, end in (("rpm", user, rpm_end), ("rps", model, rps_end)):
            w = self._windows.get((kind, name))
            if end is not None and w is not None and abs(w[1] - end) < 0.05 and w[0] > 0:
                w[0] -= 1

    def settle(self, user: str, tokens: int, release: bool) -> None:
        if tokens > 0:
            self._add("tpm", user, tokens, USER_WINDOW_MS, self._clock())
        if release:
            n = self._concurrent.get(user, 0) - 1
            if n > 0:
                self._concurrent[user] = n
            else:
                self._concurrent.pop(user, None)

    async def usage(self, user: str) -> dict[str, int]:
        now = self._clock()
        req, req_reset = self._read("rpm", user, now)
        tok, tok_reset = self._read("tpm", user, now)
        return {"requests": req, "requests_reset_ms": req_reset, "tokens": tok, "tokens_reset_ms": tok_reset,
                "concurrent": self._concurrent.get(user, 0)}

    async def peek(self, users: list[str]) -> dict[str, dict[str, int]]:
        """Current window usage of several users at once, for the status page (no charge)."""
        now = self._clock()
        return {u: {"requests": self._read("rpm", u, now)[0], "tokens": self._read("tpm", u, now)[0],
                    "concurrent": self._concurrent.get(u, 0)} for u in users}

    def slots(self) -> dict[str, int]:
        """The requests in flight this process holds, by user (those with a concurrency limit)."""
        return dict(self._concurrent)

    def active_users(self, limit: int) -> list[str]:
        """Users with a live RPM/TPM window or a request in flight, at most ``limit``, sorted."""
        now = self._clock()
        names = {name for (kind, name), w in self._windows.items() if kind != "rps" and w[1] > now}
        names.update(self._concurrent)
        return sorted(names)[:limit]

    # -- directory store ---------------------------------------------------------------------

    async def load_directory(self) -> tuple[str, dict[str, UserLimits], dict[str, KeyRecord], None]:
        return str(self.version), dict(self.users), dict(self.keys), None

    async def get_key(self, digest: str) -> KeyRecord | None:
        return self.keys.get(digest)

    async def put_user(self, name: str, limits: UserLimits, only: str | None = None) -> bool:
        """As the Redis backend's: ``only="absent"``/``"present"`` makes the write conditional."""
        if only is not None and (name in self.users) != (only == "present"):
            return False
        self.users[name] = limits
        self.version += 1
        return True

    async def patch_user(self, name: str, changes: dict[str, Any], base: UserLimits | None) -> bool:
        """As the Redis backend's: read and written with no await between."""
        cur = self.users.get(name, base)
        if cur is None:
            return False
        self.users[name] = limits_from_stored({**limits_stored(cur), **changes})     # models: None clears it
        self.version += 1
        return True

    async def delete_user(self, name: str) -> int | None:
        """As the Redis backend's: the record and every key of the user, or None without a record."""
        if self.users.pop(name, None) is None:
            return None
        gone = [d for d, k in self.keys.items() if k.user == name]
        for d in gone:
            del self.keys[d]
        self.version += 1
        return len(gone)

    async def put_key(self, rec: KeyRecord, only: str | None = None) -> bool:
        if only is not None and (rec.digest in self.keys) != (only == "present"):
            return False
        self.keys[rec.digest] = rec
        self.version += 1
        return True

    async def delete_key(self, digest: str) -> None:
        self.keys.pop(digest, None)
        self.version += 1
