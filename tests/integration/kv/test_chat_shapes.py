"""A plain chat keyed on KV events is put together from its shape (``kv_events.chat_shapes``), not
rendered with the chat template for every request: through the OpenAI SDK, two conversations' turns
are keyed as the engine caches them (the second's from the shapes the first met) and counted by how
their prompt was made; off, every chat is rendered."""

from __future__ import annotations

import pytest

from enginesim.tiny_tokenizer import TINY_DIR
from tests.support.http import openai_client
from tests.support.kv import events_gateway
from tests.support.metrics import metric

pytestmark = pytest.mark.integration

TOK = str(TINY_DIR)
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i} is kqz lo abc" for i in range(120))


async def _conversation(client, tok, turns: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached prompt tokens) of each turn of one conversation."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question number {i} about kqz"})
        r = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
        assert r.usage.prompt_tokens == len(tok.encode(tok.render(messages)))
        out.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return out


@pytest.mark.parametrize("shapes", [True, False])
async def test_a_conversation_is_keyed_from_its_shape(sims, gateway, shapes):
    _, gw, kv = await events_gateway(sims, gateway, TOK, chat_shapes=shapes)
    tok = kv.tokenizers["m"]
    made: list[tuple[list[str] | None, list[str]]] = []
    shape = tok.chat_segments

    def spy(messages):
        got = shape(messages)
        made.append((got, tok.segments(tok.render(messages))))
        return got

    tok.chat_segments = spy
    async with openai_client(gw, "x") as client:
        # a second conversation: its turns' shapes were met once already, so they are put together
        conversations = [await _conversation(client, tok, 4) for _ in range(2)]
    # each turn the gateway put together (the second conversation's) was the template's own; the
    # first conversation's turns, each a shape met for the first time, were rendered
    assert sum(got is not None for got, _ in made) >= 3 if shapes else not made
    assert all(got is None or got == rendered for got, rendered in made)
    # every later turn of a conversation found the earlier turn's blocks on the engine
    for turns in conversations:
        for (before, _), (_, cached) in zip(turns, turns[1:], strict=False):
            assert cached >= before // 16 * 16 - 16
    page = await gw.metrics_text()
    by_shape = metric(page, "switchyard_kv_events_chat_renders_total", model="m", how="shape") or 0
    rendered = metric(page, "switchyard_kv_events_chat_renders_total", model="m", how="template") or 0
    assert metric(page, "switchyard_kv_events_chat_renders_total", model="m", how="mismatch") == 0
    if shapes:
        assert by_shape >= 4 and rendered >= 4 and tok.renders["shape"] == by_shape
    else:
        assert by_shape == 0 and rendered >= 4 and tok.shapes_off
