"""Arbitrary JSON in every field the request parsers read: the bodies, the fields, the generators.

Shared by the parser-level property test (tests/unit/gateway/test_request_fuzz.py) and the
end-to-end one (tests/integration/api/test_request_values.py). A case is an API's path, a valid body
for it, and the positions in that body the parser reads (top-level fields and nested ones: a
message, its content, a content part, its type and text, ...). A generated request is the body with
one position replaced by an arbitrary JSON value.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Case:
    api: str                 # "openai", "anthropic": how an error names the field
    path: str                # the URL path
    body: dict[str, Any]
    fields: tuple[Path, ...]


CHAT_BODY = {"model": "m", "max_tokens": 5, "max_completion_tokens": 5, "n": 1, "best_of": 1, "user": "u", "seed": 7,
             "stream": True, "stream_options": {"include_usage": True},
             "messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "hello"},
                                                       {"type": "image_url", "image_url": {"url": "data:x"}}]}]}
MESSAGES_BODY = {"model": "m", "max_tokens": 5, "stream": True, "metadata": {"user_id": "u"}, "temperature": 0.5,
                 "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                 "system": [{"type": "text", "text": "be brief"}],
                 "messages": [{"role": "user", "content": [
                     {"type": "text", "text": "hello"},
                     {"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}]}
RESPONSES_BODY = {"model": "m", "instructions": "be brief", "stream": True, "store": True, "background": False,
                  "max_output_tokens": 5, "previous_response_id": "resp_1", "user": "u", "temperature": 1.5,
                  "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                  "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
                            {"type": "function_call_output", "call_id": "c1", "output": "42"}]}

CASES: tuple[Case, ...] = (
    Case("openai", "/v1/chat/completions", CHAT_BODY, (
        (), ("model",), ("messages",), ("messages", 0), ("messages", 1), ("messages", 0, "role"),
        ("messages", 0, "content"), ("messages", 1, "content"), ("messages", 1, "content", 0),
        ("messages", 1, "content", 0, "type"), ("messages", 1, "content", 0, "text"),
        ("messages", 1, "content", 1), ("messages", 1, "content", 1, "type"), ("stream",), ("stream_options",),
        ("stream_options", "include_usage"), ("max_tokens",), ("max_completion_tokens",), ("n",), ("best_of",),
        ("user",), ("seed",))),
    Case("openai", "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 5, "n": 1, "best_of": 1,
                                         "stream": True, "stream_options": {"include_usage": False}},
         (("model",), ("prompt",), ("max_tokens",), ("n",), ("best_of",), ("stream",), ("stream_options",),
          ("stream_options", "include_usage"))),
    Case("openai", "/v1/completions", {"model": "m", "prompt": [[1, 2], [3]], "stream": False},
         (("prompt", 0), ("prompt", 0, 1), ("prompt", 1, 0))),
    Case("openai", "/v1/embeddings", {"model": "m", "input": ["a", "b"]},
         (("model",), ("input",), ("input", 0), ("stream",), ("max_tokens",), ("n",), ("user",))),
    Case("openai", "/v1/embeddings", {"model": "m", "input": [[1, 2]]}, (("input", 0), ("input", 0, 0))),
    Case("openai", "/v1/responses", RESPONSES_BODY, (
        (), ("model",), ("input",), ("input", 0), ("input", 0, "role"), ("input", 0, "content"),
        ("input", 0, "content", 0), ("input", 0, "content", 0, "text"), ("input", 1), ("input", 1, "output"),
        ("instructions",), ("stream",), ("store",), ("background",), ("max_output_tokens",),
        ("previous_response_id",), ("user",), ("temperature",), ("tools",), ("tools", 0), ("tools", 0, "type"),
        ("tools", 0, "name"), ("tools", 0, "parameters"))),
    Case("anthropic", "/v1/messages", MESSAGES_BODY, (
        (), ("model",), ("max_tokens",), ("stream",), ("system",), ("system", 0), ("system", 0, "text"),
        ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
        ("messages", 0, "content", 0), ("messages", 0, "content", 0, "type"), ("messages", 0, "content", 0, "text"),
        ("messages", 0, "content", 1), ("messages", 0, "content", 1, "content"), ("metadata",),
        ("metadata", "user_id"), ("temperature",), ("tools",), ("tools", 0), ("tools", 0, "type"),
        ("tools", 0, "name"), ("tools", 0, "input_schema"))),
    Case("anthropic", "/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
         (("model",), ("messages",), ("messages", 0, "content"), ("stream",), ("max_tokens",))),
    Case("openai", "/v1/rerank", {"model": "m", "query": "q", "documents": ["a", {"text": "b"}]},
         ((), ("model",), ("query",), ("documents",), ("documents", 0), ("documents", 1, "text"), ("stream",),
          ("user",))),
    Case("openai", "/v1/score", {"model": "m", "text_1": "a", "text_2": ["b", "c"]},
         (("model",), ("text_1",), ("text_2",), ("text_2", 0))),
    Case("openai", "/tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
         (("model",), ("prompt",), ("messages",), ("messages", 0), ("messages", 0, "content"))),
    Case("openai", "/detokenize", {"model": "m", "tokens": [1, 2]}, (("model",), ("tokens",), ("tokens", 0))),
)


def with_value(body: dict[str, Any], path: Path, value: Any) -> Any:
    """A copy of ``body`` with ``value`` at ``path`` (``()``: the whole body is ``value``)."""
    if not path:
        return value
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def field_name(api: str, path: Path) -> str:
    """How an error of ``api`` names the field at ``path``: ``messages[1].content[0].type`` in an
    OpenAI ``param``, ``messages.0.content.0.type`` at the head of an Anthropic message."""
    if api == "anthropic":
        return ".".join(str(k) for k in path)
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def names(named: str, field: str, sep: str) -> bool:
    """``named`` is ``field`` or a position inside it."""
    return named == field or named.startswith(field + ".") or (sep == "[" and named.startswith(field + "["))


# JSON scalars the way engines meet them: ints within 64 bits (orjson's range), any finite float
# (huge ones too), and strings that often look like numbers or booleans
_WORDS = ("true", "false", "True", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0", "5", "5.0", " 5 ",
          "5.5", "1_000", "-1", "+5", "1e3", "inf", "nan", "", "text", "image_url", "input_text", "user")
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
           | st.sampled_from((0, 1, -1, 2, 5)) | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from((0.0, 1.0, 5.0, 5.5, -1.0, 1e300, 1e19)) | st.sampled_from(_WORDS) | st.text(max_size=8))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(("type", "text", "role", "content", "x")) | st.text(max_size=4),
                                             inner, max_size=3), max_leaves=6)


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """One arbitrary JSON value from a seeded generator (for the end-to-end test, which cannot
    hand each example to hypothesis)."""
    kind = rng.randrange(10 if depth < 2 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice((0, 1, -1, 5, 1 << 62, -(1 << 63)))
    if kind == 3:
        return rng.choice((0.0, 1.0, 5.0, 5.5, -1.0, 1e300, rng.uniform(-1e6, 1e6)))
    if kind in (4, 5, 6):
        return rng.choice(_WORDS)
    if kind in (7, 8):
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(("type", "text", "role", "content", "x")): random_json(rng, depth + 1)
            for _ in range(rng.randrange(3))}
