"""The admission queue's order and positions, the drain rate and the Retry-After it gives."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.queue import DrainRate, FairQueue, Waiter, retry_after_s

SHED, STD, CRIT = 0, 1, 2


def w(rank, user, size=10):
    return Waiter(rank, user, size, 0.0)


def drain(q):
    out = []
    while (x := q.pop()) is not None:
        out.append(x)
    return out


def test_classes_first_then_users_in_turn_then_arrival_order():
    q = FairQueue()
    items = [w(SHED, "e"), w(STD, "a"), w(STD, "a"), w(STD, "b"), w(STD, "a"), w(CRIT, "c"), w(STD, "d")]
    for x in items:
        q.push(x)
    assert len(q) == 7 and q.bytes == 70
    s, a1, a2, b1, a3, c1, d1 = items
    assert drain(q) == [c1, a1, b1, d1, a2, a3, s]
    assert len(q) == 0 and q.bytes == 0


def test_remove_and_victim():
    q = FairQueue()
    s1, s2, s3, t = w(SHED, "x"), w(SHED, "y"), w(SHED, "y"), w(STD, "a")
    for x in (s1, s2, s3, t):
        q.push(x)
    assert q.victim(STD) is s3          # the newest of the user with most sheddable requests waiting
    assert q.victim(SHED) is None       # nobody below sheddable
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


def test_retry_after():
    assert retry_after_s(0, 10.0, 60) == 1.0          # at least a second
    assert retry_after_s(49, 10.0, 60) == 5.0         # 50 to drain at 10/s
    assert retry_after_s(10_000, 10.0, 60) == 60.0    # capped
    assert retry_after_s(3, 0.0, 60) == 60.0          # nothing drained lately: the cap
