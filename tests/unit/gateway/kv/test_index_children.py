"""A request's keys stop where nothing is chained on: the index counts, for each key, the keys held
or pending anywhere that chain on it, and a segment past the last full block is not tokenized when
no engine holds (or is about to hold) anything after that block. A conversation's new message,
behind blocks only its own engine holds, then costs the event loop nothing; the match is the same."""

from __future__ import annotations

import random
from collections import Counter

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv.index import EventIndex, request_root, root_key
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer, chain_keys
from gateway.kv.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from gateway.request import CHAT, parse
from tests.support.kv import text, words

BS = 16
WORDS = words(11, 400)
SYSTEM = "You are a helpful assistant. " + text(WORDS, 1012, 300)


def _text(seed: int, n: int) -> str:
    return text(WORDS, seed, n)


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _index(ttl: float = 10.0, tok: ModelTokenizer | None = None):
    tok = tok or ModelTokenizer(TINY_DIR)
    cfg = KVEventsConfig(enabled=True, speculative_ttl_s=ttl, stall_timeout_s=1000)
    clock = Clock()
    idx = EventIndex({"m": tok}, lambda m: cfg, clock)
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in (1, 2)]
    states = [idx.track(ep, cfg) for ep in eps]
    for i, s in enumerate(states):       # each engine reports a block: its block size is known
        idx.apply(s, Batch(0.0, [BlockStored([900 + i], None, [i] * BS, BS)], 0))
    return idx, tok, eps, states, clock


def _consistent(idx: EventIndex) -> None:
    """The counts are those of the keys held or pending, by the key each chains on."""
    live = set(idx._holders) | set(idx._pending)
    assert set(idx._parent_of) == live
    assert idx._children == Counter(idx._parent_of[k] for k in live)


def _store(idx, state, messages, first_hash: int, tok) -> list[int]:
    """The engine behind ``state`` prefilled ``messages`` and reports its full blocks; their keys."""
    ids = tok.tokenizer.encode(tok.render(messages), add_special_tokens=False).ids
    n = len(ids) // BS
    idx.apply(state, Batch(0.0, [BlockStored(list(range(first_hash, first_hash + n)), None, ids[:n * BS], BS)], 0))
    return chain_keys(root_key("m", None, BS), ids, BS)


def _req(messages, rid="r"):
    return parse(CHAT, orjson.dumps({"model": "m", "messages": messages}), {}, rid)


def test_a_new_message_behind_its_own_engines_blocks_is_not_tokenized():
    idx, tok, eps, states, _ = _index()
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _text(1, 30)},
             {"role": "assistant", "content": _text(2, 20)}]
    held = _store(idx, states[0], turn1, 1, tok)
    _consistent(idx)
    turn2 = turn1 + [{"role": "user", "content": _text(3, 25)}]
    message = next(s for s in tok.request_segments(CHAT, {"messages": turn2})[0] if turn2[-1]["content"] in s)
    tokenized: list[str] = []
    encode = tok._encode_one
    tok._encode_one = lambda seg: tokenized.append(seg) or encode(seg)
    req = _req(turn2)
    depths, tokens, _ = idx.match(req, eps)
    assert message not in tokenized and not tok.is_cached(message)
    assert idx.left(req) and idx.left(req)[0] == message         # tokenized after routing, for the next turn
    # the match is what the engine holds: every block of turn 1 whose tokens turn 2 repeats
    full = chain_keys(root_key("m", None, BS), tok.encode(tok.render(turn2)), BS)
    same = next((i for i, (a, b) in enumerate(zip(held, full, strict=False)) if a != b), min(len(held), len(full)))
    assert depths == {eps[0]: same * BS, eps[1]: 0}
    assert abs(tokens - len(tok.encode(tok.render(turn2)))) < 0.2 * tokens


def test_a_block_chained_on_the_last_one_is_matched():
    """Another engine holds the same turn 2 (a retry, the same question): the message is tokenized
    and the match goes past the blocks turn 1 left."""
    idx, tok, eps, states, _ = _index()
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _text(1, 30)},
             {"role": "assistant", "content": _text(2, 20)}]
    _store(idx, states[0], turn1, 1, tok)
    turn2 = turn1 + [{"role": "user", "content": _text(3, 60)}]
    _store(idx, states[1], turn2, 5000, tok)
    _consistent(idx)
    depths, _, _ = idx.match(_req(turn2), eps)
    n = len(tok.encode(tok.render(turn2)))
    assert depths[eps[1]] == (n // BS) * BS > depths[eps[0]]


def test_pending_blocks_are_chained_on_until_they_expire():
    """A routed request's new blocks, held speculatively, are chained on as held ones: the same request
    again before the engine reports them is tokenized and follows them; once they expire it is not."""
    idx, tok, eps, states, clock = _index()
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _text(1, 30)},
             {"role": "assistant", "content": _text(2, 20)}]
    _store(idx, states[0], turn1, 1, tok)
    turn2 = turn1 + [{"role": "user", "content": _text(3, 60)}]
    first = _req(turn2, "a")
    depths, _, _ = idx.match(first, eps)
    idx.routed(first, eps[1])                   # routed elsewhere (say, the first was busy)
    _consistent(idx)
    assert idx._pending                          # its blocks past the match, up to the probe's end
    again = _req(turn2, "b")
    d2, _, _ = idx.match(again, eps)
    assert d2[eps[1]] > depths[eps[1]]
    clock.t += 11                                # the speculative entries expire
    idx._expire(clock.t)
    assert not idx._pending
    _consistent(idx)
    d3, _, _ = idx.match(_req(turn2, "c"), eps)
    assert d3 == depths


def test_the_keys_are_the_same_with_or_without_the_counts():
    """Against ``tokenize_unreached`` (every segment tokenized): the depths are equal for every request
    of a few interleaved conversations stored on two engines."""
    idx, tok, eps, states, _ = _index(ttl=0)
    whole, _, weps, wstates, _ = _index(ttl=0)
    whole.settings = lambda m: KVEventsConfig(enabled=True, speculative_ttl_s=0, tokenize_unreached=True)
    convs = {c: [{"role": "system", "content": SYSTEM if c % 2 else _text(40 + c, 120)}] for c in range(4)}
    r = random.Random(3)
    deep = 0
    for n in range(24):
        c = r.randrange(4)
        convs[c].append({"role": "user", "content": _text(100 + n, r.randint(3, 70))})
        a = idx.match(_req(convs[c], f"a{n}"), eps)[0]
        b = whole.match(_req(convs[c], f"b{n}"), weps)[0]
        assert [a[ep] for ep in eps] == [b[ep] for ep in weps]
        deep += max(a.values()) > 0
        e = r.randrange(2)
        convs[c].append({"role": "assistant", "content": _text(200 + n, r.randint(1, 30))})
        _store(idx, states[e], convs[c], 1000 * (n + 1), tok)
        _store(whole, wstates[e], convs[c], 1000 * (n + 1), tok)
        _consistent(idx)
    assert deep >= 12 and tok.segments_unreached >= 12       # matched, and keyed short of the new message

_TOK = ModelTokenizer(TINY_DIR)     # the examples' prompts are token ids: no text is tokenized, no cache kept
_ops = st.lists(st.tuples(st.sampled_from(["store", "store", "remove", "clear", "route", "expire", "forget"]),
                          st.integers(0, 1), st.integers(0, 3), st.integers(1, 5), st.integers(0, 9)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_the_counts_follow_every_change(ops):
    """Stores sharing prefixes, removals, clears, speculative holds, their expiry and an endpoint
    forgotten: the counts are always those of the keys held or pending."""
    idx, tok, eps, states, clock = _index(ttl=5.0, tok=_TOK)
    root = root_key("m", None, BS)
    chains = [[tuple((c * 31 + b * 7 + j) % 40 for j in range(BS)) for b in range(5)] for c in range(4)]
    for op, e, c, n, x in ops:
        s = idx.states.get(eps[e])
        if op == "store" and s is not None:
            start = x % n
            ids = [t for block in chains[c][:n] for t in block]
            hashes = [c * 100 + b + 1 for b in range(n)]
            idx.apply(s, Batch(0.0, [BlockStored(hashes[start:], hashes[start - 1] if start else None,
                                                 ids[start * BS:], BS)], 0))
        elif op == "remove" and s is not None:
            idx.apply(s, Batch(0.0, [BlockRemoved([c * 100 + b + 1 for b in range(x % 5, n)])], 0))
        elif op == "clear" and s is not None:
            idx.apply(s, Batch(0.0, [AllBlocksCleared()], 0))
        elif op == "route" and s is not None:
            ids = [t for block in chains[c][:n] for t in block] + [1]
            req = parse("/v1/completions", orjson.dumps({"model": "m", "prompt": ids}), {}, f"r{x}")
            assert request_root(req, "m", BS) == root
            idx.match(req, eps)
            idx.routed(req, eps[e])
        elif op == "expire":
            clock.t += x
            idx._expire(clock.t)
        elif op == "forget" and s is not None:
            idx.forget(eps[e])
            idx.track(eps[e], s.settings)
        _consistent(idx)
