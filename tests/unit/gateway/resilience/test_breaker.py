"""Circuit breaker transitions, ejection times and the ejection cap, on a hand-driven clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from gateway.config.schema import ConfigError, config_from_dict
from gateway.endpoints import Endpoint, EndpointPool
from gateway.resilience.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, Breakers
from gateway.resilience.outcome import Outcome

F, S, B, C, N = Outcome.FAULT, Outcome.SUCCESS, Outcome.BACKPRESSURE, Outcome.CLIENT_ERROR, Outcome.NONE


class Timers:
    """A clock and a ``call_later`` that run only when the test advances time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.pending: list[list] = []

    def call_later(self, delay, fn):
        entry = [self.now + delay, fn, False]
        self.pending.append(entry)
        return SimpleNamespace(cancel=lambda: entry.__setitem__(2, True))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for entry in sorted(self.pending, key=lambda e: e[0]):
            if entry[0] <= self.now and not entry[2]:
                entry[2] = True
                entry[1]()


def setup(n=4, **cfg):
    pool = EndpointPool()
    eps = [pool.add(Endpoint(url=f"http://127.0.0.1:{9000 + i}", model="m")) for i in range(n)]
    t = Timers()
    config = BreakerConfig(**cfg)
    br = Breakers(pool, lambda _m: config, CollectorRegistry(), passive=True, clock=lambda: t.now,
                  call_later=t.call_later)
    return br, eps, t


def feed(br, ep, outcomes, cause=""):
    for o in outcomes:
        br.record(ep, o, cause)


def decide(br, ep):
    br.on_decision(None, SimpleNamespace(endpoint=ep, prefill=None), (), 0.0)


def test_consecutive_faults_open_and_ejection_makes_unready():
    br, (a, *_), t = setup(consecutive_faults=3, fault_rate=0)
    feed(br, a, [F, F])
    assert br.state(a) == CLOSED and a.ready
    feed(br, a, [S, F, F])          # a success breaks the run
    assert br.state(a) == CLOSED
    feed(br, a, [F])
    assert br.state(a) == OPEN and not a.ready and a.extra["breaker"] == "open"


@pytest.mark.parametrize("neutral", [B, C, N])
def test_backpressure_client_errors_and_cancels_never_open(neutral):
    br, (a, *_), t = setup(consecutive_faults=2, min_requests=2)
    feed(br, a, [neutral] * 50)
    assert br.state(a) == CLOSED
    feed(br, a, [F, neutral, F])    # and do not break a run of faults either
    assert br.state(a) == OPEN


def test_fault_rate_over_the_window_opens():
    br, (a, *_), t = setup(consecutive_faults=100, fault_rate=0.5, min_requests=10, window_s=10)
    feed(br, a, [F, S] * 5)         # 50 %: not above the limit
    assert br.state(a) == CLOSED
    feed(br, a, [F])                # 6 of 11
    assert br.state(a) == OPEN


def test_fault_rate_forgets_outcomes_older_than_the_window():
    br, (a, *_), t = setup(consecutive_faults=100, fault_rate=0.5, min_requests=10, window_s=10)
    feed(br, a, [F] * 4 + [S] * 5)
    t.advance(11)                    # those fell out of the window
    feed(br, a, [F, S, F, S, F, S, F, S, S])
    assert br.state(a) == CLOSED


def test_half_open_trials_then_close_after_successes():
    br, (a, b, *_), t = setup(consecutive_faults=1, base_ejection_s=10, half_open_trials=2, success_threshold=3)
    feed(br, a, [F])
    t.advance(9.9)
    assert br.state(a) == OPEN
    t.advance(0.2)
    assert br.state(a) == HALF_OPEN and a.ready
    decide(br, a)
    assert a.ready                   # one trial out of two
    decide(br, a)
    assert not a.ready               # both slots taken: no third trial until one answers
    decide(br, b)                    # another endpoint's decisions change nothing here
    feed(br, a, [S])
    assert br.state(a) == HALF_OPEN and a.ready
    decide(br, a)
    feed(br, a, [B, S])              # backpressure frees a slot but proves nothing
    assert br.state(a) == HALF_OPEN
    decide(br, a)
    feed(br, a, [S])
    assert br.state(a) == CLOSED and a.ready


def test_a_trial_fault_opens_again_for_longer_and_the_ejection_count_decays():
    br, (a, *_), t = setup(consecutive_faults=1, base_ejection_s=10, max_ejection_s=25, success_threshold=1)
    feed(br, a, [F])
    assert br.breaker(a).open_for == 10
    t.advance(10)
    decide(br, a)
    feed(br, a, [F])
    assert br.state(a) == OPEN and br.breaker(a).open_for == 20
    t.advance(20)
    feed(br, a, [F])                 # half-open, a fault without a decision (a request sent earlier)
    assert br.breaker(a).open_for == 25          # capped by max_ejection_s
    t.advance(25)
    feed(br, a, [S])
    assert br.state(a) == CLOSED
    t.advance(20)                    # two base times closed: two ejections forgotten
    feed(br, a, [F])
    assert br.breaker(a).ejections == 2 and br.breaker(a).open_for == 20


def test_lost_trials_free_their_slot_after_the_base_time():
    br, (a, *_), t = setup(consecutive_faults=1, base_ejection_s=5, half_open_trials=1)
    feed(br, a, [F])
    t.advance(5)
    decide(br, a)
    assert not a.ready
    t.advance(5)
    assert br.state(a) == HALF_OPEN and a.ready


def test_outcomes_while_open_change_nothing():
    br, (a, *_), t = setup(consecutive_faults=1, base_ejection_s=5, success_threshold=1)
    feed(br, a, [F])
    feed(br, a, [S] * 5 + [F] * 5)
    assert br.state(a) == OPEN and br.breaker(a).ejections == 1


@pytest.mark.parametrize(("n", "pct", "ejectable"), [(4, 10, 1), (10, 10, 1), (20, 10, 2), (4, 50, 2), (4, 100, 3),
                                                    (2, 100, 1), (1, 100, 0)])
def test_max_ejection_percent_always_one_never_all(n, pct, ejectable):
    br, eps, t = setup(n=n, consecutive_faults=1, max_ejection_percent=pct)
    for ep in eps:
        feed(br, ep, [F])
    assert sum(1 for ep in eps if br.state(ep) != CLOSED) == ejectable
    capped = br.metrics.capped.labels("m").value
    assert capped == n - ejectable


def test_unhealthy_endpoints_leave_the_last_ready_one_in():
    br, (a, b, c), t = setup(n=3, consecutive_faults=1, max_ejection_percent=100)
    b.healthy = c.healthy = False    # the health probe took them out
    feed(br, a, [F])
    assert br.state(a) == CLOSED and a.ready


def _capped(br) -> float:
    return sum(s.value for fam in br.metrics.capped.collect() for s in fam.samples if s.name.endswith("_total"))


def test_the_cap_counts_each_ejection_it_refused_not_each_fault_of_the_endpoint_it_keeps_in():
    """Two endpoints, one of which may be out: ``a`` is. ``b`` then fails 7 times in a row with
    ``consecutive_faults: 2``: its breaker decides to eject it at the 2nd, 4th and 6th (each refused
    ejection spends the faults that made it, as an ejection does, Envoy's ``ejections_overflow``),
    so 3 refused ejections; the same holds for the fault rate. Each of its faults from the 2nd on
    was counted before (6)."""
    br, (a, b), t = setup(n=2, consecutive_faults=2, fault_rate=0, max_ejection_percent=50, success_threshold=1)
    feed(br, a, [F, F])
    assert br.state(a) == OPEN
    feed(br, b, [F] * 7)
    assert br.state(b) == CLOSED and b.ready and _capped(br) == 3
    feed(br, b, [S, F])                     # a success breaks the run: the next needs 2 again
    assert _capped(br) == 3
    t.advance(10)                           # a's trial closes its breaker: room for b
    decide(br, a)
    feed(br, a, [S])
    feed(br, b, [F])
    assert br.state(b) == OPEN and _capped(br) == 3
    br2, (x, y), _ = setup(n=2, consecutive_faults=100, fault_rate=0.5, min_requests=4, max_ejection_percent=50)
    feed(br2, x, [F] * 4)
    assert br2.state(x) == OPEN
    feed(br2, y, [F] * 9)                   # a full window of faults, refused, then one as full again
    assert br2.state(y) == CLOSED and _capped(br2) == 2


def test_a_refused_connection_opens_at_once_with_passive_health():
    br, (a, *_), t = setup(consecutive_faults=5)
    br.record(a, F, "connect")
    assert br.state(a) == OPEN
    br2, (x, *_), _ = setup(consecutive_faults=5)
    br2.passive = False
    br2.record(x, F, "connect")
    assert br2.state(x) == CLOSED


def test_an_engine_the_probes_found_down_and_then_up_goes_half_open_before_its_ejection_ends():
    br, (a, *_), t = setup(consecutive_faults=5, base_ejection_s=10, success_threshold=1)
    br.record(a, F, "connect")              # the engine died: its port refuses
    br.on_health(a)                         # a scrape or a probe that still finds it up: nothing
    assert br.state(a) == OPEN
    a.healthy = False                       # the probes take it out
    br.on_health(a)
    t.advance(2)
    assert br.state(a) == OPEN
    a.healthy = True                        # restarted: it answers /health again
    br.on_health(a)
    assert br.state(a) == HALF_OPEN and a.ready
    t.advance(10)                           # the ejection's own timer, cancelled, changes nothing
    assert br.state(a) == HALF_OPEN
    decide(br, a)
    feed(br, a, [S])
    assert br.state(a) == CLOSED


def test_an_engine_that_answers_its_probes_while_failing_requests_stays_out_its_ejection():
    br, (a, *_), t = setup(consecutive_faults=2, base_ejection_s=10)
    feed(br, a, [F, F])                     # 500s while /health stays fine
    for _ in range(5):
        br.on_health(a)                     # probes and scrapes: healthy all along
        t.advance(1)
    assert br.state(a) == OPEN
    t.advance(5)
    assert br.state(a) == HALF_OPEN


def test_a_breaker_opened_while_the_probes_had_the_engine_out_goes_half_open_when_it_is_back():
    br, (a, *_), t = setup(consecutive_faults=1, base_ejection_s=10)
    a.healthy = False                       # the probes first
    br.on_health(a)                         # no breaker open yet: nothing to remember
    br.record(a, F, "reset")                # then a leg sent before, cut: the breaker opens
    assert br.state(a) == OPEN
    a.healthy = True
    br.on_health(a)
    assert br.state(a) == HALF_OPEN
    feed(br, a, [F])                        # its trial fails: open again, for longer, until the
    assert br.state(a) == OPEN and br.breaker(a).open_for == 20     # probes see it down again
    br.on_health(a)
    assert br.state(a) == OPEN


def test_groups_are_per_role():
    pool = EndpointPool()
    pre = [pool.add(Endpoint(url=f"http://127.0.0.1:{9100 + i}", model="m", role="prefill")) for i in range(2)]
    dec = [pool.add(Endpoint(url=f"http://127.0.0.1:{9200 + i}", model="m", role="decode")) for i in range(2)]
    t = Timers()
    cfg = BreakerConfig(consecutive_faults=1)
    br = Breakers(pool, lambda _m: cfg, CollectorRegistry(), clock=lambda: t.now, call_later=t.call_later)
    feed(br, pre[0], [F])
    feed(br, dec[0], [F])            # another group: its own ejection allowance
    feed(br, pre[1], [F])            # the prefill group already has one ejected (and one ready left)
    assert [br.state(e) for e in pre + dec] == [OPEN, CLOSED, OPEN, CLOSED]


def test_disabled_and_reconfigured():
    br, (a, *_), t = setup(consecutive_faults=1)
    feed(br, a, [F])
    assert br.state(a) == OPEN
    off = BreakerConfig(enabled=False)
    br.reconfigure(lambda _m: off)
    assert br.state(a) == CLOSED and a.ready
    feed(br, a, [F] * 10)
    assert br.state(a) == CLOSED


def test_transitions_and_state_gauge_are_exported():
    br, (a, *_), t = setup(consecutive_faults=1, base_ejection_s=1, success_threshold=1)
    feed(br, a, [F])
    t.advance(1)
    feed(br, a, [S])
    m = br.metrics.transitions
    assert m.labels("m", a.name, "closed", "open").value == 1
    assert m.labels("m", a.name, "open", "half_open").value == 1
    assert m.labels("m", a.name, "half_open", "closed").value == 1
    feed(br, a, [F])
    gauge = {tuple(s.labels.values()): s.value for f in br.metrics.states.collect() for s in f.samples}
    assert gauge[("m", a.name)] == 1


def test_config_blocks_global_and_per_model():
    raw = {"breaker": {"consecutive_faults": 3, "base_ejection_s": 2},
           "retry": {"budget_percent": 10},
           "models": [{"name": "a", "endpoints": ["http://x:1"], "breaker": {"base_ejection_s": 7},
                       "retry": {"max_retries": 0}},
                      {"name": "b", "endpoints": ["http://x:2"]}]}
    cfg = config_from_dict(raw)
    assert (cfg.breaker_for("a").consecutive_faults, cfg.breaker_for("a").base_ejection_s) == (3, 7)
    assert cfg.breaker_for("b").base_ejection_s == 2 and cfg.breaker_for("zzz") is cfg.breaker
    assert (cfg.retry_for("a").max_retries, cfg.retry_for("a").budget_percent) == (0, 10)
    assert BreakerConfig().max_ejection_percent == 10 and BreakerConfig().consecutive_faults == 5
    with pytest.raises(ConfigError, match=r"models\[0\]\.breaker\.fault_rate"):
        config_from_dict({"models": [{"name": "a", "endpoints": ["http://x:1"], "breaker": {"fault_rate": 2}}]})
    with pytest.raises(ConfigError, match=r"breaker\.max_ejection_s"):
        config_from_dict({"breaker": {"base_ejection_s": 10, "max_ejection_s": 5}})
    with pytest.raises(ConfigError, match=r"retry\.tries"):
        config_from_dict({"retry": {"tries": 1}})
    off = config_from_dict({"upstream": {"retry_on_connect_error": False}})
    assert not off.retry_for("m").enabled


def _outcomes(br) -> dict[tuple[str, str], float]:
    return {(s.labels["endpoint"], s.labels["outcome"]): s.value
            for f in br.metrics.outcomes.collect() for s in f.samples if s.name.endswith("_total")}


def test_successes_on_a_closed_breaker_count_alike_on_the_short_path_and_the_general_one():
    br, (a, b, *_), t = setup(consecutive_faults=3, fault_rate=0.5, min_requests=4, window_s=10)
    feed(br, a, [S] * 5)                   # the first takes the general path, the rest the short one
    feed(br, a, [F, F])
    feed(br, a, [S])                       # a success resets the faults in a row
    feed(br, a, [F, F])
    assert br.state(a) == CLOSED
    feed(br, a, [F])                       # 3 in a row
    assert br.state(a) == OPEN
    feed(br, a, [S])                       # a late answer on an open breaker changes nothing
    assert br.state(a) == OPEN and not a.ready
    assert _outcomes(br)[(a.name, "success")] == 7 and _outcomes(br)[(a.name, "fault")] == 5
    t.advance(3600)                        # half-open, then a trial's success closes it
    decide(br, a)
    feed(br, a, [S] * 5)
    assert br.state(a) == CLOSED
    for _ in range(3):                     # closed again: the window and the faults in a row still count
        feed(br, a, [S, F])
    assert br.state(a) == CLOSED
    feed(br, a, [F, F, F])
    assert br.state(a) == OPEN


def test_a_reload_that_turns_breakers_off_reaches_the_short_path_too():
    br, (a, *_), t = setup(consecutive_faults=2, fault_rate=0)
    feed(br, a, [S, S])
    off = BreakerConfig(enabled=False, consecutive_faults=2, fault_rate=0)
    br.reconfigure(lambda _m: off)
    feed(br, a, [S, F, F, F])              # counted, never judged
    assert br.state(a) == CLOSED and a.ready
    assert _outcomes(br)[(a.name, "success")] == 3
    br.reset(a)                            # the endpoint left: nothing of it is kept
    assert id(a) not in br._success


def test_an_endpoint_that_left_the_pool_leaves_no_breaker_behind():
    """Pods come and go for months: nothing of a removed endpoint is kept, also when answers of the
    requests that were on it come afterwards, or a sibling worker's ejection of it."""
    br, (a, b, *_), t = setup(consecutive_faults=2, fault_rate=0)
    feed(br, a, [S, F, F])
    feed(br, b, [S])
    assert br.state(a) == OPEN and id(a) in br._by_ep and id(b) in br._success
    br.pool.remove(a)
    br.pool.remove(b)
    assert not br._by_ep and not br._success and not br._half_opens
    assert not a.ejected and "breaker" not in a.extra
    feed(br, a, [F, F, S])
    feed(br, b, [S, F])
    assert not br.adopt_open(a, 10.0, 1)
    assert not br._by_ep and not br._success
    assert not [e for e in t.pending if not e[2]]          # its ejection timer was cancelled
    assert _outcomes(br)[(a.name, "fault")] == 4           # the outcomes are still counted


def test_a_siblings_ejection_leaves_its_trials_to_that_worker_until_it_goes_quiet():
    br, (a, *_), t = setup(consecutive_faults=1, base_ejection_s=10, half_open_trials=1, success_threshold=1)
    assert br.adopt_open(a, 10.0, 1)          # a sibling ejected it
    t.advance(10)
    assert br.state(a) == HALF_OPEN and not a.ready      # half-open, the trials the sibling's
    feed(br, a, [S])                          # a leg sent before the ejection: it proves what it does
    assert br.state(a) == CLOSED and a.ready
    assert br.adopt_open(a, 10.0, 1)
    t.advance(10)
    assert br.adopt_open(a, 20.0, 2)          # the sibling's trial failed: its new ejection is this one's
    assert br.state(a) == OPEN and br.breaker(a).ejections == 2
    t.advance(10)
    assert br.state(a) == OPEN                # not at the end of the first one
    t.advance(10)
    assert br.state(a) == HALF_OPEN and not a.ready
    assert br.adopt_close(a)                  # the sibling's trial passed
    assert br.state(a) == CLOSED and a.ready
    assert br.adopt_open(a, 10.0, 1)
    t.advance(10)
    t.advance(9.9)
    assert not a.ready
    t.advance(0.2)                            # no word within base_ejection_s: trials here too
    assert br.state(a) == HALF_OPEN and a.ready
    decide(br, a)
    assert not a.ready
    feed(br, a, [S])
    assert br.state(a) == CLOSED and a.ready


def test_a_siblings_ejection_of_an_engine_the_probes_find_back_still_leaves_it_the_trials():
    br, (a, *_), t = setup(consecutive_faults=1, base_ejection_s=10, half_open_trials=1)
    assert br.adopt_open(a, 10.0, 1)
    a.healthy = False
    br.on_health(a)
    a.healthy = True
    br.on_health(a)
    assert br.state(a) == HALF_OPEN and not a.ready
    t.advance(10)
    assert a.ready


def test_an_own_ejection_is_not_lengthened_by_a_siblings():
    br, (a, *_), t = setup(consecutive_faults=1, base_ejection_s=10, half_open_trials=1)
    feed(br, a, [F])
    assert not br.adopt_open(a, 30.0, 3)
    t.advance(10)
    assert br.state(a) == HALF_OPEN and a.ready


def test_two_workers_that_eject_an_endpoint_at_once_keep_one_ejection_whose_trials_one_of_them_sends():
    """Workers 0 and 1 each see the fault that ejects ``a`` before either hears the other's
    ejection (their messages cross on the bus). Both keep worker 0's: worker 1 holds it for worker
    0's time and leaves the trials to it, so ``half_open_trials`` reach the engine, not one set per
    worker, and each counts the ejection once. Before, each kept its own and sent trials of its own."""
    t = Timers()
    config = BreakerConfig(consecutive_faults=1, base_ejection_s=10, half_open_trials=1, success_threshold=1)
    workers, told = [], []
    for index in range(2):
        pool = EndpointPool()
        pool.add(Endpoint(url="http://127.0.0.1:9000", model="m"))
        pool.add(Endpoint(url="http://127.0.0.1:9001", model="m"))
        br = Breakers(pool, lambda _m: config, CollectorRegistry(), passive=True, clock=lambda: t.now,
                      call_later=t.call_later)
        br.on_change = lambda ep, open_for, n, index=index: told.append((index, ep.url, open_for, n))
        workers.append((br, pool.endpoints("m")[0]))

    def deliver() -> None:              # each message to the other worker, told who sent it
        while told:
            sender, url, open_for, n = told.pop(0)
            br, ep = workers[1 - sender]
            assert ep.url == url
            if open_for > 0:
                br.adopt_open(ep, open_for, n, sender_first=sender < 1 - sender)
            else:
                br.adopt_close(ep)

    feed(workers[0][0], workers[0][1], [F])
    t.advance(0.001)
    feed(workers[1][0], workers[1][1], [F])
    deliver()
    (b0, a0), (b1, a1) = workers
    assert b0.state(a0) == b1.state(a1) == OPEN
    t.advance(10)
    assert b0.state(a0) == b1.state(a1) == HALF_OPEN
    assert a0.ready and not a1.ready         # worker 0 sends the trial; worker 1 waits for its word
    decide(b0, a0)
    feed(b0, a0, [S])
    deliver()
    assert b0.state(a0) == b1.state(a1) == CLOSED and a1.ready
    for br in (b0, b1):
        assert _transitions(br) == {("closed", "open"): 1, ("open", "half_open"): 1, ("half_open", "closed"): 1}


def _transitions(br) -> dict[tuple[str, str], float]:
    return {(s.labels["from_state"], s.labels["to_state"]): s.value
            for fam in br.metrics.transitions.collect() for s in fam.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_third_worker_keeps_the_lower_workers_ejection_of_two_past_the_cap_whichever_it_hears_first(order):
    """Workers 0 and 1 eject endpoints 0 and 1 of a group of two at once (``max_ejection_percent:
    50``: one may be out). Worker 2 hears both, in either order, and ends holding worker 0's, the
    other endpoint serving, as workers 0 and 1 do; it counts no refusal (worker 1, whose ejection
    is undone, counts it). Before, it kept whichever it heard first."""
    br, (e0, e1), t = setup(n=2, consecutive_faults=1, max_ejection_percent=50)
    br.index = 2
    ejected = {0: e0, 1: e1}
    for sender in order:
        br.adopt_open(ejected[sender], 10.0, 1, owner=sender)
    assert (br.state(e0), br.state(e1)) == (OPEN, CLOSED)
    assert br.breaker(e0).held and br.breaker(e0).owner == 0
    assert not e0.ready and e1.ready
    assert not [s for fam in br.metrics.capped.collect() for s in fam.samples if s.name.endswith("_total")]


def test_a_siblings_ejection_refused_for_what_the_probes_found_here_undoes_no_ejection_of_this_worker():
    """Worker 1 ejected B, and worker 0 (which held it) ejects A, within ``max_ejection_percent:
    100`` of three, C being up as worker 0 saw it. Here C is down: A is refused to keep one endpoint
    ready, as before, and B stays out. The cap is not what refused it, so worker 0 did not eject A
    unaware of B: its ejection outranks none of this worker's."""
    br, (a, b, c), t = setup(n=3, consecutive_faults=1, max_ejection_percent=100)
    br.index = 1
    feed(br, b, [F])
    c.healthy = False
    assert not br.adopt_open(a, 10.0, 1, owner=0)
    assert (br.state(a), br.state(b)) == (CLOSED, OPEN) and a.ready and not b.ready
    assert sum(s.value for fam in br.metrics.capped.collect() for s in fam.samples if s.name.endswith("_total")) == 1


def test_a_siblings_ejection_refused_here_counts_once_however_often_it_is_told():
    """Worker 0's ejection of A (its first) is refused here, C being down by this worker's probes
    and B out: told again (a catch-up after a gap reads it in worker 0's whole view), it is the same
    refused ejection, not counted again. Once worker 0 closes it, its next ejection of A is a new
    one, refused and counted again; so is a new ejection after a failed trial (its second)."""
    br, (a, b, c), t = setup(n=3, consecutive_faults=1, max_ejection_percent=100)
    br.index = 1
    feed(br, b, [F])
    c.healthy = False
    for _ in range(3):
        assert not br.adopt_open(a, 10.0, 1, owner=0)
    assert _capped(br) == 1
    br.adopt_close(a)                       # worker 0's trials passed: that ejection is over
    assert not br.adopt_open(a, 10.0, 1, owner=0)
    assert _capped(br) == 2
    assert not br.adopt_open(a, 20.0, 2, owner=0)
    assert not br.adopt_open(a, 15.0, 2, owner=0)
    assert _capped(br) == 3 and br.state(a) == CLOSED and a.ready


def test_a_siblings_ejection_a_starting_worker_refuses_is_not_counted_its_predecessor_did():
    """A worker started again learns worker 0's ejection of A from its whole view (``counted``
    False: its predecessor heard of that ejection when it was decided and counted what it made of
    it, which the new worker carries on). Refused here as it was there (C down by the probes, B
    out), it is not counted a second time; told again later (a catch-up), not either. A new
    ejection of worker 0's after it is."""
    br, (a, b, c), t = setup(n=3, consecutive_faults=1, max_ejection_percent=100)
    br.index = 1
    feed(br, b, [F])
    c.healthy = False
    assert not br.adopt_open(a, 10.0, 1, owner=0, counted=False)
    assert not br.adopt_open(a, 9.0, 1, owner=0)
    assert _capped(br) == 0
    assert not br.adopt_open(a, 20.0, 2, owner=0)
    assert _capped(br) == 1
