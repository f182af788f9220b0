"""Parsing and reshaping Responses API bodies (``POST /v1/responses``); pure code, no I/O.

``parse_responses`` validates a body before any endpoint is touched and extracts what routing and
accounting need: the model, the stream flag, and the prompt text the engine will prefill, which is
``instructions`` followed by the text of ``input`` (a string or a list of items whose ``content``
is a string or a list of text parts). That text is the prefix-cache key of every strategy.
``temperature`` (0 to 2), the function tools' ``name`` and ``parameters``, ``include`` (OpenAI's
includable names) and ``truncation`` ("auto" or "disabled") are checked as OpenAI documents them,
with OpenAI's error codes.

The helpers below serve the gateway-held history (``responses.state: gateway``): a stored
response's input and output items become the ``input`` of its follow-up, in the forms every
engine accepts (a message item with string content; function calls as they are).
"""

from __future__ import annotations

from typing import Any

from gateway.apis.paths import RESPONSES as RESPONSES  # the path, re-exported
from gateway.errors import GatewayError
from gateway.request import (
    InferenceRequest,
    body_bytes,
    caller_headers,
    claimed_user,
    int_error,
    lax_bool,
    lax_float,
    lax_int,
    load_object,
    no_model,
    slo_objectives,
    text_and_tools_tokens,
)


def _bad(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code, header=("x-error-request-body-processing", "true"),
                        error_class="validation")


def _bool_field(data: dict[str, Any], key: str) -> bool | None:
    """``data[key]`` as the engines read an optional bool (written back when coerced)."""
    v = data.get(key)
    if v is None or v is True or v is False:
        return v
    try:
        out = data[key] = lax_bool(v)
    except ValueError as e:
        raise _bad(f"{key}: {e}", key) from None
    return out


def _check_temperature(v: Any) -> None:
    """``temperature``: a number, not negative, refused with OpenAI's codes. OpenAI documents 0 to 2,
    but the engine samples at any temperature that is not negative (vLLM's request takes any float),
    so one above 2 goes on, as chat's does."""
    try:
        t = lax_float(v)
    except ValueError:
        raise _bad("Invalid type for 'temperature': expected a decimal, but got "
                   f"{type(v).__name__} instead.", "temperature", "invalid_type") from None
    if not t >= 0:          # NaN too
        raise _bad(f"Invalid 'temperature': decimal below minimum value. Expected a value >= 0, but got {v} instead.",
                   "temperature", "decimal_below_min_value")


def _check_tools(tools: Any) -> None:
    """OpenAI's ``tools``: a list of objects, each with a ``type``; a function tool has a ``name``
    (not empty) and ``parameters``, when given, an object (OpenAI's and vLLM's ``FunctionTool``
    make ``parameters`` optional). The other tool types are the engine's to take or refuse."""
    if not isinstance(tools, list):
        raise _bad("Invalid type for 'tools': expected an array, but got "
                   f"{type(tools).__name__} instead.", "tools", "invalid_type")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"Invalid type for '{where}': expected an object, but got {type(tool).__name__} instead.",
                       where, "invalid_type")
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise _missing_or_type(f"{where}.type", kind, "a string")
        if kind != "function":
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            if name == "":
                raise _bad(f"Invalid '{where}.name': empty string. Expected a string with minimum length 1, "
                           "but got an empty string instead.", f"{where}.name", "empty_string")
            raise _missing_or_type(f"{where}.name", name, "a string")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _missing_or_type(f"{where}.parameters", params, "an object")


# what ``include`` may ask for, and the ``truncation`` strategies, as OpenAI's API reference names them
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
TRUNCATION = ("auto", "disabled")


def _supported(values: tuple[str, ...]) -> str:
    quoted = [f"'{v}'" for v in values]
    return ", ".join(quoted[:-1]) + f", and {quoted[-1]}" if len(quoted) > 2 else " and ".join(quoted)


def _check_include(include: Any) -> None:
    """``include``: a list of OpenAI's includable names; another type or an unknown name is OpenAI's
    400 naming it (the engine would take the list unread, or refuse it with its own words)."""
    if not isinstance(include, list):
        raise _bad(f"Invalid type for 'include': expected an array of strings, but got {type(include).__name__} "
                   "instead.", "include", "invalid_type")
    for i, name in enumerate(include):
        if not isinstance(name, str):
            raise _bad(f"Invalid type for 'include[{i}]': expected one of {_supported(INCLUDABLE)}, but got "
                       f"{type(name).__name__} instead.", f"include[{i}]", "invalid_type")
        if name not in INCLUDABLE:
            raise _bad(f"Invalid value: '{name[:100]}'. Supported values are: {_supported(INCLUDABLE)}.",
                       f"include[{i}]", "invalid_value")


def _check_truncation(v: Any) -> None:
    if not isinstance(v, str):
        raise _bad(f"Invalid type for 'truncation': expected one of {_supported(TRUNCATION)}, but got "
                   f"{type(v).__name__} instead.", "truncation", "invalid_type")
    if v not in TRUNCATION:
        raise _bad(f"Invalid value: '{v[:100]}'. Supported values are: {_supported(TRUNCATION)}.", "truncation",
                   "invalid_value")


def _missing_or_type(where: str, v: Any, expected: str) -> GatewayError:
    if v is None:
        return _bad(f"Missing required parameter: '{where}'.", where, "missing_required_parameter")
    return _bad(f"Invalid type for '{where}': expected {expected}, but got {type(v).__name__} instead.",
                where, "invalid_type")


def _parts_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise _bad(f"'{where}[{i}]' must be an object", f"{where}[{i}]")
            text = part.get("text")
            if text is not None:
                if not isinstance(text, str):
                    raise _bad(f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
                out.append(text)
        return " ".join(out)
    raise _bad(f"'{where}' must be a string or an array of content parts", where)


def items_text(items: list[Any], where: str = "input") -> list[str]:
    """The text of each input item (role, then content; a tool call's arguments or output)."""
    parts: list[str] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad(f"'{where}[{i}]' must be an object", f"{where}[{i}]")
        role = item.get("role")
        if role is not None:
            if not isinstance(role, str):
                raise _bad(f"'{where}[{i}].role' must be a string", f"{where}[{i}].role")
            parts.append(role)
        if "content" in item:
            parts.append(_parts_text(item["content"], f"{where}[{i}].content"))
        for key in ("arguments", "output"):
            v = item.get(key)
            if isinstance(v, str):
                parts.append(v)
            elif v.__class__ is list:       # a tool's output as content parts: their text (read laxly, as the engines do)
                parts.extend(p["text"] for p in v if p.__class__ is dict and p.get("text").__class__ is str)
    return parts


def input_items(value: Any) -> list[Any]:
    """``input`` as a list of items: a string is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else list(value)


def prompt_text(data: dict[str, Any]) -> str:
    parts = []
    instructions = data.get("instructions")
    if isinstance(instructions, str) and instructions:
        parts.append(instructions)
    inp = data.get("input")
    if isinstance(inp, str):
        parts.append(inp)
    elif isinstance(inp, list):
        parts.extend(items_text(inp))
    return "\n".join(parts)


def parse_responses(path: str, body: bytes, headers: Any, request_id: str) -> InferenceRequest:
    """Validate a ``/v1/responses`` body; unknown fields pass through to the engine untouched."""
    data = load_object(body)
    model = data.get("model")
    if model is None or model == "":
        raise no_model(model)
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    try:
        return _parse_named(path, body, headers, request_id, data, model)
    except GatewayError as e:         # the request's log line names the model the body named
        e.model = model
        raise


def _parse_named(path: str, body: bytes, headers: Any, request_id: str, data: dict[str, Any],
                 model: str) -> InferenceRequest:
    stream = _bool_field(data, "stream")
    if "input" not in data or data["input"] is None:
        raise _bad("'input' is a required property", "input")
    inp = data["input"]
    if not isinstance(inp, str | list):
        raise _bad("'input' must be a string or an array of input items", "input")
    if isinstance(inp, list) and not inp:
        raise _bad("'input' must not be empty", "input")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    _bool_field(data, "store")
    _bool_field(data, "background")
    if "request_id" in data:
        # vLLM and SGLang make a body's request_id the new response's id: a client naming an id the
        # gateway holds would replace that response (its owner or history record, the engine's
        # copy), another user's too. OpenAI has no such parameter; the client's id for a request
        # is its x-request-id header
        raise _bad("Unknown parameter: 'request_id'.", "request_id", "unknown_parameter")
    key = data.get("prompt_cache_key")
    if key is not None and key.__class__ is not str:
        raise _bad("'prompt_cache_key' must be a string", "prompt_cache_key")
    prev = data.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise _bad("'previous_response_id' must be a non-empty string", "previous_response_id")
    v = data.get("max_output_tokens")
    if v is not None:
        if type(v) is not int:
            try:
                v = data["max_output_tokens"] = lax_int(v)
            except ValueError as e:
                raise int_error("max_output_tokens", e) from None
        if v < 1:
            raise _bad("'max_output_tokens' must be a positive integer", "max_output_tokens")
    temperature = data.get("temperature")
    if temperature is not None:
        _check_temperature(temperature)
    tools = data.get("tools")
    if tools is not None:
        _check_tools(tools)
    include = data.get("include")
    if include is not None:
        _check_include(include)
    truncation = data.get("truncation")
    if truncation is not None:
        _check_truncation(truncation)
    text = prompt_text(data)
    user, session_id, session_key = caller_headers(headers)
    if user is None and isinstance(data.get("user"), str):
        user = data["user"]
    user = claimed_user(user)
    slo_ttft, slo_tpot = slo_objectives(headers)
    return InferenceRequest(
        path=path, body=body, data=data, model=model, stream=bool(stream),
        include_usage=True,             # a Responses stream always ends with its usage: nothing to inject
        prompt_text=text, prompt_tokens_est=text_and_tools_tokens(text, tools), request_id=request_id,
        user=user, session_id=session_id, session_key=session_key, headers=headers,
        slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot)


def output_as_input(output: Any) -> list[Any]:
    """A response's output items as input items of a follow-up: messages with their text as a
    string (what every engine's chat template takes), reasoning dropped (engines drop it too),
    tool calls and anything else unchanged."""
    out: list[Any] = []
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "reasoning":
            continue
        if kind == "message":
            texts = []
            for part in item.get("content") or ():
                if isinstance(part, dict):
                    t = part.get("text") if part.get("type") != "refusal" else part.get("refusal")
                    if isinstance(t, str):
                        texts.append(t)
            out.append({"role": item.get("role") or "assistant", "content": "".join(texts)})
            continue
        out.append({k: v for k, v in item.items() if k != "status"})
    return out


def item_ids(items: Any) -> set[str]:
    """The ids the items of a list name."""
    return {rid for i in items if i.__class__ is dict and (rid := i.get("id")).__class__ is str} \
        if isinstance(items, list) else set()


def chain_ids(record: dict[str, Any]) -> set[str]:
    """Every item id of a stored response's chain: its input's, its output's (the reasoning and the
    messages a follow-up's history names without their ids too) and those of the turns before it
    (``ids``: a record keeps the ids of its history, whose items the history's shape lost)."""
    before = record.get("ids")
    kept = {i for i in before if i.__class__ is str} if isinstance(before, list) else set()
    return kept | item_ids(record.get("input")) | item_ids(record.get("output"))


def unique_items(items: list[Any]) -> list[Any]:
    """``items`` without an item whose id an earlier one names: a stored record's input as the
    gateway now keeps one. A record an older release wrote can hold an item twice (a resent
    function call, before :func:`check_unique_ids` refused it); read back as it is, its
    ``input_items`` would list the id twice (an ``after`` cursor on it goes round) and each
    follow-up would show the engine the item twice and keep the repeat."""
    seen: set[str] = set()
    out: list[Any] = []
    for item in items:
        rid = item.get("id") if item.__class__ is dict else None
        if rid.__class__ is str:
            if rid in seen:
                continue
            seen.add(rid)
        out.append(item)
    return out


def check_unique_ids(seen: set[str], items: list[Any]) -> None:
    """A follow-up's new input ``items`` name no id its chain (``seen``: :func:`chain_ids`) or
    another of them names, as OpenAI requires: an item sent again (the function call a follow-up
    answers, the previous turn's reasoning or assistant message, an ``item_reference`` to one of
    them) is a 400 naming ``input`` and the id. Kept, its id would be listed twice by
    ``input_items``, whose ``after`` cursor then goes round, and the engine would be shown the item
    twice. The history's own ids, the engine's, are not checked: a follow-up cannot change them."""
    seen = set(seen)
    for item in items:
        rid = item.get("id") if isinstance(item, dict) else None
        if not isinstance(rid, str):
            continue
        if rid in seen:
            raise _bad(f"Duplicate item found with id {rid}. Remove duplicate items from your input and try again.",
                       "input")
        seen.add(rid)


def with_history(ireq: InferenceRequest, history: list[Any]) -> list[Any]:
    """Rewrite ``ireq`` for a gateway-held conversation: ``input`` becomes the stored history plus
    the new input, ``previous_response_id`` goes, and ``store`` is false (the gateway keeps the
    state; vLLM's in-process store never evicts). The body is re-encoded and the prompt text (the
    prefix-cache key) and token estimate follow. Returns the full input."""
    data = dict(ireq.data)
    full = history + input_items(data["input"])
    data["input"] = full
    prev = data.pop("previous_response_id", None)
    if isinstance(prev, str):
        ireq.previous_response_id = prev
    data["store"] = False
    ireq.data = data
    ireq.body = body_bytes(data, ireq.body)
    ireq.prompt_text = prompt_text(data)
    ireq.prompt_tokens_est = text_and_tools_tokens(ireq.prompt_text, data.get("tools"))
    return full
