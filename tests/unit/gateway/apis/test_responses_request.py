"""Parsing /v1/responses bodies and replaying a gateway-held history."""

from __future__ import annotations

import orjson
import pytest

from gateway.apis.responses_request import RESPONSES, output_as_input, parse_responses, with_history
from gateway.errors import GatewayError


def parse(body) -> object:
    return parse_responses(RESPONSES, orjson.dumps(body), {}, "rid")


def test_prompt_text_is_instructions_then_input():
    r = parse({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call_output", "call_id": "c", "output": "42"}]})
    assert r.prompt_text == "Be brief.\nuser\nHi\n42"
    assert r.include_usage and not r.stream and r.prompt_tokens_est >= 1


def test_a_tool_output_given_as_content_parts_is_counted_as_its_text():
    """A function_call_output's output may be a list of content parts (input_text, an image, a
    file): their text is the prompt's, counted in the estimate as a string output is."""
    r = parse({"model": "m", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c",
         "output": [{"type": "input_text", "text": "Sunny, " + "warm " * 200}, {"type": "input_image", "image_url": "x"},
                    "not a part", {"type": "input_text", "text": 3}]}]})
    assert r.prompt_text == "user\nWeather?\n{}\nSunny, " + "warm " * 200
    assert r.prompt_tokens_est >= 250


@pytest.mark.parametrize("body,param", [
    ({"model": "m"}, "input"), ({"model": "m", "input": []}, "input"), ({"model": "m", "input": 1}, "input"),
    ({"model": "m", "input": ["x"]}, "input[0]"), ({"model": "m", "input": "x", "stream": "maybe"}, "stream"),
    ({"model": "m", "input": "x", "instructions": 1}, "instructions"),
    ({"model": "m", "input": "x", "store": 2}, "store"),
    ({"model": "m", "input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"model": "m", "input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "x"}, "model"),
])
def test_bad_bodies_name_the_parameter(body, param):
    with pytest.raises(GatewayError) as ei:
        parse(body)
    assert ei.value.status == 400 and ei.value.param == param


def test_history_replay_rewrites_the_body():
    r = parse({"model": "m", "input": "and now?", "previous_response_id": "resp_1", "store": True, "x": 1})
    history = [{"role": "user", "content": "hello"}] + output_as_input([
        {"type": "reasoning", "content": []},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "hi "}, {"type": "output_text", "text": "there"}]},
        {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c", "status": "completed"}])
    full = with_history(r, history)
    sent = orjson.loads(r.body)
    assert sent["input"] == full == [{"role": "user", "content": "hello"},
                                     {"role": "assistant", "content": "hi there"},
                                     {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"},
                                     {"role": "user", "content": "and now?"}]
    assert "previous_response_id" not in sent and sent["store"] is False and sent["x"] == 1
    assert r.prompt_text.startswith("user\nhello\nassistant\nhi there")
