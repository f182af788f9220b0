"""The admission queue's order and positions, the drain rate and the Retry-After it gives."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.queue import GRANTED, DrainRate, FairQueue, Waiter, retry_after_s

SHED, STD, CRIT = 0, 1, 2


def w(rank, user, size=10):
    return Waiter(rank, user, size, 0.0)


def one_out(q, rank, user, cost=1.0):
    """Whom a newcomer evicts from a queue full at its present length (no byte bound)."""
    return q.make_room(rank, user, cost, 0, len(q), 1 << 40)


def drain(q):
    out = []
    while (x := q.pop()) is not None:
        out.append(x)
    return out



def test_the_walk_in_order_meets_the_waiters_as_peek_passes_over_them():
    """``in_order`` (a newcomer's walk to its turn) and ``peek`` with the ones before skipped (the
    pump's) agree; from a class, it stops above the classes below."""
    q = FairQueue()
    items = [w(SHED, "e"), w(STD, "a"), w(STD, "a"), w(STD, "b"), w(CRIT, "c"), w(STD, "d"), w(CRIT, "f")]
    for x in items:
        q.push(x)
    skip: set[int] = set()
    seen = []
    while (x := q.peek(skip)) is not None:
        seen.append(x)
        skip.add(id(x))
    walked = list(q.in_order())
    assert walked == seen and sorted(map(id, walked)) == sorted(map(id, items))
    assert list(q.in_order(STD)) == [x for x in walked if x.rank >= STD]
    assert [x.user for x in walked] == ["c", "f", "a", "a", "b", "d", "e"]

def _rewalk(q, decide):
    """The pump's order as it was: after each grant or removal, ``in_order`` walked anew, the
    waiters passed over skipped."""
    passed: set[int] = set()
    out = []
    while True:
        for x in q.in_order():
            if id(x) in passed:
                continue
            out.append(x.seq)
            d = decide(x)
            if d == "stop":
                return out
            if d == "grant":
                q.take(x)
                x.state = GRANTED
                break
            if d == "remove":
                q.remove(x)
                break
            passed.add(id(x))
        else:
            return out


def _walk(q, decide):
    out = []
    for x in q.walk():
        out.append(x.seq)
        d = decide(x)
        if d == "stop":
            break
        if d == "grant":
            q.take(x)
            x.state = GRANTED
        elif d == "remove":
            q.remove(x)
    return out


@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from("abcde"), st.integers(0, 60), st.integers(0, 3),
                          st.sampled_from(["grant", "grant", "pass", "remove", "stop"])), max_size=40),
       st.dictionaries(st.sampled_from("abcde"), st.integers(0, 200)))
def test_one_walk_meets_the_waiters_as_walking_anew_after_each_grant_does(entries, counters):
    """``walk`` (the pump's one walk) meets the waiters in the order the pump met them when it
    walked the queue anew after each grant (a grant moves its user's counter, and so the order),
    whatever it does with each: grant it, pass it over, remove it, or stop."""
    orders = []
    for run in (_rewalk, _walk):
        q = FairQueue()
        for user, c in counters.items():
            for r in range(3):
                q.charge(r, user, float(c + r))
        items = []
        for rank, user, cost, deadline, _ in entries:
            x = Waiter(rank, user, 10, 0.0, cost=float(cost), deadline=float(deadline) if deadline else math.inf)
            q.push(x)
            items.append(x)
        what = {x.seq: e[4] for x, e in zip(items, entries, strict=True)}
        orders.append(run(q, lambda x, what=what: what[x.seq]))
    assert orders[0] == orders[1]


def test_classes_first_then_users_in_turn_then_arrival_order():
    q = FairQueue()
    items = [w(SHED, "e"), w(STD, "a"), w(STD, "a"), w(STD, "b"), w(STD, "a"), w(CRIT, "c"), w(STD, "d")]
    for x in items:
        q.push(x)
    assert len(q) == 7 and q.bytes == 70
    s, a1, a2, b1, a3, c1, d1 = items
    assert drain(q) == [c1, a1, b1, d1, a2, a3, s]
    assert len(q) == 0 and q.bytes == 0


def test_remove_and_displace():
    q = FairQueue()
    s1, s2, s3, t = w(SHED, "x"), w(SHED, "y"), w(SHED, "y"), w(STD, "a")
    for x in (s1, s2, s3, t):
        q.push(x)
    assert one_out(q, STD, "a") == [(s3, "displaced")]     # the newest of the user with most sheddable requests waiting
    assert one_out(q, SHED, "y") is None                   # nobody below sheddable, and y is its heaviest user
    assert q.remove(s3) and not q.remove(s3)
    assert q.higher_waiting(SHED) and not q.higher_waiting(STD)
    assert drain(q) == [t, s1, s2]


@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from("abcd")), max_size=30), st.integers(0, 2),
       st.sampled_from("abcde"))
def test_position_is_the_number_of_dispatches_before(entries, rank, user):
    waiters = [w(r, u) for r, u in entries]
    q = FairQueue()
    for x in waiters:
        q.push(x)
    positions = [q.position(x.rank, x.user, x) for x in waiters]
    newcomer = q.position(rank, user)
    order = drain(q)
    assert [order.index(x) for x in waiters] == positions
    probe = w(rank, user)
    q = FairQueue()                  # draining charged the counters: the same pushes on a fresh queue
    for x in (*waiters, probe):
        q.push(x)
    assert drain(q).index(probe) == newcomer


def test_drain_rate_over_its_window():
    d = DrainRate(10)
    assert d.rate(100.0) == 0.0
    for i in range(20):
        d.tick(100.0 + i * 0.1)              # 20 in two seconds
    assert d.rate(102.0) == 10.0
    assert d.rate(105.0) == 4.0              # the same 20 over five seconds
    assert d.rate(110.5) == 1.0              # the first second left the window
    assert d.rate(125.0) == 0.0


def test_drain_rate_resized_keeps_the_seconds_both_windows_hold():
    d = DrainRate(2)
    for sec in (100.0, 101.0):
        d.tick(sec, 3)
    d.resize(60)                             # a reload widened the window
    for i in range(5):
        d.tick(102.0 + i)
    assert d.rate(110.0) == 11 / 10          # 6 kept + 5 new, since the first tick 10 s ago
    d = DrainRate(10)
    for i in range(6):
        d.tick(100.0 + i)
    d.resize(3)                              # narrowed: seconds 103..105 are kept, 100..102 are not
    assert d.rate(105.5) == 3 / 3


def test_retry_after():
    assert retry_after_s(0, 10.0, 60) == 1.0          # at least a second
    assert retry_after_s(49, 10.0, 60) == 5.0         # 50 to drain at 10/s
    assert retry_after_s(10_000, 10.0, 60) == 60.0    # capped
    assert retry_after_s(3, 0.0, 60) == 60.0          # nothing drained lately: the cap


@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from("abcd"), st.integers(1, 50),
                          st.sampled_from([math.inf, 1.0, 2.0, 3.0])), max_size=30))
def test_position_holds_with_costs_and_deadlines(entries):
    waiters = [Waiter(r, u, 10, 0.0, cost=c, deadline=d) for r, u, c, d in entries]
    q = FairQueue()
    for x in waiters:
        q.push(x)
    positions = [q.position(x.rank, x.user, x) for x in waiters]
    order = drain(q)
    assert [order.index(x) for x in waiters] == positions


def test_fairness_is_over_tokens_not_requests():
    """A user of 1600-token requests and one of 100-token requests, both always waiting: the light
    one is dispatched about sixteen times as often."""
    q = FairQueue()
    for _ in range(40):
        q.push(Waiter(STD, "big", 10, 0.0, cost=1600))
        q.push(Waiter(STD, "small", 10, 0.0, cost=100))
    first = [x.user for x in (q.pop() for _ in range(34))]
    assert first.count("big") == 2 and first.count("small") == 32


def test_a_user_who_starts_waiting_is_lifted_to_the_others():
    q = FairQueue()
    q.charge(STD, "old", 10_000)                 # served long ago: not held against it for ever
    q.push(w(STD, "a"))
    q.charge(STD, "a", 50)
    q.push(w(STD, "new"))                        # idle time is not banked either
    assert q.counter(STD, "new") == 50
    q.push(w(STD, "old"))
    assert q.counter(STD, "old") == 50


def test_earliest_deadline_first_inside_a_users_line():
    q = FairQueue()
    late, none, soon = (Waiter(STD, "a", 10, 0.0, deadline=d) for d in (9.0, math.inf, 2.0))
    for x in (late, none, soon):
        q.push(x)
    assert q.position(STD, "a", deadline=5.0) == 1              # after the one due sooner only
    assert drain(q) == [soon, late, none]


def test_a_full_queue_evicts_from_the_heaviest_user_not_the_newcomer():
    q = FairQueue()
    heavy = [w(STD, "carol") for _ in range(5)]
    for x in heavy:
        q.push(x)
    q.push(w(STD, "dave"))
    assert one_out(q, STD, "dave") == [(heavy[-1], "fair_share")]     # the newest of carol's
    assert one_out(q, STD, "carol") is None         # carol's own newcomer: refused instead
    assert one_out(q, SHED, "erin") is None         # nobody of its class waits
    q.charge(STD, "dave", 100)                      # dave was served far more lately
    assert one_out(q, STD, "dave") is None


def test_room_is_made_only_when_the_evictions_allowed_make_enough():
    q = FairQueue()
    s1, s2, big = w(SHED, "x", 100), w(SHED, "x", 100), Waiter(CRIT, "a", 500, 0.0, cost=5.0)
    for x in (s1, s2, big):
        q.push(x)
    # 150 bytes more within 700: both sheddable ones go, newest first
    assert q.make_room(CRIT, "b", 1.0, 150, 10, 700) == [(s2, "displaced"), (s1, "displaced")]
    # 250 bytes: even both freed, a's request (not to be evicted by b, who would have more) leaves too little
    assert q.make_room(CRIT, "b", 1e6, 250, 10, 700) is None
    # larger than the bound itself: nothing could make room
    assert q.make_room(CRIT, "b", 1.0, 701, 10, 700) is None
    assert len(q) == 3 and q.bytes == 700                  # planning evicts nobody
    # at the count bound one goes; a heavier user's request goes when the bytes need it, after the lower class
    assert q.make_room(CRIT, "b", 1.0, 0, 3, 1 << 40) == [(s2, "displaced")]
    assert q.make_room(CRIT, "b", 1.0, 600, 10, 700) == [(s2, "displaced"), (s1, "displaced"), (big, "fair_share")]


def test_a_queue_over_its_bounds_gives_a_newcomer_one_place_not_the_cut_to_them():
    """A reload lowered the bounds below what waits: a newcomer takes one request's place (as many
    as hold its bytes), so the queue does not grow; nobody at all when it fits beside them."""
    q = FairQueue()
    low = [w(SHED, f"u{i}", 100) for i in range(6)]
    for x in low:
        q.push(x)
    out = q.make_room(STD, "a", 1.0, 50, 2, 1 << 40)             # six waiting, queue_max now 2
    assert len(out) == 1 and out[0][1] == "displaced"
    out = q.make_room(STD, "a", 1.0, 150, 10, 200)                # 600 bytes held, the bound now 200
    assert [r for _, r in out] == ["displaced", "displaced"]      # 150 bytes: two requests of 100
    assert q.make_room(STD, "a", 1.0, 201, 10, 200) is None       # a body over the bound never queues
    assert q.make_room(SHED, "u0", 1.0, 50, 2, 1 << 40) is None   # nobody it may evict: refused
    assert q.make_room(STD, "a", 1.0, 50, 10, 1 << 40) == []      # room under the bounds: nobody goes
