"""The per-model waiting queue and the drain-rate estimate (pure; the service does the waiting).

Order: strictly by class (critical, then standard, then sheddable). Inside a class, fairly across
users by the tokens they were served — a virtual token counter per user, as in VTC (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI '24): the next request is the one of the waiting
user whose counter is lowest (ties: the user who started waiting first), and dispatching it adds
its cost (prompt tokens + 2 x the expected output tokens) to that counter (one per class). A user who starts
waiting is lifted to the lowest counter among those waiting in the class (and kept no higher than
the highest), so time spent idle is not banked as credit and service long past is not held
against anyone for ever. With equal costs this is round-robin, one request of each user in turn.
Inside one user's line: earliest deadline first (``x-slo-ttft-ms`` or the model's default), then
first come first served — fairness between users and EDF inside a user's flow, as in the Gateway
API Inference Extension's flow control; so one user's deadlines cannot push a light user back.

A full queue makes room by *eviction*, never by refusing a lighter newcomer: a request of a lower
class goes first; inside the class, the newest, least urgent request of the user with the most
service (counter plus what is queued) goes when that is more than the newcomer's user would have
with it (``make_room``). Nobody is evicted for a newcomer those evictions could not make room for.

A request's *position* is how many dispatches happen before it under that order, assuming nobody
else arrives: every request of a higher class, then those of its class whose start tag (counter
plus the costs queued before them in their line) is lower. ``Retry-After`` is that position over
the drain rate; the same estimate decides whether a deadline can be met at all.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from typing import Any

WAITING, GRANTED, FAILED = "waiting", "granted", "failed"
MAX_USERS = 10_000           # counters kept per model (the least recently served forgotten first)


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
    widen: bool = False                  # its model's endpoints ready since may take it (none chose them)
    accepts: Any = None                  # with widen: which of them its API lets it go to (None: all)
    cost: float = 1.0                    # tokens it will be charged (its user's counter)
    deadline: float = math.inf           # monotonic seconds by which its first token is due
    slo_ms: float | None = None          # the TTFT objective its deadline comes from
    seq: int = 0                         # arrival order (set by the queue)
    rec: Any = None                      # its request's record: the log fields of how its wait ended
    # granted past waiters that could not go: the endpoints it must leave to them (their only room)
    reserved: Any = None

    def key(self) -> tuple[float, int]:
        return self.deadline, self.seq


@dataclass(slots=True)
class _Line:
    """One user's requests of one class, earliest deadline first."""

    since: int                           # when the user started waiting: the tie-break between users
    items: list[Waiter] = field(default_factory=list)
    cost: float = 0.0                    # the costs queued


class FairQueue:
    def __init__(self, classes: int = 3) -> None:
        self._classes: list[dict[str, _Line]] = [{} for _ in range(classes)]
        self._counts = [0] * classes
        self.bytes = 0
        # per class: user → tokens served (virtual)
        self.counters: list[OrderedDict[str, float]] = [OrderedDict() for _ in range(classes)]
        self._seq = 0
        self._held = 0
        # told when the queue fills (its first request) or empties (its last one left)
        self.on_change: Callable[[], None] | None = None

    def __len__(self) -> int:
        return sum(self._counts)

    def count(self, rank: int) -> int:
        return self._counts[rank]

    def users(self, rank: int) -> int:
        return len(self._classes[rank])

    def waiting_users(self, rank: int) -> list[str]:
        return list(self._classes[rank])

    # -- the counters ----------------------------------------------------------------------------

    def counter(self, rank: int, user: str) -> float:
        return self.counters[rank].get(user, 0.0)

    def charge(self, rank: int, user: str, tokens: float) -> None:
        """Add served tokens to ``user``'s counter in class ``rank`` (a dispatch, or a correction
        once the answer's real size is known)."""
        c = self.counters[rank]
        c[user] = max(0.0, c.get(user, 0.0) + tokens)
        c.move_to_end(user)
        while len(c) > MAX_USERS:
            c.popitem(last=False)

    def _lifted(self, rank: int, user: str) -> float:
        """The counter ``user`` starts waiting with in class ``rank``."""
        own = self.counter(rank, user)
        lines = self._classes[rank]
        if not lines or user in lines:
            return own
        waiting = [self.counter(rank, u) for u in lines]
        return min(max(own, min(waiting)), max(waiting))

    # -- in and out ------------------------------------------------------------------------------

    def push(self, w: Waiter) -> None:
        lines = self._classes[w.rank]
        self._seq += 1
        w.seq = self._seq
        line = lines.get(w.user)
        if line is None:
            lifted = self._lifted(w.rank, w.user)
            if lifted != self.counter(w.rank, w.user):
                self.charge(w.rank, w.user, lifted - self.counter(w.rank, w.user))
            line = lines[w.user] = _Line(self._seq)
        insort(line.items, w, key=Waiter.key)
        line.cost += w.cost
        self._counts[w.rank] += 1
        self.bytes += w.size
        self._held += 1
        if self._held == 1 and self.on_change is not None:
            self.on_change()

    def _next_user(self, rank: int) -> str | None:
        lines = self._classes[rank]
        if not lines:
            return None
        return min(lines, key=lambda u: (self.counter(rank, u), lines[u].since))

    def peek(self, skip: set[int] | None = None) -> Waiter | None:
        """The next request to dispatch; with ``skip`` (ids of waiters that cannot go now), the
        first of the others in the same order."""
        if not skip:
            for rank in range(len(self._classes) - 1, -1, -1):
                user = self._next_user(rank)
                if user is not None:
                    return self._classes[rank][user].items[0]
            return None
        return next((w for w in self.in_order() if id(w) not in skip), None)

    def in_order(self, rank: int = 0) -> Iterator[Waiter]:
        """The requests of class ``rank`` and above, in the order they are dispatched (were none
        dispatched meanwhile: a dispatch moves its user's counter). The first user of a class is
        found without sorting the others, which are sorted only if the walk goes past its requests.
        Not to be resumed after the queue changed."""
        for r in range(len(self._classes) - 1, rank - 1, -1):
            first = self._next_user(r)
            if first is None:
                continue
            lines = self._classes[r]
            yield from lines[first].items
            for user in sorted(lines, key=lambda u: (self.counter(r, u), lines[u].since)):
                if user != first:
                    yield from lines[user].items

    def walk(self) -> Iterator[Waiter]:
        """The requests in the order the pump grants them, each once, while the walker grants
        (``take``, then state ``GRANTED``) or removes the request it was just given: a grant moves
        its user's counter, so that user's requests after it come again at its new counter's turn,
        where ``in_order`` walked anew would find them (less the requests passed, which stay
        passed). One walk however many grants: the users of a class in a heap."""
        for r in range(len(self._classes) - 1, -1, -1):
            lines = self._classes[r]
            heap = [(self.counter(r, u), line.since, u, 0) for u, line in lines.items()]
            heapify(heap)
            while heap:
                _, since, user, i = heappop(heap)
                items = lines[user].items if user in lines else []
                while i < len(items):
                    w = items[i]
                    yield w
                    if i < len(items) and items[i] is w:
                        i += 1                  # passed over
                    elif w.state == GRANTED:    # its user's counter moved: its turn again by it
                        if i < len(items):
                            heappush(heap, (self.counter(r, user), since, user, i))
                        break
                    # else removed (shed, gone): the next is where it was

    def take(self, w: Waiter) -> None:
        """Dispatch ``w``: out of the queue, its cost on its user's counter."""
        if self.remove(w):
            self.charge(w.rank, w.user, w.cost)

    def pop(self) -> Waiter | None:
        """The next request to dispatch; its cost goes on its user's counter."""
        for rank in range(len(self._classes) - 1, -1, -1):
            user = self._next_user(rank)
            if user is not None:
                w = self._classes[rank][user].items[0]
                self.remove(w)
                self.charge(rank, user, w.cost)
                return w
        return None

    def remove(self, w: Waiter) -> bool:
        """Take ``w`` out (timed out, client gone, displaced); False if it is not queued."""
        lines = self._classes[w.rank]
        line = lines.get(w.user)
        if line is None:
            return False
        try:
            line.items.remove(w)
        except ValueError:
            return False
        line.cost -= w.cost
        if not line.items:
            del lines[w.user]
        self._counts[w.rank] -= 1
        self.bytes -= w.size
        self._held -= 1
        if not self._held and self.on_change is not None:
            self.on_change()
        return True

    def higher_waiting(self, rank: int) -> bool:
        return any(self._counts[r] for r in range(rank + 1, len(self._counts)))

    # -- making room -----------------------------------------------------------------------------

    def make_room(self, rank: int, user: str, cost: float, size: int, max_count: int,
                  max_bytes: int) -> list[tuple[Waiter, str]] | None:
        """Whom a newcomer of ``user`` (class ``rank``, ``cost``, a body of ``size`` bytes) evicts so
        that the queue holds it within ``max_count`` requests and ``max_bytes``, each with its reason,
        in the order they go: [] when it fits as things are, None when no eviction the rules allow
        would make room (then nobody is evicted). One at a time: a request of a lower class
        (``displaced``: the newest, least urgent of the lowest class, from its heaviest user); else,
        inside its class, the newest, least urgent request of the user with the most service,
        counter and queued costs together, if that is more than ``user`` would have with the
        newcomer (``fair_share``). Computed without touching the queue, so a newcomer that could not
        fit after all its evictions (a body larger than the bound, or than what it may evict holds)
        takes nobody's place for nothing. A queue a reload left over a bound is not cut down to it
        for one newcomer: the newcomer takes the place of one request (of as many as hold its
        bytes), so the queue does not grow, and shrinks as its requests go."""
        if size > max_bytes:
            return None
        taken: dict[int, tuple[int, float]] = {}       # id(line) → (its newest requests evicted, their costs)
        out: list[tuple[Waiter, str]] = []
        count, held = len(self), self.bytes
        max_count, max_bytes = max(max_count, count), max(max_bytes, held)

        def left(line: _Line) -> int:
            return len(line.items) - taken.get(id(line), (0, 0.0))[0]

        def heaviest(r: int) -> tuple[str, _Line, float] | None:
            best = None
            for u, line in self._classes[r].items():
                if left(line):
                    load = self.counter(r, u) + line.cost - taken.get(id(line), (0, 0.0))[1]
                    if best is None or (load, -line.since) > (best[2], -best[1].since):
                        best = (u, line, load)
            return best

        while count + 1 > max_count or held + size > max_bytes:
            pick = next((h for r in range(rank) if (h := heaviest(r)) is not None), None)
            reason = "displaced"
            if pick is None:
                pick, reason = heaviest(rank), "fair_share"
                if pick is None or pick[0] == user:
                    return None
                own = self._classes[rank].get(user)
                if own is not None and left(own):
                    mine = self.counter(rank, user) + own.cost - taken.get(id(own), (0, 0.0))[1]
                else:
                    lines = [u for u, line in self._classes[rank].items() if left(line)]
                    mine = self.counter(rank, user)
                    if lines:
                        waiting = [self.counter(rank, u) for u in lines]
                        mine = min(max(mine, min(waiting)), max(waiting))
                if pick[2] <= mine + cost:
                    return None
            _, line, _ = pick
            w = line.items[left(line) - 1]
            n, costs = taken.get(id(line), (0, 0.0))
            taken[id(line)] = (n + 1, costs + w.cost)
            out.append((w, reason))
            count -= 1
            held -= w.size
        return out

    # -- where one stands ------------------------------------------------------------------------

    def position(self, rank: int, user: str, w: Waiter | None = None, deadline: float = math.inf,
                 cost: float = 1.0) -> int:
        """Dispatches before ``w`` (queued), or before a request of ``user`` and class ``rank``
        (with ``deadline`` and ``cost``) that would join now."""
        ahead = sum(self._counts[r] for r in range(rank + 1, len(self._counts)))
        lines = self._classes[rank]
        line = lines.get(user)
        if w is not None and line is not None and w in line.items:
            idx = line.items.index(w)
        elif line is not None:
            idx = sum(1 for x in line.items if x.deadline <= deadline)
        else:
            idx = 0
        start = self.counter(rank, user) if line is not None else self._lifted(rank, user)
        if line is not None:
            start += sum(x.cost for x in line.items[:idx])
        since = line.since if line is not None else self._seq + 1
        for u, other in lines.items():
            if u == user:
                continue
            tag = self.counter(rank, u)
            for x in other.items:
                if (tag, other.since) >= (start, since):
                    break
                ahead += 1
                tag += x.cost
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

    def resize(self, window_s: float) -> None:
        """Measure over ``window_s`` from now on (a reload), keeping the seconds counted that both
        windows hold."""
        window = max(1, int(math.ceil(window_s)))
        if window == self.window:
            return
        buckets = [0] * window
        if self._last is not None:
            for sec in range(self._last - min(window, self.window) + 1, self._last + 1):
                buckets[sec % window] = self._buckets[sec % self.window]
        self.window, self._buckets = window, buckets

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
