"""The session map (TTL, LRU, publish only what others need) and prefix-cache's session preference."""

from __future__ import annotations

from gateway.apis.paths import MESSAGES
from gateway.apis.responses_request import RESPONSES
from gateway.endpoints import Endpoint
from gateway.request import CHAT, COMPLETIONS
from routers import session_map
from routers.prefix_cache import PrefixCacheRouter
from routers.session_map import RESPONSE, SessionMap, session_of
from tests.support.factories import Clock, endpoints, inference_request, router_ctx


def test_session_of_a_request():
    assert session_of(inference_request(session_key="k1")) == "m\0s:k1"
    assert session_of(inference_request(session_id="aWQ=")) == "m\0s:aWQ="
    assert session_of(inference_request(model="other", session_key="k1")) == "other\0s:k1"   # per model
    prev = inference_request()
    prev.data = {"previous_response_id": "resp_1"}
    assert session_of(prev) == RESPONSE + "resp_1"
    assert session_map.MESSAGES == MESSAGES
    msg = inference_request(path=MESSAGES, data={"metadata": {"user_id": "user_abc_session_1"}})
    assert session_of(msg) == "m\0u:user_abc_session_1"
    for path in (CHAT, RESPONSES):        # there metadata is the caller's own tags
        assert session_of(inference_request(path=path, data={"metadata": {"user_id": "user_abc_session_1"}})) is None
    assert session_of(inference_request()) is None
    assert session_of(inference_request(session_key="x" * 300)) is None       # over-long: no session


def test_prompt_cache_key_names_a_session_after_the_key_headers_and_before_x_session_id():
    def req(path: str = CHAT, **fields):
        return inference_request(path=path, **fields)

    key = {"prompt_cache_key": "conv-1"}
    for path in (CHAT, COMPLETIONS, RESPONSES):
        assert session_of(req(path, data=dict(key))) == "m\0s:conv-1"
    # the key headers win; the body's key wins over x-session-id and a previous_response_id
    assert session_of(req(data=dict(key), session_key="k1", session_id="aWQ=")) == "m\0s:k1"
    assert session_of(req(data=dict(key), session_id="aWQ=")) == "m\0s:conv-1"
    assert session_of(req(RESPONSES, data={**key, "previous_response_id": "resp_1"})) == "m\0s:conv-1"
    # bounds as a header's: over 256 characters names no session; a non-string or empty one is not read
    assert session_of(req(data={"prompt_cache_key": "x" * 257}, session_id="aWQ=")) is None
    assert session_of(req(data={"prompt_cache_key": "x" * 256})) == "m\0s:" + "x" * 256
    for odd in (7, None, "", ["conv-1"], {"id": "conv-1"}):
        assert session_of(req(data={"prompt_cache_key": odd})) is None
        assert session_of(req(data={"prompt_cache_key": odd}, session_id="aWQ=")) == "m\0s:aWQ="
    # not a field of Anthropic's Messages: metadata.user_id names its session there
    msg = req(MESSAGES, data={**key, "metadata": {"user_id": "u1"}})
    assert session_of(msg) == "m\0u:u1"


def test_entries_expire_and_the_least_recent_go_first():
    clock = Clock()
    eps = endpoints(3)
    m = SessionMap(ttl_s=10, max_entries=2, clock=clock)
    m.put("a", eps[0])
    m.put("b", eps[1])
    clock.t += 5
    m.put("a", eps[0])                   # touched: now the most recent
    m.put("c", eps[2])                   # over the bound: "b" goes
    assert m.get("b") is None and m.get("a") is eps[0] and m.get("c") is eps[2]
    assert m.evictions == 1
    clock.t += 10.5                      # "a" was touched 10.5 s ago
    assert m.get("a") is None and m.get("c") is None
    m.apply("d", eps[1], "alice")
    assert m.entry("d") == (eps[1], "alice")


def test_only_new_changed_or_aging_entries_are_published_and_applied_ones_never():
    clock = Clock()
    eps = endpoints(2)
    told = []
    m = SessionMap(ttl_s=100, clock=clock)
    m.on_put = lambda key, ep, tag, at: told.append((key, ep))
    m.put("a", eps[0])
    m.put("a", eps[0])                   # unchanged
    clock.t += 10
    m.put("a", eps[0])
    assert told == [("a", eps[0])]
    m.put("a", eps[1])                   # changed
    clock.t += 30                        # older than a quarter of the TTL: refreshed for the others
    m.put("a", eps[1])
    m.apply("b", eps[0])
    assert told == [("a", eps[0]), ("a", eps[1]), ("a", eps[1])]


def test_an_entry_in_use_is_told_again_once_a_quarter_of_the_bound_came_after_it():
    """The others order their copy by when they were told: an entry refreshed here, not told, would be
    the first a full map there drops."""
    eps = endpoints(2)
    told = []
    m = SessionMap(ttl_s=100, max_entries=8, clock=Clock())
    m.on_put = lambda key, ep, tag, at: told.append(key)
    m.put("a", eps[0])
    m.apply("b", eps[1])
    m.put("a", eps[0])                   # one entry since "a" was told: not yet
    assert told == ["a"]
    m.put("c", eps[1])
    m.put("a", eps[0])                   # two (a quarter of 8) since: told again
    m.put("a", eps[0])
    assert told == ["a", "c", "a"]


def test_of_two_entries_told_at_once_every_map_keeps_the_later_and_a_move_orders_after_what_it_moves():
    eps = endpoints(3)
    told = []
    a, b = SessionMap(wall=lambda: 100.0), SessionMap(wall=lambda: 101.0)
    a.on_put = b.on_put = lambda *fact: told.append(fact)
    a.put("s", eps[0])
    b.put("s", eps[1])                     # neither has heard of the other's yet
    (_, ep_a, tag_a, at_a), (_, ep_b, tag_b, at_b) = told
    assert a.apply("s", ep_b, tag_b, at_b) and not b.apply("s", ep_a, tag_a, at_a)
    assert a.get("s") is b.get("s") is eps[1]
    # a's clock is 1 s behind b's: its move of the session still comes after the entry it moves
    told.clear()
    a.put("s", eps[2])
    assert told[0][3] > 101.0 and b.apply(*told[0]) and b.get("s") is eps[2]
    assert b.apply("s", eps[0], None, 100.5) is False and b.get("s") is eps[2]     # an older one
    assert b.apply("s", eps[0]) and b.get("s") is eps[0]                          # no time: taken


def _router(loads, **knobs):
    clock = Clock()
    ctx, fallbacks = router_ctx(1, clock, prefix_block_chars=8, **knobs)
    outcomes = []
    object.__setattr__(ctx, "on_session", lambda model, outcome: outcomes.append(outcome))
    return PrefixCacheRouter(ctx), endpoints(len(loads), loads), outcomes, fallbacks


def test_a_session_goes_where_it_went_last_unless_overloaded_or_gone():
    r, eps, outcomes, _ = _router([0, 0, 0, 0])
    first = r.route(inference_request("hi", session_key="agent-1"), eps)
    assert first.reason == ""
    for _ in range(5):
        d = r.route(inference_request("hello", session_key="agent-1"), eps)
        assert d.endpoint is first.endpoint and d.reason == "session"
    assert outcomes == ["kept"] * 5
    first.endpoint.in_flight = 20         # beyond prefix_imbalance_abs (8) above the others: overloaded
    d = r.route(inference_request("again", session_key="agent-1"), eps)
    assert d.endpoint is not first.endpoint and d.reason == "" and outcomes[-1] == "overloaded"
    moved = d.endpoint                    # the session follows the new decision
    others = [ep for ep in eps if ep is not moved]
    n = len(outcomes)
    d = r.route(inference_request("and again", session_key="agent-1"), others)
    assert d.endpoint is not moved and len(outcomes) == n      # ready, left out (a retry off it): not counted
    moved = d.endpoint
    moved.healthy = False                 # down: gone
    d = r.route(inference_request("once more", session_key="agent-1"), [ep for ep in eps if ep is not moved])
    assert d.endpoint is not moved and outcomes[-1] == "gone" and len(outcomes) == n + 1


def test_session_preference_can_be_turned_off():
    r, eps, outcomes, _ = _router([0, 0, 0, 0], prefix_session=False)
    picks = {r.route(inference_request("hi", session_key="agent-1"), eps).endpoint for _ in range(20)}
    assert len(picks) > 1 and outcomes == []


def test_a_response_id_is_followed_to_the_endpoint_that_answered_it():
    r, eps, outcomes, _ = _router([0, 0, 0])
    r.ctx.sessions.put(RESPONSE + "resp_9", eps[2])
    req = inference_request("continue")
    req.data = {"previous_response_id": "resp_9"}
    d = r.route(req, eps)
    assert d.endpoint is eps[2] and d.reason == "session" and outcomes == ["kept"]


def test_a_siblings_entries_are_merged_with_their_times_and_never_over_a_later_one():
    clock = Clock()
    eps = endpoints(3)
    theirs, mine = SessionMap(ttl_s=10, clock=clock), SessionMap(ttl_s=10, clock=clock)
    told = []
    mine.on_put = lambda *fact: told.append(fact)
    theirs.put("old", eps[0])
    clock.t += 4
    theirs.put("a", eps[0], "alice")
    theirs.put("b", eps[1])
    clock.t += 1
    mine.put("b", eps[2])                  # this map recorded "b" after the sibling did
    told.clear()
    clock.t += 6                           # "old" is 11 s old: expired, not exported
    exported = theirs.export()
    assert [k for k, *_ in exported] == ["a", "b"]
    kept = [mine.merge(*entry) for entry in exported]
    assert kept == [True, False]
    assert mine.entry("a") == (eps[0], "alice") and mine.get("b") is eps[2]
    assert told == []                      # a sibling's fact is not published again
    clock.t += 3.5                         # "a" keeps the sibling's time: 10.5 s old now, "b" 9.5
    assert mine.get("a") is None and mine.get("b") is eps[2]


def test_forgetting_an_endpoint_drops_its_sessions_not_its_responses_lineage():
    eps = endpoints(2)
    m = SessionMap()
    m.put("m\0s:a", eps[0])
    m.put("m\0s:b", eps[1])
    m.put(RESPONSE + "resp_1", eps[0], "owner")
    assert m.forget(eps[0]) == 1
    assert m.get("m\0s:a") is None and m.get("m\0s:b") is eps[1]
    assert m.entry(RESPONSE + "resp_1") == (eps[0], "owner")
    # where the gateway holds the responses, their lineage is a session like any other
    assert m.forget(eps[0], lineage=True) == 1
    assert m.entry(RESPONSE + "resp_1") is None and m.get("m\0s:b") is eps[1]


def test_a_session_stays_on_an_endpoint_running_one_request_beside_idle_ones():
    """Twelve endpoints, the session's running one request and the others idle: not overloaded
    (one request above the mean), so the session is kept there."""
    r, eps, outcomes, _ = _router([0] * 12)
    first = r.route(inference_request("hi", session_key="agent-1"), eps).endpoint
    first.in_flight = 1
    d = r.route(inference_request("hello", session_key="agent-1"), eps)
    assert d.endpoint is first and outcomes == ["kept"]


def test_a_users_sessions_are_bounded_by_their_share_and_evict_only_their_own():
    m = SessionMap(max_entries=20, user_share=0.25)          # 5 a user
    ep = Endpoint(url="http://a:1", model="m")
    m.put("\1alice\0m\0s:keep", ep)
    m.put("m\0s:anon", ep)                                   # no API key: the whole map's
    for i in range(40):
        m.put(f"\1bob\0m\0s:{i}", ep)
    assert m.get("\1alice\0m\0s:keep") is ep and m.get("m\0s:anon") is ep
    assert [k for k in m.keys() if k.startswith("\1bob")] == [f"\1bob\0m\0s:{i}" for i in range(35, 40)]
    assert m.user_evictions == 35 and len(m) == 7
    m.reconfigure(1800.0, 20, user_share=0.1)                # 2 a user, at once
    assert [k for k in m.keys() if k.startswith("\1bob")] == [f"\1bob\0m\0s:{i}" for i in range(38, 40)]
    assert m.forget(ep) == 4 and len(m) == 0 and not m._owned


def test_a_users_responses_lineage_counts_against_that_users_share_and_keeps_its_owner():
    m = SessionMap(max_entries=20, user_share=0.25)          # 5 a user
    a, b = Endpoint(url="http://a:1", model="m"), Endpoint(url="http://b:1", model="m")
    m.put("\1alice\0m\0s:keep", a)
    m.put(RESPONSE + "resp_anon", a)                          # auth off: no owner, the whole map's
    for i in range(40):                                       # the Responses API tags each with its owner
        m.put(f"{RESPONSE}resp_{i}", a, "bob") if i % 2 else m.apply(f"{RESPONSE}resp_{i}", a, "bob")
    assert m.get("\1alice\0m\0s:keep") is a and m.get(RESPONSE + "resp_anon") is a
    assert [k for k in m.keys() if k.startswith(RESPONSE + "resp_") and k != RESPONSE + "resp_anon"] == \
        [f"{RESPONSE}resp_{i}" for i in range(35, 40)]
    assert m.user_evictions == 35 and len(m) == 7
    m.put(f"{RESPONSE}resp_39", b)        # a router's turn on the chain (no tag): still bob's
    assert m.entry(f"{RESPONSE}resp_39") == (b, "bob")
    m.put(f"{RESPONSE}resp_40", a, "bob")
    assert m.get(f"{RESPONSE}resp_35") is None and m.user_evictions == 36
    assert m.forget(a, lineage=True) + m.forget(b, lineage=True) == 7 and not m._owned
    m.put(f"{RESPONSE}resp_x", a, "carol")
    m.apply(f"{RESPONSE}resp_x", b)           # another process's entry with no owner: no longer carol's
    assert not m._owned and m.get(f"{RESPONSE}resp_x") is b
