"""Answers tokenized ahead pause while they do not pay (``kv_events.answers_unheld_limit``): the
first request to send an answer back tells whether an engine held the block with the answer's
first generated tokens; after ``limit`` such turns in a row found it held nowhere, only one answer
in ``ANSWER_SAMPLE`` is tokenized ahead, until one is found held."""

from __future__ import annotations

from gateway.kv.tokenization import ANSWER_SAMPLE, chain_keys
from tests.support.kv import LLAMA3, text, toy_tokenizer, words

BS = 16
ROOT = 12345
VOCAB = words(3, 60)


def _turn(tok, n: int, engine_caches_answers: bool):
    """The second turn of conversation ``n``: (its segments, lead ids, the keys some engine holds
    then, how many keys lie before the answer). The engine served the first turn: it holds that
    prompt's full blocks, and with ``engine_caches_answers`` also those of the answer it generated."""
    system = {"role": "system", "content": text(VOCAB, 1000 + n, 40)}
    user = {"role": "user", "content": text(VOCAB, 2000 + n, 20)}
    answer = text(VOCAB, 3000 + n, 60)
    first = tok.encode(tok.render([system, user]))
    nxt = [system, user, {"role": "assistant", "content": answer}, {"role": "user", "content": text(VOCAB, 4000 + n, 9)}]
    ids = tok.encode(tok.render(nxt))
    assert ids[:len(first)] == first
    generated = len(tok.encode(answer))
    cached = len(first) + (generated if engine_caches_answers else 0)
    held = set(chain_keys(ROOT, ids[:cached], BS))
    segments, lead = tok.request_segments("/v1/chat/completions", {"messages": nxt})
    seg = tok.answer_segment(answer)
    assert seg in segments
    tok._store(seg, tok._encode_one(seg))       # tokenized ahead
    tok.expect_answer(seg)
    return segments, lead, held


def _keys(tok, segments, lead, held):
    return tok.block_keys(segments, lead, ROOT, BS, 1 << 20, held.__contains__, held=held.__contains__)


def test_a_next_turn_tells_whether_its_answer_was_held(tmp_path):
    tok = toy_tokenizer(tmp_path, LLAMA3)
    segments, lead, held = _turn(tok, 1, engine_caches_answers=True)
    _keys(tok, segments, lead, held)
    assert tok.answers_met == {"held": 1, "not_held": 0}
    segments, lead, held = _turn(tok, 2, engine_caches_answers=False)
    _keys(tok, segments, lead, held)
    assert tok.answers_met == {"held": 1, "not_held": 1}
    _keys(tok, segments, lead, held)             # the same turn again (a retry): told once
    assert tok.answers_met == {"held": 1, "not_held": 1}


def test_only_answers_tokenized_ahead_are_watched(tmp_path):
    tok = toy_tokenizer(tmp_path, LLAMA3)
    segments, lead, held = _turn(tok, 1, engine_caches_answers=False)
    tok._answers.clear()
    _keys(tok, segments, lead, held)
    assert tok.answers_met == {"held": 0, "not_held": 0}


def test_answers_pause_after_the_limit_and_resume_when_one_is_held(tmp_path):
    tok = toy_tokenizer(tmp_path, LLAMA3)
    limit = 3
    for n in range(limit):
        assert not tok.answers_paused(limit) and tok.answers_wanted(limit)
        _keys(tok, *_turn(tok, n, engine_caches_answers=False))
    assert tok.answers_paused(limit)
    assert not tok.answers_paused(0)              # 0: never paused
    draws = [tok.answers_wanted(limit) for _ in range(4 * ANSWER_SAMPLE)]
    assert sum(draws) == 4                        # one in ANSWER_SAMPLE still goes ahead
    _keys(tok, *_turn(tok, 10, engine_caches_answers=True))
    assert not tok.answers_paused(limit) and tok.answers_wanted(limit)
    assert tok.answers_met == {"held": 1, "not_held": limit}


def test_the_watched_block_is_past_the_generation_prompt(tmp_path):
    """The block watched holds a generated token whatever the prompt's length: an engine that holds
    the first turn's prompt only is never taken for one that caches its answers."""
    tok = toy_tokenizer(tmp_path, LLAMA3)
    for n in range(40):                           # prompts of many lengths modulo the block size
        _keys(tok, *_turn(tok, 100 + n, engine_caches_answers=False))
    assert tok.answers_met["held"] == 0 and tok.answers_met["not_held"] == 40


def test_the_watched_answers_are_bounded(tmp_path, monkeypatch):
    from gateway.kv import tokenization

    monkeypatch.setattr(tokenization, "ANSWERS_KEPT", 8)
    tok = toy_tokenizer(tmp_path, LLAMA3)
    for i in range(50):
        tok.expect_answer(f"answer {i}")
    assert len(tok._answers) == 8 and hash("answer 49") in tok._answers


def test_an_answer_sent_back_before_its_tokens_landed_counts_when_nothing_is_held_past_it(tmp_path):
    """The next turn came before the thread tokenized the answer: with nothing held past the blocks
    before it (the keys end there, untokenized), it was held nowhere."""
    tok = toy_tokenizer(tmp_path, LLAMA3)
    segments, lead, held = _turn(tok, 1, engine_caches_answers=False)
    seg = next(s for s in segments if hash(s) in tok._answers)
    tok._segments.pop(seg)                      # not landed yet
    children = set()                            # nothing chained on any key
    k = tok.block_keys(segments, lead, ROOT, BS, 1 << 20, held.__contains__, extends=children.__contains__,
                       held=held.__contains__)
    assert not k.exact
    assert tok.answers_met == {"held": 0, "not_held": 1}
