"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Served by engines that speak it (vLLM and SGLang, each with its Anthropic handler: ``handlers/``
says which engine serves which path), through the same pipeline as chat. What differs from OpenAI, and lives here:

- **Parsing.** ``model``, ``messages`` (content a string or a list of blocks) and, for
  ``/v1/messages``, ``max_tokens`` are required; ``system`` is a string or a list of text blocks.
  The prefix the router hashes is the system prompt followed by the messages, as the engine's
  chat template renders them in that order. ``metadata.user_id`` names the user when no ``user``
  header does. What Anthropic's API refuses and the engine would take is refused here too: a
  negative ``temperature`` (one above 1.0 goes on, as vLLM samples at it), ``stop_sequences`` that
  are not a list of strings, a custom tool without a ``name`` or an ``input_schema`` object, a
  message whose role is not user or assistant (Claude Code's ``ctx`` and ``msg`` go on: vLLM
  reads them as user), a boolean for an integer or a number (``max_tokens``, ``top_k``,
  ``temperature``, ``top_p``, ``thinking.budget_tokens``), a ``tool_choice`` of type ``tool``
  without a string ``name`` (vLLM answers it with a 500) or naming none of ``tools``. The body is forwarded unchanged: the
  usage of a stream always arrives (in
  ``message_start`` and ``message_delta``), so nothing has to be asked for.
- **Errors.** Before headers: ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's
  error types for the status (``invalid_request_error``, ``not_found_error``,
  ``rate_limit_error``, ``overloaded_error``, ...); the gateway's own 503 for want of capacity
  is Anthropic's 529 ``overloaded_error`` (``own_error``), and so is a P/D prefill's 503 or 529
  (the pair's 502 on the OpenAI paths; a prefill's 429 is a 429 ``rate_limit_error``), one for a
  failure ``api_error``. After headers: an ``event: error`` frame with
  the same body. An engine's error answer (vLLM sends this shape already, but OpenAI-shaped for
  validation errors) is re-shaped the same way, keeping its status (a 503, the engine's overload,
  is a 529) and message. An engine's own
  error event in a stream passes on as it came, unless its error's type is none of Anthropic's
  (vLLM writes ``internal_error``): then that frame alone is written again with the type for its
  ``code`` (``api_error`` without one), the rest of it kept.
- **Stream accounting.** Events are named by their ``event:`` line. The first
  ``content_block_delta`` of generated tokens (``text_delta``, ``thinking_delta``,
  ``input_json_delta``), or a ``tool_use`` block's ``content_block_start`` (its tool's name), is
  the first token (TTFT); each later read that carries one is an inter-token gap (deltas that
  came in one read add none, as on chat completions). A
  thinking block's ``signature_delta`` and a text block's ``citations_delta`` carry no token and
  count for neither, nor does a delta whose text, thinking or JSON is empty (an engine's empty
  token, as a chat chunk with empty content); only an event that names one of the two, or holds
  two quotes together, is decoded to tell.
  ``message_start`` carries the input tokens, ``message_delta`` the output tokens and the stop
  reason, ``message_stop`` ends the stream. Only those three and ``error`` are JSON-decoded.
  A usage of zeros (SGLang's ``message_start``, and its ``message_delta`` after its own error
  event) counts nothing: the stream is charged as one whose usage never came.
  An event goes out once it is whole (its blank line came), never in part.

Over prefill/decode pairs (docs/pd.md, Messages): an engine whose Messages request takes the P/D
fields (vLLM's ``kv_transfer_params``) runs Messages disaggregated, its decode's stream scanned as
here; an engine whose request cannot carry them (SGLang's has no bootstrap fields) is refused with
its adapter's reason (``pd_refusal``). count_tokens, which generates nothing, runs whole on the
chosen decode on both (``generates``).

Token counts follow Anthropic: ``input_tokens`` excludes prompt tokens read from or written to
the prompt cache (``cache_read_input_tokens``, ``cache_creation_input_tokens``), so the prompt
tokens the gateway counts are their sum, and the cached ones are the cache reads. SGLang's
``input_tokens`` is the whole prompt's count, its cache reads a part of it
(``messages_input_has_cache_reads`` of its adapter): its prompt tokens are ``input_tokens``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.apis.paths import ANTHROPIC_PATHS, COUNT_TOKENS
from gateway.apis.serving import EngineSpecificApi
from gateway.errors import ErrorClass, GatewayError, normalize_upstream_error
from gateway.pipeline.sse import ITL_KEEP, MAX_EVENT_BYTES, as_lf, cr_mode, has_fields, lf_scan
from gateway.request import (
    InferenceRequest,
    caller_headers,
    claimed_user,
    lax_bool,
    lax_float,
    lax_int,
    load_object,
    slo_objectives,
    text_and_tools_tokens,
)
from gateway.resilience.outcome import event_status
from handlers import adapter_for

# Anthropic's error types by HTTP status (docs.anthropic.com/en/api/errors)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
          403: "permission_error", 404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
          429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
          504: "timeout_error", 529: "overloaded_error"}
ERROR_TYPES = frozenset(_TYPES.values())


def error_type(status: int) -> str:
    return _TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, message: str, type_: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_ or error_type(status), "message": message}}


def error_event(status: int, message: str) -> bytes:
    """The ``event: error`` frame that ends a stream the gateway cannot complete."""
    return b"event: error\ndata: " + orjson.dumps(anthropic_error(status, message)) + b"\n\n"


# the gateway's own 503s that refuse a request for want of capacity: a model with no ready endpoint
# (engines down, draining, their breakers open; none a router could choose), the gateway draining or
# out of sockets, no prefill left to try. Anthropic answers overload with 529 ``overloaded_error``
# (the SDK's ``OverloadedError``); Retry-After is kept
_OVERLOAD = frozenset({ErrorClass.NO_ENDPOINT, ErrorClass.NO_ROUTE, ErrorClass.DRAINING, ErrorClass.GATEWAY_RESOURCES,
                       ErrorClass.PD_PREFILL_TRANSPORT})


def _overload(e: GatewayError) -> bool:
    """Whether the gateway's own 503 ``e`` is overload: ``_OVERLOAD``, and a LoRA adapter no ready
    endpoint has a free slot for (not one that failed to load: a failure, ``api_error``)."""
    return e.error_class in _OVERLOAD or (e.error_class is ErrorClass.LORA_LOAD
                                          and e.headers.get("x-error-lora-load") == "full")


def own_error(e: GatewayError) -> GatewayError:
    """The gateway's own error as Anthropic's API answers it: a 503 for want of capacity is its 529
    ``overloaded_error``, and so is an engine's overload the gateway answers for it (a P/D
    prefill's 503 or 529, the pair's 502 on the OpenAI paths), while that engine's 429 is a 429
    ``rate_limit_error`` (``busy``: the status and its wait); the rest keep their status."""
    if e.status == 503 and _overload(e):
        return e.with_status(529)
    if e.busy is not None:
        status, wait = e.busy
        out = e.with_status(status)
        out.headers["Retry-After"] = wait
        return out
    return e


def own_error_type(e: GatewayError) -> str | None:
    """The type of the gateway's own error on these paths, when not the one for its status: a 503
    left a 503 by ``own_error`` (the shared state unavailable, a LoRA adapter failing to load) is
    a failure, not overload, so ``api_error``; an engine's 503 the gateway answers for it (a
    prefill's) stays the engine's busy signal."""
    if e.status == 503 and not e.error_class.name.startswith("PD_PREFILL"):
        return "api_error"
    return None


def _bad(message: str) -> GatewayError:
    return GatewayError(400, message, header=("x-error-request-body-processing", "true"), error_class=ErrorClass.VALIDATION)


# Claude Code's attribution line, a text block of ``system`` carrying a per-request hash; vLLM drops
# such blocks before rendering (vllm/entrypoints/anthropic/serving.py), so the prefix must too
_BILLING_HEADER = "x-anthropic-billing-header"


def _blocks_text(content: Any, where: str, media: list[bool], system: bool = False, text_only: bool = False) -> str:
    """The text of a message's ``content``: a string, or a list of content blocks whose text
    (``text`` blocks, the content of ``tool_result`` blocks, a string or text blocks, and the input
    of ``tool_use`` blocks as JSON) is what the prefix holds.
    An ``image`` or ``document`` block sets ``media[0]`` (the request is multimodal). In a system
    prompt, text blocks holding Claude Code's attribution line are left out, as the engine leaves
    them out of what it renders. ``text_only`` (the ``system`` field, Anthropic's string or list
    of text blocks): a block of another type is refused, as Anthropic refuses it, where the
    engine would render the system prompt without it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: Input should be a valid string or a list of content blocks")
    out = []
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise _bad(f"{where}.{i}: a content block must be an object with a 'type'")
        if not isinstance(block.get("type"), str):
            raise _bad(f"{where}.{i}.type: Field required" if block.get("type") is None
                       else f"{where}.{i}.type: Input should be a valid string")
        if text_only and block["type"] != "text":
            raise _bad(f"{where}.{i}.type: Input should be 'text'")
        text = block.get("text")
        if block["type"] == "text":
            if not isinstance(text, str):
                raise _bad(f"{where}.{i}.text: Input should be a valid string")
            if not (system and text.startswith(_BILLING_HEADER)):
                out.append(text)
        elif block["type"] == "tool_result":
            result = _tool_result_text(block.get("content"), media)
            if result:
                out.append(result)
        elif block["type"] == "tool_use" and block.get("input"):
            out.append(_json_text(block["input"]))
        elif block["type"] in ("image", "document"):
            media[0] = True
    return "\n".join(out)


def _json_text(value: Any) -> str:
    """A ``tool_use`` block's input as the engine renders it, the JSON arguments of the call both
    engines make of it (nothing for a value the encoder cannot write, nested past its depth)."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        return ""


def _tool_result_text(content: Any, media: list[bool]) -> str:
    """The text a ``tool_result`` block gives the engine: its content when a string, else the text
    of its text blocks joined by newlines, as both engines build the tool message they render
    (vLLM's ``_convert_user_tool_result``, SGLang's ``_convert_tool_result_content``); an image in
    it sets ``media[0]``. Content of another shape is the engine's to refuse."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for part in content:
        if isinstance(part, dict):
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in ("image", "document"):
                media[0] = True
    return "\n".join(texts)


# a message's roles: Anthropic's user and assistant, and Claude Code's ``ctx`` and ``msg``, which
# vLLM reads as user (SGLang refuses them: its answer)
_ROLES = frozenset(("user", "assistant", "ctx", "msg"))


def _check_not_bool(data: dict[str, Any], keys: tuple[str, ...], kind: str, where: str = "") -> None:
    """Anthropic refuses a boolean for an integer or a number field; the engine reads its request
    in pydantic's lax mode, which takes ``true`` as 1, so the gateway refuses it first."""
    for key in keys:
        v = data.get(key)
        if v is True or v is False:
            raise _bad(f"{where}{key}: Input should be a valid {kind}")


def _check_temperature(v: Any) -> None:
    """``temperature``: a number, not negative. Anthropic documents 0.0 to 1.0, but the engine
    behind this API samples at any temperature that is not negative (vLLM's Messages request takes
    any float; its sampler refuses a negative one), so one above 1.0 goes on, as chat's does."""
    try:
        t = lax_float(v)
    except ValueError as e:
        raise _bad(f"temperature: {e}") from None
    if not t >= 0.0:        # NaN too
        raise _bad("temperature: Input should be greater than or equal to 0")


def _check_stop_sequences(stops: Any) -> None:
    """``stop_sequences``: a list of strings, as Anthropic requires and vLLM's Messages request
    reads it (both refuse a string); refused here, so the answer does not depend on the engine."""
    if not isinstance(stops, list):
        raise _bad("stop_sequences: Input should be a valid list")
    for i, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise _bad(f"stop_sequences.{i}: Input should be a valid string")


def _check_tools(tools: Any) -> None:
    """Anthropic's ``tools``: a list of objects; a custom tool (``type`` absent or ``custom``) has a
    ``name`` and an ``input_schema`` object. Server tools (``web_search_20250305``, ``bash_20250124``,
    ...) have no schema: the engine takes them or refuses them."""
    if not isinstance(tools, list):
        raise _bad("tools: Input should be a valid list")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools.{i}: Input should be a valid dictionary")
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            if not isinstance(kind, str):
                raise _bad(f"tools.{i}.type: Input should be a valid string")
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools.{i}.name: " + ("Field required" if name is None else "Input should be a valid string"
                                              if not isinstance(name, str) else "String should have at least 1 character"))
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"tools.{i}.input_schema: " + ("Field required" if schema is None
                                                      else "Input should be a valid dictionary"))


def _check_tool_choice(choice: Any, tools: Any) -> None:
    """A ``tool_choice`` of type ``tool`` names one of the request's ``tools``, as Anthropic
    requires: vLLM's Messages request takes one without a name, then fails to convert it to its
    chat request, a 500 (an endpoint's fault to the breaker) for the request's own mistake; one
    naming a tool not offered would be generated as the engine makes of it. Other shapes are the
    engine's to refuse (its 400)."""
    if isinstance(choice, dict) and choice.get("type") == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _bad("tool_choice.name: " + ("Field required" if name is None else "Input should be a valid string"))
        if not any(isinstance(tool, dict) and tool.get("name") == name for tool in tools or ()):
            raise _bad(f"tool_choice.name: no tool named {name[:100]!r} in tools")


class AnthropicApi(EngineSpecificApi):
    name = "anthropic"
    paths = ANTHROPIC_PATHS
    object_answers = True

    def parse(self, path: str, body: bytes, headers: Mapping[str, str], request_id: str) -> InferenceRequest:
        data = load_object(body, "The request body is not valid JSON.", "The request body must be a JSON object.")
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise GatewayError(400, "model: Field required" if model in (None, "") else "model: Input should be a valid string",
                               param="model", header=("x-error-no-model-backends", ""), error_class=ErrorClass.VALIDATION)
        try:
            return self._parse_named(path, body, headers, request_id, data, model)
        except GatewayError as e:     # the request's log line names the model the body named
            e.model = model
            raise

    def _parse_named(self, path: str, body: bytes, headers: Mapping[str, str], request_id: str,
                     data: dict[str, Any], model: str) -> InferenceRequest:
        count_only = path == COUNT_TOKENS
        stream = False           # count_tokens has no such field: the engine ignores it
        if not count_only:
            stream = data.get("stream")
            if stream is not True and stream is not False:
                if stream is None:
                    stream = False
                else:
                    try:
                        stream = data["stream"] = lax_bool(stream)
                    except ValueError as e:
                        raise _bad(f"stream: {e}") from None
            mt = data.get("max_tokens")
            if mt is None:
                raise _bad("max_tokens: Field required")
            _check_not_bool(data, ("max_tokens", "top_k"), "integer")
            _check_not_bool(data, ("temperature", "top_p"), "number")
            if type(mt) is not int:
                try:
                    mt = data["max_tokens"] = lax_int(mt)
                except ValueError as e:
                    raise _bad(f"max_tokens: {e}") from None
            if mt < 1:
                raise _bad("max_tokens: Input should be a positive integer")
            temperature = data.get("temperature")
            if temperature is not None:
                _check_temperature(temperature)
            stops = data.get("stop_sequences")
            if stops is not None:
                _check_stop_sequences(stops)
        thinking = data.get("thinking")
        if isinstance(thinking, dict):
            _check_not_bool(thinking, ("budget_tokens",), "integer", "thinking.")
        tools = data.get("tools")
        if tools is not None:
            _check_tools(tools)
        if "tool_choice" in data:
            _check_tool_choice(data["tool_choice"], tools)
        parts = []
        media = [False]
        system = data.get("system")
        if system is not None:
            parts.append(_blocks_text(system, "system", media, system=True, text_only=True))
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise _bad("messages: Field required" if messages is None else "messages: Input should be a valid list")
        if not messages:
            raise _bad("messages: at least one message is required")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise _bad(f"messages.{i}: Input should be a valid dictionary")
            role = msg.get("role")
            if role is None:
                raise _bad(f"messages.{i}.role: Field required")
            if not isinstance(role, str) or role not in _ROLES:
                # the system prompt is the top-level ``system``: Anthropic refuses a message of another
                # role, where vLLM renders a ``system`` one into its system prompt and SGLang refuses it
                raise _bad(f"messages.{i}.role: Input should be 'user' or 'assistant'")
            if "content" not in msg:
                raise _bad(f"messages.{i}.content: Field required")
            parts.append(role)
            parts.append(_blocks_text(msg["content"], f"messages.{i}.content", media))
        prompt_text = "\n".join(parts)
        user, session_id, session_key = caller_headers(headers)
        meta = data.get("metadata")
        if user is None and isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
            user = meta["user_id"]
        user = claimed_user(user)
        slo_ttft, slo_tpot = slo_objectives(headers)
        return InferenceRequest(
            path=path, body=body, data=data, model=model, stream=stream,
            include_usage=True,          # a Messages stream always carries its usage
            prompt_text=prompt_text,
            prompt_tokens_est=text_and_tools_tokens(prompt_text, tools),
            request_id=request_id, user=user, session_id=session_id, session_key=session_key,
            headers=headers,         # type: ignore[arg-type]
            multimodal=media[0], slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot,
        )

    def pd_refusal(self, path: str, engines: set[str]) -> str | None:
        """Messages run on an engine's pairs when its Messages request takes the P/D fields (vLLM's
        takes ``kv_transfer_params``). count_tokens, which generates nothing, runs whole on the
        chosen decode of any pair: both engines' handlers render the chat and count its tokens,
        without the scheduler that pairs legs (where SGLang's decode-mode server refuses a request
        without a bootstrap room)."""
        if path == COUNT_TOKENS:
            return None
        for engine in sorted(engines):
            why = adapter_for(engine).messages_pd_refusal
            if why is not None:
                return why
        return None

    def generates(self, path: str) -> bool:
        return path != COUNT_TOKENS

    def error_body(self, e: GatewayError) -> bytes:
        return orjson.dumps(anthropic_error(e.status, e.message, own_error_type(e)))

    def own_error(self, e: GatewayError) -> GatewayError:
        return own_error(e)

    def stream_error(self, ctx: Any, status: int, message: str, code: str | None) -> bytes:
        return error_event(status, message)

    def upstream_error(self, status: int, raw: bytes, ctx: Any = None) -> tuple[int, bytes, str]:
        status, err = normalize_upstream_error(status, raw)
        if status == 503:       # an engine's busy answer (SGLang's full queue, a vLLM not ready) is
            status = 529        # overload, which Anthropic answers with 529 (the SDK's OverloadedError)
        message = str(err["error"].get("message"))
        # the engine's own type when it is one of Anthropic's (vLLM's own are exception names);
        # not the one the normalising gave a body without any (FastAPI's ``{"detail"}``, text)
        given = err["error"].get("type") if _typed(raw) else None
        type_ = given if given in ERROR_TYPES else None
        return status, orjson.dumps(anthropic_error(status, message, type_)), message

    def scanner(self, ctx: Any) -> MessagesScanner:
        return MessagesScanner(self._inclusive(ctx))

    def body_usage(self, ctx: Any, data: dict[str, Any]) -> dict | None:
        stop = data.get("stop_reason")
        if isinstance(stop, str):
            ctx.rec.finish_reason = stop
        usage = data.get("usage")
        return openai_usage(usage, inclusive=self._inclusive(ctx)) if isinstance(usage, dict) else None

    def _inclusive(self, ctx: Any) -> bool:
        """Whether the engine that answers ``ctx`` counts its cache reads in ``input_tokens``: the
        decision's endpoint, or the one a retry went to (``rec.endpoint`` names it)."""
        ep = ctx.decision.endpoint if ctx.decision is not None else None
        name = ctx.rec.endpoint
        if ep is None or (name is not None and ep.name != name):
            ep = next((e for e in self.pool.endpoints(ctx.ireq.model) if e.name == name), ep)
        return ep is not None and adapter_for(ep.engine).messages_input_has_cache_reads


def _typed(raw: bytes) -> bool:
    """Whether an engine's error body names its error's type itself."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(data, dict):
        return False
    err = data.get("error")
    return isinstance(err.get("type") if isinstance(err, dict) else data.get("type"), str)


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _reports(usage: dict[str, Any]) -> bool:
    """Whether a stream's usage reports anything: SGLang's ``message_start`` carries zeros, and
    so does the ``message_delta`` it still sends after its own error event; a prompt has a token
    at least, so all zeros are no count (the stream is charged as one without its usage)."""
    return any(_count(usage.get(k)) for k in _USAGE_KEYS)


_USAGE_KEYS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def openai_usage(usage: dict[str, Any], output: int | None = None, inclusive: bool = False) -> dict[str, Any]:
    """An Anthropic usage object in OpenAI's spelling (what the gateway's accounting reads).
    ``inclusive``: its ``input_tokens`` already counts the cache reads (SGLang's)."""
    cache_read = _count(usage.get("cache_read_input_tokens"))
    prompt = _count(usage.get("input_tokens"))
    if not inclusive:
        prompt += cache_read + _count(usage.get("cache_creation_input_tokens"))
    return {"prompt_tokens": prompt,
            "completion_tokens": _count(usage.get("output_tokens")) if output is None else output,
            "prompt_tokens_details": {"cached_tokens": cache_read}}


_BOUNDARY = re.compile(rb"\n\r?\n")
_DELTA = b"content_block_delta"
_BLOCK_START = b"content_block_start"


# deltas that carry no generated token: a thinking block's signature, a text block's citation
# (text_delta, thinking_delta and input_json_delta carry the tokens)
_UNTOKENED = frozenset(("signature_delta", "citations_delta"))


# the member of each delta of generated tokens that holds them: empty, the delta carries none (an
# engine's empty token), as a chat chunk whose content is empty carries none
_TOKENS_IN = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}


def _maybe_untokened(data: bytes | bytearray, start: int, end: int) -> bool:
    """Whether the event at ``data[start:end]`` may be a delta of a type in ``_UNTOKENED``, or one
    whose tokens are an empty string: their names, and two quotes together (an empty string, or an
    escaped quote at a string's end), are searched for, and only an event holding one is decoded
    to tell."""
    return (data.find(b"signature_delta", start, end) >= 0 or data.find(b"citations_delta", start, end) >= 0
            or data.find(b'""', start, end) >= 0)


def _tokened(payload: bytes | None) -> bool:
    """Whether a ``content_block_delta`` event's data carries generated tokens: every delta but one
    whose type is in ``_UNTOKENED`` (data that cannot be read counts, as before)."""
    if payload is None:
        return True
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return True
    return _delta_tokened(obj) if isinstance(obj, dict) else True


def _delta_tokened(obj: dict[str, Any]) -> bool:
    delta = obj.get("delta")
    if not isinstance(delta, dict):
        return True
    kind = delta.get("type")
    if not isinstance(kind, str):       # a list or an object: no type of a delta
        return True
    if kind in _UNTOKENED:
        return False
    key = _TOKENS_IN.get(kind)
    return key is None or delta.get(key) != ""


def _names_tool(obj: dict[str, Any]) -> bool:
    """Whether a ``content_block_start`` opens a ``tool_use`` block naming its tool: the name is
    the first of the block's generated output the client sees (its input follows in deltas), as a
    chat stream's chunk naming a tool is a token; a text or thinking block starts empty."""
    block = obj.get("content_block")
    if not isinstance(block, dict) or block.get("type") != "tool_use":
        return False
    name = block.get("name")
    return isinstance(name, str) and name != ""


def _tool_named(payload: bytes) -> bool:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and _names_tool(obj)


def _parse_event(ev: bytes | bytearray) -> tuple[bytes | None, bytes | None]:
    """(event name, data payload) of one complete SSE event; either may be missing."""
    name = None
    data: list[bytes] = []
    for line in bytes(ev).split(b"\n"):
        if line.endswith(b"\r"):
            line = line[:-1]
        if line.startswith(b"event:"):
            name = line[6:].strip()
        elif line.startswith(b"data:"):
            v = line[5:]
            data.append(v[1:] if v.startswith(b" ") else v)
    return name, (b"\n".join(data) if data else None)


class MessagesScanner:
    """Scan an Anthropic Messages event stream (``StreamScanner``): bytes pass through unchanged."""

    __slots__ = ("first_token_at", "last_token_at", "token_events", "itl", "usage", "finish_reason", "error", "done",
                 "moved", "_start_usage", "_buf", "_pending", "_skip", "_now", "_cr", "_lf", "_retyped", "_inclusive",
                 "model")

    def __init__(self, inclusive: bool = False) -> None:
        self._inclusive = inclusive  # input_tokens counts the cache reads (``openai_usage``)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_events = 0       # content_block_delta events of generated tokens
        self.itl: list[float] = []
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.error: dict | None = None
        self.model: str | None = None   # the model message_start names (decoded already): the trace's
        self.done = False
        self.moved = False          # the last read held more than comments (``has_fields``)
        self._start_usage: dict[str, Any] = {}
        self._buf = bytearray()     # the current incomplete event
        self._pending = bytearray()  # the bytes of it not forwarded yet
        self._skip = False          # the current event outgrew MAX_EVENT_BYTES: not scanned
        self._now = 0.0
        self._cr = False            # lines end with bare CRs: read as LFs (gateway/pipeline/sse.py ``as_lf``)
        self._lf: bytearray | None = None   # with _cr: _buf as LFs, converted as its reads came
        self._retyped: bytes | None = None  # the engine's error event just scanned, with Anthropic's type

    def feed(self, chunk: bytes, now: float) -> bytes:
        """What of the bytes read so far goes to the client: every complete event. An event's
        first part waits here for its end, so that a stream the engine breaks in the middle of an
        event ends with the gateway's error event, not with half a frame glued to it (which the
        SDK would read as one event: a JSON error, or a ``ping`` that swallows the error)."""
        self._now = now
        pending = self._pending
        buf = self._buf
        old = len(buf)
        if buf:
            pos = old - 2 if old > 2 else 0
            buf += chunk
            data: bytes | bytearray = buf
        elif chunk:
            data, pos = chunk, 0
        else:
            self.moved = False
            return chunk
        self.moved = self._skip or has_fields(data)     # the held bytes begin an event
        if not self._cr:
            self._cr = cr_mode(data, max(pos - 1, 0))
        scan: bytes | bytearray = data
        if self._cr:
            scan = lf_scan(self._lf, data, old)
        start = 0
        swaps: list[tuple[int, int, bytes]] | None = None
        for m in _BOUNDARY.finditer(scan, pos):
            if self._skip:
                self._skip = False
            elif self._event(scan, start, m.start()):
                self._mark(now)
            elif self._retyped is not None:     # an error event, written again (rare: not on the common path)
                begin, end = start, m.start() - (scan[m.start() - 1] == 13)   # its last line's CR stays
                while scan[begin] in b"\r\n":     # and the end of the line before it, split from it
                    begin += 1
                swaps = [*(swaps or ()), (begin, end, self._retyped)]
                self._retyped = None
            start = m.end()
        size = len(data)
        if data is buf:
            del buf[:start]
        elif start < len(chunk):
            self._buf = bytearray(chunk[start:])
        if self._cr:            # the held bytes as LFs, kept with them
            if start >= size:
                self._lf = None
            elif scan is self._lf:
                del scan[:start]
            else:
                self._lf = bytearray(scan[start:])
        if self._skip or len(self._buf) > MAX_EVENT_BYTES:
            # not scanned, and not held either: forwarded as it comes, its last bytes kept (a blank
            # line split across reads) at every read, not grown back to the bound
            self._skip = True
            del self._buf[:-2]
            if self._lf is not None:
                del self._lf[:-2]
        if self._skip:
            if pending:
                out, self._pending = bytes(pending) + chunk, bytearray()
            else:
                out = chunk
        else:
            keep = len(self._buf)       # the incomplete event: the tail of what came
            if not pending:
                if not keep:
                    out = chunk
                else:
                    self._pending = bytearray(chunk[len(chunk) - keep:])
                    out = chunk[:len(chunk) - keep]
            else:
                pending += chunk
                out = bytes(pending[:len(pending) - keep])
                del pending[:len(pending) - keep]
        if swaps is not None:
            out = self._swapped(out, size, start, swaps)
        return out

    def _swapped(self, out: bytes, size: int, start: int, swaps: list[tuple[int, int, bytes]]) -> bytes:
        """``out`` with the events at ``swaps`` (offsets in the ``size`` bytes scanned) put in their
        new bytes. ``out`` is a run of those bytes that ends where the complete events end
        (``start``), or at their end when the event after them is forwarded as it comes."""
        base = (size if self._skip else start) - len(out)
        for begin, end, frame in reversed(swaps):
            if begin >= base:
                out = out[:begin - base] + frame + out[end - base:]
        return out

    def finish(self) -> bytes:
        """The stream's last bytes, when they end it (or carry the engine's error) without a blank
        line after them; an incomplete event is dropped, since the stream ends in an error event."""
        buf, self._buf = self._buf, bytearray()
        self._lf = None
        held, self._pending = bytes(self._pending), bytearray()
        ev = (as_lf(buf) if self._cr else bytes(buf)).rstrip(b"\r\n")
        if ev and not self._skip and self._event(ev, 0, len(ev)):
            self._mark(self._now)
        if self._retyped is not None:
            lead = len(held) - len(held.lstrip(b"\r\n"))     # the end of the line before it stays
            held, self._retyped = held[:lead] + self._retyped + b"\n\n", None
        return held if self.done or self.error is not None else b""

    def drain_itl(self) -> list[float]:
        gaps, self.itl = self.itl, []
        return gaps

    def _mark(self, now: float) -> None:
        """A delta of generated tokens, come in the read of ``now``: the gaps are those between
        reads (each has its own time), as chat's are; deltas that came in one read add none."""
        self.token_events += 1
        last = self.last_token_at
        if last is None:
            self.first_token_at = now
        elif now != last and len(self.itl) < ITL_KEEP:
            self.itl.append(now - last)
        self.last_token_at = now

    def _event(self, data: bytes | bytearray, start: int, end: int) -> bool:
        """Scan one event; True when it carried generated content."""
        if self.done:           # after message_stop: passed on as it came, but no part of the answer
            return False
        head = data.find(b"\n", start, end)
        first = data[start:end if head < 0 else head]
        if first.startswith(b"event:") and _DELTA in first:
            if _maybe_untokened(data, start, end):
                return _tokened(_parse_event(data[start:end])[1])
            return True               # the common case, never decoded
        name, payload = _parse_event(data[start:end])
        if name == _DELTA:
            return _tokened(payload) if _maybe_untokened(data, start, end) else True
        if payload is None:
            return False
        if name == _BLOCK_START:        # a tool's name, generated, comes in its block's start
            return b'"tool_use"' in payload and _tool_named(payload)
        if name is None or name in (b"message_start", b"message_delta", b"error", b"message_stop"):
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return False
            if not isinstance(obj, dict):
                return False
            kind = obj.get("type") if name is None else name.decode("ascii", "replace")
            return self._apply(kind, obj)
        return False

    def _apply(self, kind: Any, obj: dict[str, Any]) -> bool:
        if kind == "content_block_delta":
            return _delta_tokened(obj)
        if kind == "content_block_start":
            return _names_tool(obj)
        if kind == "message_start":
            msg = obj.get("message")
            usage = msg.get("usage") if isinstance(msg, dict) else None
            model = msg.get("model") if isinstance(msg, dict) else None
            if model.__class__ is str:
                self.model = model
            if isinstance(usage, dict):
                self._start_usage = usage
                if _reports(usage):
                    # its output count is not the answer's (message_delta's is): none until that comes,
                    # so a stream broken before it logs no completion count, as a chat stream's
                    self.usage = {**openai_usage(usage, inclusive=self._inclusive), "completion_tokens": None}
        elif kind == "message_delta":
            usage = obj.get("usage")
            if isinstance(usage, dict):
                # message_delta's counts are cumulative; the input side may be left to message_start
                merged = {**self._start_usage, **{k: v for k, v in usage.items() if v is not None}}
                if _reports(merged):
                    self.usage = openai_usage(merged, inclusive=self._inclusive)
            delta = obj.get("delta")
            stop = delta.get("stop_reason") if isinstance(delta, dict) else None
            if isinstance(stop, str):
                self.finish_reason = stop
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            err = obj.get("error")
            self.error = err if isinstance(err, dict) else {"message": str(err)}
            given = err.get("type") if isinstance(err, dict) else None
            if given.__class__ is not str or given not in ERROR_TYPES:
                # not a type of Anthropic's (vLLM's ``internal_error``, or none): the client would
                # not know it, so the frame is written again with the type its code names
                fixed = {"type": error_type(event_status(self.error) or 500),
                         **{k: v for k, v in self.error.items() if k != "type"}}
                self._retyped = b"event: error\ndata: " + orjson.dumps({**obj, "type": "error", "error": fixed})
        return False

