"""Fuzzing the request path end to end: random JSON in every field of chat and completions
bodies, byte-level damage, deep nesting, invalid UTF-8, odd header values.

Properties, for every example: the client gets an answer before the connection closes; never a
5xx of the gateway's making; an OpenAI-shaped error (with ``request-id``) whenever the status is
not 200; and the engine only ever receives bodies that are one valid JSON object.

The gateway and its engine run on a loop in a background thread for the whole module, so that
hypothesis drives plain blocking sockets and each example costs one loopback round trip. Under
``CI=true`` the examples are derandomized; local runs keep exploring.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import orjson
import pytest
import uvloop
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from enginesim import SimConfig, start_sim
from gateway.config.schema import config_from_dict
from gateway.server.run import start
from tests.support.edge import Exchange, assert_openai_error, request, roundtrip

FUZZ = settings(max_examples=int(os.environ.get("EDGE_FUZZ_EXAMPLES", "80")), deadline=None,
                derandomize=os.environ.get("CI") == "true",
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class Live:
    """A gateway in front of one simulated engine, on uvloop (what ``python -m gateway`` runs on)
    in a background thread."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="edge-fuzz-loop", daemon=True)
        self.thread.start()

        async def up():
            sim = await start_sim(SimConfig(engine="vllm", model="m", port=0, host="127.0.0.1", ttft_base_ms=0.0,
                                            prefill_ms_per_token=0.0, itl_ms=0.0, max_model_len=512,
                                            default_max_tokens=8))
            cfg = config_from_dict({"listen": {"host": "127.0.0.1", "port": 0},
                                    "health": {"interval_s": 60.0}, "scrape": {"interval_s": 60.0},
                                    "server": {"shutdown_grace_s": 1.0, "max_body_bytes": 1 << 20},
                                    "models": [{"name": "m", "engine": "vllm", "endpoints": [sim.url]}]})
            runner, _app, port = await start(cfg)
            return sim, runner, port

        self.sim, self.runner, self.port = self.run(up())
        self.sim_port = self.sim.port

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.runner.cleanup())
        self.run(self.sim.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def engine_received(self) -> list[dict]:
        ex = roundtrip(self.sim_port, request("GET", "/_sim/state", close=True))
        return [r for r in ex.first.json()["received"] if r["method"] != "GET"]


@pytest.fixture(scope="module")
def live():
    lv = Live()
    yield lv
    try:
        text = roundtrip(lv.port, request("GET", "/metrics", close=True)).first.body.decode()
        busy = [line for line in text.splitlines()
                if line.startswith(("switchyard_in_flight_requests{", "switchyard_endpoint_in_flight_requests{"))
                and float(line.rsplit(" ", 1)[1]) != 0.0]
        assert not busy, f"requests still in flight after the fuzz run: {busy}"
    finally:
        lv.close()


def check(live: Live, ex: Exchange, sent: bytes) -> None:
    assert ex.responses, f"connection closed without an answer (reset={ex.reset}) for {sent[:300]!r}"
    resp = ex.first
    if resp.status >= 500:
        # the simulator refuses what it does not model (n > 1, batched prompts) with 501, and the
        # gateway rightly passes an engine's answer through; anything else is the gateway's fault
        err = assert_openai_error(resp)
        assert resp.status == 501 and "enginesim" in err["message"], (resp.status, resp.body[:300], sent[:300])
    elif resp.status != 200:
        assert_openai_error(resp)
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        for frame in resp.body.split(b"\n\n"):
            if frame.startswith(b"data: ") and frame != b"data: [DONE]":
                event = orjson.loads(frame[6:])
                if "error" in event:
                    assert set(event["error"]) >= {"message", "type"}, event
    else:
        orjson.loads(resp.body)
    bad = [r for r in live.engine_received() if not r["json_object"]]
    assert not bad, f"the engine received a body that is not one JSON object: {bad}"


def send(live: Live, path: str, body: bytes, headers: dict[str, str] | None = None) -> None:
    raw = request("POST", path, body, headers, close=True)
    check(live, roundtrip(live.port, raw), raw)


# -- strategies ------------------------------------------------------------------------------------

ints = st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64, 2**70, -(2**63)]))
leaves = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=20))
json_values = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=3), max_leaves=10)


def field(plausible):
    """Mostly a value the engine accepts (so that examples reach it), sometimes any JSON at all."""
    return st.integers(0, 9).flatmap(lambda i: json_values if i == 7 else plausible)


MODELS = ["m"] * 12 + ["unknown-model", "\u0000", "m\r\nx-injected: 1", "\u202e\U0001f600", " m", "M", ""]
part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": field(st.text(max_size=30))}),
                 st.fixed_dictionaries({"type": st.just("image_url"),
                                        "image_url": field(st.fixed_dictionaries({"url": st.text(max_size=20)}))}),
                 json_values)
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "system", "assistant", "tool", "developer"])),
     "content": field(st.one_of(st.text(max_size=60), st.lists(part, max_size=3)))},
    optional={"name": field(st.text(max_size=8)), "tool_calls": json_values})
# n > 1 is refused by the simulator (501), so only n's junk and 1 are drawn
n_values = st.one_of(st.just(1), json_values.filter(lambda v: not (isinstance(v, int | float) and v > 1)))
OPTIONAL = {
    "stream": field(st.booleans()),
    "max_tokens": field(st.integers(-2, 64)),
    "max_completion_tokens": field(st.integers(-2, 64)),
    "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(0, 1)),
    "n": n_values,
    "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
    "user": field(st.text(max_size=12)),
    "seed": field(ints),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5)),
    "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
    "tools": json_values,
    "tool_choice": json_values,
    "ignore_eos": field(st.booleans()),
    "kv_transfer_params": json_values,
    "bootstrap_room": json_values,
}
chat_bodies = st.builds(
    lambda base, extra: {**extra, **base},
    st.fixed_dictionaries({"model": field(st.sampled_from(MODELS)),
                           "messages": field(st.lists(message, min_size=1, max_size=3))}, optional=OPTIONAL),
    st.dictionaries(st.text(max_size=10), json_values, max_size=2))
prompts = field(st.one_of(st.text(max_size=60), st.lists(st.text(max_size=10), min_size=1, max_size=1),
                          st.lists(st.integers(0, 50_000), min_size=1, max_size=8)))
completion_bodies = st.builds(
    lambda base, extra: {**extra, **base},
    st.fixed_dictionaries({"model": field(st.sampled_from(MODELS)), "prompt": prompts},
                          optional={"echo": field(st.booleans()), "suffix": json_values, **OPTIONAL}),
    st.dictionaries(st.text(max_size=10), json_values, max_size=2))
header_text = st.one_of(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
                        st.sampled_from(["random", "least-request", "prefix-cache:2,random:1", "nope", ""]),
                        # any text a client can write on a header line (as UTF-8: no lone surrogate,
                        # which one seed drew and the test's own client could not encode)
                        st.text(st.characters(exclude_characters="\r\n", exclude_categories=("Cs",)), max_size=20))


def dumps(value, ascii_only: bool) -> bytes:
    """JSON as a client library might write it: NaN/Infinity literals pass, and with
    ``ascii_only`` False lone surrogates become invalid UTF-8."""
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")


# -- tests ---------------------------------------------------------------------------------------------

@FUZZ
@given(body=st.one_of(chat_bodies, chat_bodies, chat_bodies, chat_bodies, json_values), ascii_only=st.booleans(),
       headers=st.fixed_dictionaries({}, optional={"routing-strategy": header_text, "x-request-id": header_text,
                                                   "user": header_text, "x-session-id": header_text}))
@example(body={"model": "\u0000", "messages": [{"role": "user", "content": "hi"}]}, ascii_only=True, headers={})
@example(body={"model": "m\r\nx-injected: 1", "messages": []}, ascii_only=True, headers={})
@example(body={"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}, ascii_only=False, headers={})
@example(body={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
               "stream_options": {"include_usage": True}}, ascii_only=True, headers={})
def test_chat_bodies_with_random_json_in_every_field(live, body, ascii_only, headers):
    send(live, CHAT, dumps(body, ascii_only), headers)


@FUZZ
@given(body=st.one_of(completion_bodies, completion_bodies, completion_bodies, json_values), ascii_only=st.booleans())
@example(body={"model": "m", "prompt": "hi", "max_tokens": 2**64}, ascii_only=True)
@example(body={"model": "\u0000", "prompt": "hi"}, ascii_only=True)
def test_completion_bodies_with_random_json_in_every_field(live, body, ascii_only):
    send(live, COMPLETIONS, dumps(body, ascii_only))


VALID = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2})
INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe2\x82"]


@st.composite
def damaged_bodies(draw) -> bytes:
    body = bytearray(draw(st.sampled_from([VALID, dumps({"model": "m", "prompt": "hi", "max_tokens": 1}, True)])))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "utf8", "nul"]))
        pos = draw(st.integers(0, max(0, len(body) - 1)))
        if op == "flip" and body:
            body[pos] = draw(st.integers(0, 255))
        elif op == "truncate":
            del body[pos:]
        elif op == "insert":
            body[pos:pos] = draw(st.binary(min_size=1, max_size=6))
        elif op == "delete" and body:
            del body[pos:pos + draw(st.integers(1, 4))]
        elif op == "utf8":
            body[pos:pos] = draw(st.sampled_from(INVALID_UTF8))
        elif op == "nul":
            body[pos:pos] = b"\x00"
    return bytes(body)


@FUZZ
@given(body=damaged_bodies(), path=st.sampled_from([CHAT, COMPLETIONS]))
@example(body=b"\xef\xbb\xbf" + VALID, path=CHAT)
@example(body=VALID.replace(b"hello there", b"hello \xed\xa0\x80 there"), path=CHAT)
@example(body=b'{"model":"m","model":"unknown","messages":[{"role":"user","content":"x"}]}', path=CHAT)
@example(body=b'{"model":"m","prompt":"x","max_tokens":1e400}', path=COMPLETIONS)
@example(body=b"", path=CHAT)
def test_byte_level_damage(live, body, path):
    send(live, path, body)


@pytest.mark.parametrize("depth", [64, 1000, 1100, 20_000, 200_000])
@pytest.mark.parametrize("shape", ["list", "dict"])
def test_deep_nesting(live, depth, shape):
    if shape == "list":
        nested = b"[" * depth + b"]" * depth
    else:
        nested = b'{"a":' * depth + b"1" + b"}" * depth
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":1,"metadata":' + nested + b"}"
    send(live, CHAT, body)
    send(live, CHAT, nested)
