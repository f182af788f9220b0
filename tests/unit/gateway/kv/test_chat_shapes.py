"""A plain chat put together from its shape (``ModelTokenizer.chat_segments``): at the second chat of a
sequence of roles the chat template renders that sequence once, with placeholders as contents, and
that chat and later ones of the sequence are made from the pieces. The segments are the template's
own, checked against a full render at each shape's first chat made and one chat in 64; a template
that writes a content otherwise than its placeholder is found out and every chat of it is rendered
from then on."""

from __future__ import annotations

import json
import random

import pytest

from bench.chat_bpe import tokenizer_dir as bpe_dir
from enginesim.tiny_tokenizer import TINY_DIR
from gateway.kv import tokenization
from gateway.kv.tokenization import CHECK_EVERY, SHAPE_MESSAGES, ModelTokenizer
from tests.support.kv import LLAMA3, PLAIN, REFUSES, toy_tokenizer

# the system message trimmed and folded into the last user message; the others as given
MISTRAL = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] | trim %}"
           "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
           "{% for m in msgs %}{% if m['role'] == 'user' %}[INST] {% if loop.last and sys %}{{ sys }}\n\n"
           "{% endif %}{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
# rewrites an answer's content (keeps what follows a marker), as reasoning templates drop thoughts
REWRITES = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
            "{% if m['role'] == 'assistant' %}{{ m['content'].split('DONE:')[-1] }}{% else %}{{ m['content'] }}"
            "{% endif %}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>")
# a content right after text that begins a special token: the two could make one
HALF_TOKEN = "{% for m in messages %}<|eot{{ m['content'] }}<|eot_id|>{% endfor %}"
# trims the user's content only from the right
RSTRIP = "{% for m in messages %}<|eot_id|>{{ m['role'] }}\n{{ m['content'] | trim if m['role'] == 'system' else m['content'].rstrip() }}{% endfor %}<|eot_id|>"


def _dir(tmp_path, template: str, scheme: str = "always") -> ModelTokenizer:
    return toy_tokenizer(tmp_path, template, scheme)


TEXTS = ["hello there", "  fine thanks\n", "the quick\n\nbrown fox", "x", "a <b>bold</b> claim < 3",
         "naïve café ünïcode ☃", "tabs\tand\r\nreturns ", "[INST is not <|a special|> token"]


def _chats(rng: random.Random, n: int) -> list[list[dict]]:
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": rng.choice(TEXTS)}] if rng.random() < 0.7 else []
        for _ in range(rng.randint(1, 5)):
            msgs += [{"role": "user", "content": rng.choice(TEXTS)},
                     {"role": "assistant", "content": rng.choice(TEXTS)}]
        out.append(msgs[:-1])
    return out


def _same(tok: ModelTokenizer, msgs: list[dict]) -> list[str] | None:
    got = tok.chat_segments(msgs)
    if got is not None:
        assert got == tok.segments(tok.render(msgs))
    return got


def _shape(msgs: list[dict]) -> tuple[str, ...]:
    return tuple(m["role"] for m in msgs)


@pytest.mark.parametrize("template, scheme", [(LLAMA3, "always"), (MISTRAL, "always"), (PLAIN, "always"),
                                              (PLAIN, "first"), (RSTRIP, "always")])
def test_a_chat_made_from_its_shape_is_the_templates(tmp_path, template, scheme):
    tok = _dir(tmp_path, template, scheme)
    chats = _chats(random.Random(7), 300)
    made = [_same(tok, msgs) for msgs in chats]
    if template is RSTRIP:            # trimmed on one side only: not a form it knows, every chat rendered
        assert made == [None] * 300 and tok.renders["shape"] == 0
        return
    # every chat but the first of its shape (learned at the second)
    firsts = {_shape(msgs): i for i, msgs in reversed(list(enumerate(chats)))}
    assert [m is None for m in made] == [firsts[_shape(msgs)] == i for i, msgs in enumerate(chats)]
    assert tok.renders["shape"] == 300 - len(firsts) and tok.renders["mismatch"] == 0 and not tok.shapes_off


@pytest.mark.parametrize("directory", [TINY_DIR, None])
def test_the_projects_tokenizers(directory):
    """The tiny ChatML tokenizer the tests use, and the benchmark's Llama-3-style BPE."""
    tok = ModelTokenizer(directory or bpe_dir())
    for msgs in _chats(random.Random(3), 200):
        tok.chat_segments(msgs)                   # the first of its shape: rendered
        assert _same(tok, msgs) is not None
    assert tok.renders["mismatch"] == 0


def test_request_segments_uses_the_shape_and_renders_the_rest(tmp_path):
    tok = _dir(tmp_path, LLAMA3)
    plain = {"messages": [{"role": "user", "content": "hello there"}]}
    for _ in range(2):                            # rendered, then put together from its shape
        assert tok.request_segments("/v1/chat/completions", plain) == (tok.segments(tok.render(plain["messages"])), [])
    assert tok.renders == {"shape": 1, "template": 1, "mismatch": 0}
    # not plain: a name, parts, a tool, template kwargs, a content holding a special token, an empty one
    others = [
        {"messages": [{"role": "user", "content": "hello", "name": "bob"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]},
        {"messages": [{"role": "user", "content": "hello"}], "tools": []},
        {"messages": [{"role": "user", "content": "hello"}], "chat_template_kwargs": {"x": 1}},
        {"messages": [{"role": "user", "content": "hi <|eot_id|> there"}]},
        {"messages": [{"role": "user", "content": " \n "}]},
        {"messages": [{"role": "u" * 33, "content": "hello"}]},
    ]
    for body in others:
        segments, _ = tok.request_segments("/v1/chat/completions", body)
        assert segments == tok.segments(tok.render(body["messages"], **({"tools": []} if "tools" in body else
                                                                       body.get("chat_template_kwargs", {}))))
    assert tok.renders == {"shape": 1, "template": 1 + len(others), "mismatch": 0}


@pytest.mark.parametrize("template", [REFUSES, HALF_TOKEN])
def test_a_shape_not_recognized_is_rendered(tmp_path, template):
    tok = _dir(tmp_path, template)
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "and you"}]
    assert tok.chat_segments(msgs) is None and not tok._shapes          # met once: rendered
    assert tok.chat_segments(msgs) is None
    assert tok._shapes[("user", "assistant", "user")] is None          # learned once
    assert tok.chat_segments(msgs) is None


def test_a_template_that_rewrites_a_content_is_found_out(tmp_path, monkeypatch):
    tok = _dir(tmp_path, REWRITES)
    told: list[bool] = []
    tok.on_mismatch = lambda: told.append(True)
    first = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"},
             {"role": "user", "content": "and you"}]
    assert tok.chat_segments(first) is None           # met once: rendered
    assert _same(tok, first) is not None              # the shape's first chat made: checked, and the same
    rewritten = [dict(m) for m in first]
    rewritten[1]["content"] = "thinking DONE: fine"
    # the chats between two checks are made from the shape, unchecked: their segments differ from
    # the template's (only their routing keys are off; what the engine gets is the client's chat)
    for _ in range(CHECK_EVERY - 1):
        assert tok.chat_segments(rewritten) != tok.segments(tok.render(rewritten))
    assert not tok.shapes_off and not told
    # the next one is checked: shapes are off for good, and every chat is rendered
    assert tok.chat_segments(rewritten) is None
    assert tok.shapes_off and told == [True] and tok.renders["mismatch"] == 1
    assert tok.chat_segments(first) is None
    assert tok.request_segments("/v1/chat/completions", {"messages": rewritten})[0] == \
        tok.segments(tok.render(rewritten))


def test_a_chat_of_many_messages_is_rendered(tmp_path):
    """Past ``SHAPE_MESSAGES`` a chat is rendered: its shape would hardly be met again, and its pieces
    would hold as many slots."""
    tok = _dir(tmp_path, LLAMA3)
    many = [{"role": "user" if i % 2 else "assistant", "content": f"hello {i}"} for i in range(SHAPE_MESSAGES + 1)]
    assert tok.chat_segments(many) is None and tok.chat_segments(many) is None and not tok._shapes
    assert tok.chat_segments(many[1:]) is None and _same(tok, many[1:]) is not None
    # nor is a role longer than any a template knows kept in a shape's key
    odd = [{"role": "u" * 33, "content": "hello"}]
    assert tok.chat_segments(odd) is None and tok.chat_segments(odd) is None
    assert not any(len(r) > 32 for key in tok._shapes for r in key) and hash(tuple(r["role"] for r in odd)) not in tok._once


def test_a_shape_is_learned_at_its_second_chat(tmp_path, monkeypatch):
    """Shapes met once are remembered, boundedly, and learned only when met again: a stream of shapes
    each sent once costs the template's render, as without shapes."""
    monkeypatch.setattr(tokenization, "SHAPES_KEPT", 2)
    tok = _dir(tmp_path, LLAMA3)
    learned: list[tuple] = []
    learn = tok._learn_shape
    tok._learn_shape = lambda roles: learned.append(roles) or learn(roles)
    for n in range(1, 30):
        assert tok.chat_segments([{"role": "user", "content": "hello"}] * n) is None
    assert not learned and len(tok._once) == 8
    assert _same(tok, [{"role": "user", "content": "hello"}] * 29) is not None and learned == [("user",) * 29]


def test_shapes_kept_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenization, "SHAPES_KEPT", 4)
    tok = _dir(tmp_path, LLAMA3)
    for n in range(1, 12):
        assert tok.chat_segments([{"role": "user", "content": "hello"}] * n) is None
        assert _same(tok, [{"role": "user", "content": "hello"}] * n) is not None
    assert len(tok._shapes) == 4


def test_a_tokenizer_without_a_template_has_no_shapes(tmp_path):
    _dir(tmp_path, LLAMA3)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    tok = ModelTokenizer(tmp_path)
    assert tok.shapes_off and tok.chat_segments([{"role": "user", "content": "hello"}]) is None
