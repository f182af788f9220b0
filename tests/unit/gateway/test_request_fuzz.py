"""Arbitrary JSON in every field a request parser reads: never a 5xx, and a 400 names the field.

Every API the gateway parses (chat, completions, embeddings, Responses, Messages and its
count_tokens, the JSON pass-through ones) is fed its valid body with one position replaced by an
arbitrary JSON value (null, booleans, ints, huge floats, strings that look like numbers or
booleans, lists and objects, nested): a top-level field, a message, its content, a content part,
its type and text, a prompt's token list, an input item, ... (``tests/support/request_fuzz.py``).

Properties, for every example:

- the parser answers: an ``InferenceRequest``, or a ``GatewayError`` with status 400; nothing
  else escapes (a ``TypeError`` from a list where a string was expected was a 500);
- the error names the field: the OpenAI ``param`` (``messages[1].content[0].type``), or the
  head of an Anthropic message (``messages.0.content.0.type: ...``), is the replaced position or
  a position inside it, or, when the replaced position is an object's ``type``, a field of that
  object (the new type asks for fields the object lacks). Two exceptions: a falsy ``stream`` next to ``stream_options`` is an error
  naming ``stream_options``, the field whose condition failed (vLLM's check); and an item of a
  completions ``prompt`` or an embeddings ``input`` that fits none of the list types the field
  takes is an error naming the whole list, as the engines' union types report it;
- what the parser accepted is typed as later stages expect: ``stream`` a bool, the token limits
  and ``n`` ints (a coerced value is written back into the parsed body), and the parsed body can
  still be encoded (a stage that rewrites the body re-encodes it).

Each case runs ``REQUEST_FUZZ_EXAMPLES`` examples (default 120; the twelve cases make 1,440
generated requests, a few seconds). Under ``CI=true`` the examples are derandomized.
"""

from __future__ import annotations

import os

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.apis.anthropic import AnthropicApi
from gateway.apis.passthrough import PassthroughApi
from gateway.apis.responses_request import parse_responses
from gateway.endpoints import EndpointPool
from gateway.errors import GatewayError
from gateway.request import parse
from tests.support.request_fuzz import CASES, JSON_VALUES, Case, field_name, names, with_value

EXAMPLES = int(os.environ.get("REQUEST_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=os.environ.get("CI") == "true",
                suppress_health_check=[HealthCheck.too_slow])

# a prompt or an input is one of several list types (strings, token ids, lists of token ids): an
# item that fits none makes the whole list refused, and the error names the list
UNIONS = {"/v1/completions": ("prompt",), "/v1/embeddings": ("input",)}

# the fields later stages read as ints and bools (continuation budgets, P/D bodies, the relay)
TYPED_INTS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens", "n"),
              "/v1/completions": ("max_tokens", "n"), "/v1/messages": ("max_tokens",),
              "/v1/responses": ("max_output_tokens",)}
TYPED_BOOLS = {"/v1/chat/completions": ("stream",), "/v1/completions": ("stream",), "/v1/messages": ("stream",),
               "/v1/responses": ("stream", "store", "background")}

_ANTHROPIC = AnthropicApi(EndpointPool())
_PASSTHROUGH = PassthroughApi(EndpointPool())


def parser_for(path: str):
    if path.startswith("/v1/messages"):
        return _ANTHROPIC.parse
    if path == "/v1/responses":
        return parse_responses
    if path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        return parse
    return _PASSTHROUGH.parse


def check(case: Case, field: tuple, value) -> None:
    body = orjson.dumps(with_value(case.body, field, value))
    try:
        ireq = parser_for(case.path)(case.path, body, {}, "rid")
    except GatewayError as e:
        assert e.status == 400, (e.status, e.message)
        where = field_name(case.api, field)
        # a tag (``type``) decides which other fields its object needs: a part made a text part
        # by its new type is refused for its missing ``text``, a field of the same object
        tagged = field_name(case.api, field[:-1]) if field and field[-1] == "type" and len(field) > 1 else None
        if not field:
            if not isinstance(value, dict):    # an object is a body: its own fields are what is named
                assert e.param is None and "body" in e.message
        elif case.api == "anthropic":
            head = e.message.split(":", 1)[0]
            assert names(head, where, ".") or (tagged is not None and names(head, tagged, ".")), (where, e.message)
        else:
            assert e.param is not None and (names(e.param, where, "[")
                                            or (tagged is not None and names(e.param, tagged, "["))
                                            or (where == "stream" and e.param == "stream_options")
                                            or (e.param in UNIONS.get(case.path, ()) and names(where, e.param, "["))), \
                (where, e.param, e.message)
        return
    assert ireq.stream is True or ireq.stream is False
    assert ireq.include_usage is True or ireq.include_usage is False
    for key in TYPED_INTS.get(case.path, ()):
        v = ireq.data.get(key)
        assert v is None or type(v) is int, (key, v)
    for key in TYPED_BOOLS.get(case.path, ()):
        v = ireq.data.get(key)
        assert v is None or v is True or v is False, (key, v)
    assert ireq.prompt_tokens_est >= 0
    assert orjson.loads(orjson.dumps(ireq.data)) == ireq.data     # a stage that re-encodes the body can


@pytest.mark.parametrize("case", CASES, ids=[f"{c.path}#{i}" for i, c in enumerate(CASES)])
def test_any_json_in_any_field_is_served_or_a_400_naming_it(case):
    @FUZZ
    @given(field=st.sampled_from(case.fields), value=JSON_VALUES)
    def run(field, value):
        check(case, field, value)

    run()


@pytest.mark.parametrize("value", [[], {}, [1], {"a": 1}, ["text"], 5, 5.5, True, None])
def test_a_content_part_type_of_any_json_type(value):
    """The 500 of the issue: ``{"type": []}`` raised ``TypeError: unhashable type``."""
    case = CASES[0]
    check(case, ("messages", 1, "content", 0, "type"), value)
    check(case, ("messages", 1, "content", 1, "type"), value)


def test_a_list_type_is_a_400_naming_the_part():
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [{"type": []}]}]})
    with pytest.raises(GatewayError) as ei:
        parse("/v1/chat/completions", body, {}, "rid")
    assert ei.value.status == 400 and ei.value.param == "messages[0].content[0].type"


def test_integers_beyond_64_bits_are_refused():
    """pydantic refuses a whole float beyond 64 bits ("exceeded maximum size"); orjson reads an
    integer literal that large as such a float, and the gateway could not write it back either."""
    for raw in (b"123456789012345678901234567890", b"1e300", b'"123456789012345678901234567890"'):
        body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": ' + raw + b"}"
        with pytest.raises(GatewayError) as ei:
            parse("/v1/chat/completions", body, {}, "rid")
        assert ei.value.status == 400 and ei.value.param == "max_tokens" and "exceeded maximum size" in ei.value.message
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "18446744073709551615"}'
    ireq = parse("/v1/chat/completions", body, {}, "rid")
    assert orjson.loads(orjson.dumps(ireq.data))["max_tokens"] == (1 << 64) - 1
