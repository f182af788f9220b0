"""The numbers and booleans the gateway accepts are the ones the engines accept.

Where the gateway validates a field before routing, it accepts what vLLM and SGLang accept and
refuses what both refuse. What they accept is decided by their request models, checked in:

- vLLM ``vllm/entrypoints/openai/protocol.py`` (commit 0052bed3): ``ChatCompletionRequest``
  (``max_tokens: Optional[int]``, ``max_completion_tokens: Optional[int]``, ``n: Optional[int] = 1``,
  ``best_of`` no longer in either (vLLM V1 dropped it: an extra field, ignored),
  ``stream: Optional[bool]``, ``stream_options: Optional[StreamOptions]`` and the before-validator
  ``validate_stream_options``: ``if data.get("stream_options") and not data.get("stream")``, on
  the values as sent), ``CompletionRequest`` (``max_tokens: Optional[int] = 16``, ``n: int = 1``,
  ``stream: Optional[bool]``, same validator), ``StreamOptions`` (``include_usage:
  Optional[bool]``), ``EmbeddingCompletionRequest`` (no ``stream``, ``max_tokens`` or ``n``;
  ``extra="allow"``: they are ignored), ``ResponsesRequest`` (``max_output_tokens:
  Optional[int]``, ``stream``/``store``/``background: Optional[bool]``).
- vLLM ``vllm/sampling_params.py`` (commit 00388f65), ``SamplingParams._verify_args``:
  ``max_tokens must be at least 1, got {max_tokens}.`` (a negative or zero chat limit, and a
  Responses ``max_output_tokens`` below 1 through ``to_sampling_params``); ``n`` at least 1.
- vLLM ``vllm/entrypoints/anthropic/protocol.py`` (commit 00589e56): ``AnthropicMessagesRequest``
  (``max_tokens: int`` with ``validate_max_tokens``: ``max_tokens must be positive``; ``stream:
  bool | None``); ``AnthropicCountTokensRequest`` has no ``stream`` or ``max_tokens``.
- SGLang ``python/sglang/srt/entrypoints/openai/protocol.py`` (commit 004c82e0):
  ``ChatCompletionRequest`` (``max_tokens``/``max_completion_tokens: Optional[int]``, ``n: int =
  1``, ``stream: bool = False``), ``CompletionRequest`` (``max_tokens: int = 16`` with
  ``validate_max_tokens_positive``, ``n: int = 1``, ``stream: bool = False``), ``StreamOptions``
  (``include_usage: Optional[bool] = False``), ``EmbeddingRequest`` (no ``stream``/``max_tokens``/
  ``n``), ``ResponsesRequest`` (``max_output_tokens: Optional[int]``, ``stream``/``store``/
  ``background: Optional[bool]``); ``SamplingParams.verify`` in
  ``python/sglang/srt/sampling/sampling_params.py``: ``max_new_tokens must be at least 0``.

Both are pydantic v2 models in the default (lax) mode, and FastAPI validates the ``json.loads``
output with them. Verified with pydantic 2.x (``model_validate`` of ``int | None``, ``int``,
``bool | None`` fields): an ``int`` takes an int, a bool (true is 1), a whole float (5.0; 5.5 is
"Input should be a valid integer, got a number with a fractional part"), a string of an integer,
trimmed, with single underscores and an optional ``.0…`` ("5", " 5 ", "1_000", "5.0"; "5.5",
"1e3", "0x10" are "unable to parse string as an integer"); not null unless Optional, not a list or
an object ("Input should be a valid integer"). A ``bool`` takes true/false, 0 and 1 (ints or
floats), and "0", "1", "true", "false", "yes", "no", "on", "off", "t", "f", "y", "n" in any case
(not " true", "2", "1.0": "unable to interpret input"). ``list[int]`` applies the int rule to each
item; a list of strings stays strings (the union's exact match wins).

The range checks follow what both engines refuse: a negative ``max_tokens`` or
``max_completion_tokens`` is a 400 (0 is left to the engine: SGLang serves a chat
``max_tokens`` of 0, and vLLM a completions one with ``echo``); Messages' ``max_tokens`` and
Responses' ``max_output_tokens`` below 1 are a 400. One range is the gateway's own: ``n``, the
count of sequences the engine generates, is taken from 1 to ``MAX_CHOICES`` (128, as OpenAI's API takes ``n``); the
engines set no upper bound. Where one engine accepts null and the other
does not (chat ``n``, completions ``max_tokens``), the gateway accepts it; completions ``n`` is
``int`` in both, so null is a 400.

One deliberate difference: an integer beyond 64 bits is refused. pydantic refuses such a whole
float ("exceeded maximum size") but takes the integer literal and the numeric string; orjson reads
the literal as a float, and could not write the value back into a re-encoded body.

The last test runs the gateway's coercion and pydantic side by side over a corpus of values, when
pydantic is installed (it comes with the ``openai`` dev dependency).
"""

from __future__ import annotations

import orjson
import pytest

from gateway.apis.anthropic import AnthropicApi
from gateway.apis.responses_request import parse_responses
from gateway.endpoints import EndpointPool
from gateway.errors import GatewayError
from gateway.request import CHAT, COMPLETIONS, EMBEDDINGS, MAX_CHOICES, lax_bool, lax_int, parse

MSG = [{"role": "user", "content": "hi"}]
_ANTHROPIC = AnthropicApi(EndpointPool())
REFUSED = object()

BASE = {CHAT: {"model": "m", "messages": MSG}, COMPLETIONS: {"model": "m", "prompt": "hi"},
        EMBEDDINGS: {"model": "m", "input": "hi"}, "/v1/responses": {"model": "m", "input": "hi"},
        "/v1/messages": {"model": "m", "messages": MSG, "max_tokens": 4},
        "/v1/messages/count_tokens": {"model": "m", "messages": MSG}}


def run(path: str, fields: dict):
    body = orjson.dumps({**BASE[path], **fields})
    if path.startswith("/v1/messages"):
        return _ANTHROPIC.parse(path, body, {}, "rid")
    if path == "/v1/responses":
        return parse_responses(path, body, {}, "rid")
    return parse(path, body, {}, "rid")


INTS = [  # value, what the engines read (REFUSED: a 400)
    (5, 5), (5.0, 5), (-0.0, 0), (1e3, 1000), ("5", 5), (" 5 ", 5), ("+5", 5), ("5.0", 5), ("5.00", 5),
    ("1_000", 1000), (True, 1), (False, 0), (0, 0), (9e18, 9 * 10**18), (1e19, REFUSED),
    ("12345678901234567890123", REFUSED),
    (5.5, REFUSED), (1.0000000000000002, REFUSED), ("5.5", REFUSED), ("1e3", REFUSED), ("0x10", REFUSED),
    ("", REFUSED), ("five", REFUSED), ("1__0", REFUSED), ([], REFUSED), ([5], REFUSED), ({}, REFUSED),
    (-1, REFUSED), (-1.0, REFUSED), ("-3", REFUSED),
]


FAN_OUT = ("n",)      # a count of sequences: read as an int, then 1 to MAX_CHOICES


@pytest.mark.parametrize("path,key", [(CHAT, "max_tokens"), (CHAT, "max_completion_tokens"), (CHAT, "n"),
                                      (COMPLETIONS, "max_tokens"), (COMPLETIONS, "n")])
@pytest.mark.parametrize("value,read", INTS)
def test_token_limits_and_n(path, key, value, read):
    if key in FAN_OUT and read is not REFUSED and not 1 <= read <= MAX_CHOICES:
        read = REFUSED
    if read is REFUSED:
        with pytest.raises(GatewayError) as ei:
            run(path, {key: value})
        assert ei.value.status == 400 and ei.value.param == key and key in ei.value.message
        return
    ireq = run(path, {key: value})
    assert ireq.data[key] == read and type(ireq.data[key]) is int


@pytest.mark.parametrize("path,key,accepted", [
    (CHAT, "max_tokens", True), (CHAT, "max_completion_tokens", True), (CHAT, "n", True),
    (COMPLETIONS, "max_tokens", True), (COMPLETIONS, "n", False)])
def test_null_where_either_engine_takes_it(path, key, accepted):
    if accepted:
        assert run(path, {key: None}).data[key] is None
    else:
        with pytest.raises(GatewayError) as ei:
            run(path, {key: None})
        assert ei.value.param == key and "valid integer" in ei.value.message


def test_messages_the_error_messages_are_pydantics():
    with pytest.raises(GatewayError) as ei:
        run(CHAT, {"max_tokens": 5.5})
    assert ei.value.message == "max_tokens: Input should be a valid integer, got a number with a fractional part"
    with pytest.raises(GatewayError) as ei:
        run(CHAT, {"n": "two"})
    assert ei.value.message == "n: Input should be a valid integer, unable to parse string as an integer"
    with pytest.raises(GatewayError) as ei:
        run(CHAT, {"stream": "maybe"})
    assert ei.value.message == "stream: Input should be a valid boolean, unable to interpret input"


BOOLS = [
    (True, True), (False, False), (None, False), (1, True), (0, False), (1.0, True), (0.0, False),
    ("true", True), ("True", True), ("TRUE", True), ("yes", True), ("on", True), ("t", True), ("y", True),
    ("1", True), ("false", False), ("no", False), ("off", False), ("f", False), ("n", False), ("0", False),
    (2, REFUSED), (-1, REFUSED), (0.5, REFUSED), (2.0, REFUSED), ("maybe", REFUSED), (" true", REFUSED),
    ("1.0", REFUSED), ("", REFUSED), ([], REFUSED), ({}, REFUSED), ([True], REFUSED),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("value,read", BOOLS)
def test_stream(path, value, read):
    if read is REFUSED:
        with pytest.raises(GatewayError) as ei:
            run(path, {"stream": value})
        assert ei.value.status == 400 and "stream" in ei.value.message
        return
    ireq = run(path, {"stream": value})
    assert ireq.stream is read
    if value is not None:
        assert ireq.data["stream"] is read        # what a re-encoded body and every later stage see


@pytest.mark.parametrize("value,read", BOOLS)
def test_include_usage(value, read):
    fields = {"stream": True, "stream_options": {"include_usage": value}}
    if read is REFUSED:
        with pytest.raises(GatewayError) as ei:
            run(CHAT, fields)
        assert ei.value.param == "stream_options.include_usage"
        return
    ireq = run(CHAT, fields)
    assert ireq.include_usage is read
    if value is not None:
        assert ireq.data["stream_options"]["include_usage"] is read


@pytest.mark.parametrize("key", ["store", "background"])
@pytest.mark.parametrize("value,read", BOOLS)
def test_responses_flags(key, value, read):
    if read is REFUSED:
        with pytest.raises(GatewayError) as ei:
            run("/v1/responses", {key: value})
        assert ei.value.param == key
        return
    ireq = run("/v1/responses", {key: value})
    assert ireq.data[key] is (None if value is None else read)


@pytest.mark.parametrize("fields,accepted", [
    ({"stream_options": {"include_usage": True}}, False),           # vLLM: "Stream options can only be defined when `stream=True`."
    ({"stream": False, "stream_options": {"include_usage": True}}, False),
    ({"stream": None, "stream_options": {"include_usage": True}}, False),
    ({"stream": False, "stream_options": {}}, True),                 # an empty object is falsy to vLLM's check
    ({"stream": False, "stream_options": None}, True),
    ({"stream": "false", "stream_options": {"include_usage": True}}, True),   # "false" is truthy as sent
    ({"stream": "true", "stream_options": {"include_usage": True}}, True),
    ({"stream": True, "stream_options": []}, False),                 # not a StreamOptions
])
def test_stream_options_need_a_stream_as_vllm_checks_it(fields, accepted):
    if not accepted:
        with pytest.raises(GatewayError) as ei:
            run(CHAT, fields)
        assert ei.value.param == "stream_options"
        return
    ireq = run(CHAT, fields)
    if ireq.stream:
        assert ireq.include_usage
    else:
        # the options are moot, and dropped: a re-encoded body with stream false would not pass
        assert not ireq.include_usage and not ireq.data.get("stream_options")


@pytest.mark.parametrize("value,read", [
    (5, 5), (5.0, 5), ("5", 5), (True, 1), (None, None),
    (0, REFUSED), (-1, REFUSED), (1.5, REFUSED), ("x", REFUSED), ([], REFUSED)])
def test_responses_max_output_tokens(value, read):
    if read is REFUSED:
        with pytest.raises(GatewayError) as ei:
            run("/v1/responses", {"max_output_tokens": value})
        assert ei.value.param == "max_output_tokens"
        return
    assert run("/v1/responses", {"max_output_tokens": value}).data["max_output_tokens"] == read


@pytest.mark.parametrize("value,read", [
    (5, 5), (5.0, 5), ("5", 5), (" 7 ", 7),
    (0, REFUSED), (-2, REFUSED), (2.5, REFUSED), ("x", REFUSED), (None, REFUSED), ([], REFUSED), (False, REFUSED), (True, REFUSED)])
def test_messages_max_tokens(value, read):
    if read is REFUSED:
        with pytest.raises(GatewayError) as ei:
            run("/v1/messages", {"max_tokens": value})
        assert ei.value.message.startswith("max_tokens: ")
        return
    ireq = run("/v1/messages", {"max_tokens": value})
    assert ireq.data["max_tokens"] == read and type(ireq.data["max_tokens"]) is int


def test_fields_an_api_does_not_have_are_left_to_the_engine():
    """Embeddings have no stream, max_tokens or n, count_tokens no stream or max_tokens, and
    completions no max_completion_tokens: the engines ignore them, so the gateway does too."""
    ireq = run(EMBEDDINGS, {"stream": True, "max_tokens": "lots", "n": [], "stream_options": 5})
    assert ireq.stream is False and ireq.include_usage is False
    assert run("/v1/messages/count_tokens", {"stream": True, "max_tokens": "x"}).stream is False
    assert run(COMPLETIONS, {"max_completion_tokens": "x"}).data["max_completion_tokens"] == "x"
    assert run(COMPLETIONS, {"max_completion_tokens": -1}).data["max_completion_tokens"] == -1


@pytest.mark.parametrize("path,key,value,read,tokens", [
    (COMPLETIONS, "prompt", [1.0, 2.0], [1, 2], 2),
    (COMPLETIONS, "prompt", [True, "2", 3], [1, 2, 3], 3),
    (COMPLETIONS, "prompt", [[1.0], [2, "3"]], [[1], [2, 3]], 3),
    (COMPLETIONS, "prompt", ["1", "2"], ["1", "2"], None),             # strings stay strings
    (COMPLETIONS, "prompt", [1.5], REFUSED, None),
    (COMPLETIONS, "prompt", [1, "a"], REFUSED, None),
    (COMPLETIONS, "prompt", [[1], "2"], REFUSED, None),
    (EMBEDDINGS, "input", [1.0, 2.0], [1, 2], 2),
    (EMBEDDINGS, "input", [[1.0, 2.0], [3]], [[1, 2], [3]], 3),
    (EMBEDDINGS, "input", [None], REFUSED, None),
])
def test_token_id_lists(path, key, value, read, tokens):
    if read is REFUSED:
        with pytest.raises(GatewayError) as ei:
            run(path, {key: value})
        assert ei.value.param == key
        return
    ireq = run(path, {key: value})
    assert ireq.data[key] == read
    if tokens is not None:
        assert ireq.prompt_tokens_est == tokens


CORPUS = [
    0, 1, 2, -1, 5, 10**30, 0.0, 1.0, -0.0, 5.0, 5.5, -5.0, 1e3, 2.0, 0.5, 9.2e18,
    True, False, None, [], {}, [1], {"a": 1},
    "5", "+5", "-5", " 5", "5 ", "\t5\n", "5.", "5.0", "5.00", "5.10", ".0", "0.", "-0", "-0.0", "00", "0005",
    "1_000", "1__000", "_1", "1_", "1e3", "0x10", "0b1", "1_000.0", "1.0_0", "", "  ", "-", "+", "5 5",
    "١", "５", "1.5", "inf", "nan", "NaN", "5,0",
    "true", "TRUE", "True", "tRuE", "yes", "YES", "on", "ON", "t", "T", "y", "Y", "1", "0", "false", "FALSE",
    "no", "off", "f", "F", "n", "N", " yes", "yes ", "1.0", "0.0", "01", "00", "+1", "maybe",
]


def test_the_coercion_is_pydantics():
    """The gateway's reading of an int and a bool, against pydantic's own (lax mode, validating
    Python values as FastAPI does), over the corpus: the same values accepted, to the same value,
    and the same message for the ones refused."""
    pydantic = pytest.importorskip("pydantic")

    class Fields(pydantic.BaseModel):
        i: int
        b: bool

    for value in CORPUS:
        for name, ours in (("i", lax_int), ("b", lax_bool)):
            try:
                want = getattr(Fields.model_validate({"i": 0, "b": False, name: value}), name)
            except pydantic.ValidationError as e:
                want = ValueError(e.errors()[0]["msg"])
            try:
                got = ours(value)
            except ValueError as e:
                got = e
            if isinstance(want, ValueError):
                assert isinstance(got, ValueError) and str(got) == str(want), (name, value, got, want)
            else:
                assert got == want and type(got) is type(want), (name, value, got, want)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("value", [0, -5, MAX_CHOICES + 1, "129", 2.5, [2], "two", None, True, 5])
def test_best_of_is_not_read(path, value):
    """Neither engine generates ``best_of`` sequences now (vLLM V1 has no such field and ignores it,
    SGLang's completions type it and never use it): the gateway leaves it as sent, refuses no value
    of it and counts no sequence for it; ``n`` alone is the request's fan-out."""
    ireq = run(path, {"best_of": value, "n": 2})
    assert ireq.data["best_of"] == value and type(ireq.data["best_of"]) is type(value)
    assert (ireq.choices, ireq.fan, ireq.sequences) == (2, 2, 2)
