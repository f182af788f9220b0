"""A chat's answer is tokenized ahead of its next turn (``kv_events.tokenize_answers``): once the
gateway relayed it whole, streamed or not, the segment the chat template makes of it is tokenized
in the tokenizer thread, so the next turn, sending it back, finds it cached and keys as the engine
caches; off, nothing is tokenized ahead of it."""

from __future__ import annotations

import asyncio

import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from tests.support.http import openai_client
from tests.support.kv import events_gateway
from tests.support.metrics import metric
from tests.support.waiting import until

pytestmark = pytest.mark.integration

TOK = str(TINY_DIR)
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i} is kqz lo abc" for i in range(120))


async def _setup(sims, gateway, **kv):
    return await events_gateway(sims, gateway, TOK, **kv)


async def _ask(client, messages, stream: bool) -> tuple[str, int, int]:
    """(the answer's text, prompt tokens, cached prompt tokens) through the OpenAI SDK."""
    if stream:
        parts, usage = [], None
        out = await client.chat.completions.create(model="m", messages=messages, max_tokens=12, stream=True,
                                                   stream_options={"include_usage": True})
        async for chunk in out:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return "".join(parts), usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=12)
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [True, False])
async def test_the_next_turn_finds_the_answer_tokenized(sims, gateway, stream):
    sim, gw, kv = await _setup(sims, gateway)
    tok = kv.tokenizers["m"]
    async with openai_client(gw, "x") as client:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
        answer, _, _ = await _ask(client, messages, stream)
        assert answer
        seg = tok.answer_segment(answer)
        await until(lambda: tok.is_cached(seg))
        page = await gw.metrics_text()
        assert metric(page, "switchyard_kv_events_answers_total", model="m", outcome="tokenized") == 1
        # the next turn sends it back: it is one of that turn's segments, and not tokenized on its way
        tokenized: list[str] = []
        encode = tok._encode_one

        def spy(segment: str) -> list[int]:
            tokenized.append(segment)
            return encode(segment)

        tok._encode_one = spy
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "second question"}]
        segments = tok.segments(tok.render(messages))
        assert seg in segments
        _, prompt, cached = await _ask(client, messages, stream)
        assert seg not in tokenized
        # keyed as the engine caches: its blocks through the answer were found where they are
        assert cached >= len(tok.encode(tok.render(messages[:3]))) // 16 * 16 - 16 > 0
        assert prompt == len(tok.encode(tok.render(messages)))


async def test_off_nothing_is_tokenized_ahead_of_the_next_turn(sims, gateway):
    sim, gw, kv = await _setup(sims, gateway, tokenize_answers=False)
    tok = kv.tokenizers["m"]
    async with openai_client(gw, "x") as client:
        answer, _, _ = await _ask(client, [{"role": "user", "content": "first question"}], True)
        await asyncio.sleep(0.3)
        assert not tok.is_cached(tok.answer_segment(answer))
        assert metric(await gw.metrics_text(), "switchyard_kv_events_answers_total") == 0


async def _converse(gw, tok, turns: int, check=None) -> None:
    """``turns`` turns of one conversation through the OpenAI SDK, each answer 40 tokens sent back in
    the next turn; each answer taken ahead is awaited in the tokenizer's cache before the next turn
    (which then meets it cached), as a client's think time lets it land. ``check(turn, response,
    messages sent)`` sees each answer."""
    messages = [{"role": "system", "content": SYSTEM}]
    async with openai_client(gw, "x") as client:
        for i in range(turns):
            messages.append({"role": "user", "content": f"question number {i} about rule {i}"})
            tokenized = metric(await gw.metrics_text(), "switchyard_kv_events_answers_total", outcome="tokenized")
            r = await client.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                                     extra_body={"ignore_eos": True})
            answer = r.choices[0].message.content
            assert answer and r.usage.completion_tokens == 40
            if check is not None:
                check(i, r, messages)
            messages.append({"role": "assistant", "content": answer})
            if metric(await gw.metrics_text(), "switchyard_kv_events_answers_total", outcome="tokenized") > tokenized:
                seg = tok.answer_segment(answer)
                await until(lambda seg=seg: tok.is_cached(seg))


async def test_answers_pause_while_no_engine_holds_them(sims, gateway):
    """enginesim caches a prompt's blocks, not what it generates: each next turn finds its answer's
    first generated block held nowhere, and after ``answers_unheld_limit`` such turns the answers are
    no longer collected and tokenized ahead (one in 16 still is). The client's answers are unchanged."""
    import structlog

    sim, gw, kv = await _setup(sims, gateway, answers_unheld_limit=2)
    with structlog.testing.capture_logs() as logs:
        await _converse(gw, kv.tokenizers["m"], 5)
    page = await gw.metrics_text()
    assert metric(page, "switchyard_kv_events_answers_met_total", model="m", outcome="not_held") == 2
    assert metric(page, "switchyard_kv_events_answers_met_total", model="m", outcome="held") == 0
    assert metric(page, "switchyard_kv_events_answers_total", model="m", outcome="tokenized") == 2
    assert metric(page, "switchyard_kv_events_answers_total", model="m", outcome="paused") == 3
    assert [e for e in logs if e["event"].startswith("kv events: answers no longer tokenized ahead")]


async def test_answers_held_by_an_engine_that_caches_what_it_generates(sims, gateway):
    """enginesim with ``cache_output_blocks`` caches a block of generated tokens once it fills, as vLLM
    does, and reports it: each next turn finds its answer held, hits the cache through it, and the
    answers go on being tokenized ahead."""
    sim, gw, kv = await _setup(sims, gateway, engine={"cache_output_blocks": True}, answers_unheld_limit=2)
    tok = kv.tokenizers["m"]

    def hit_through_the_answer(turn: int, r, messages) -> None:
        if turn:    # the engine held the last turn's prompt and answer: a hit through the answer's blocks
            through = len(tok.encode(tok.render(messages[:-1])))
            assert r.usage.prompt_tokens_details.cached_tokens >= through // 16 * 16 - 16

    await _converse(gw, tok, 5, hit_through_the_answer)
    page = await gw.metrics_text()
    assert metric(page, "switchyard_kv_events_answers_met_total", model="m", outcome="held") == 4
    assert metric(page, "switchyard_kv_events_answers_met_total", model="m", outcome="not_held") == 0
    assert metric(page, "switchyard_kv_events_answers_total", model="m", outcome="tokenized") == 5
    assert metric(page, "switchyard_kv_events_answers_total", model="m", outcome="paused") == 0
