"""The Responses API (``/v1/responses``) as vLLM and SGLang serve it, for either engine style.

Shapes from the engines' own handlers (vLLM ``entrypoints/openai/serving_responses.py`` and its
``responses/api_router.py``; SGLang ``srt/entrypoints/openai/serving_responses.py``, itself
adapted from vLLM's):

* ``POST /v1/responses``; ``GET /v1/responses/{id}``; ``POST /v1/responses/{id}/cancel``. Neither
  engine serves ``DELETE`` or ``/input_items`` (405 / 404 here too).
* Ids are ``resp_<uuid hex>`` (a body ``request_id`` wins); output messages ``msg_<uuid hex>``.
* The store is a per-process dict that never evicts: response by id, and the input messages by id.
  vLLM keeps it only with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``--enable-responses-store``
  here); without it ``store: true`` is silently ignored and ``background`` is refused. SGLang
  always stores. A restarted engine has forgotten everything.
* ``previous_response_id``: the conversation is ``instructions`` as a system message, the previous
  response's stored messages, its output messages as assistant turns, then the new input; an
  unknown id is 404 ``Response with id '<id>' not found.`` (SGLang first refuses an id that does
  not start with ``resp_``: 400, param ``response_id``).
* A stream is ``event: <type>`` + ``data: <json>`` frames, no ``[DONE]``: ``response.created``,
  ``response.in_progress``, then with the first text ``response.output_item.added`` and
  ``response.content_part.added``, one ``response.output_text.delta`` per engine step,
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
  and ``response.completed`` with the usage; ``sequence_number`` counts from 0. An engine failure
  mid-stream breaks the connection (the generator raises under Starlette).
* Usage is ``input_tokens``/``output_tokens`` (+ details) for vLLM; SGLang's non-streaming body
  keeps its chat ``UsageInfo`` (``prompt_tokens``/``completion_tokens``) and converts it only in
  ``response.completed``.
* An answer that ``max_output_tokens`` (or the context) cut short: vLLM says ``status: "incomplete"``
  with ``incomplete_details: {"reason": "max_output_tokens"}`` (its message item stays
  ``completed``), in the body and in the stream's last response, whose event is still
  ``response.completed`` (OpenAI's is ``response.incomplete``); SGLang says ``completed`` (it sets
  ``incomplete`` on its gpt-oss path only). Cancel of a finished response is 400
  ``Cannot cancel a synchronous response.``
* ``background`` with ``stream`` (vLLM): the stream's events are made by the background task and
  kept; the POST's answer follows them, and ``GET /v1/responses/{id}?stream=true&starting_after=N``
  replays those after sequence number N and follows the rest, so a client that left resumes. A
  reader that leaves does not stop the response. SGLang answers a background request whole.
* Default output length: the simulator's chat default (``--default-max-tokens``), not the engines'
  rest-of-context, so an unbounded request stays short.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from enginesim.engine import Engine
from enginesim.errors import ApiError, ErrorStyle
from enginesim.frontend import (
    Dropped,
    at_end,
    check_fault_status,
    request_dp_rank,
    request_fault,
    request_priority,
    slow_headers,
)
from enginesim.logprobs import responses_logprobs, responses_requested
from enginesim.protocol import bool_field, lax_int
from enginesim.sequence import SamplingParams, Sequence
from enginesim.tokenizer import content_text
from enginesim.tools import ToolCalls, rendered_tools, responses_tool_calls
from enginesim.tracing import trace_headers
from enginesim.wire import SseWriter, drop_connection, dumps, json_response, read_json

_BAD = "Bad Request"


def _message(item: Any) -> dict[str, Any]:
    """One input item as a chat message, as both engines' non-harmony path builds it (vLLM's
    ``construct_chat_message_with_tool_call``): a ``function_call`` an assistant turn whose
    ``tool_calls`` entry is that call (no content), a ``function_call_output`` a ``tool`` message
    naming the call, a ``reasoning`` item an assistant turn holding only its reasoning (no text the
    template renders), any other item its role and content."""
    if not isinstance(item, dict):
        raise ApiError(400, "1 validation error:\n  input: Input should be a valid list of items", type_=_BAD,
                       param="input")
    kind = item.get("type")
    if kind == "function_call":
        return {"role": "assistant", "tool_calls": [{
            "id": str(item.get("call_id") or ""), "type": "function",
            "function": {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "")}}]}
    if kind == "function_call_output":
        return {"role": "tool", "content": content_text(item.get("output")),
                "tool_call_id": str(item.get("call_id") or "")}
    if kind == "reasoning":
        text = ""
        for key in ("summary", "content"):         # a summary of one part, else content of one
            parts = item.get(key)
            if isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], dict):
                text = str(parts[0].get("text") or "")
                break
        return {"role": "assistant", "reasoning": text}
    return {"role": item.get("role", "user"), "content": content_text(item.get("content"))}


class _EventLog:
    """A background stream's frames, in order, and a wake-up for the readers that follow it."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.closed = False
        self._changed = asyncio.Event()

    async def append(self, frame: bytes) -> None:
        self.frames.append(frame)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self) -> None:
        await self._changed.wait()


class ResponsesApi:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.sglang = self.cfg.engine == "sglang"
        self.style = ErrorStyle.SGLANG_OPENAI if self.sglang else ErrorStyle.VLLM
        self.store_enabled = self.sglang or self.cfg.enable_responses_store
        self.response_store: dict[str, dict[str, Any]] = {}
        self.msg_store: dict[str, list[dict[str, Any]]] = {}
        self.background: dict[str, tuple[Sequence, asyncio.Task]] = {}
        self.event_logs: dict[str, _EventLog] = {}     # background streams' events (vLLM keeps them all)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.create),
                web.get("/v1/responses/{response_id}", self.retrieve),
                web.post("/v1/responses/{response_id}/cancel", self.cancel)]

    def snapshot(self) -> dict[str, Any]:
        return {"stored": sorted(self.response_store)}

    # -- errors -----------------------------------------------------------------------------------

    def _not_found(self, rid: str) -> ApiError:
        return ApiError(404, f"Response with id '{rid}' not found.", type_="invalid_request_error",
                        param="response_id" if self.sglang else None)

    def _check_id(self, rid: str) -> None:
        if self.sglang and not rid.startswith("resp_"):
            raise ApiError(400, f"Invalid 'response_id': '{rid}'. Expected an ID that begins with 'resp'.",
                           type_="invalid_request_error", param="response_id")

    # -- POST /v1/responses -------------------------------------------------------------------

    def _parse(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        if "input" not in body:
            raise ApiError(400, "1 validation error:\n  input: Field required", type_=_BAD, param="input")
        inp = body["input"]
        if not isinstance(inp, str | list):
            raise ApiError(400, "1 validation error:\n  input: Input should be a valid string or list",
                           type_=_BAD, param="input")
        model = body.get("model")
        if not self.sglang and model is not None and model not in self.cfg.served_model_names:
            names = ", ".join(self.cfg.served_model_names)
            raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {names}.", param="model")
        if self.engine.dead:
            raise ApiError(500, "EngineCore encountered an issue.", type_="InternalServerError")
        if body.get("background") and body.get("store") is False:
            raise ApiError(400, "1 validation error:\n  Value error, background can only be used when `store` "
                           "is true", type_=_BAD)
        if body.get("store", True) and not self.store_enabled:
            if body.get("background"):
                raise ApiError(400, "This vLLM engine does not support `store=True` and therefore does not "
                               "support the background mode. To enable these features, set the environment "
                               "variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                               type_="invalid_request_error")
            body["store"] = False
        prev_id = body.get("previous_response_id")
        prev = None
        if prev_id is not None:
            self._check_id(str(prev_id))
            prev = self.response_store.get(prev_id)
            if prev is None:
                raise self._not_found(str(prev_id))
        messages: list[dict[str, Any]] = []
        if body.get("instructions"):
            messages.append({"role": "system", "content": str(body["instructions"])})
        if prev is not None:
            messages.extend(self.msg_store.get(prev["id"], []))
            for item in prev.get("output") or ():
                if item.get("type") == "message":
                    for part in item.get("content") or ():
                        messages.append({"role": "assistant", "content": part.get("text", "")})
        if isinstance(inp, str):
            messages.append({"role": "user", "content": inp})
        else:
            messages.extend(_message(item) for item in inp)
        return messages, prev

    async def create(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        try:
            body = await read_json(request, require_json=True)
            messages, _prev = self._parse(body)
            prompt_ids = engine.tokenizer.encode_chat(messages, rendered_tools(body.get("tools"), "parameters"))
            n = len(prompt_ids)
            if n > engine.max_prompt_tokens:
                raise ApiError(400, f"The engine prompt length {n} exceeds the max_model_len "
                               f"{self.cfg.max_model_len}. Please reduce prompt.", type_="invalid_request_error")
            limit = body.get("max_output_tokens")
            if limit is not None:
                try:
                    limit = lax_int(limit)
                except ValueError as e:
                    raise ApiError(400, f"1 validation error:\n  max_output_tokens: {e}",
                                   type_=_BAD, param="max_output_tokens") from None
                if limit < 1:
                    raise ApiError(400, f"max_tokens must be at least 1, got {limit}.", type_=_BAD,
                                   param="max_output_tokens")
            max_tokens = max(1, min(limit or self.cfg.max_tokens_default("chat"), self.cfg.max_model_len - n))
            if not self.sglang:
                responses_requested(body)       # its refusals (a top_logprobs past the engine's maximum)
            fault = request_fault(engine, request)
            check_fault_status(engine, fault)
            rid = body.get("request_id") if isinstance(body.get("request_id"), str) else f"resp_{uuid.uuid4().hex}"
            stream, background = bool_field(body, "stream", False), bool_field(body, "background", False)
            store = bool_field(body, "store", True)
            salt = body.get("cache_salt")
            seq = engine.new_sequence(seq_id=rid, rid=rid, prompt_ids=prompt_ids,
                                      params=SamplingParams(max_tokens=max_tokens), stream=stream and not background,
                                      fault=fault, cache_salt=salt if isinstance(salt, str) and salt else None,
                                      dp_rank=request_dp_rank(engine, request))
            seq.trace_headers = trace_headers(request.headers)
            seq.priority = request_priority(engine, request, body)
            if self.cfg.tool_call_parser:
                seq.tool_calls = responses_tool_calls(body, lambda: f"call_{uuid.uuid4().hex[:24]}")
            engine.role.accept(seq, body)
        except ApiError as exc:
            return exc.response(self.style)
        if store:
            self.msg_store[rid] = messages
        engine.submit(seq)
        if background:
            return await self._background(request, body, seq, max_tokens, stream and not self.sglang)
        try:
            if stream:
                return await self._stream(request, body, seq, max_tokens, store)
            return await self._complete(request, body, seq, max_tokens, store)
        except Dropped:
            return web.Response(status=500)     # never reaches the client: the transport is gone
        finally:
            engine.client_gone(seq)

    def _reasoning_budget(self, seq: Sequence, max_tokens: int) -> int:
        """How many of the answer's first tokens are reasoning: with ``--reasoning-parser`` (vLLM),
        half its ``max_output_tokens``; none on a call or without the parser."""
        if self.sglang or not self.cfg.reasoning_parser or seq.tool_calls is not None:
            return 0
        return max_tokens // 2

    def _usage(self, seq: Sequence, *, responses_shape: bool = True, reasoning: int = 0) -> dict[str, Any]:
        p, c, cached = seq.prompt_tokens, seq.completion_tokens, seq.cached_tokens
        if self.sglang and not responses_shape:
            return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c,
                    "prompt_tokens_details": {"cached_tokens": cached}, "reasoning_tokens": 0}
        if self.sglang:
            return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": c,
                    "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}
        return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached, "input_tokens_per_turn": [],
                                                            "cached_tokens_per_turn": []},
                "output_tokens": c, "output_tokens_details": {"reasoning_tokens": reasoning, "tool_output_tokens": 0,
                                                              "output_tokens_per_turn": [],
                                                              "tool_output_tokens_per_turn": []},
                "total_tokens": p + c}

    def _response(self, body: dict[str, Any], seq: Sequence, max_tokens: int, status: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        out = {
            "id": seq.id, "created_at": seq.created, "incomplete_details": None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"),
            "model": body.get("model") if self.sglang else self.cfg.served_name, "object": "response",
            "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "background": bool_field(body, "background", False), "max_output_tokens": max_tokens,
            "max_tool_calls": body.get("max_tool_calls"), "previous_response_id": body.get("previous_response_id"),
            "prompt": None, "reasoning": body.get("reasoning"), "service_tier": body.get("service_tier", "auto"),
            "status": status, "text": body.get("text"), "top_logprobs": body.get("top_logprobs"),
            "truncation": body.get("truncation", "disabled"), "usage": usage, "user": body.get("user"),
        }
        if not self.sglang:
            out["input_messages"] = out["output_messages"] = None
        return out

    def _message_item(self, item_id: str, text: str, status: str = "completed",
                      logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}] if text or \
            status == "completed" else []
        return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message"}

    @staticmethod
    def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"text": text, "type": "reasoning_text"}] if status == "completed" else []
        return {"id": item_id, "summary": [], "type": "reasoning", "content": content, "encrypted_content": None,
                "status": status}

    @staticmethod
    def _call_item(calls: ToolCalls, i: int, item_id: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"arguments": arguments, "call_id": calls.ids[i], "name": calls.names[i], "type": "function_call",
                "id": item_id, "status": status}

    def _finished(self, body: dict[str, Any], seq: Sequence, max_tokens: int, text: str, store: bool,
                  responses_usage: bool = True, item_ids: list[str] | None = None) -> dict[str, Any]:
        calls: ToolCalls | None = seq.tool_calls
        if calls is not None:           # the calls are whole, whatever ended the generation
            ids = item_ids or [f"fc_{uuid.uuid4().hex}" for _ in calls.names]
            output = [self._call_item(calls, i, ids[i], calls.arguments(i, text)) for i in range(len(calls.names))]
        else:
            k = min(self._reasoning_budget(seq, max_tokens), len(seq.output_ids))
            ids = seq.output_ids[k:] if k else None
            lps = self._logprobs(body, seq, ids, k)
            if k:                   # the reasoning first (its tokens' text), then the message of the rest
                thought = "".join(self.engine.tokenizer.piece(t) for t in seq.output_ids[:k])[:len(text)]
                text = text[len(thought):]
            output = [self._message_item(f"msg_{uuid.uuid4().hex}", text, logprobs=lps)] if text else []
            if k:
                output.insert(0, self._reasoning_item(f"rs_{uuid.uuid4().hex}", thought))
        cut = seq.finish_reason == "length" and not self.sglang and calls is None
        reasoning = min(self._reasoning_budget(seq, max_tokens), seq.completion_tokens) if calls is None else 0
        resp = self._response(body, seq, max_tokens, "incomplete" if cut else "completed", output,
                              self._usage(seq, responses_shape=responses_usage, reasoning=reasoning))
        if cut:
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        if store:
            stored = self.response_store.get(seq.id)
            if stored is None or stored.get("status") != "cancelled":
                self.response_store[seq.id] = resp
        return resp

    def _logprobs(self, body: dict[str, Any], seq: Sequence, ids: list[int] | None = None, start: int = 0,
                  *, whole: bool = True) -> list[dict[str, Any]] | None:
        """The logprobs of output tokens ``ids`` (all the answer's when None) the request's
        ``include`` asked for (vLLM alone): a whole answer's part carries None, a delta ``[]``, when
        it asked for none."""
        top = None if self.sglang else responses_requested(body)
        if top is None:
            return None if whole else []
        return responses_logprobs(self.engine.tokenizer, self.cfg.seed, seq.output_ids if ids is None else ids,
                                  start, top, with_bytes=whole)

    async def _drain(self, seq: Sequence) -> tuple[str, bool]:
        """The whole output; False when the engine failed or aborted the request."""
        parts = []
        while True:
            out = await seq.channel.get()
            assert out is not None
            parts.append(out.text)
            if out.finish_reason is not None:
                return "".join(parts), out.finish_reason not in ("error", "abort") and out.status is None

    async def _complete(self, request: web.Request, body: dict[str, Any], seq: Sequence, max_tokens: int,
                        store: bool) -> web.StreamResponse:
        text, ok = await self._drain_or_drop(request, seq)
        await slow_headers(self.engine, seq.fault)
        if not ok:
            return ApiError(500, seq.error or "Internal server error",
                            type_="InternalServerError").response(self.style)
        return json_response(self._finished(body, seq, max_tokens, text, store, responses_usage=not self.sglang))

    async def _drain_or_drop(self, request: web.Request, seq: Sequence) -> tuple[str, bool]:
        drop_after = seq.fault.drop_after
        if drop_after is None:
            return await self._drain(seq)
        parts, sent = [], 0
        while True:
            out = await seq.channel.get()
            assert out is not None
            if out.token_ids and sent >= drop_after:
                self.engine.fail(seq, f"Simulated connection drop after {sent} tokens")
                drop_connection(request)
                raise Dropped
            sent += len(out.token_ids)
            parts.append(out.text)
            if out.finish_reason is not None:
                return "".join(parts), out.finish_reason not in ("error", "abort") and out.status is None

    async def _stream(self, request: web.Request, body: dict[str, Any], seq: Sequence, max_tokens: int,
                      store: bool) -> web.StreamResponse:
        writer = SseWriter(request, charset="utf-8")
        await slow_headers(self.engine, seq.fault)
        await writer.start()
        await self._events(body, seq, max_tokens, store, writer.response.write, request)
        await at_end(self.engine, request, seq.fault)
        await writer.response.write_eof()
        return writer.response

    async def _events(self, body: dict[str, Any], seq: Sequence, max_tokens: int, store: bool,
                      emit: Callable[[bytes], Awaitable[Any]], request: web.Request | None) -> None:
        """The stream's frames, each handed to ``emit``; ``request``: the client connection a fault
        or an engine failure breaks (None: a background stream's, which has none)."""
        seqno = 0

        async def send(kind: str, event: dict[str, Any]) -> None:
            nonlocal seqno
            frame = {"type": kind, "sequence_number": seqno, **event}
            seqno += 1
            await emit(b"event: " + kind.encode() + b"\ndata: " + dumps(frame) + b"\n\n")

        initial = self._response(body, seq, max_tokens, "in_progress", [], None)
        await send("response.created", {"response": initial})
        await send("response.in_progress", {"response": initial})
        item_id = f"{'item' if self.sglang else 'msg'}_{uuid.uuid4().hex}"
        call_ids = [f"fc_{uuid.uuid4().hex}" for _ in (seq.tool_calls.names if seq.tool_calls is not None else ())]
        text, started, sent = [], False, 0
        budget = self._reasoning_budget(seq, max_tokens)
        rs_id, thought, thinking = f"rs_{uuid.uuid4().hex}", [], False
        mi = 0                                      # the message's output index: 1 after a reasoning item

        async def close_reasoning() -> None:
            nonlocal thinking
            thinking = False
            full = "".join(thought)
            await send("response.reasoning_text.done", {"content_index": 0, "item_id": rs_id, "output_index": 0,
                                                        "text": full})
            await send("response.reasoning_part.done", {"content_index": 0, "item_id": rs_id, "output_index": 0,
                                                        "part": {"text": full, "type": "reasoning_text"}})
            await send("response.output_item.done", {"output_index": 0, "item": self._reasoning_item(rs_id, full)})

        drop_after = seq.fault.drop_after
        while True:
            out = await seq.channel.get(self.cfg.sse_keepalive_s or None)
            if out is None:
                continue
            if drop_after is not None and out.token_ids and sent >= drop_after and request is not None:
                self.engine.fail(seq, f"Simulated connection drop after {sent} tokens")
                drop_connection(request)
                raise Dropped
            sent += len(out.token_ids)
            if out.finish_reason in ("error", "abort") or out.status is not None:
                if request is not None:
                    drop_connection(request)      # the generator raises: Starlette breaks the response
                raise Dropped
            calls: ToolCalls | None = seq.tool_calls
            if calls is not None:
                if out.text or (out.finish_reason is not None and not started):
                    if not started:
                        started = True
                        await send("response.output_item.added", {"output_index": 0, "item": self._call_item(
                            calls, 0, call_ids[0], "", "in_progress")})
                    text.append(out.text)
                    await send("response.function_call_arguments.delta", {
                        "delta": calls.piece(out.text), "item_id": call_ids[0], "output_index": 0})
            elif out.text and sent - len(out.token_ids) < budget:
                if not thinking and not thought:
                    thinking, mi = True, 1
                    await send("response.output_item.added", {"output_index": 0, "item": self._reasoning_item(
                        rs_id, "", "in_progress")})
                    await send("response.reasoning_part.added", {"content_index": 0, "item_id": rs_id, "output_index": 0,
                                                                 "part": {"text": "", "type": "reasoning_text"}})
                thought.append(out.text)
                await send("response.reasoning_text.delta", {"content_index": 0, "delta": out.text, "item_id": rs_id,
                                                             "output_index": 0})
            elif out.text:
                if thinking:
                    await close_reasoning()
                if not started:
                    started = True
                    await send("response.output_item.added", {"output_index": mi, "item": self._message_item(
                        item_id, "", "in_progress")})
                    await send("response.content_part.added", {
                        "content_index": 0, "item_id": item_id, "output_index": mi,
                        "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}})
                text.append(out.text)
                lps = self._logprobs(body, seq, list(out.token_ids), sent - len(out.token_ids), whole=False)
                await send("response.output_text.delta", {"content_index": 0, "delta": out.text, "item_id": item_id,
                                                          "logprobs": lps, "output_index": mi})
            if out.finish_reason is not None:
                break
        if thinking:
            await close_reasoning()
        full = "".join(text)
        calls = seq.tool_calls
        if calls is not None:
            for i, name in enumerate(calls.names):
                args = calls.arguments(i, full)
                if i == 0:
                    await send("response.function_call_arguments.delta", {
                        "delta": calls.close(), "item_id": call_ids[0], "output_index": 0})
                else:
                    await send("response.output_item.added", {"output_index": i, "item": self._call_item(
                        calls, i, call_ids[i], "", "in_progress")})
                    await send("response.function_call_arguments.delta", {
                        "delta": args, "item_id": call_ids[i], "output_index": i})
                await send("response.function_call_arguments.done", {
                    "arguments": args, "item_id": call_ids[i], "name": name, "output_index": i})
                await send("response.output_item.done", {"output_index": i, "item": self._call_item(
                    calls, i, call_ids[i], args)})
            await send("response.completed", {"response": self._finished(body, seq, max_tokens, full, store,
                                                                            item_ids=call_ids)})
            return
        if started:
            k = min(budget, len(seq.output_ids))
            part = {"annotations": [], "text": full, "type": "output_text",
                    "logprobs": self._logprobs(body, seq, seq.output_ids[k:] if k else None, k)}
            await send("response.output_text.done", {"content_index": 0, "item_id": item_id, "logprobs": [],
                                                     "output_index": mi, "text": full})
            await send("response.content_part.done", {"content_index": 0, "item_id": item_id, "output_index": mi,
                                                      "part": part})
            await send("response.output_item.done", {"output_index": mi, "item": self._message_item(
                item_id, full, logprobs=part["logprobs"])})
        final = self._finished(body, seq, max_tokens, "".join(thought) + full, store)
        for item in final["output"]:                # the stream's item ids are the stored ones
            item["id"] = rs_id if item["type"] == "reasoning" else item_id
        await send("response.completed", {"response": final})

    # -- background ---------------------------------------------------------------------------

    async def _background(self, request: web.Request, body: dict[str, Any], seq: Sequence, max_tokens: int,
                          stream: bool) -> web.StreamResponse:
        queued = self._response(body, seq, max_tokens, "queued", [], None)
        self.response_store[seq.id] = queued
        log = _EventLog() if stream else None
        if log is not None:
            self.event_logs[seq.id] = log

        async def run() -> None:
            if self.sglang:
                queued["status"] = "in_progress"
            if log is not None:         # vLLM: the stream's events are made here and kept for its readers
                queued["status"] = "in_progress"
                try:
                    await self._events(body, seq, max_tokens, True, log.append, None)
                except Dropped:
                    if queued["status"] not in ("completed", "cancelled"):
                        queued["status"] = "failed"
                finally:
                    log.close()
                return
            text, ok = await self._drain(seq)
            if ok:
                self._finished(body, seq, max_tokens, text, True, responses_usage=not self.sglang)
            elif queued["status"] not in ("completed", "cancelled"):
                queued["status"] = "failed"

        task = asyncio.get_running_loop().create_task(run())
        self.background[seq.id] = (seq, task)
        task.add_done_callback(lambda _t: self.background.pop(seq.id, None))
        if log is not None:
            return await self._follow(request, log, -1)
        return json_response(queued)

    async def _follow(self, request: web.Request, log: _EventLog, after: int) -> web.StreamResponse:
        """A background stream's events after sequence number ``after``, as they come, to its end;
        a reader that leaves stops only its own copy (the response goes on)."""
        writer = SseWriter(request, charset="utf-8")
        await writer.start()
        i = after + 1
        while True:
            while i < len(log.frames):
                await writer.response.write(log.frames[i])
                i += 1
            if log.closed:
                break
            await log.wait()
        await writer.response.write_eof()
        return writer.response

    # -- GET / cancel -------------------------------------------------------------------------

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        try:
            self._check_id(rid)
            resp = self.response_store.get(rid)
            if resp is None:
                raise self._not_found(rid)
            log = self.event_logs.get(rid) if request.query.get("stream") == "true" and not self.sglang else None
            if request.query.get("stream") == "true" and not self.sglang and log is None:
                raise ApiError(400, "Cannot stream a response that was not created with background=true and "
                               "stream=true.", type_="invalid_request_error")
            after = request.query.get("starting_after", "-1")
            if log is not None and not after.lstrip("-").isdigit():
                raise ApiError(400, "starting_after must be an integer", type_="invalid_request_error")
        except ApiError as exc:
            return exc.response(self.style)
        if log is not None:
            return await self._follow(request, log, int(after))
        return json_response(resp)

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        try:
            self._check_id(rid)
            resp = self.response_store.get(rid)
            if resp is None:
                raise self._not_found(rid)
            if resp.get("status") not in ("queued", "in_progress"):
                raise ApiError(400, "Cannot cancel a synchronous response.", type_="invalid_request_error")
        except ApiError as exc:
            return exc.response(self.style)
        resp["status"] = "cancelled"
        running = self.background.get(rid)
        if running is not None:
            seq, task = running
            self.engine.abort(seq, "Cancelled")
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return json_response(resp)
