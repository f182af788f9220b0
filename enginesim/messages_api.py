"""vLLM's Anthropic Messages API (``vllm/entrypoints/anthropic/``): ``/v1/messages`` and count_tokens.

vLLM turns a Messages request into a chat completion (the system prompt first, then the
messages), runs it, and converts the answer. What a gateway sees, reproduced here:

- Non-streaming: ``{"id", "type": "message", "role": "assistant", "content": [{"type": "text",
  "text"}], "model", "stop_reason", "usage": {"input_tokens", "output_tokens"}}``; ``None``
  fields are left out. ``model`` is the chat answer's: a LoRA adapter's name, else the served
  name. The id is the chat completion's (``chatcmpl-…``). ``stop_reason``: ``end_turn`` for EOS,
  ``max_tokens`` for length, and for a stop string of the request's ``stop_sequences`` (the chat
  choice's ``stop_reason`` a string) ``stop_sequence``, with the
  matched string in ``stop_sequence`` (left out otherwise). A prefill for a remote decode
  (``kv_transfer_params.do_remote_decode``) answers its ``kv_transfer_params`` at top level, as the
  chat answer vLLM converts does; a decode takes the params the same way as chat (the request's
  top-level ``kv_transfer_params`` goes into the chat request vLLM builds).
- Streaming: headers as soon as the request is admitted (as for chat), then, each frame as
  ``event: <type>`` + ``data: {...}``: ``message_start`` (with the first output; ``usage``
  carries ``input_tokens`` and ``output_tokens: 0``), ``content_block_start`` (index 0, an empty
  text block) before the first text, one ``content_block_delta`` (``text_delta``) per output,
  ``content_block_stop``, ``message_delta`` (``stop_reason``, ``stop_sequence``: the matched string
  or null, and the cumulative usage, input tokens included), ``message_stop``. No ``ping`` frames,
  no ``[DONE]``.
- With a reasoning parser, the chat's reasoning is a ``thinking`` block before the text: whole,
  ``{"type": "thinking", "thinking", "signature": <uuid hex>}``; streamed, its block start
  ``{"type": "thinking", "thinking": ""}``, ``thinking_delta`` deltas, then a ``signature_delta``
  and its ``content_block_stop`` before the text block (index 1) starts.
- Errors: ``{"type": "error", "error": {"type", "message"}}`` where ``type`` is vLLM's exception
  name (``NotFoundError``, ``BadRequestError``) and the status is the error's. A failure
  mid-stream is ``event: error`` with ``{"type": "error", "error": {"type": "internal_error",
  "message"}}``, and the stream ends there (no ``message_stop``).
- count_tokens: ``{"input_tokens": N, "context_management": {"original_input_tokens": N}}``.
- What its request model refuses is a validation 400 in this shape (type ``Bad Request``) naming
  the field: a block type or ``tool_choice`` type outside its Literals, a ``tool_choice`` or
  ``metadata`` that is not an object, ``stop_sequences`` that are not a list of strings, a
  message's role other than user, assistant and system (Claude Code's ``ctx`` and ``msg`` are read
  as user first). SGLang's model refuses the same, its roles user and assistant only.

SGLang's Anthropic handler (``sglang/srt/entrypoints/anthropic/``) converts the same way but
answers in its own dialect, reproduced by ``SGLangMessagesApi``:

- Non-streaming: the id is ``msg_<hex>``, ``model`` the request's; ``stop_reason`` is ``end_turn``
  for any stop (a stop string included: no ``stop_sequence`` reason, no field), ``max_tokens`` for
  length. ``usage`` is ``{"input_tokens": <prompt tokens, cached ones included>, "output_tokens",
  "cache_read_input_tokens": <cached>}``: the input count is the whole prompt's, unlike
  Anthropic's, whose ``input_tokens`` leaves the cache reads out.
- Streaming: the head goes out at once (a ``StreamingResponse`` over the chat stream, not the chat
  path's wait for the first chunk). ``message_start`` comes with the first chunk and its usage is
  zeros; the text block; then ``content_block_stop``, ``message_delta`` (``{"stop_reason"}`` and
  the usage as above) and ``message_stop``. A failure in the chat stream becomes ``event: error``
  ``{"type": "error", "error": {"type": "api_error", "message": "Stream processing error"}}``,
  and the stream still ends with ``message_delta`` (zero usage) and ``message_stop``.
- A failure of a non-streaming request (the context too long included) is a 500
  ``{"type": "error", "error": {"type": "internal_error", "message": "Internal processing error"}}``;
  a body its models refuse is FastAPI's validation 400 in SGLang's OpenAI envelope. ``model`` is
  echoed, never checked; a ``system`` role inside ``messages`` is refused (roles are user and
  assistant only).
- count_tokens: ``{"input_tokens": N}``.
"""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web

from enginesim.engine import Engine
from enginesim.errors import ApiError, ErrorStyle, vllm_type
from enginesim.frontend import (
    Dropped,
    at_end,
    check_fault_status,
    collect,
    outputs,
    request_dp_rank,
    request_fault,
    request_priority,
    slow_headers,
)
from enginesim.protocol import lax_bool, lax_int, parse_stop
from enginesim.sequence import SamplingParams, Sequence
from enginesim.tokenizer import content_text
from enginesim.tools import ToolCalls, messages_tool_calls, rendered_tools, sglang_call_id, vllm_call_id
from enginesim.tracing import trace_headers
from enginesim.wire import dumps, json_response, read_json

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop(seq: Sequence) -> tuple[str, str | None]:
    """The Anthropic stop reason of a finished sequence, and the stop sequence it matched: a stop
    string ends it with ``stop_sequence`` (an EOS, whose stop reason is a token id, with
    ``end_turn``)."""
    if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
        return "stop_sequence", seq.stop_reason
    return _STOP_REASONS.get(seq.finish_reason or "", "end_turn"), None


def _error_response(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    body = {"type": "error", "error": {"type": exc.type_ or vllm_type(exc.status), "message": exc.message}}
    return json_response(body, status=exc.status, headers=headers)


def _stream_flag(body: dict[str, Any]) -> bool:
    """``stream`` as vLLM's ``bool | None`` field reads it (lax: "true", 1, ...)."""
    v = body.get("stream")
    if v is None:
        return False
    try:
        return lax_bool(v)
    except ValueError as e:
        raise ApiError(400, f"1 validation error:\n  stream: {e}", type_="Bad Request") from None



def _max_tokens(body: dict[str, Any], not_positive: str) -> int:
    """``max_tokens``, required, as the engine's request model reads it (lax: "8"), above 0; the
    message for one that is not is each engine's."""
    try:
        n = lax_int(body.get("max_tokens"))
    except ValueError as e:
        raise ApiError(400, f"1 validation error:\n  max_tokens: {e}", type_="Bad Request") from None
    if n <= 0:
        raise ApiError(400, f"1 validation error:\n  max_tokens: {not_positive}", type_="Bad Request")
    return n

def _frame(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + dumps(data) + b"\n\n"


def _tool_use_blocks(calls: ToolCalls, text: str) -> list[dict[str, Any]]:
    """A whole answer's ``tool_use`` blocks, their ``input`` the calls' arguments decoded."""
    return [{"type": "tool_use", "id": calls.ids[i], "name": name, "input": orjson.loads(calls.arguments(i, text))}
            for i, name in enumerate(calls.names)]


def _tool_use_frames(calls: ToolCalls, text: str, finishing: bool) -> list[bytes]:
    """A stream's frames of ``tool_use`` blocks for one output: the first call's block opened at
    index 0 with its first piece, an ``input_json_delta`` per piece, and when the answer finishes
    its end and the other calls' blocks, each opened, given its input whole and closed."""
    frames = []
    started = calls._opened
    if text or (finishing and not started):
        piece = calls.piece(text)
        if not started:
            frames.append(_frame("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
                "type": "tool_use", "id": calls.ids[0], "name": calls.names[0], "input": {}}}))
        frames.append(_json_delta(0, piece))
    if finishing:
        frames.append(_json_delta(0, calls.close()))
        frames.append(_frame("content_block_stop", {"type": "content_block_stop", "index": 0}))
        for i in range(1, len(calls.names)):
            frames.append(_frame("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                "type": "tool_use", "id": calls.ids[i], "name": calls.names[i], "input": {}}}))
            frames.append(_json_delta(i, calls.arguments(i, calls.text)))
            frames.append(_frame("content_block_stop", {"type": "content_block_stop", "index": i}))
    return frames


def _json_delta(index: int, piece: str) -> bytes:
    return _frame("content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "input_json_delta", "partial_json": piece}})


# the content block types and tool choices each engine's request model takes (a pydantic Literal):
# another is its validation 400 (vLLM's ``vllm/entrypoints/anthropic/protocol.py``, SGLang's
# ``sglang/srt/entrypoints/anthropic/protocol.py``); Anthropic's document, search_result, ... are not among them
VLLM_BLOCKS = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking")
SGLANG_BLOCKS = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
TOOL_CHOICES = ("auto", "any", "tool", "none")
# the roles of a message: vLLM reads Claude Code's ``ctx`` and ``msg`` as ``user`` before checking
VLLM_ROLES = ("user", "assistant", "system")
SGLANG_ROLES = ("user", "assistant")
_VLLM_ROLE_MAP = {"ctx": "user", "msg": "user"}


def _literal(values: tuple[str, ...]) -> str:
    quoted = [f"'{v}'" for v in values]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def check_request_model(body: dict[str, Any], blocks: tuple[str, ...]) -> None:
    """What the engine's request model refuses of the blocks of ``system`` and ``messages`` and of
    ``tool_choice``: a block type it has no place for, a tool_choice type outside its four."""
    def check(content: Any, where: str) -> None:
        if not isinstance(content, list):
            return
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in blocks:
                raise ApiError(400, f"1 validation error:\n  {where}.list[AnthropicContentBlock].{j}.type: "
                               f"Input should be {_literal(blocks)}", type_="Bad Request")
    check(body.get("system"), "system")
    messages = body.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(m, dict):
            check(m.get("content"), f"messages.{i}.content")
    tc = body.get("tool_choice")
    if tc is not None and not isinstance(tc, dict):
        raise ApiError(400, "1 validation error:\n  tool_choice: Input should be a valid dictionary or instance of "
                       "AnthropicToolChoice", type_="Bad Request")
    if isinstance(tc, dict) and isinstance(tc.get("type"), str) and tc["type"] not in TOOL_CHOICES:
        raise ApiError(400, f"1 validation error:\n  tool_choice.type: Input should be {_literal(TOOL_CHOICES)}",
                       type_="Bad Request")


def check_roles(body: dict[str, Any], roles: tuple[str, ...]) -> None:
    """A message's role the engine's request model has no place for (a pydantic Literal)."""
    messages = body.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(m, dict) and m.get("role") not in roles:
            raise ApiError(400, f"1 validation error:\n  messages.{i}.role: Input should be {_literal(roles)}",
                           type_="Bad Request")


def messages_fields(body: dict[str, Any]) -> tuple[str, ...]:
    """What both engines' Messages request models refuse of ``metadata`` (an object) and
    ``stop_sequences`` (a list of strings); the stop sequences."""
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise ApiError(400, "1 validation error:\n  metadata: Input should be a valid dictionary", type_="Bad Request")
    stops = body.get("stop_sequences")
    if stops is None:
        return ()
    if not isinstance(stops, list):
        raise ApiError(400, "1 validation error:\n  stop_sequences: Input should be a valid list", type_="Bad Request")
    for i, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise ApiError(400, f"1 validation error:\n  stop_sequences.{i}: Input should be a valid string",
                           type_="Bad Request")
    return parse_stop(stops)


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "".join(b.get("text") or "" for b in system if isinstance(b, dict) and b.get("type") == "text")
    raise ApiError(400, "1 validation error:\n  system: Input should be a valid string or list", type_="Bad Request")


def _tool_result_text(content: Any) -> str:
    """A ``tool_result`` block's content as the tool message both engines make of it: a string,
    or its text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text") or "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _chat_turns(role: Any, content: Any) -> list[dict[str, Any]]:
    """The chat messages both engines make of one Messages message: a ``tool_use`` block an
    assistant's ``tool_calls`` entry (its input as JSON), a user's ``tool_result`` block a ``tool``
    message of its own (before the message's other content; an assistant's is text), the other
    blocks the message's content. A user message left without content is dropped."""
    if not isinstance(content, list):
        return [{"role": role, "content": content_text(content)}]
    out: list[dict[str, Any]] = []
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            calls.append({"id": block.get("id") or "", "type": "function", "function": {
                "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                        "content": _tool_result_text(block.get("content"))})
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {_tool_result_text(block.get('content'))}"})
        else:
            parts.append(block)
    if parts or calls or role != "user":
        msg: dict[str, Any] = {"role": role, "content": content_text(parts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat conversation vLLM renders for a Messages body: the system prompt (top level, and
    any system messages) first, then the user and assistant messages, their tool calls and
    results as chat's (``_chat_turns``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "1 validation error:\n  messages: Input should be a valid list", type_="Bad Request")
    system = _system_text(body.get("system"))
    system += "".join(content_text(m.get("content")) for m in messages if m.get("role") == "system")
    out = [{"role": "system", "content": system}] if system else []
    for m in messages:
        if m.get("role") != "system":
            out += _chat_turns(m.get("role"), m.get("content"))
    return out


class MessagesApi:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages),
                web.post("/v1/messages/count_tokens", self.count_tokens)]

    def _adapter(self, model: Any) -> str | None:
        """The LoRA adapter ``model`` names, if it is a registered one (vLLM's chat path, which its
        Messages handler goes through, takes a loaded adapter's name as the model)."""
        lora = self.engine.lora
        return model if lora is not None and isinstance(model, str) and model in lora.registered else None

    def _check_model(self, model: Any) -> None:
        if not isinstance(model, str) or not model:
            raise ApiError(400, "1 validation error:\n  model: Field required", type_="Bad Request")
        if model not in self.cfg.served_model_names and self._adapter(model) is None:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") in _VLLM_ROLE_MAP
                                              for m in messages):
            body = {**body, "messages": [{**m, "role": _VLLM_ROLE_MAP[m["role"]]}
                                         if isinstance(m, dict) and m.get("role") in _VLLM_ROLE_MAP else m
                                         for m in messages]}
        check_roles(body, VLLM_ROLES)
        check_request_model(body, VLLM_BLOCKS)
        ids = self.engine.tokenizer.encode_chat(chat_messages(body), rendered_tools(body.get("tools"), "input_schema"))
        limit = self.engine.max_prompt_tokens
        if len(ids) > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your "
                           f"prompt contains {len(ids)} input tokens. Please reduce the length of the input.")
        return ids

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, require_json=True)
            self._check_model(body.get("model"))
            n = len(self._prompt_ids(body))
        except ApiError as exc:
            return self._error(exc)
        return json_response(self._counted(n))

    def _error(self, exc: ApiError) -> web.Response:
        return _error_response(exc)

    def _counted(self, n: int) -> dict[str, Any]:
        return {"input_tokens": n, "context_management": {"original_input_tokens": n}}

    async def messages(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        try:
            body = await read_json(request, require_json=True)
            self._check_model(body.get("model"))
            max_tokens = _max_tokens(body, "max_tokens must be positive")
            stream = _stream_flag(body)
            stop = messages_fields(body)
            if engine.dead:
                raise ApiError(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                               type_="InternalServerError")
            prompt_ids = self._prompt_ids(body)
            fault = request_fault(engine, request)
            n, ctx = len(prompt_ids), self.cfg.max_model_len
            if max_tokens + n > ctx:        # vLLM's chat path checks the Messages request too
                raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                               f"model's maximum context length is {ctx} tokens and your request has {n} input "
                               f"tokens ({max_tokens} > {ctx} - {n}).", type_="BadRequestError", param="max_tokens")
            check_fault_status(engine, fault)
            base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            seq_id = f"chatcmpl-{base}"
            seq = engine.new_sequence(
                seq_id=seq_id, rid=f"{seq_id}-{uuid.uuid4().hex[:8]}", prompt_ids=prompt_ids,
                params=SamplingParams(max_tokens=max(1, max_tokens), min_tokens=0,
                                      stop=stop, ignore_eos=False),
                stream=stream, fault=fault, cache_salt=None, lora=self._adapter(body.get("model")),
                dp_rank=request_dp_rank(engine, request))
            seq.trace_headers = trace_headers(request.headers)
            seq.priority = request_priority(engine, request, body)
            if self.cfg.tool_call_parser:
                seq.tool_calls = messages_tool_calls(body, vllm_call_id)
            engine.role.accept(seq, body)
        except ApiError as exc:
            return _error_response(exc)
        engine.submit(seq)
        try:
            if stream:
                return await self._stream(request, seq)
            return await self._complete(request, seq)
        except Dropped:
            return web.Response(status=500)     # never reaches the client: the transport is gone
        finally:
            engine.client_gone(seq)

    def _reasoning_budget(self, seq: Sequence) -> int:
        """How many of the answer's first tokens are reasoning (the chat's, with vLLM's
        ``--reasoning-parser``: half its ``max_tokens``), a ``thinking`` block here."""
        if not self.cfg.reasoning_parser or self.cfg.engine != "vllm" or seq.tool_calls is not None:
            return 0
        return seq.params.max_tokens // 2

    async def _complete(self, request: web.Request, seq: Sequence) -> web.StreamResponse:
        result = await collect(self.engine, request, seq)
        await slow_headers(self.engine, seq.fault)
        if result.final.finish_reason == "error" or result.final.status is not None:
            return _error_response(ApiError(500, "Internal server error", type_="InternalServerError"))
        content = [{"type": "text", "text": result.text}] if result.text else []
        k = min(self._reasoning_budget(seq), len(seq.output_ids))
        if k:       # the chat's reasoning first, a thinking block with a signature of vLLM's (a uuid's hex)
            thought = "".join(self.engine.tokenizer.piece(t) for t in seq.output_ids[:k])[:len(result.text)]
            rest = result.text[len(thought):]
            content = [{"type": "thinking", "thinking": thought, "signature": uuid.uuid4().hex}]
            if rest:
                content.append({"type": "text", "text": rest})
        if seq.tool_calls is not None:
            content = _tool_use_blocks(seq.tool_calls, result.text)
        out: dict[str, Any] = {"id": seq.id, "type": "message", "role": "assistant", "content": content,
                               "model": seq.lora or self.cfg.served_name,
                               "usage": {"input_tokens": seq.prompt_tokens, "output_tokens": seq.completion_tokens}}
        if seq.tool_calls is not None:
            out["stop_reason"] = "tool_use"
        elif seq.finish_reason in _STOP_REASONS:
            out["stop_reason"], matched = _stop(seq)
            if matched is not None:
                out["stop_sequence"] = matched
        # the chat answer's kv_transfer_params at top level (messages_full_converter), None left out
        out.update((k, v) for k, v in self.engine.role.response_extras(seq).items() if v is not None)
        return json_response(out)

    async def _stream(self, request: web.Request, seq: Sequence) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        resp.charset = "utf-8"
        await slow_headers(self.engine, seq.fault)
        await resp.prepare(request)             # vLLM: headers once the request is admitted
        started = block_open = False
        budget, done, index, thinking = self._reasoning_budget(seq), 0, 0, False
        async with aclosing(outputs(self.engine, request, seq, self.cfg.sse_keepalive_s)) as stream:
            async for out in stream:
                if out is None:
                    continue                    # vLLM's keep-alive is a chat-stream feature
                if out.finish_reason == "error" or out.status is not None:
                    await resp.write(_frame("error", {"type": "error", "error": {
                        "type": "internal_error", "message": out.message or "Internal server error"}}))
                    await resp.write_eof()
                    return resp
                if not started:
                    started = True
                    await resp.write(_frame("message_start", {"type": "message_start", "message": {
                        "id": seq.id, "type": "message", "role": "assistant", "content": [],
                        "model": seq.lora or self.cfg.served_name, "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": seq.prompt_tokens, "output_tokens": 0}}}))
                if seq.tool_calls is not None:
                    for frame in _tool_use_frames(seq.tool_calls, out.text, out.finish_reason is not None):
                        await resp.write(frame)
                elif out.text and done < budget:
                    if not thinking:            # a thinking block, its signature sent as it closes
                        thinking = True
                        await resp.write(_frame("content_block_start", {
                            "type": "content_block_start", "index": 0,
                            "content_block": {"type": "thinking", "thinking": ""}}))
                    await resp.write(_frame("content_block_delta", {
                        "type": "content_block_delta", "index": 0,
                        "delta": {"type": "thinking_delta", "thinking": out.text}}))
                elif out.text:
                    if thinking:
                        await resp.write(self._end_thinking())
                        thinking, index = False, 1
                    if not block_open:
                        block_open = True
                        await resp.write(_frame("content_block_start", {
                            "type": "content_block_start", "index": index,
                            "content_block": {"type": "text", "text": ""}}))
                    await resp.write(_frame("content_block_delta", {
                        "type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": out.text}}))
                done += len(out.token_ids)
        if thinking:
            await resp.write(self._end_thinking())
        if block_open:
            await resp.write(_frame("content_block_stop", {"type": "content_block_stop", "index": index}))
        reason, matched = _stop(seq) if seq.tool_calls is None else ("tool_use", None)
        await resp.write(_frame("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
            "usage": {"input_tokens": seq.prompt_tokens, "output_tokens": seq.completion_tokens}}))
        await resp.write(_frame("message_stop", {"type": "message_stop"}))
        await at_end(self.engine, request, seq.fault)
        await resp.write_eof()
        return resp


    @staticmethod
    def _end_thinking() -> bytes:
        """The close of the thinking block (index 0): its signature, then its stop."""
        return (_frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "signature_delta", "signature": uuid.uuid4().hex}})
                + _frame("content_block_stop", {"type": "content_block_stop", "index": 0}))


class SGLangMessagesApi(MessagesApi):
    """SGLang's Messages API (see the module's docstring for how it differs from vLLM's)."""

    def _check_model(self, model: Any) -> None:
        if not isinstance(model, str) or not model:
            raise ApiError(400, "1 validation error:\n  model: Field required", type_="Bad Request")

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        check_roles(body, SGLANG_ROLES)
        check_request_model(body, SGLANG_BLOCKS)
        return self.engine.tokenizer.encode_chat(chat_messages(body), rendered_tools(body.get("tools"), "input_schema"))

    def _error(self, exc: ApiError) -> web.Response:
        if exc.status == 400 and exc.type_ == "Bad Request":     # the request's model refused it
            return exc.response(ErrorStyle.SGLANG_OPENAI)
        return _error_response(exc)

    def _usage(self, seq: Sequence) -> dict[str, int]:
        cached = seq.cached_tokens if self.cfg.report_cached_tokens else 0
        return {"input_tokens": seq.prompt_tokens, "output_tokens": seq.completion_tokens,
                "cache_read_input_tokens": cached}

    def _counted(self, n: int) -> dict[str, Any]:
        return {"input_tokens": n}

    async def messages(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        try:
            body = await read_json(request, require_json=True)
            self._check_model(body.get("model"))
            max_tokens = _max_tokens(body, "Value error, max_tokens must be positive")     # pydantic's validator
            stream = _stream_flag(body)
            stop = messages_fields(body)
            prompt_ids = self._prompt_ids(body)
            fault = request_fault(engine, request)
            check_fault_status(engine, fault)
        except ApiError as exc:
            return self._error(exc)
        model = body["model"]
        n = len(prompt_ids)      # the tokenizer manager's checks fail inside the chat handler
        too_long = engine.dead or n > engine.max_prompt_tokens or n + max_tokens >= self.cfg.max_model_len
        if not stream and too_long:
            return self._failed()
        seq: Sequence | None = None
        if not too_long:
            seq = engine.new_sequence(
                seq_id=uuid.uuid4().hex, rid=uuid.uuid4().hex, prompt_ids=prompt_ids,
                params=SamplingParams(max_tokens=max_tokens, min_tokens=0, stop=stop, ignore_eos=False),
                stream=stream, fault=fault, cache_salt=None, dp_rank=request_dp_rank(engine, request))
            seq.trace_headers = trace_headers(request.headers)
            seq.priority = request_priority(engine, request, body)
            if self.cfg.tool_call_parser:
                seq.tool_calls = messages_tool_calls(body, sglang_call_id)
            engine.role.accept(seq, body)
            engine.submit(seq)
        try:
            if stream:
                return await self._sglang_stream(request, seq, model, fault)
            assert seq is not None
            return await self._sglang_complete(request, seq, model)
        except Dropped:
            return web.Response(status=500)     # never reaches the client: the transport is gone
        finally:
            if seq is not None:
                engine.client_gone(seq)

    def _failed(self) -> web.Response:
        return _error_response(ApiError(500, "Internal processing error", type_="internal_error"))

    async def _sglang_complete(self, request: web.Request, seq: Sequence, model: str) -> web.StreamResponse:
        result = await collect(self.engine, request, seq)
        await slow_headers(self.engine, seq.fault)
        if result.final.finish_reason == "error" or result.final.status is not None:
            return self._failed()
        content = [{"type": "text", "text": result.text}] if result.text else []
        finish = seq.finish_reason
        if seq.tool_calls is not None:
            content, finish = _tool_use_blocks(seq.tool_calls, result.text), "tool_calls"
        return json_response({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                              "content": content, "model": model,
                              "stop_reason": _STOP_REASONS.get(finish or "stop", "end_turn"),
                              "usage": self._usage(seq)})

    async def _sglang_stream(self, request: web.Request, seq: Sequence | None, model: str,
                             fault: Any) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        resp.charset = "utf-8"
        await slow_headers(self.engine, fault)
        await resp.prepare(request)             # the head at once: a StreamingResponse
        started = block_open = False
        usage = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
        finish: str | None = None
        if seq is None:                         # the chat stream's first chunk is its error
            await resp.write(_STREAM_ERROR)
        else:
            async with aclosing(outputs(self.engine, request, seq, self.cfg.sse_keepalive_s)) as stream:
                async for out in stream:
                    if out is None:
                        continue
                    if out.finish_reason == "error" or out.status is not None:
                        await resp.write(_STREAM_ERROR)
                        break
                    if not started:
                        started = True
                        await resp.write(_frame("message_start", {"type": "message_start", "message": {
                            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": [],
                            "model": model, "usage": dict(usage)}}))
                    if seq.tool_calls is not None:
                        for frame in _tool_use_frames(seq.tool_calls, out.text, out.finish_reason is not None):
                            await resp.write(frame)
                    elif out.text:
                        if not block_open:
                            block_open = True
                            await resp.write(_frame("content_block_start", {
                                "type": "content_block_start", "index": 0,
                                "content_block": {"type": "text", "text": ""}}))
                        await resp.write(_frame("content_block_delta", {
                            "type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": out.text}}))
                    if out.finish_reason is not None:
                        finish = out.finish_reason if seq.tool_calls is None else "tool_calls"
                else:
                    usage = self._usage(seq)
        if block_open:
            await resp.write(_frame("content_block_stop", {"type": "content_block_stop", "index": 0}))
        await resp.write(_frame("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": _STOP_REASONS.get(finish or "stop", "end_turn")},
            "usage": usage}))
        await resp.write(_frame("message_stop", {"type": "message_stop"}))
        if seq is not None:
            await at_end(self.engine, request, seq.fault)
        await resp.write_eof()
        return resp


_STREAM_ERROR = _frame("error", {"type": "error", "error": {"type": "api_error", "message": "Stream processing error"}})


def sglang_routes(engine: Engine) -> list[web.RouteDef]:
    return SGLangMessagesApi(engine).routes()
