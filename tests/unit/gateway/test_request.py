"""Request parsing: every shape OpenAI accepts, and a clear 400 for everything else."""

import orjson
import pytest

from gateway.errors import GatewayError
from gateway.request import CHAT, COMPLETIONS, EMBEDDINGS, parse, request_id_from
from tests.support.fork import drawn_in_child


def p(path, obj, headers=None):
    body = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return parse(path, body, headers or {}, "rid-1")


def test_chat_with_string_and_parts_content():
    r = p(CHAT, {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"},
                                     {"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"role": "assistant", "content": None, "tool_calls": []}],
        "stream": True, "stream_options": {"include_usage": True}, "unknown_field": 1})
    assert r.model == "m" and r.stream and r.include_usage
    assert "be brief" in r.prompt_text and "hello" in r.prompt_text
    assert r.prompt_text.index("be brief") < r.prompt_text.index("hello")
    assert r.prompt_tokens_est >= 1
    assert r.multimodal                     # the image part: not keyed like the engine (gateway/kv/index.py)


@pytest.mark.parametrize("messages,prompt,media", [
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "system\nbe brief\nuser\nhi", False),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []}], "user\nhi\nassistant\n", False),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "user\nhi\nassistant\n", False),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}], "user\na", True),
])
def test_a_chat_prompt_is_each_messages_role_and_text_in_order(messages, prompt, media):
    r = p(CHAT, {"model": "m", "messages": messages})
    assert r.prompt_text == prompt and r.multimodal is media


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": "hi"}, "hi"], "messages[1]"),
    ([{"role": "user", "content": "hi"}, {"role": 3, "content": "x"}], "messages[1].role"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_a_chat_message_of_another_shape_is_refused_by_name(messages, param):
    with pytest.raises(GatewayError) as e:
        p(CHAT, {"model": "m", "messages": messages})
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("kind,media", [("text", False), ("refusal", False), ("input_audio", True),
                                        ("video_url", True), (None, True)])
def test_chat_parts_other_than_text_make_the_request_multimodal(kind, media):
    part = {"type": kind, "text": "x"} if kind else {"text": "x"}
    r = p(CHAT, {"model": "m", "messages": [{"role": "user", "content": [part]}]})
    assert r.multimodal is media
    assert not p(CHAT, {"model": "m", "messages": [{"role": "user", "content": "plain"}]}).multimodal


@pytest.mark.parametrize("prompt,tokens", [("a b c d e f g h", None), (["one", "two"], None),
                                           ([1, 2, 3], 3), ([[1, 2], [3]], 3)])
def test_completion_prompt_shapes(prompt, tokens):
    r = p(COMPLETIONS, {"model": "m", "prompt": prompt})
    if tokens is not None:
        assert r.prompt_tokens_est == tokens


@pytest.mark.parametrize("path,obj,choices", [
    (CHAT, {}, 1), (CHAT, {"n": 2}, 2), (CHAT, {"n": None}, 1), (CHAT, {"n": "3"}, 3), (CHAT, {"n": 128}, 128),
    (COMPLETIONS, {"prompt": "a"}, 1), (COMPLETIONS, {"prompt": [1, 2, 3], "n": 2}, 2),
    (COMPLETIONS, {"prompt": ["a", "b", "c"]}, 3), (COMPLETIONS, {"prompt": [[1], [2]], "n": 2}, 4)])
def test_the_choices_an_answer_carries(path, obj, choices):
    """``n``, times the prompts of a completion's batch: the relay reads a stream of several apart."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {}
    assert p(path, {"model": "m", **base, **obj}).choices == choices


def test_a_completion_of_prompt_embeds():
    """vLLM's prompt_embeds in the place of a prompt: no text, one choice per tensor of a list."""
    one = p(COMPLETIONS, {"model": "m", "prompt_embeds": "AAAA"})
    assert one.prompt_text == "" and one.prompt_tokens_est == 1 and one.choices == 1
    assert p(COMPLETIONS, {"model": "m", "prompt": None, "prompt_embeds": ["A", "B"], "n": 2}).choices == 4


def test_embeddings_shapes():
    assert p(EMBEDDINGS, {"model": "e", "input": "hi"}).model == "e"
    assert p(EMBEDDINGS, {"model": "e", "input": [[1, 2, 3]]}).prompt_tokens_est == 3
    # vLLM's chat embeddings: a chat's messages in the place of input, read as a chat's
    chat = p(EMBEDDINGS, {"model": "e", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a photo"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert chat.prompt_text == "user\na photo" and chat.multimodal
    assert p(EMBEDDINGS, {"model": "e", "input": None, "messages": [{"role": "user", "content": "x"}]}).prompt_text


@pytest.mark.parametrize("path,obj,param", [
    (CHAT, b"{not json", None),
    (CHAT, b"[1,2]", None),
    (CHAT, {"messages": [{"role": "user", "content": "x"}]}, "model"),
    (CHAT, {"model": "", "messages": [{"role": "user", "content": "x"}]}, "model"),
    (CHAT, {"model": 5, "messages": []}, "model"),
    (CHAT, {"model": "m", "messages": []}, "messages"),
    (CHAT, {"model": "m"}, "messages"),
    (CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "maybe"}, "stream"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"model": "m"}, "prompt"),
    (COMPLETIONS, {"model": "m", "prompt": [1, "a"]}, "prompt"),
    (COMPLETIONS, {"model": "m", "prompt": []}, "prompt"),
    (EMBEDDINGS, {"model": "m"}, "input"),
])
def test_bad_input_is_a_400_naming_the_param(path, obj, param):
    with pytest.raises(GatewayError) as ei:
        p(path, obj)
    assert ei.value.status == 400
    assert ei.value.param == param
    body = ei.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


def test_user_and_session_headers():
    r = p(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "bob"},
          {"x-session-id": "abc"})
    assert r.user == "bob" and r.session_id == "abc"
    assert p(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, {"user": "al"}).user == "al"


def test_request_id_kept_when_sane():
    assert request_id_from("abc-123_x.y:z") == "abc-123_x.y:z"
    for bad in (None, "", "has space", "x" * 200, "new\nline", "ünï"):
        rid = request_id_from(bad)
        assert rid != bad and len(rid) == 32


def test_request_ids_of_a_forked_worker_are_its_own():
    """Two workers forked from one parent draw different ids (each had the parent's generator)."""
    child = drawn_in_child(lambda: request_id_from(None))
    mine = [request_id_from(None) for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(mine)
    assert child != drawn_in_child(lambda: request_id_from(None))   # a restarted worker's too


@pytest.mark.parametrize("path,obj", [
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    (COMPLETIONS, {"model": "m", "prompt": "hi"}),
    (EMBEDDINGS, {"model": "m", "input": "hi"}),
])
def test_slo_headers_are_the_request_objectives(path, obj):
    ireq = p(path, obj, {"x-slo-ttft-ms": "250", "x-slo-tpot-ms": " 12.5 "})
    assert (ireq.slo_ttft_ms, ireq.slo_tpot_ms) == (250.0, 12.5)
    ireq = p(path, obj, {"x-slo-ttft-ms": "1e3"})
    assert (ireq.slo_ttft_ms, ireq.slo_tpot_ms) == (1000.0, None)
    assert (p(path, obj).slo_ttft_ms, p(path, obj).slo_tpot_ms) == (None, None)


@pytest.mark.parametrize("header,value", [("x-slo-ttft-ms", "fast"), ("x-slo-ttft-ms", "0"),
                                          ("x-slo-tpot-ms", "-3"), ("x-slo-tpot-ms", "nan"),
                                          ("x-slo-ttft-ms", "inf"), ("x-slo-tpot-ms", "")])
def test_a_bad_slo_header_is_a_400_naming_it(header, value):
    with pytest.raises(GatewayError) as ei:
        p(CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, {header: value})
    e = ei.value
    assert e.status == 400 and e.param == header and header in e.message
    assert orjson.loads(e.body_bytes())["error"]["param"] == header
