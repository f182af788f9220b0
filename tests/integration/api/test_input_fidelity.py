"""What the gateway refuses of a client's input before routing, whichever path the request takes.

A client's integer past 64 bits is a 400 naming the field, sent by a real client on real sockets,
and no engine sees the request. The same input gets the same answer whether or not the gateway
re-encodes the body (a stream the gateway asks usage for, an alias).
"""

from __future__ import annotations

import openai
import orjson
import pytest

from tests.support.factories import model_block
from tests.support.http import openai_client, post, sim_state

MSGS = [{"role": "user", "content": "Tell me about switchyards and trains."}]
BIG = 123456789012345678901234567890          # past 64 bits: orjson reads it as a float


@pytest.fixture
async def fleet(sims, gateway):
    v = await sims("vllm", "m")
    s = await sims("sglang", "qwen")
    gw = await gateway([model_block("m", "vllm", [v.url]), model_block("qwen", "sglang", [s.url])],
                       aliases=[{"name": "chat", "targets": [{"model": "m"}]}])
    return gw, v, s


async def posts_seen(*sims) -> list[dict]:
    return [r for sim in sims for r in (await sim_state(sim.url))["received"] if r["method"] == "POST"]


def raw_body(fields: str, model: str = "m", stream: str = "") -> bytes:
    """A chat body with ``fields`` written as the client wrote them (digits kept: no JSON encoder)."""
    return (f'{{"model": "{model}", "messages": {orjson.dumps(MSGS).decode()}, "max_tokens": 2'
            f'{stream}, {fields}}}').encode()


# the body as sent, on the fast path (its bytes forwarded), a stream the gateway asks usage for (re-encoded)
# and an alias's (re-encoded with the target's name)
PATHS = [("m", ""), ("m", ', "stream": true'), ("chat", ""), ("qwen", ', "stream": true')]


@pytest.mark.parametrize("model,stream", PATHS)
@pytest.mark.parametrize("seed", [str(BIG), str(-BIG), str(1 << 64), str(1 << 63), str(-(1 << 63) - 1)])
async def test_a_seed_past_64_bits_is_refused_on_every_path(fleet, model, stream, seed):
    gw, v, s = fleet
    r = await post(gw, raw_body(f'"seed": {seed}', model, stream))
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == "seed" and err["code"] == "integer_out_of_range", err
    assert err["type"] == "invalid_request_error" and "64-bit" in err["message"], err
    assert await posts_seen(v, s) == []


@pytest.mark.parametrize("model,stream", PATHS)
async def test_a_seed_within_64_bits_is_served_on_every_path(fleet, model, stream):
    gw, v, s = fleet
    for seed in ((1 << 63) - 1, -(1 << 63), 0):
        r = await post(gw, raw_body(f'"seed": {seed}', model, stream))
        assert r.status == 200, r.body
    assert len(await posts_seen(v, s)) == 3


async def test_the_openai_sdk_sees_a_seed_past_64_bits_refused(fleet):
    gw, v, s = fleet
    client = openai_client(gw)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ei:
            await client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, seed=BIG, stream=stream)
        assert ei.value.param == "seed" and ei.value.code == "integer_out_of_range"
        with pytest.raises(openai.BadRequestError) as ei:
            await client.completions.create(model="m", prompt="Once", max_tokens=2, seed=1 << 64, stream=stream)
        assert ei.value.param == "seed" and ei.value.code == "integer_out_of_range"
    assert await posts_seen(v, s) == []


@pytest.mark.parametrize("model,stream", PATHS)
async def test_a_count_past_64_bits_says_so_on_every_path(fleet, model, stream):
    gw, v, s = fleet
    for key in ("max_tokens", "n", "max_completion_tokens"):
        body = raw_body(f'"{key}": {BIG}', model, stream).replace(b'"max_tokens": 2, ', b"")
        r = await post(gw, body)
        assert r.status == 400, r.body
        err = r.json()["error"]
        assert err["param"] == key and err["code"] == "integer_out_of_range", err
    assert await posts_seen(v, s) == []
