"""The prefix index: chained block keys, depth, capacity, idle expiry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.endpoints import Endpoint
from routers.base import RoutingSettings
from routers.prefix_cache import PrefixIndex, prefix_keys
from tests.unit.routers.prefix_helpers import BLOCK, SYSTEM, Clock, make_eps, make_req, setup

# -- keys ----------------------------------------------------------------------------------------


def test_keys_are_chained_per_block_and_ignore_the_partial_tail():
    a = prefix_keys("abcdefgh" "ijklmnop" "qrs", "m", 8, 100)
    b = prefix_keys("abcdefgh" "ijklmnop" "XYZ", "m", 8, 100)
    c = prefix_keys("abcdefgh" "IJKLMNOP", "m", 8, 100)
    assert len(a) == 2 and a == b                # the 3-char tail is not a full block
    assert c[0] == a[0] and c[1] != a[1]
    # a block's key depends on everything before it, not just on its own text
    assert prefix_keys("zzzzzzzz" "ijklmnop", "m", 8, 100)[1] != a[1]
    assert prefix_keys("abcdefgh", "other-model", 8, 100)[0] != a[0]
    assert len(prefix_keys("x" * 80, "m", 8, 4)) == 4     # at most max_blocks
    assert prefix_keys("short", "m", 8, 100) == []


def test_non_ascii_text_is_keyed_by_characters():
    text = "é" * 16 + "ü" * 16
    keys = prefix_keys(text, "m", 8, 100)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert prefix_keys("é" * 8, "m", 8, 100) == keys[:1]


def _keys_encoding_all(text: str, model: str, block_chars: int, max_blocks: int) -> list[int]:
    """The keys as they were made when the whole prompt was encoded first (the reference)."""
    from xxhash import xxh3_64_intdigest

    from routers.prefix_index import _ROOT_SEED
    n = min(len(text) // block_chars, max_blocks)
    h = xxh3_64_intdigest(model.encode(), _ROOT_SEED)
    keys = []
    if text.isascii():
        data = text.encode()
        for i in range(n):
            h = xxh3_64_intdigest(data[i * block_chars:(i + 1) * block_chars], h)
            keys.append(h)
        return keys
    for i in range(n):
        h = xxh3_64_intdigest(text[i * block_chars:(i + 1) * block_chars].encode(), h)
        keys.append(h)
    return keys


@pytest.mark.parametrize("text", [
    "",
    "a" * 7,
    "abcdefgh" * 5,
    "abcdefgh" * 5 + "abc",
    "abcdefgh" * 40,                         # past max_blocks: the tail is not keyed
    "abcdefgh" * 4 + "é" + "x" * 200,        # non-ASCII past what is hashed: ASCII where it is
    "é" + "abcdefgh" * 10,
    "abcdefg" + "日本語のテキスト" * 9,
    "🙂" * 33 + "a" * 100,                   # four UTF-8 bytes a character
    "x" * 31 + "🙂" + "y" * 500,
    "\x00\x7f" * 100 + "\u0080",
])
@pytest.mark.parametrize("block_chars,max_blocks", [(8, 4), (8, 100), (1, 3), (7, 1000), (512, 1024)])
def test_keys_are_those_of_the_whole_prompt_encoded(text, block_chars, max_blocks):
    """Only the characters of the keyed blocks are encoded now: the keys are byte for byte the same
    for every prompt, ASCII or not, whether the non-ASCII part is keyed or past the cut."""
    assert prefix_keys(text, "m", block_chars, max_blocks) == _keys_encoding_all(text, "m", block_chars, max_blocks)


@given(st.text(max_size=200), st.integers(1, 16), st.integers(1, 20))
@settings(max_examples=300, deadline=None)
def test_keys_of_any_prompt_are_those_of_the_whole_prompt_encoded(text, block_chars, max_blocks):
    assert prefix_keys(text, "m", block_chars, max_blocks) == _keys_encoding_all(text, "m", block_chars, max_blocks)


def test_a_huge_prompt_is_encoded_only_as_far_as_it_is_hashed():
    """At most ``max_blocks × block_chars`` characters are hashed: a prompt at the body limit is
    not encoded whole (16 MB of bytes made and dropped for each request, about 20 ms)."""
    import tracemalloc
    text = "a" * (8 << 20)
    tracemalloc.start()
    try:
        keys = prefix_keys(text, "m", 512, 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(keys) == 1024
    assert peak < 2 << 20, peak


def test_a_huge_prompt_with_tools_is_copied_only_as_far_as_it_is_hashed():
    """A request with ``tools`` is keyed as its tools' text then its prompt: the prompt is not copied
    whole behind the tools for the few blocks hashed, and the keys are those of the whole text."""
    import tracemalloc

    from routers.prefix_index import tools_text
    _, index, _, _ = setup(block=512, prefix_max_blocks=1024)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = make_req("a" * (8 << 20), data={"tools": tools})
    tracemalloc.start()
    try:
        keys = index.keys(req)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert keys == _keys_encoding_all(tools_text(tools) + req.prompt_text, "m", 512, 1024)
    assert peak < 2 << 20, peak


_KEYS_SCRIPT = ("from routers.prefix_index import prefix_keys; "
                "print(prefix_keys('abcdefgh' * 6 + 'élan vital' * 3, 'm', 8, 100))")


def test_keys_are_the_same_in_processes_with_different_hash_seeds():
    """Replicas do not share Python's hash seed: the keys they exchange must not depend on it."""
    root = Path(__file__).resolve().parents[3]
    outs = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
        outs.add(subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True,
                                text=True, check=True, timeout=60).stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == str(prefix_keys("abcdefgh" * 6 + "élan vital" * 3, "m", 8, 100))


def test_insert_tells_the_listener_and_apply_insert_does_not():
    _, index, _, _ = setup()
    eps = make_eps(2)
    told: list[tuple[list[int], Endpoint]] = []
    index.on_insert = lambda keys, ep: told.append((list(keys), ep))
    req = make_req(SYSTEM)
    index.insert(req, eps[0])
    assert told == [(index.keys(req), eps[0])]
    # another process's insertion, applied here: held, and not published again
    _, other, _, _ = setup()
    other.apply_insert(told[0][0], eps[1])
    assert other.depths(make_req(SYSTEM + "more text " * 10), eps)[0] == {eps[1]: 20}
    index.apply_insert(told[0][0], eps[1])
    assert len(told) == 1
    assert index.holders(req) == 2


def test_chain_is_memoised_per_request_object():
    _, index, _, _ = setup()
    req = make_req(SYSTEM)
    assert index.keys(req) is index.keys(req)
    assert index.keys(make_req(SYSTEM)) == index.keys(req)


# -- the index -----------------------------------------------------------------------------------


def test_depth_is_the_longest_held_prefix():
    _, index, _, _ = setup()
    eps = make_eps(3)
    index.insert(make_req(SYSTEM), eps[0])
    index.insert(make_req(SYSTEM[:80]), eps[1])
    conv = make_req(SYSTEM + "user: how do switches work?")
    depths, n = index.depths(conv, eps)
    assert n == len(conv.prompt_text) // BLOCK
    assert depths == {eps[0]: 20, eps[1]: 10}
    match = index.match(conv, eps)
    assert match[eps[2]] == 0.0 and match[eps[0]] == pytest.approx(100 * 20 / n)


def test_capacity_evicts_the_deep_end_of_old_chains_first():
    _, index, _, _ = setup(prefix_index_blocks=30)
    eps = make_eps(2)
    index.insert(make_req(SYSTEM), eps[0])              # 20 blocks
    index.insert(make_req("Z" * 80), eps[1])            # 10 more: full
    assert len(index) == 30
    index.insert(make_req("Q" * 40), eps[1])            # 5 new: the 5 least recent go
    assert len(index) == 30 and index.evictions == 5
    depths, _ = index.depths(make_req(SYSTEM), eps)
    assert depths == {eps[0]: 15}                       # the prefix survived, its tail went


def test_idle_blocks_and_entries_expire():
    _, index, clock, _ = setup(prefix_idle_ttl_s=60.0)
    eps = make_eps(2)
    index.insert(make_req(SYSTEM), eps[0])
    clock.t += 30
    index.insert(make_req(SYSTEM[:40]), eps[1])
    clock.t += 40                                       # eps[0]'s entries are 70 s old, eps[1]'s 40 s
    depths, _ = index.depths(make_req(SYSTEM), eps)
    assert depths == {eps[1]: 5}
    assert index.sweep() == 15                          # the blocks only eps[0] held, idle > 60 s
    clock.t += 61
    assert index.sweep() == 5 and len(index) == 0


def test_forget_an_endpoint():
    _, index, _, _ = setup()
    eps = make_eps(2)
    index.insert(make_req(SYSTEM), eps[0])
    index.insert(make_req(SYSTEM[:40]), eps[1])
    index.forget(eps[0])
    assert index.depths(make_req(SYSTEM), eps)[0] == {eps[1]: 5}
    assert len(index) == 5


def test_a_forgotten_endpoint_is_not_brought_back_by_a_siblings_older_blocks():
    """Its engine restarted: a sibling's whole view sent later still names it on the blocks it held
    before, which must stay forgotten; what the sibling touched there since is taken."""
    clock = Clock()
    eps = make_eps(2)
    _, theirs, _, _ = setup(clock=clock, prefix_idle_ttl_s=60)
    _, mine, _, _ = setup(clock=clock, prefix_idle_ttl_s=60)
    old, new = make_req(SYSTEM), make_req("A prompt sent after the restart, long enough. " * 2)
    for index in (theirs, mine):
        index.insert(old, eps[0])
        index.insert(old, eps[1])
    clock.t += 1
    mine.forget(eps[0])
    clock.t += 1
    theirs.insert(new, eps[0])
    by_slot, rows = theirs.export()
    mine.merge(rows, by_slot)
    assert mine.depths(old, eps)[0] == {eps[1]: len(SYSTEM) // BLOCK}
    assert mine.depths(new, eps)[0] == {eps[0]: len(new.prompt_text) // BLOCK}
    clock.t += 61                           # past the TTL nothing older is live anyway: the mark goes
    mine.sweep()
    assert mine._cleared == {}


def test_endpoints_that_left_are_dropped_with_their_slots_and_not_merged_back():
    """``drop``: endpoints gone for good leave every block (in one walk) and the index holds them no
    more; a sibling's view merged later does not bring them back; their slots serve others."""
    _, index, _, _ = setup()
    _, theirs, _, _ = setup()
    eps = make_eps(3)
    for i, ep in enumerate(eps):
        index.insert(make_req(SYSTEM[:40 * (i + 1)]), ep)       # 5, 10 and 15 blocks, nested
        theirs.insert(make_req(SYSTEM[:40 * (i + 1)]), ep)
    assert index.stats()["entries"] == 30
    index.forget(eps[0])                     # a restart first: dropping clears its mark too
    for ep in eps[:2]:
        ep.removed = True
    assert index.drop(eps[:2]) == 10
    assert index.stats()["entries"] == 15 and len(index) == 15
    assert list(index.slots().values()) == [eps[2]] and index._cleared == {}
    by_slot, rows = theirs.export()
    index.merge(rows, by_slot)
    assert list(index.slots().values()) == [eps[2]] and index.stats()["entries"] == 15
    assert index.drop(eps[:2]) == 0
    fresh = make_eps(1)[0]
    index.insert(make_req(SYSTEM[:40]), fresh)
    assert index.depths(make_req(SYSTEM), [fresh, eps[2]])[0] == {fresh: 5, eps[2]: 15}


def test_stats_for_a_gauge():
    _, index, _, _ = setup(prefix_index_blocks=100)
    eps = make_eps(2)
    index.insert(make_req(SYSTEM), eps[0])
    index.insert(make_req(SYSTEM[:40]), eps[1])
    assert index.stats() == {"blocks": 20, "capacity": 100, "entries": 25, "evictions": 0}


texts = st.text(alphabet="ab", min_size=0, max_size=64)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(texts, st.integers(0, 3), st.integers(0, 30)), min_size=1, max_size=40),
       probe=texts, capacity=st.integers(1, 40), ttl=st.integers(5, 100))
def test_property_binary_search_equals_a_linear_walk(ops, probe, capacity, ttl):
    """The index stays prefix-closed under LRU and idle eviction, so binary search finds exactly
    the depth a block-by-block walk finds."""
    clock = Clock()
    index = PrefixIndex(RoutingSettings(prefix_block_chars=4, prefix_index_blocks=capacity,
                                        prefix_idle_ttl_s=float(ttl)), clock)
    eps = make_eps(4)
    for text, who, dt in ops:
        clock.t += dt
        index.insert(make_req(text), eps[who])
    req = make_req(probe)
    keys = index.keys(req)
    cut = int(clock() * 1000) - index.idle_ttl_ms
    expected = {}
    for ep in eps:
        slot = index._slots.get(ep)
        depth = 0
        for k in keys:
            held = index._blocks.get(k)
            if held is None or slot is None:
                break
            ts = (held >> 24 if (held & 0xFFFFFF) == slot else -(1 << 62)) if isinstance(held, int) else held.get(slot, -(1 << 62))
            if ts < cut:
                break
            depth += 1
        if depth:
            expected[ep] = depth
    assert index.depths(req, eps)[0] == expected
    assert len(index) <= capacity


def test_endpoint_slots_are_released_when_no_block_mentions_them(monkeypatch):
    """Pods come and go: the index must not keep every endpoint it ever saw."""
    from routers import prefix_index

    monkeypatch.setattr(prefix_index, "_SLOT_COMPACT_AT", 4)
    _, index, _, _ = setup(prefix_index_blocks=40)
    kept = make_eps(1)[0]
    index.insert(make_req(SYSTEM), kept)                     # 20 blocks
    for i in range(30):                                      # 30 short-lived endpoints, 20 blocks each
        ep = Endpoint(url=f"http://10.1.0.{i + 1}:8000", model="m")
        index.insert(make_req(f"{i:03d}" + SYSTEM[3:]), ep)
    assert len(index._slots) <= 8
    assert len(index) == 40
    depths, _ = index.depths(make_req(f"{29:03d}" + SYSTEM[3:]), [ep])
    assert depths == {ep: 20}


def test_a_siblings_blocks_are_merged_with_their_times_and_never_over_a_later_touch():
    clock = Clock()
    eps = make_eps(3)
    _, theirs, _, _ = setup(clock=clock, prefix_idle_ttl_s=10)
    _, mine, _, _ = setup(clock=clock, prefix_idle_ttl_s=10)
    told = []
    mine.on_insert = lambda keys, ep: told.append(keys)
    req, other = make_req(SYSTEM), make_req("Another prompt that is long enough. " * 2)
    theirs.insert(req, eps[0])
    clock.t += 4
    theirs.insert(other, eps[1])
    mine.insert(other, eps[2])
    told.clear()
    by_slot, rows = theirs.export()
    assert len(rows) == len(theirs) and set(by_slot.values()) == {eps[0], eps[1]}
    assert mine.merge(rows, by_slot) == len(rows)
    assert told == []
    assert mine.depths(req, eps)[0] == {eps[0]: len(SYSTEM) // BLOCK}
    assert mine.depths(other, eps)[0] == {eps[1]: len(other.prompt_text) // BLOCK, eps[2]: len(other.prompt_text) // BLOCK}
    clock.t += 6.5                          # req's blocks keep the sibling's time: 10.5 s idle now
    assert mine.depths(req, eps)[0] == {}
    assert mine.depths(other, eps)[0] != {}
    # what is idle past the TTL is neither exported nor merged
    assert all(len(row) > 1 for row in theirs.export()[1]) and len(theirs.export()[1]) == len(theirs.keys(other))
    stale = [[k, 0, int((clock.t - 11) * 1000)] for k in theirs.keys(make_req("Yet another long prompt here. " * 2))]
    assert mine.merge(stale, {0: eps[0]}) == 0


_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city, now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
_OTHER_TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web for a query",
                                                  "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def test_the_tools_a_chat_offers_are_keyed_before_its_messages():
    """The engine renders a request's tools into the prompt it prefills (a chat template puts them
    at its head, as a system prompt): the same messages under other tools are another prefix, and
    turns that offer the same tools share the tools' blocks, whatever order their fields came in."""
    _, index, _, _ = setup()
    text = SYSTEM + "user\nWhat is the weather in Paris?"
    plain = make_req(text, data={"model": "m", "messages": []})
    weather = make_req(text, data={"model": "m", "messages": [], "tools": _TOOLS})
    search = make_req(text, data={"model": "m", "messages": [], "tools": _OTHER_TOOLS})
    reordered = [{"function": {k: t["function"][k] for k in reversed(list(t["function"]))}, "type": "function"}
                 for t in _TOOLS]
    later = make_req(SYSTEM + "user\nAnd in Rome?", data={"model": "m", "messages": [], "tools": reordered})
    k_plain, k_weather, k_search, k_later = (index.keys(r) for r in (plain, weather, search, later))
    assert k_weather[0] != k_plain[0]                       # another prefix from the first block
    assert not set(k_search) & set(k_weather[len(k_weather) - len(k_plain):])   # no message block shared
    assert len(k_weather) > len(k_plain)                                  # the tools' blocks are prefilled too
    shared = next(i for i, (a, b) in enumerate(zip(k_weather, k_later, strict=False)) if a != b)
    assert shared * BLOCK >= len(SYSTEM)            # the tools and the system prompt: the same blocks
    # a request that offers no tools, or tools the encoder cannot write, is keyed on its text alone
    assert index.keys(make_req(text, data={"model": "m", "tools": []})) == k_plain
    deep: list = []
    for _ in range(300):
        deep = [deep]
    assert index.keys(make_req(text, data={"model": "m", "tools": deep})) == k_plain
