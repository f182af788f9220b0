"""SGLang's HTTP surface (``python -m sglang.launch_server``), as of SGLang 0.5.23.

Differences from vLLM that a gateway notices, all reproduced here: the request id is the body
``rid`` (no ``X-Request-Id``, no ``chatcmpl-`` prefix); ``model`` is echoed, never validated;
OpenAI streams send headers only together with the first chunk; chat chunks are msgspec-shaped
(``reasoning_content`` always present, ``matched_stop`` on every choice, a separate finish chunk);
errors use the old flat envelope; ``/generate`` streams cumulative text; ``/abort_request`` aborts
by rid prefix and the stream ends with ``finish_reason: "abort"``; ``/health`` is 503 while starting;
an echoing completion that asks for logprobs above 0 gets the prompt's first (its
``logprob_start_len`` 0), and a completion's ``max_tokens`` below 1 is its request model's 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from contextlib import aclosing
from datetime import UTC, datetime
from functools import partial
from typing import Any

from aiohttp import web

from enginesim.config import SGLANG_VERSION
from enginesim.engine import Engine
from enginesim.errors import ApiError, ErrorStyle, internal_error
from enginesim.frontend import (
    Dropped,
    at_end,
    check_fault_status,
    collect,
    merged_outputs,
    outputs,
    request_dp_rank,
    request_fault,
    request_priority,
    slow_headers,
)
from enginesim.logprobs import sglang_echo_logprobs, sglang_logprobs, sglang_requested
from enginesim.lora import LoraError, LoraFull
from enginesim.protocol import OpenAIRequest, parse_openai, parse_stop, token_id_list
from enginesim.sequence import SamplingParams, Sequence, StepOutput
from enginesim.tools import ToolCalls, chat_tool_calls, sglang_call_id, tool_deltas
from enginesim.tracing import trace_headers
from enginesim.vllm_api import embed, embedding_inputs, vocab_size
from enginesim.wire import SseWriter, json_response, read_json

OPENAI = ErrorStyle.SGLANG_OPENAI
NATIVE = ErrorStyle.SGLANG_NATIVE

FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)")
FLUSH_FAIL = ("Cache not flushed: requests are still running or waiting.\n"
              "(When there are running or waiting requests, the operation will not be performed.)")


class SglangApi:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/generate", self.generate),
            web.put("/generate", self.generate),
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.post("/v1/embeddings", self.embeddings),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),
            web.get("/health", self.health),
            web.get("/health_generate", self.health),
            web.get("/ready", self.ready),
            web.get("/ping", self.ready),
            web.get("/model_info", self.model_info),
            web.get("/get_model_info", self.model_info),
            web.get("/server_info", self.server_info),
            web.get("/get_server_info", self.server_info),
            web.get("/v1/loads", self.loads),
            web.post("/abort_request", self.abort_request),
            web.post("/load_lora_adapter", self.load_lora),
            web.post("/unload_lora_adapter", self.unload_lora),
            web.get("/flush_cache", self.flush_cache),
            web.post("/flush_cache", self.flush_cache),
            web.get("/metrics", self.metrics),
        ]

    # -- shared ---------------------------------------------------------------------------------

    def _check_length(self, n: int) -> None:
        limit = self.engine.max_prompt_tokens
        if n > limit:
            raise ApiError(400, f"The input ({n} tokens) is longer than the model's context length "
                           f"({limit} tokens).", type_="BadRequest")

    def _check_total(self, n: int, max_tokens: int | None) -> None:
        """SGLang's tokenizer manager: a ``max_new_tokens`` the request names that, with its prompt,
        reaches the context length is refused (without ``--allow-auto-truncate``)."""
        ctx = self.cfg.max_model_len
        if max_tokens is not None and n <= self.engine.max_prompt_tokens and max_tokens + n >= ctx:
            raise ApiError(400, f"Requested token count exceeds the model's maximum context length of {ctx} "
                           f"tokens. You requested a total of {max_tokens + n} tokens: {n} tokens from the "
                           f"input messages and {max_tokens} tokens for the completion. Please reduce the "
                           "number of tokens in the input messages or the completion to fit within the limit.",
                           type_="BadRequest")

    def _check_alive(self) -> None:
        if self.engine.dead:
            raise internal_error("Internal server error: the scheduler is dead")

    def _matched_stop(self, seq: Sequence) -> str | int | None:
        return seq.stop_reason if seq.finish_reason == "stop" else None

    def _usage(self, seq: Sequence) -> dict[str, Any]:
        return {"prompt_tokens": seq.prompt_tokens,
                "total_tokens": seq.prompt_tokens + seq.completion_tokens,
                "completion_tokens": seq.completion_tokens,
                "prompt_tokens_details": ({"cached_tokens": seq.cached_tokens}
                                          if self.cfg.report_cached_tokens else None),
                "reasoning_tokens": 0,
                "completion_tokens_details": None}

    def _submit(self, request: web.Request, body: dict[str, Any], prompt_ids: list[int],
                params: SamplingParams, stream: bool, prompts: int = 1, rid: str | None = None) -> Sequence:
        """Validate, apply the fault's status, and queue. Raises ``ApiError`` (style set by caller).
        ``rid``: the request's (a batch's first prompt's), else the body's."""
        engine = self.engine
        self._check_alive()
        self._check_length(len(prompt_ids))
        fault = request_fault(engine, request)
        check_fault_status(engine, fault)
        if rid is None:
            rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            rid = uuid.uuid4().hex
        salt = body.get("cache_salt") or body.get("extra_key")
        lora = body.get("lora_path")
        if isinstance(lora, str) and (engine.lora is None or lora not in engine.lora.registered):
            raise ApiError(400, f"LoRA adapter '{lora}' is not loaded. Load it with /load_lora_adapter first.",
                           type_="BadRequest")
        seq = engine.new_sequence(seq_id=rid, rid=rid, prompt_ids=prompt_ids, params=params, stream=stream,
                                  fault=fault, cache_salt=salt if isinstance(salt, str) else None,
                                  lora=lora if isinstance(lora, str) else None,
                                  dp_rank=request_dp_rank(engine, request))
        seq.trace_headers = trace_headers(request.headers)
        seq.priority = request_priority(engine, request, body)
        engine.role.accept(seq, body, 0, prompts)
        engine.submit(seq)
        return seq

    # -- OpenAI-compatible ----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "completions")

    async def embeddings(self, request: web.Request) -> web.Response:
        """SGLang's ``/v1/embeddings`` (an embedding model's): the vectors of ``input``, its
        OpenAI-shaped list with usage."""
        try:
            body = await read_json(request, require_json=False)
            self._check_alive()
            refused = _empty_input(body.get("input"))
            if refused is not None:
                raise ApiError(400, refused, type_="BadRequestError")
            inputs = embedding_inputs(body.get("input"))
            dims = body.get("dimensions") or self.cfg.embedding_dim
            if not isinstance(dims, int) or isinstance(dims, bool) or dims < 1:
                raise ApiError(400, "dimensions must be a positive integer", param="dimensions")
            dims = min(dims, self.cfg.embedding_dim)     # the first `dims` values, at most all of them
        except ApiError as exc:
            return exc.response(OPENAI)
        data, total = [], 0
        for i, item in enumerate(inputs):
            ids = item if isinstance(item, list) else self.engine.tokenizer.encode(item)
            total += len(ids)
            data.append({"embedding": embed(ids, dims, self.cfg.seed), "index": i, "object": "embedding"})
        return json_response({"data": data, "model": body.get("model") or self.cfg.served_name, "object": "list",
                              "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                                        "prompt_tokens_details": None}})

    async def _openai(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await read_json(request, require_json=False)
            req = parse_openai(body, kind, self.engine.tokenizer, vllm=False, several=True)
            if self.engine.role.name != "aggregated" and req.n > 1:
                # SGLang sends a prompt's n samples (and the prefill-only request that caches its
                # prefix first) with the prompt's one bootstrap room, so a P/D pair's rooms collide
                # (a batch's prompts each have a room of their own: room + i, or the list's i-th)
                raise ApiError(501, "enginesim does not simulate n > 1 on a P/D role "
                               "(SGLang's samples of a prompt share its bootstrap room)", param="n")
            req = dataclasses.replace(req, logprobs=sglang_requested(body, kind))
            _check_logit_bias(body.get("logit_bias"), vocab_size(self.engine.tokenizer))
            model = req.model if req.model is not None else "default"
            prompts = [ids for ids, _ in req.batch] or [req.prompt_ids]
            for ids in prompts:
                self._check_total(len(ids), req.max_tokens)
            # a max_tokens of 0 is a prefill-only request: the prompt runs, no token comes
            max_tokens = req.max_tokens if req.max_tokens is not None else self.cfg.max_tokens_default(kind)
            params = SamplingParams(max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                                    ignore_eos=req.ignore_eos)
            for ids in prompts[1:]:
                self._check_length(len(ids))
            rids = _batch_rids(body, len(prompts)) if _listed_prompts(body, kind) else None
            seq = self._submit(request, body, req.prompt_ids, params, req.stream, prompts=len(prompts),
                               rid=rids[0] if rids else None)
            if kind == "chat" and self.cfg.tool_call_parser and req.n == 1:
                seq.tool_calls = chat_tool_calls(body, sglang_call_id)
        except ApiError as exc:
            return exc.response(OPENAI)
        # a batch of prompts, n choices each (SGLang's parallel sampling: a sequence of the same
        # prompt per choice); choice ``prompt_i * n + j`` is prompt i's j-th, as SGLang indexes them
        seqs = [seq]
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                if p == 0 and j == 0:
                    continue
                rid = rids[p] if rids else seq.rid
                child = self.engine.new_sequence(
                    seq_id=seq.id, rid=f"{rid}_{j}" if j else rid, prompt_ids=ids,
                    params=params, stream=req.stream, fault=seq.fault, cache_salt=seq.cache_salt, lora=seq.lora,
                    dp_rank=request_dp_rank(self.engine, request))
                if j:
                    child.output_key += f"\0choice {j}"     # each choice samples its own tokens
                child.trace_headers = seq.trace_headers
                child.priority = seq.priority
                try:
                    # a P/D role's prompt i meets its counterpart on its own room
                    self.engine.role.accept(child, body, p, len(prompts))
                except ApiError as exc:
                    for s in seqs:
                        self.engine.client_gone(s)
                    return exc.response(OPENAI)
                self.engine.submit(child)
                seqs.append(child)
        try:
            if len(seqs) > 1:
                # each choice's echo: its own prompt's text
                echoes = [req.batch[i // req.n][1] if req.batch else req.echo for i in range(len(seqs))]
                if req.stream:
                    return await self._stream_choices(request, req, seqs, model, echoes)
                return await self._complete_choices(request, req, seqs, model, echoes)
            if req.stream:
                return await self._stream(request, req, seq, model)
            return await self._complete(request, req, seq, model)
        except Dropped:
            return web.Response(status=500)  # never reaches the client: the transport is gone
        finally:
            for s in seqs:
                self.engine.client_gone(s)

    def _logprobs(self, req: OpenAIRequest, ids: list[int] | tuple[int, ...], start: int) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice's tokens ``ids`` (from position ``start``), None when the
        request asks for none."""
        if req.logprobs is None or not ids:
            return None
        return sglang_logprobs(self.engine.tokenizer, self.cfg.seed, ids, start, req.logprobs, req.kind)

    def _echoed(self, req: OpenAIRequest, seq: Sequence, generated: dict[str, Any] | None,
                echo: str | None) -> dict[str, Any] | None:
        """A completion's ``logprobs`` where its echo (``echo``: the text it begins with) goes out:
        with a count above 0 SGLang computed the prompt's, which come first."""
        if echo is None or req.kind != "completions" or not req.logprobs:
            return generated
        return sglang_echo_logprobs(self.engine.tokenizer, self.cfg.seed, seq.prompt_ids, req.logprobs, generated)

    def _usage_of(self, seqs: list[Sequence], n: int) -> dict[str, Any]:
        """The usage of several choices (``n`` per prompt): each prompt once, as its first choice
        counts it (its cached tokens too), every choice's tokens (SGLang's ``UsageProcessor``)."""
        usage = self._usage(seqs[0])
        prompt = sum(s.prompt_tokens for s in seqs[::n])
        done = sum(s.completion_tokens for s in seqs)
        usage["prompt_tokens"] = prompt
        usage["completion_tokens"] = done
        usage["total_tokens"] = prompt + done
        if usage["prompt_tokens_details"] is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(s.cached_tokens for s in seqs[::n])}
        return usage

    async def _complete_choices(self, request: web.Request, req: OpenAIRequest, seqs: list[Sequence],
                                model: str, echoes: list[str | None]) -> web.StreamResponse:
        """A whole answer of several choices: ``choices`` in index order, usage summed."""
        results = await asyncio.gather(*(collect(self.engine, request, s) for s in seqs))
        await slow_headers(self.engine, seqs[0].fault)
        for result in results:
            err = _failure(result.final)
            if err is not None:
                return err.response(OPENAI)
        choices = []
        for i, (seq, result) in enumerate(zip(seqs, results, strict=True)):
            choice: dict[str, Any] = {"index": i}
            if req.kind == "chat":
                choice["message"] = {"role": "assistant", "content": result.text, "reasoning_content": None,
                                     "tool_calls": None}
            else:
                choice["text"] = (echoes[i] or "") + result.text
            choice.update({"logprobs": self._echoed(req, seq, self._logprobs(req, seq.output_ids, 0), echoes[i]),
                           "finish_reason": seq.finish_reason,
                           "matched_stop": self._matched_stop(seq)})
            if req.kind == "chat":
                choice["hidden_states"] = None
            choices.append(choice)
        seq = seqs[0]
        return json_response({"id": seq.id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                              "created": seq.created, "model": model, "choices": choices,
                              "usage": self._usage_of(seqs, req.n), "metadata": {"weight_version": "default"}})

    async def _stream_choices(self, request: web.Request, req: OpenAIRequest, seqs: list[Sequence],
                              model: str, echoes: list[str | None]) -> web.StreamResponse:
        """A stream of several choices, as SGLang sends it: each chunk carries one choice (its
        ``index``), interleaved as their tokens come; a chat choice's role chunk with its first
        output, its finish in a chunk of its own. Headers go out with the first chunk."""
        writer = SseWriter(request, charset=None)
        seq = seqs[0]
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        continuous = req.continuous_usage

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {"id": seq.id, "object": obj, "created": seq.created, "model": model,
                                   "choices": [choice]}
            if continuous:
                usage = self._usage(seqs[choice["index"]])
                out["usage"] = _drop_none(usage) if not chat else usage
            return out

        came, pumps = merged_outputs(self.engine, request, seqs)
        try:
            left = len(seqs)
            pending: list[list[int]] = [[] for _ in range(len(seqs))]
            done = [0] * len(seqs)

            def take(k: int) -> dict[str, Any] | None:
                """The logprobs of choice k's tokens not yet sent (SGLang's go with the step's chunk)."""
                ids, pending[k] = pending[k], []
                start, done[k] = done[k], done[k] + len(ids)
                return self._logprobs(req, ids, start)

            first = [True] * len(seqs)
            echo = [None if chat else e for e in echoes]
            while left:
                i, out = await came.get()
                if isinstance(out, Dropped):
                    raise out
                err = _failure(out)
                if err is not None:
                    if not writer.started:
                        return err.response(OPENAI)
                    await writer.send(err.stream_payload(OPENAI))
                    return await writer.done()
                if not writer.started:
                    await slow_headers(self.engine, seq.fault)
                finishing = out.finish_reason is not None
                left -= finishing
                s = seqs[i]
                pending[i].extend(out.token_ids)
                if chat:
                    if first[i]:
                        await writer.send(chunk({"index": i, "delta": {"reasoning_content": None,
                                                                       "role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None, "matched_stop": None}))
                    if out.text:
                        await writer.send(chunk({"index": i, "delta": {"reasoning_content": None,
                                                                       "content": out.text},
                                                 "logprobs": take(i), "finish_reason": None, "matched_stop": None}))
                    if finishing:
                        await writer.send(chunk({"index": i, "delta": {"reasoning_content": None},
                                                 "logprobs": take(i), "finish_reason": out.finish_reason,
                                                 "matched_stop": self._matched_stop(s)}))
                elif out.text or finishing or echo[i] is not None:
                    await writer.send(chunk({"index": i, "text": (echo[i] or "") + out.text,
                                             "logprobs": self._echoed(req, s, take(i), echo[i]),
                                             "finish_reason": out.finish_reason,
                                             "matched_stop": self._matched_stop(s) if finishing else None}))
                    echo[i] = None
                first[i] = False
        finally:
            for p in pumps:
                p.cancel()
        if req.include_usage:
            usage = self._usage_of(seqs, req.n)
            await writer.send({"id": seq.id, "object": obj, "created": seq.created, "model": model,
                               "choices": [], "usage": usage if chat else _drop_none(usage)})
        return await writer.done(partial(at_end, self.engine, request, seq.fault))

    async def _complete(self, request: web.Request, req: OpenAIRequest, seq: Sequence,
                        model: str) -> web.StreamResponse:
        result = await collect(self.engine, request, seq)
        await slow_headers(self.engine, seq.fault)
        err = _failure(result.final)
        if err is not None:
            return err.response(OPENAI)
        choice: dict[str, Any] = {"index": 0}
        if req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": result.text, "reasoning_content": None,
                                 "tool_calls": None}
        else:
            choice["text"] = (req.echo or "") + result.text
        calls: ToolCalls | None = seq.tool_calls
        if calls is not None and req.kind == "chat":
            choice["message"]["content"] = None
            choice["message"]["tool_calls"] = [
                {"id": calls.ids[i], "index": i, "type": "function",
                 "function": {"name": name, "arguments": calls.arguments(i, result.text)}}
                for i, name in enumerate(calls.names)]
        logprobs = None if calls is not None else self._echoed(req, seq, self._logprobs(req, seq.output_ids, 0),
                                                                req.echo)
        choice.update({"logprobs": logprobs, "finish_reason": "tool_calls" if calls is not None else seq.finish_reason,
                       "matched_stop": None if calls is not None else self._matched_stop(seq)})
        if req.kind == "chat":
            choice["hidden_states"] = None
        body: dict[str, Any] = {"id": seq.id,
                                "object": "chat.completion" if req.kind == "chat" else "text_completion",
                                "created": seq.created, "model": model, "choices": [choice],
                                "usage": self._usage(seq), "metadata": {"weight_version": "default"}}
        body.update(self.engine.role.response_extras(seq))
        return json_response(body)

    async def _stream(self, request: web.Request, req: OpenAIRequest, seq: Sequence,
                      model: str) -> web.StreamResponse:
        writer = SseWriter(request, charset=None)
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        # SGLang reads the two options apart (``should_include_usage``): continuous_usage_stats puts
        # the usage on every chunk with include_usage or without it (vLLM only with it)
        continuous = req.continuous_usage

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {"id": seq.id, "object": obj, "created": seq.created, "model": model,
                                   "choices": [choice]}
            if continuous:
                out["usage"] = _drop_none(self._usage(seq)) if not chat else self._usage(seq)
            return out

        pending: list[list[int]] = [[] for _ in range(1)]
        done = [0] * 1

        def take(k: int) -> dict[str, Any] | None:
            """The logprobs of choice k's tokens not yet sent (SGLang's go with the step's chunk)."""
            ids, pending[k] = pending[k], []
            start, done[k] = done[k], done[k] + len(ids)
            return self._logprobs(req, ids, start)

        first = True
        # echo: the prompt's text begins the first chunk of a completion (SGLang: the prompt is
        # prepended to the first chunk's text; usage counts the generated tokens only)
        echo = req.echo if not chat else None
        async with aclosing(outputs(self.engine, request, seq)) as stream:
            async for out in stream:
                assert out is not None
                err = _failure(out)
                if err is not None:
                    if not writer.started:  # nothing sent yet: a proper HTTP error
                        return err.response(OPENAI)
                    await writer.send(err.stream_payload(OPENAI))
                    return await writer.done()
                if not writer.started:
                    # SGLang returns the StreamingResponse only once the first chunk exists.
                    await slow_headers(self.engine, seq.fault)
                finishing = out.finish_reason is not None
                pending[0].extend(out.token_ids)
                if chat:
                    if first:
                        await writer.send(chunk({"index": 0, "delta": {"reasoning_content": None,
                                                                       "role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None,
                                                 "matched_stop": None}))
                    if seq.tool_calls is not None:
                        for d in tool_deltas(seq.tool_calls, out.text, finishing):
                            await writer.send(chunk({"index": 0, "delta": {"reasoning_content": None, "tool_calls": [d]},
                                                     "logprobs": None, "finish_reason": None, "matched_stop": None}))
                        if finishing:
                            await writer.send(chunk({"index": 0, "delta": {"reasoning_content": None},
                                                     "logprobs": None, "finish_reason": "tool_calls",
                                                     "matched_stop": None}))
                    elif out.text:
                        await writer.send(chunk({"index": 0, "delta": {"reasoning_content": None,
                                                                       "content": out.text},
                                                 "logprobs": take(0), "finish_reason": None,
                                                 "matched_stop": None}))
                    if finishing and seq.tool_calls is None:
                        await writer.send(chunk({"index": 0, "delta": {"reasoning_content": None},
                                                 "logprobs": take(0), "finish_reason": out.finish_reason,
                                                 "matched_stop": self._matched_stop(seq)}))
                elif out.text or finishing or echo is not None:
                    await writer.send(chunk({"index": 0, "text": (echo or "") + out.text,
                                             "logprobs": self._echoed(req, seq, take(0), echo),
                                             "finish_reason": out.finish_reason,
                                             "matched_stop": self._matched_stop(seq) if finishing else None}))
                    echo = None
                first = False
        if req.include_usage:
            usage = self._usage(seq)
            await writer.send({"id": seq.id, "object": obj, "created": seq.created, "model": model,
                               "choices": [], "usage": usage if chat else _drop_none(usage)})
        return await writer.done(partial(at_end, self.engine, request, seq.fault))

    # -- native /generate -----------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request, require_json=False)
            prompt_ids = self._generate_prompt(body)
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise ApiError(400, "sampling_params must be an object")
            max_new = sp.get("max_new_tokens")
            if max_new is None:
                max_new = self.cfg.max_tokens_default("generate")
            min_new = sp.get("min_new_tokens") or 0
            if not isinstance(max_new, int) or not isinstance(min_new, int) or max_new < 0 or min_new < 0:
                raise ApiError(400, "max_new_tokens and min_new_tokens must be non-negative integers")
            params = SamplingParams(max_tokens=max_new, min_tokens=min_new,
                                    stop=parse_stop(sp.get("stop")), ignore_eos=bool(sp.get("ignore_eos")))
            stream = bool(body.get("stream", False))
            seq = self._submit(request, body, prompt_ids, params, stream)
        except ApiError as exc:
            return exc.response(NATIVE)
        try:
            if stream:
                return await self._generate_stream(request, seq)
            result = await collect(self.engine, request, seq)
            await slow_headers(self.engine, seq.fault)
            err = _failure(result.final)
            if err is not None:
                # An abort with a status is raised as an HTTPException: the flat envelope.
                return err.response(NATIVE if result.final.status is None else OPENAI)
            return json_response(self._generate_body(seq, result.text))
        except Dropped:
            return web.Response(status=500)  # never reaches the client: the transport is gone
        finally:
            self.engine.client_gone(seq)

    def _generate_prompt(self, body: dict[str, Any]) -> list[int]:
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise ApiError(400, "Either text or input_ids should be provided.")
        if isinstance(text, str):
            return self.engine.tokenizer.encode(text)
        ids = token_id_list(input_ids, "input_ids")
        if ids is not None:
            return ids
        if isinstance(text, list) or (isinstance(input_ids, list) and input_ids
                                      and isinstance(input_ids[0], list)):
            raise ApiError(501, "enginesim serves one prompt per request; batched /generate is not simulated")
        raise ApiError(400, "text must be a string, input_ids a list of token ids")

    def _finish_object(self, seq: Sequence) -> dict[str, Any] | None:
        reason = seq.finish_reason
        if not seq.finished or reason is None:
            return None
        if reason == "stop":
            return {"type": "stop", "matched": seq.stop_reason}
        if reason == "length":
            # A P/D prefill reports length 0 (SGLang: FINISH_LENGTH(length=0) once the KV is sent).
            return {"type": "length", "length": seq.role_data.get("finish_length", seq.params.max_tokens)}
        return {"type": "abort", "message": seq.error, "status_code": None, "err_type": None}

    def _generate_body(self, seq: Sequence, text: str, output_ids: list[int] | None = None,
                       final: bool = True) -> dict[str, Any]:
        ids = seq.output_ids if output_ids is None else output_ids
        return {"text": text, "output_ids": list(ids),
                "meta_info": {"id": seq.rid, "finish_reason": self._finish_object(seq) if final else None,
                              "prompt_tokens": seq.prompt_tokens, "completion_tokens": len(ids),
                              "cached_tokens": seq.cached_tokens, "reasoning_tokens": 0,
                              "weight_version": "default", "num_retractions": 0,
                              "e2e_latency": round(time.monotonic() - seq.arrival, 6)}}

    async def _generate_stream(self, request: web.Request, seq: Sequence) -> web.StreamResponse:
        writer = SseWriter(request, charset=None)
        await slow_headers(self.engine, seq.fault)
        await writer.start()  # /generate returns its StreamingResponse at once
        text = ""
        ids: list[int] = []
        async with aclosing(outputs(self.engine, request, seq)) as stream:
            async for out in stream:
                assert out is not None
                err = _failure(out)
                if err is not None:
                    await writer.send(err.stream_payload(NATIVE))
                    return await writer.done()
                text += out.text
                ids.extend(out.token_ids)
                finishing = out.finish_reason is not None
                if out.token_ids or finishing:
                    # Cumulative: every event carries everything generated so far.
                    await writer.send(self._generate_body(seq, text, ids, final=finishing))
        return await writer.done(partial(at_end, self.engine, request, seq.fault))

    # -- control and info -----------------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, require_json=False)
        except ApiError:
            body = {}
        if body.get("abort_all"):
            self.engine.abort_all()
        elif isinstance(body.get("rid"), str) and body["rid"]:
            self.engine.abort_matching(body["rid"])
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.num_live or not all([p.flush() for p in self.engine.pools]):
            return web.Response(status=400, text=FLUSH_FAIL)
        return web.Response(status=200, text=FLUSH_OK)

    async def health(self, request: web.Request) -> web.Response:
        ok = self.engine.ready and not self.engine.dead and not self.engine.closing
        return web.Response(status=200 if ok else 503)

    async def ready(self, request: web.Request) -> web.Response:
        return await self.health(request)

    def _card(self) -> dict[str, Any]:
        return {"id": self.cfg.served_name, "object": "model", "created": self.created, "owned_by": "sglang",
                "root": self.cfg.served_name, "parent": None, "max_model_len": self.cfg.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        cards = [self._card()]
        lora = self.engine.lora
        for name, path in (lora.registered.items() if lora is not None else ()):
            cards.append({**self._card(), "id": name, "root": path, "parent": self.cfg.served_name})
        return json_response({"object": "list", "data": cards})

    async def load_lora(self, request: web.Request) -> web.Response:
        return await self._lora_call(request, load=True)

    async def unload_lora(self, request: web.Request) -> web.Response:
        return await self._lora_call(request, load=False)

    async def _lora_call(self, request: web.Request, load: bool) -> web.Response:
        """SGLang's runtime adapter calls: ``{success, error_message, loaded_adapters}``, 400 on failure."""
        lora = self.engine.lora
        try:
            body = await read_json(request, require_json=False)
        except ApiError as exc:
            return exc.response(OPENAI)
        error = ""
        if lora is None:
            error = "LoRA is not enabled. Please set `--enable-lora` to True."
        else:
            if load and self.cfg.lora_load_call_ms:
                await asyncio.sleep(self.cfg.lora_load_call_ms / 1000.0)
            try:
                if load and body.get("lora_name") in lora.registered:      # SGLang's LoRARegistry's words
                    error = (f"LoRA with name {body.get('lora_name')} already exists. "
                             f"Loaded LoRAs: dict_keys({list(lora.registered)!r})")
                elif load:
                    lora.load(body.get("lora_name"), body.get("lora_path"))
                elif body.get("lora_name") not in lora.registered:
                    error = (f"LoRA with name {body.get('lora_name')} does not exist. "
                             f"Loaded LoRAs: dict_keys({list(lora.registered)!r})")
                else:
                    lora.unload(body.get("lora_name"))
            except LoraFull as e:
                error = (f"Cannot load LoRA adapter {e.name} at path {e.path}. Maximum number of loaded LoRA "
                         f"adapters is {e.cap}. Please unload some LoRA adapters before loading new ones.")
            except LoraError as e:
                error = e.message
        loaded = dict(lora.registered) if lora is not None else {}
        return json_response({"success": not error, "error_message": error, "loaded_adapters": loaded},
                             status=400 if error else 200)

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.cfg.served_name:
            return json_response({"error": {"message": f"The model '{name}' does not exist",
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}}, status=404)
        return json_response(self._card())

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response({
            "model_path": self.cfg.model, "served_model_name": self.cfg.served_name,
            "tokenizer_path": self.cfg.model, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "load_format": "auto", "reasoning_parser": None,
            "tool_call_parser": None, "disaggregation_mode": self.engine.role.disaggregation_mode,
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": "llama",
            "architectures": ["LlamaForCausalLM"]})

    async def server_info(self, request: web.Request) -> web.Response:
        cfg, engine = self.cfg, self.engine
        return json_response({
            "model_path": cfg.model, "served_model_name": cfg.served_name, "host": cfg.host,
            "port": request.url.port, "page_size": cfg.block_size, "context_length": cfg.max_model_len,
            "max_running_requests": cfg.max_num_seqs, "max_total_tokens": cfg.kv_blocks * cfg.block_size,
            "disable_radix_cache": not cfg.enable_prefix_caching, "enable_cache_report": cfg.report_cached_tokens,
            "enable_metrics": cfg.enable_metrics, "disaggregation_mode": engine.role.disaggregation_mode,
            "disaggregation_bootstrap_port": engine.role.bootstrap_port or cfg.bootstrap_port or 8998,
            "disaggregation_transfer_backend": "enginesim",
            "random_seed": cfg.seed, "startup_time": engine.started_at, "version": SGLANG_VERSION,
            "frontend": "enginesim",
            "internal_states": [{"last_gen_throughput": engine.stats.gen_throughput(),
                                 "num_running_reqs": len(engine.running),
                                 "num_waiting_reqs": len(engine.waiting)}]})

    async def loads(self, request: web.Request) -> web.Response:
        engine, pool = self.engine, self.engine.pool
        used = pool.used_blocks * pool.block_size
        total = pool.num_blocks * pool.block_size
        load: dict[str, Any] = {
            "dp_rank": 0, "num_running_reqs": len(engine.running), "num_waiting_reqs": len(engine.waiting),
            "num_used_tokens": used, "num_total_tokens": total, "max_total_num_tokens": total,
            "max_running_requests": self.cfg.max_num_seqs, "token_usage": pool.usage,
            "gen_throughput": engine.stats.gen_throughput(), "cache_hit_rate": engine.stats.cache_hit_rate(),
            "utilization": len(engine.running) / self.cfg.max_num_seqs}
        gauges = engine.role.gauges()
        if gauges:
            load["disaggregation"] = {"mode": engine.role.disaggregation_mode,
                                      **{k.removeprefix("num_"): v for k, v in gauges.items()}}
        return json_response({
            "timestamp": datetime.now(UTC).isoformat(), "version": SGLANG_VERSION,
            "accelerator": "sim", "num_accelerators": 1, "loads": [load]})

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_metrics:
            return json_response({"detail": "Not Found"}, status=404)
        return web.Response(body=self.engine.metrics.render(self.engine),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _listed_prompts(body: dict[str, Any], kind: str) -> bool:
    """A completion whose ``prompt`` is a list of prompts (strings or token id lists): SGLang runs
    it as a batch, even of one prompt."""
    prompt = body.get("prompt") if kind == "completions" else None
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _batch_rids(body: dict[str, Any], n: int) -> list[str]:
    """Each prompt's rid, as SGLang's GenerateReqInput normalizes a batch's: a list gives one a
    prompt (of the batch's length), one rid R gives prompt i ``R_i``, none a fresh one each."""
    rid = body.get("rid")
    if isinstance(rid, list):
        if len(rid) != n or not all(isinstance(r, str) and r for r in rid):
            raise ApiError(400, "The specified rids length mismatch with the batch_size for batch processing.",
                           type_="BadRequest")
        return list(rid)
    if isinstance(rid, str) and rid:
        return [f"{rid}_{i}" for i in range(n)]
    return [uuid.uuid4().hex for _ in range(n)]


def _failure(out: StepOutput) -> ApiError | None:
    """The error a finishing output is answered with: an engine failure (500), or an abort that
    carries an HTTP status (``type`` is the status as a string, FastAPI's HTTPException handler)."""
    if out.finish_reason == "error":
        if out.code is not None and (out.code != 500 or out.code_text):     # the error_code fault
            return ApiError(out.code, out.message or "Simulated engine failure", type_=str(out.code),
                            code_text=out.code_text)
        return internal_error(f"Internal server error: {out.message}")
    if out.status is not None:
        return ApiError(out.status, out.message or "Aborted", type_=str(out.status))
    return None


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _empty_input(value: Any) -> str | None:
    """What SGLang's embeddings handler (its ``_validate_request``) says of an input that is empty
    or whitespace only, or a list of strings or of token lists holding one; None for any other."""
    if not isinstance(value, str | list):      # the request model's type error comes first
        return None
    if not value:
        return "Input cannot be empty"
    if isinstance(value, str):
        return None if value.strip() else "Input cannot be empty or whitespace only"
    if isinstance(value, list) and isinstance(value[0], str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                return "All items in input list must be strings"
            if not item.strip():
                return f"Input at index {i} cannot be empty or whitespace only"
    if isinstance(value, list) and isinstance(value[0], list):
        for i, item in enumerate(value):
            if isinstance(item, list) and not item:
                return f"Input at index {i} cannot be empty"
    return None


def _check_logit_bias(bias: Any, vocab: int) -> None:
    """What SGLang's sampling params' check refuses of a ``logit_bias``: a key int() cannot read, and
    the first key outside the vocabulary."""
    if not isinstance(bias, dict):
        if bias is not None:
            raise ApiError(400, "1 validation error:\n  logit_bias: Input should be a valid dictionary",
                           type_="Bad Request")
        return
    for key in bias:
        try:
            token = int(key)
        except ValueError as e:
            raise ApiError(400, str(e), type_="BadRequestError") from None
        if not 0 <= token < vocab:
            raise ApiError(400, f"logit_bias must has keys in [0, {vocab - 1}], got {key}.", type_="BadRequestError")
