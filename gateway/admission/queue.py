"""The per-model waiting queue and the drain-rate estimate (pure; the service does the waiting).

Order: strictly by class (critical, then standard, then sheddable); inside a class, round-robin
across users (one request of each user with requests waiting, in the order the users arrived,
then again), and first come first served inside one user's requests. A user sending fifty
requests therefore does not push a user sending one behind all fifty.

A request's *position* is how many dispatches happen before it under that order, assuming nobody
else arrives: every request of a higher class, then per round of the class one request of each
user still waiting. ``Retry-After`` is that position over the drain rate.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

WAITING, GRANTED, FAILED = "waiting", "granted", "failed"


@dataclass(eq=False, slots=True)
class Waiter:
    rank: int                            # class: higher is served first (config.RANK)
    user: str
    size: int                            # body bytes it holds
    enqueued: float                      # monotonic seconds
    fut: Any = None                      # asyncio.Future set when it is dispatched or shed
    state: str = WAITING
    candidates: list = field(default_factory=list)   # the endpoints it may go to
    pairs: bool = False                  # routed as a prefill/decode pair


class FairQueue:
    def __init__(self, classes: int = 3) -> None:
        # per class: user → that user's waiters, users in round-robin order
        self._classes: list[OrderedDict[str, deque[Waiter]]] = [OrderedDict() for _ in range(classes)]
        self._counts = [0] * classes
        self.bytes = 0

    def __len__(self) -> int:
        return sum(self._counts)

    def count(self, rank: int) -> int:
        return self._counts[rank]

    def push(self, w: Waiter) -> None:
        users = self._classes[w.rank]
        q = users.get(w.user)
        if q is None:
            q = users[w.user] = deque()
        q.append(w)
        self._counts[w.rank] += 1
        self.bytes += w.size

    def peek(self) -> Waiter | None:
        for rank in range(len(self._classes) - 1, -1, -1):
            users = self._classes[rank]
            if users:
                return next(iter(users.values()))[0]
        return None

    def pop(self) -> Waiter | None:
        """The next request to dispatch; its user moves to the back of its class's rotation."""
        for rank in range(len(self._classes) - 1, -1, -1):
            users = self._classes[rank]
            if users:
                user, q = next(iter(users.items()))
                w = q.popleft()
                if q:
                    users.move_to_end(user)
                else:
                    del users[user]
                self._forget(w)
                return w
        return None

    def remove(self, w: Waiter) -> bool:
        """Take ``w`` out (timed out, client gone, displaced); False if it is not queued."""
        users = self._classes[w.rank]
        q = users.get(w.user)
        if q is None:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        if not q:
            del users[w.user]
        self._forget(w)
        return True

    def _forget(self, w: Waiter) -> None:
        self._counts[w.rank] -= 1
        self.bytes -= w.size

    def higher_waiting(self, rank: int) -> bool:
        return any(self._counts[r] for r in range(rank + 1, len(self._counts)))

    def victim(self, rank: int) -> Waiter | None:
        """Whom a request of class ``rank`` may displace from a full queue: the newest request of
        the lowest class below ``rank``, taken from the user with the most waiting."""
        for r in range(rank):
            users = self._classes[r]
            if users:
                q = max(users.values(), key=len)
                return q[-1]
        return None

    def position(self, rank: int, user: str, w: Waiter | None = None) -> int:
        """Dispatches before ``w`` (queued), or before a request of ``user`` and class ``rank``
        that would join now at the back of its user's line."""
        ahead = sum(self._counts[r] for r in range(rank + 1, len(self._counts)))
        users = self._classes[rank]
        mine = users.get(user)
        if w is not None and mine is not None and w in mine:
            idx = mine.index(w)
        else:
            idx = len(mine) if mine is not None else 0
        order = list(users)
        me = order.index(user) if user in users else len(order)
        for i, u in enumerate(order):
            if u == user:
                continue
            # users ahead of mine in the rotation are served once more in my round
            ahead += min(len(users[u]), idx + 1 if i < me else idx)
        return ahead + idx


class DrainRate:
    """Requests per second a model's endpoints finish, over the last ``window_s`` seconds: the
    pace at which a full queue moves. One-second buckets in a ring; no timer."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window = max(1, int(math.ceil(window_s)))
        self._buckets = [0] * self.window
        self._last = None            # the current bucket's second
        self._first: float | None = None

    def tick(self, now: float, n: int = 1) -> None:
        self._advance(now)
        self._buckets[int(now) % self.window] += n
        if self._first is None:
            self._first = now

    def rate(self, now: float) -> float:
        self._advance(now)
        if self._first is None:
            return 0.0
        span = min(float(self.window), max(1.0, now - self._first))
        return sum(self._buckets) / span

    def _advance(self, now: float) -> None:
        sec = int(now)
        last = self._last
        if last is None:
            self._last = sec
            return
        if sec <= last:
            return
        for s in range(last + 1, min(sec, last + self.window) + 1):
            self._buckets[s % self.window] = 0
        self._last = sec


def retry_after_s(position: int, rate: float, cap: int) -> float:
    """Seconds until ``position`` requests ahead (and this one) have drained at ``rate``/s, at
    least one second and at most ``cap``; ``cap`` when nothing has drained lately."""
    if rate <= 0:
        return float(cap)
    return min(float(cap), max(1.0, (position + 1) / rate))
