"""A chat's answer tokenized ahead of its next turn: the segment the chat template makes of an
assistant message is learned from the template, and predicted for an answer's text exactly as the
next turn's render cuts it; templates whose form is not recognized predict nothing."""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.kv.tokenization import ModelTokenizer
from gateway.pipeline.sse import AnswerText, message_text
from tests.support.kv import LLAMA3, PLAIN, REFUSES, toy_tokenizer

MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
# writes an assistant message otherwise than as its content (upper-cased)
CHANGED = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
           "{{ m['content'] | upper if m['role'] == 'assistant' else m['content'] }}<|eot_id|>{% endfor %}")
def _dir(tmp_path, template: str):
    return toy_tokenizer(tmp_path, template)


def _next_turn_segments(tok: ModelTokenizer, answer: str) -> list[str]:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": answer}, {"role": "user", "content": "and you"}]
    segs = tok.segments(tok.render(msgs))
    return segs


ANSWERS = ["fine thanks", "  fine thanks\n", "the quick\n\nbrown fox", "x"]


@pytest.mark.parametrize("template, form", [
    (LLAMA3, ("\n\n", "", True)),
    (MISTRAL, ("", "", False)),
])
def test_the_predicted_segment_is_the_one_the_next_turn_renders(tmp_path, template, form):
    tok = _dir(tmp_path, template)
    assert tok._learn_answer_form() == form
    for answer in ANSWERS:
        seg = tok.answer_segment(answer)
        assert seg is not None and seg in _next_turn_segments(tok, answer)


def test_the_projects_tokenizer_chatml_form():
    tok = ModelTokenizer(TINY_DIR)
    assert tok._learn_answer_form() == ("assistant\n", "", False)
    for answer in ANSWERS:
        assert tok.answer_segment(answer) in _next_turn_segments(tok, answer)


@pytest.mark.parametrize("template", [PLAIN, CHANGED, REFUSES])
def test_a_form_not_recognized_predicts_nothing(tmp_path, template):
    tok = _dir(tmp_path, template)
    assert tok.answer_segment("fine thanks") is None
    assert tok._answer_form is None and tok.answer_form is None         # learned once


def test_an_answer_holding_a_special_tokens_text_predicts_nothing(tmp_path):
    tok = _dir(tmp_path, LLAMA3)
    assert tok.answer_segment("fine <|eot_id|> thanks") is None
    assert tok.answer_segment("fine thanks") == "\n\nfine thanks"


def answer_text(stream: bytes) -> str | None:
    """A whole stream's answer, as the relay collects it."""
    answer = AnswerText()
    answer.add(stream)
    return answer.text()


def _sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _delta(**d):
    return {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}


def test_a_streams_answer_is_its_content_deltas_joined():
    raw = _sse(_delta(role="assistant", content=""), _delta(content="Hel"), _delta(content='lo "you"\n'),
               {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert answer_text(raw) == 'Hello "you"\n'
    assert answer_text(raw.replace(b"\n\n", b"\r\n\r\n")) == 'Hello "you"\n'
    assert answer_text(_sse(_delta(role="assistant"))) is None                 # no text
    assert answer_text(_sse(_delta(content="a"), _delta(tool_calls=[{"index": 0, "id": "t"}]))) is None
    spaced = b'data: {"choices": [{"index": 0, "delta": {"content": "a b"}}]}\n\n'
    assert answer_text(spaced + spaced) == "a ba b"
    assert answer_text(b'data: {"choices":[{"index":0,"delta":{"content":"a\\x"}}]}\n\n') is None  # a bad escape
    # a character escaped as a surrogate pair split over two deltas; reasoning and logprobs are not the answer
    split = [b'data: {"choices":[{"index":0,"delta":{"content":"ok \\ud83d"}}]}\n\n',
             b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm","content":"\\ude00!"},'
             b'"logprobs":{"content":[{"token":"x","logprob":-1}]}}]}\n\n']
    assert answer_text(b"".join(split)) == "ok \U0001f600!"


def test_a_whole_answers_text():
    ok = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}}]}
    assert message_text(ok) == "fine"
    assert message_text({"choices": [{"message": {"content": None, "tool_calls": [{"id": "t"}]}}]}) is None
    assert message_text({"choices": [ok["choices"][0], ok["choices"][0]]}) is None
    assert message_text({"choices": []}) is None and message_text([]) is None


def test_a_streams_answer_is_collected_as_it_passes_holding_little_of_the_stream(monkeypatch):
    from gateway.pipeline import relay
    monkeypatch.setattr(AnswerText, "RAW_BYTES", 300)
    monkeypatch.setattr(AnswerText, "MAX_BYTES", 2000)
    words = [f"w{i} " for i in range(40)] + ["\U0001f600"]
    raw = _sse(*(_delta(content=w) for w in words))
    seen: list[bytes] = []
    kept = relay._Kept(lambda chunk, now: seen.append(chunk) or chunk)
    reads = [raw[i:i + 37] for i in range(0, len(raw), 37)]       # reads cut anywhere, events split
    assert [kept(r, 0.0) for r in reads] == reads == seen           # what the scanner returns, unchanged
    a = kept.answer
    assert a._size <= 300 + 37 and a._parts                           # taken out as it went
    assert a.text() == "".join(words) and a.gone is None
    # a tool call after the first taking out: no text, and nothing held
    tool = AnswerText()
    for r in (raw[:400], _sse(_delta(tool_calls=[{"index": 0, "id": "t"}]))):
        tool.add(r)
    assert tool.text() is None and tool.gone == "not_text" and not tool._parts
    # past the bound: nothing more held, and why
    big = AnswerText()
    for _ in range(12):
        big.add(_sse(_delta(content="x" * 200))[:-14])
    assert big.gone == "too_long" and big.text() is None and not big._raw and not big._parts
    empty = AnswerText()
    empty.add(_sse(_delta(role="assistant")))
    assert empty.text() is None and empty.gone == "not_text"


async def test_only_a_chat_of_one_choice_is_told_its_answer_and_the_answer_is_counted():
    import orjson
    from prometheus_client import CollectorRegistry

    from gateway.endpoints import Endpoint, EndpointPool
    from gateway.kv.events import KVEventsManager
    from gateway.kv.settings import KVEventsConfig
    from gateway.request import CHAT, COMPLETIONS, parse

    registry = CollectorRegistry()
    cfg = {"on": KVEventsConfig(enabled=True), "off": KVEventsConfig(enabled=True, tokenize_answers=False)}
    tok = ModelTokenizer(TINY_DIR)
    mgr = KVEventsManager(lambda m: cfg[m], EndpointPool(), registry, {"on": tok, "off": tok}, tokenize_threads=1)
    on, off = Endpoint(url="http://a:1", model="on"), Endpoint(url="http://b:1", model="off")

    def req(path, ep, **body):
        r = parse(path, orjson.dumps({"model": ep.model, **body}), {}, "r")
        mgr.routed(r, ep)
        return r

    msgs = [{"role": "user", "content": "hi"}]
    told = req(CHAT, on, messages=msgs)
    assert told.answered is not None
    assert req(CHAT, on, messages=msgs, n=2).answered is None          # several answers
    assert req(CHAT, off, messages=msgs).answered is None              # tokenize_answers: false
    assert req(COMPLETIONS, on, prompt="hi").answered is None          # not a chat
    with structlog.testing.capture_logs() as logs:
        told.answered("fine, thanks")
        told.answered("fine, thanks!")
    said = [e for e in logs if e["event"].startswith("kv events: answers tokenized ahead")]
    assert len(said) == 1 and said[0]["before"] == "assistant\n" and said[0]["trimmed"] is False   # once a model
    told.answered(None)
    told.answered(None, "too_long")
    await asyncio.gather(*mgr._ahead)
    assert tok.is_cached(tok.answer_segment("fine, thanks"))
    told.answered("fine, thanks")                                       # the same answer again: cached

    def count(outcome):
        return registry.get_sample_value("switchyard_kv_events_answers_total", {"model": "on", "outcome": outcome})

    assert (count("tokenized"), count("not_text"), count("cached"), count("too_long")) == (2, 1, 1, 1)
    await mgr.close()
    told.answered("after the close")                                    # no thread is made again for it
    assert mgr._executor is None


async def test_a_template_not_recognized_is_said_once_and_counted(tmp_path):
    from prometheus_client import CollectorRegistry

    from gateway.endpoints import EndpointPool
    from gateway.kv.events import KVEventsManager
    from gateway.kv.settings import KVEventsConfig

    registry = CollectorRegistry()
    cfg = KVEventsConfig(enabled=True)
    mgr = KVEventsManager(lambda m: cfg, EndpointPool(), registry, {"m": _dir(tmp_path, PLAIN)}, tokenize_threads=1)
    with structlog.testing.capture_logs() as logs:
        mgr.answered("m", "fine thanks")
        mgr.answered("m", "fine thanks again")
    assert [e["log_level"] for e in logs if "not recognized" in e["event"]] == ["warning"]
    assert registry.get_sample_value("switchyard_kv_events_answers_total",
                                     {"model": "m", "outcome": "unknown_form"}) == 2
    await mgr.close()
