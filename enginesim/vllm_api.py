"""vLLM's OpenAI-compatible HTTP surface (``vllm serve``), as of vLLM 0.33.

Shapes follow the reference notes: the nested error envelope, ``chatcmpl-``/``cmpl-`` ids from
``X-Request-Id``, 404 for an unknown model, headers as soon as a stream is admitted, a role chunk
with the first token, ``finish_reason`` + ``stop_reason`` on the last delta, an optional usage
chunk with ``choices: []``, keep-alive comment frames, and in-stream errors followed by ``[DONE]``.
What vLLM refuses is refused with its 400: a completion's ``suffix``, a ``logit_bias`` key that is
not an integer or is out of the vocabulary, an embedding input of no token.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import random
import struct
import sys
import time
import uuid
from array import array
from contextlib import aclosing
from functools import partial
from typing import Any

from aiohttp import web

from enginesim.config import VLLM_VERSION
from enginesim.engine import Engine
from enginesim.errors import ApiError, ErrorStyle, failed_error
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
from enginesim.logprobs import (
    chat_logprobs,
    chat_requested,
    completion_logprobs,
    completion_prompt_logprobs,
    completion_requested,
    prompt_logprobs,
    prompt_requested,
)
from enginesim.lora import LoraError, LoraFull
from enginesim.protocol import OpenAIRequest, chat_prompt_ids, lax_int, parse_openai, token_id_list
from enginesim.sequence import SamplingParams, Sequence, StepOutput
from enginesim.tokenizer import EOS_TOKEN_ID, ID_SPACE, ids_bytes
from enginesim.tools import ToolCalls, chat_tool_calls, rendered_tools, tool_deltas, vllm_call_id
from enginesim.tracing import trace_headers
from enginesim.wire import SseWriter, json_response, read_json

STYLE = ErrorStyle.VLLM


def _tool_finish(seq: Sequence) -> str | None:
    """A tool-call answer's finish reason: vLLM's ``tool_calls`` for calls its parser found (auto,
    required), ``stop`` for a named tool (guided decoding, no parser). The simulated calls are
    whole whatever ended the generation (see enginesim.tools), so never ``length``."""
    return "stop" if seq.tool_calls.named else "tool_calls"


class VllmApi:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        config_hash = hashlib.sha256(repr(self.cfg).encode()).hexdigest()[:8]
        self.fingerprint = f"vllm-{VLLM_VERSION}-{config_hash}"
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.post("/v1/embeddings", self.embeddings),
            web.get("/v1/models", self.models),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/health", self.health),
            web.get("/ping", self.health),
            web.post("/ping", self.health),
            web.get("/version", self.version),
            web.get("/load", self.load),
            web.get("/metrics", self.metrics),
            web.post("/v1/load_lora_adapter", self.load_lora),
            web.post("/v1/unload_lora_adapter", self.unload_lora),
        ]

    # -- shared checks --------------------------------------------------------------------------

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names, if it is a registered one."""
        lora = self.engine.lora
        return model if lora is not None and model is not None and model in lora.registered else None

    def _check_model(self, model: str | None) -> None:
        names = self.cfg.served_model_names
        if model is not None and model not in names and self._adapter(model) is None:
            raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}.",
                           param="model")

    def _check_alive(self) -> None:
        if self.engine.dead:
            raise ApiError(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                           type_="InternalServerError")

    def _max_tokens(self, req: OpenAIRequest, prompt_ids: list[int] | None = None) -> int:
        """The length a prompt (``req``'s, or one of its batch) may generate, as vLLM checks it."""
        limit = self.engine.max_prompt_tokens
        n = len(req.prompt_ids if prompt_ids is None else prompt_ids)
        if n > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your "
                           f"prompt contains {n} input tokens. Please reduce the length of the input.",
                           type_="BadRequestError")
        if req.max_tokens is None:
            rest = self.cfg.max_model_len - n
            # vLLM: no length on a chat, or a completion's explicit null, is the rest of the context
            # (a completion that names none gets its request model's 16)
            kind = "chat" if req.max_tokens_null else req.kind
            if kind == "chat" and self.cfg.rest_of_context:
                return max(1, rest)
            return max(1, min(self.cfg.max_tokens_default(kind), rest))
        if req.max_tokens + n > self.cfg.max_model_len:
            m, ctx = req.max_tokens, self.cfg.max_model_len
            raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's "
                           f"maximum context length is {ctx} tokens and your request has {n} input tokens "
                           f"({m} > {ctx} - {n}).", type_="BadRequestError", param="max_tokens")
        return req.max_tokens

    # -- generation -----------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        engine = self.engine
        try:
            body = await read_json(request, require_json=True)
            # n > 1: the choices, each a sequence of its own, stepped together (on a P/D role each
            # carries the request's kv_transfer_params, as vLLM's child requests do)
            req = parse_openai(body, kind, engine.tokenizer, several=True)
            if req.batch and engine.role.name != "aggregated" and body.get("kv_transfer_params") is not None:
                raise ApiError(501, "enginesim does not simulate a batch of prompts with kv_transfer_params",
                               param="prompt")
            seed = body.get("seed")
            if isinstance(seed, float) and abs(seed) >= _I64:
                # orjson reads an integer past 64 bits as a float: vLLM's parser reads its digits
                seed = json.loads(await request.read()).get("seed")
            _check_sampling(body, seed, req.n)
            if kind == "completions" and body.get("suffix") is not None:
                raise ApiError(400, "suffix is not currently supported", type_="BadRequestError")
            check_logit_bias(body.get("logit_bias"), vocab_size(engine.tokenizer))
            req = dataclasses.replace(req, logprobs=chat_requested(body) if kind == "chat" else
                                      completion_requested(body), prompt_logprobs=prompt_requested(body, kind))
            # vLLM's before-validator, on the values as sent: {} passes, and so does "stream": "false"
            if body.get("stream_options") and not body.get("stream"):
                raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                               type_="BadRequestError", param="stream_options")
            self._check_model(req.model)
            self._check_alive()
            fault = request_fault(engine, request)
            max_tokens = self._max_tokens(req)
            if req.min_tokens > max_tokens:     # SamplingParams._verify_args, on the bound it got
                raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                               f"got {req.min_tokens}.", type_="BadRequestError")
            check_fault_status(engine, fault)
            base = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
            seq_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{base}"
            seq = engine.new_sequence(
                seq_id=seq_id, rid=f"{seq_id}-{uuid.uuid4().hex[:8]}", prompt_ids=req.prompt_ids,
                params=SamplingParams(max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                                      ignore_eos=req.ignore_eos),
                stream=req.stream, fault=fault, cache_salt=req.cache_salt, lora=self._adapter(req.model),
                dp_rank=(dp_rank := request_dp_rank(engine, request)))
            seq.trace_headers = trace_headers(request.headers)
            seq.priority = request_priority(engine, request, body)
            if kind == "chat" and self.cfg.tool_call_parser and req.n == 1:
                seq.tool_calls = chat_tool_calls(body, vllm_call_id)
            engine.role.accept(seq, body)
            # a batch of prompts is a request of its own per prompt (vLLM's ``{request_id}-{i}``);
            # vLLM forks a request of n choices into n child requests of the same prompt. Choice
            # ``prompt_i * n + j`` is prompt i's j-th
            prompts = [(ids, self._max_tokens(req, ids)) for ids, _ in req.batch[1:]]
            seqs = [seq]
            for p, (ids, limit) in enumerate([(req.prompt_ids, max_tokens), *prompts]):
                for j in range(req.n):
                    if p == 0 and j == 0:
                        continue
                    params = seq.params if p == 0 else SamplingParams(
                        max_tokens=limit, min_tokens=req.min_tokens, stop=req.stop, ignore_eos=req.ignore_eos)
                    child = engine.new_sequence(
                        seq_id=seq_id, rid=f"{seq.rid}-{p}_{j}" if p else f"{seq.rid}_{j}", prompt_ids=ids,
                        params=params,
                        stream=req.stream, fault=fault, cache_salt=req.cache_salt, lora=seq.lora,
                        dp_rank=dp_rank)
                    if j:
                        child.output_key += f"\0choice {j}"     # each choice samples its own tokens
                    child.priority = seq.priority
                    engine.role.accept(child, body)
                    seqs.append(child)
        except ApiError as exc:
            return exc.response(STYLE)
        headers = {"X-Request-Id": str(base)} if self.cfg.enable_request_id_headers else {}
        for s in seqs:
            engine.submit(s)
        try:
            if len(seqs) > 1:
                # each choice's echo: its own prompt's text
                echoes = [req.batch[i // req.n][1] if req.batch else req.echo for i in range(len(seqs))]
                if req.stream:
                    return await self._stream_choices(request, req, seqs, headers, echoes)
                return await self._complete_choices(request, req, seqs, headers, echoes)
            if req.stream:
                return await self._stream(request, req, seq, headers)
            return await self._complete(request, req, seq, headers)
        except Dropped:
            return web.Response(status=500)  # never reaches the client: the transport is gone
        finally:
            for s in seqs:
                engine.client_gone(s)  # no-op when the request already finished

    def _usage(self, seq: Sequence, *, final: bool) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": seq.prompt_tokens,
                                 "total_tokens": seq.prompt_tokens + seq.completion_tokens,
                                 "completion_tokens": seq.completion_tokens}
        if final:
            usage["prompt_tokens_details"] = (
                {"cached_tokens": seq.cached_tokens} if self.cfg.report_cached_tokens else None)
        return usage

    def _stop_reason(self, seq: Sequence) -> str | int | None:
        # vLLM reports the matched stop string/token id, and null for EOS.
        return None if seq.stop_reason == EOS_TOKEN_ID else seq.stop_reason

    def _logprobs(self, req: OpenAIRequest, ids: list[int] | tuple[int, ...], start: int,
                  offset: int) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice's tokens ``ids`` (from position ``start``; a completion's
        text from character ``offset``), None when the request asks for none."""
        if req.logprobs is None:
            return None
        if req.kind == "chat":
            return chat_logprobs(self.engine.tokenizer, self.cfg.seed, ids, start, req.logprobs)
        return completion_logprobs(self.engine.tokenizer, self.cfg.seed, ids, start, req.logprobs, offset)

    def _echoed(self, req: OpenAIRequest, echo: str | None) -> bool:
        """A completion that echoes its prompt and asks for logprobs: vLLM computes the prompt's
        (its ``prompt_logprobs`` are the ``logprobs`` count) and answers them first."""
        return req.kind == "completions" and echo is not None and req.logprobs is not None

    def _echoed_logprobs(self, req: OpenAIRequest, seq: Sequence, ids: list[int] | tuple[int, ...],
                         start: int) -> dict[str, Any]:
        """An echoing completion's ``logprobs`` as vLLM writes them on its whole answer or first
        chunk: the prompt's tokens (the first with null logprobs), then the generated ``ids`` (none
        for ``max_tokens`` 0), ``text_offset`` counted from 0 over all of them."""
        assert req.logprobs is not None
        out = completion_prompt_logprobs(self.engine.tokenizer, self.cfg.seed, seq.prompt_ids, req.logprobs)
        if not req.echo_only:
            offset = sum(len(t) for t in out["tokens"])
            tail = completion_logprobs(self.engine.tokenizer, self.cfg.seed, ids, start, req.logprobs, offset)
            for key, values in tail.items():
                out[key].extend(values)
        return out

    def _chunk_logprobs(self, req: OpenAIRequest, seq: Sequence, ids: list[int] | tuple[int, ...], start: int,
                        offset: int, echo: str | None) -> dict[str, Any] | None:
        """A stream chunk's ``logprobs``: its tokens' (their text from character ``offset``, after
        the ``echo`` it begins with), the prompt's first on an echoing completion's first chunk."""
        if self._echoed(req, echo):
            return self._echoed_logprobs(req, seq, ids, start)
        return self._logprobs(req, ids, start, offset + len(echo or ""))

    def _choice(self, req: OpenAIRequest, index: int, seq: Sequence, text: str, token_ids: bool,
                echo: str | None = None) -> dict[str, Any]:
        """One choice of a whole answer, as vLLM writes it (``token_ids``: the sequence's and its
        prompt's ids, as ``return_token_ids`` asks; ``echo``: the prompt's text ``text`` begins with)."""
        choice: dict[str, Any] = {"index": index}
        if req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text, "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "tool_calls": [], "reasoning": None}
        else:
            choice["text"] = text
        calls: ToolCalls | None = seq.tool_calls
        k = min(self._reasoning_budget(req, seq), len(seq.output_ids))
        if k:                   # the reasoning parser's split: the first tokens' text, then the content
            thought = "".join(self.engine.tokenizer.piece(t) for t in seq.output_ids[:k])[:len(text)]
            choice["message"]["reasoning"], choice["message"]["content"] = thought, text[len(thought):]
        if calls is not None and req.kind == "chat":
            choice["message"]["content"] = None
            choice["message"]["tool_calls"] = [
                {"id": calls.ids[i], "type": "function",
                 "function": {"name": name, "arguments": calls.arguments(i, text)}}
                for i, name in enumerate(calls.names)]
        if calls is not None:
            logprobs = None
        elif self._echoed(req, echo):
            logprobs = self._echoed_logprobs(req, seq, seq.output_ids, 0)
        else:
            logprobs = self._logprobs(req, seq.output_ids, 0, len(echo or ""))
        choice.update({"logprobs": logprobs, "finish_reason": _tool_finish(seq) if calls is not None else seq.finish_reason,
                       "stop_reason": self._stop_reason(seq),
                       "token_ids": list(seq.output_ids) if token_ids else None})
        if req.kind == "completions":
            # echo with logprobs: vLLM computed the prompt's logprobs, and the choice carries them
            # asked for (prompt_logprobs, or echo with logprobs): vLLM computed the prompt's
            # logprobs, and the choice carries them
            choice["prompt_logprobs"] = self._prompt_logprobs(req, seq)
            choice["prompt_token_ids"] = seq.prompt_ids if token_ids else None
        return choice

    def _reasoning_budget(self, req: OpenAIRequest, seq: Sequence) -> int:
        """How many of a chat answer's first tokens are reasoning: with ``--reasoning-parser``, half
        its ``max_tokens``; none on a call, an echo, several choices or without the parser."""
        if (not self.cfg.reasoning_parser or req.kind != "chat" or req.n != 1 or seq.tool_calls is not None
                or req.echo):
            return 0
        return seq.params.max_tokens // 2

    def _prompt_logprobs(self, req: OpenAIRequest, seq: Sequence) -> list[dict[str, Any] | None] | None:
        if req.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.engine.tokenizer, self.cfg.seed, seq.prompt_ids, req.prompt_logprobs)

    async def _complete(self, request: web.Request, req: OpenAIRequest, seq: Sequence,
                        headers: dict[str, str]) -> web.StreamResponse:
        result = await collect(self.engine, request, seq)
        await slow_headers(self.engine, seq.fault)
        if result.final.finish_reason == "error" or result.final.status is not None:
            return failed_error(result.final.code, result.final.message, result.final.code_text).response(STYLE, headers)
        # echo: the prompt's text (a completion) or the last message's (a chat) begins the answer
        text = "" if req.echo_only else result.text     # max_tokens 0 with echo: the prompt alone
        choice = self._choice(req, 0, seq, (req.echo or "") + text, req.return_token_ids, req.echo)
        body: dict[str, Any] = {
            "id": seq.id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": seq.created, "model": seq.lora or self.cfg.served_name, "choices": [choice],
            "service_tier": None, "system_fingerprint": self.fingerprint,
            "usage": self._usage(seq, final=True),
        }
        if req.kind == "chat":
            body["prompt_logprobs"] = self._prompt_logprobs(req, seq)
            body["prompt_token_ids"] = seq.prompt_ids if req.return_token_ids else None
        body["kv_transfer_params"] = None
        body.update(self.engine.role.response_extras(seq))
        return json_response(body, headers=headers)

    async def _stream(self, request: web.Request, req: OpenAIRequest, seq: Sequence,
                      headers: dict[str, str]) -> web.StreamResponse:
        writer = SseWriter(request, charset="utf-8", headers=headers)
        await slow_headers(self.engine, seq.fault)
        await writer.start()  # vLLM: headers go out once the request is admitted
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        continuous = req.include_usage and req.continuous_usage

        def chunk(choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
            out = {"id": seq.id, "object": obj, "created": seq.created, "model": seq.lora or self.cfg.served_name,
                   "choices": [choice], **extra}
            if continuous:
                out["usage"] = self._usage(seq, final=False)
            return out

        first = True
        # echo: the prompt's text goes out with the first output's, on its chunk (held back or not)
        echo = req.echo if not chat else None
        done = offset = 0      # the tokens sent so far, and the characters of a completion's text
        async with aclosing(outputs(self.engine, request, seq, self.cfg.sse_keepalive_s)) as stream:
            async for out in stream:
                if out is None:
                    await writer.keepalive()
                    continue
                if out.finish_reason == "error" or out.status is not None:
                    await writer.send(failed_error(out.code, out.message, out.code_text).stream_payload(STYLE))
                    return await writer.done()
                if req.echo_only:       # max_tokens 0 with echo: the prompt alone
                    out = dataclasses.replace(out, text="")
                prompt_ids = seq.prompt_ids if req.return_token_ids else None
                if chat and first:
                    # return_token_ids: the prompt's ids ride on the first chunk ever
                    await writer.send(chunk(
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, prompt_token_ids=prompt_ids, prompt_text=None))
                    prompt_ids = None
                    if req.echo:        # echo: the last message's content, a chunk of its own
                        await writer.send(chunk({"index": 0, "delta": {"content": req.echo}, "logprobs": None,
                                                 "finish_reason": None}))
                if chat and seq.tool_calls is not None:
                    for c in self._tool_deltas(seq, out):
                        await writer.send(chunk(c))
                    first = False
                    continue
                if (out.finish_reason is None and not out.text and not (req.return_token_ids and out.token_ids)
                        and echo is None):
                    done += len(out.token_ids)
                    continue  # held back (maybe the start of a stop string); its ids still go out when asked
                await writer.send(self._delta_chunk(chunk, chat, seq, out, req.include_usage,
                                                    req.return_token_ids, prompt_ids if first else None, echo=echo,
                                                    logprobs=self._chunk_logprobs(req, seq, out.token_ids, done,
                                                                                  offset, echo),
                                                    reasoning=done < self._reasoning_budget(req, seq)))
                done += len(out.token_ids)
                offset += len(out.text) + len(echo or "")
                first = False
                echo = None
        if req.include_usage:
            await writer.send({"id": seq.id, "object": obj, "created": seq.created,
                               "model": seq.lora or self.cfg.served_name, "choices": [],
                               "usage": _drop_none(self._usage(seq, final=True)),
                               "system_fingerprint": self.fingerprint})
        return await writer.done(partial(at_end, self.engine, request, seq.fault))

    def _tool_deltas(self, seq: Sequence, out: StepOutput) -> list[dict[str, Any]]:
        """The choices of a tool-call answer's chunks for one output: the first call's arguments
        a piece at a time (its id and name on the first), the other calls whole at the end, then
        the finishing chunk."""
        deltas = tool_deltas(seq.tool_calls, out.text, out.finish_reason is not None)
        out_choices = [{"index": 0, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}
                       for d in deltas]
        if out.finish_reason is not None:
            out_choices.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": _tool_finish(seq),
                                "stop_reason": self._stop_reason(seq)})
        return out_choices

    def _delta_chunk(self, chunk: Any, chat: bool, seq: Sequence, out: StepOutput,
                     has_usage_chunk: bool, token_ids: bool = False,
                     prompt_ids: list[int] | None = None, index: int = 0,
                     echo: str | None = None, logprobs: dict[str, Any] | None = None,
                     reasoning: bool = False) -> dict[str, Any]:
        """``echo``: the prompt's text a completion's first chunk begins with (vLLM: the prompt's
        text and the first output's; its ``token_ids`` stay the output's, its usage counts them only)."""
        finishing = out.finish_reason is not None
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["delta"] = {"reasoning": out.text} if reasoning else {"content": out.text}
        else:
            choice["text"] = out.text if echo is None else echo + out.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = out.finish_reason
        if finishing or not chat:
            choice["stop_reason"] = self._stop_reason(seq) if finishing else None
        if chat:
            choice["token_ids"] = list(out.token_ids) if token_ids else None
        elif token_ids:       # completions: the prompt's ids on the first chunk, in its choice
            if prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = list(out.token_ids)
        extra: dict[str, Any] = {}
        if chat:
            extra["kv_transfer_params"] = None
        if finishing:
            extra.update(self.engine.role.response_extras(seq))
            if not has_usage_chunk:
                extra["system_fingerprint"] = self.fingerprint
        return chunk(choice, **extra)

    # -- n > 1 ----------------------------------------------------------------------------------

    def _usage_of(self, seqs: list[Sequence], n: int) -> dict[str, Any]:
        """The usage of a request of several choices (``n`` per prompt): each prompt once, every
        choice's tokens."""
        usage = self._usage(seqs[0], final=True)
        done = sum(s.completion_tokens for s in seqs)
        prompt = sum(s.prompt_tokens for s in seqs[::n])
        usage["prompt_tokens"] = prompt
        usage["completion_tokens"] = done
        usage["total_tokens"] = prompt + done
        return usage

    async def _complete_choices(self, request: web.Request, req: OpenAIRequest, seqs: list[Sequence],
                                headers: dict[str, str], echoes: list[str | None]) -> web.StreamResponse:
        """A whole answer of several choices: ``choices`` in index order, usage summed."""
        results = await asyncio.gather(*(collect(self.engine, request, s) for s in seqs))
        await slow_headers(self.engine, seqs[0].fault)
        failed = next((r.final for r in results if r.final.finish_reason == "error" or r.final.status is not None), None)
        if failed is not None:
            return failed_error(failed.code, failed.message, failed.code_text).response(STYLE, headers)
        choices = []
        for i, (seq, result) in enumerate(zip(seqs, results, strict=True)):
            text = "" if req.echo_only else result.text
            choices.append(self._choice(req, i, seq, (echoes[i] or "") + text, False, echoes[i]))
        seq = seqs[0]
        body: dict[str, Any] = {
            "id": seq.id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": seq.created, "model": seq.lora or self.cfg.served_name, "choices": choices,
            "service_tier": None, "system_fingerprint": self.fingerprint, "usage": self._usage_of(seqs, req.n),
        }
        if req.kind == "chat":
            body["prompt_logprobs"] = self._prompt_logprobs(req, seq)
            body["prompt_token_ids"] = None
        body["kv_transfer_params"] = None
        # a prefill's choices each keep their blocks for a decode; the answer names one choice's
        body.update(self.engine.role.response_extras(seqs[0]))
        return json_response(body, headers=headers)

    async def _stream_choices(self, request: web.Request, req: OpenAIRequest, seqs: list[Sequence],
                              headers: dict[str, str], echoes: list[str | None]) -> web.StreamResponse:
        """A stream of several choices, as vLLM sends it: each chunk carries one choice (its
        ``index``), the choices' chunks interleaved as their tokens come; a chat's role chunks
        first, one per choice; each choice's last chunk carries its ``finish_reason``. With
        ``continuous_usage_stats`` each chunk's usage is its own choice's (vLLM's
        ``previous_num_tokens[i]``); the final usage chunk sums them."""
        writer = SseWriter(request, charset="utf-8", headers=headers)
        seq = seqs[0]
        await slow_headers(self.engine, seq.fault)
        await writer.start()
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        continuous = req.include_usage and req.continuous_usage

        def chunk(choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
            out = {"id": seq.id, "object": obj, "created": seq.created, "model": seq.lora or self.cfg.served_name,
                   "choices": [choice], **extra}
            if continuous:
                out["usage"] = self._usage(seqs[choice["index"]], final=False)
            return out

        came, pumps = merged_outputs(self.engine, request, seqs)
        try:
            first = True
            left = len(seqs)
            echo = [None if chat else e for e in echoes]     # each choice's first chunk echoes
            done = [0] * len(seqs)          # each choice's tokens sent so far
            offset = [0] * len(seqs)        # and the characters of its text
            while left:
                i, out = await came.get()
                if isinstance(out, Dropped):
                    raise out
                if out.finish_reason == "error" or out.status is not None:
                    await writer.send(failed_error(out.code, out.message, out.code_text).stream_payload(STYLE))
                    return await writer.done()
                if req.echo_only:       # max_tokens 0 with echo: the prompt alone
                    out = dataclasses.replace(out, text="")
                if chat and first:
                    for k in range(len(seqs)):
                        await writer.send(chunk({"index": k, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}))
                    for k in range(len(seqs) if req.echo else 0):
                        await writer.send(chunk({"index": k, "delta": {"content": req.echo}, "logprobs": None,
                                                 "finish_reason": None}))
                first = False
                if out.finish_reason is not None:
                    left -= 1
                elif not out.text and echo[i] is None:
                    done[i] += len(out.token_ids)
                    continue
                await writer.send(self._delta_chunk(chunk, chat, seqs[i], out, req.include_usage, index=i,
                                                    echo=echo[i], logprobs=self._chunk_logprobs(
                                                        req, seqs[i], out.token_ids, done[i], offset[i], echo[i])))
                done[i] += len(out.token_ids)
                offset[i] += len(out.text) + len(echo[i] or "")
                echo[i] = None
        finally:
            for p in pumps:
                p.cancel()
        if req.include_usage:
            await writer.send({"id": seq.id, "object": obj, "created": seq.created,
                               "model": seq.lora or self.cfg.served_name, "choices": [],
                               "usage": _drop_none(self._usage_of(seqs, req.n)),
                               "system_fingerprint": self.fingerprint})
        return await writer.done(partial(at_end, self.engine, request, seq.fault))

    # -- other endpoints ------------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/embeddings``: the vectors of ``input`` (OpenAI's embeddings request) or, in
        its place, of a chat's ``messages`` rendered as the chat template renders them (vLLM's chat
        embeddings request, ``EmbeddingChatRequest``: one vector)."""
        try:
            body = await read_json(request, require_json=True)
            self._check_model(body.get("model"))
            self._check_alive()
            if body.get("input") is None and "messages" in body:
                inputs: list[str | list[int]] = [chat_prompt_ids(body["messages"], self.engine.tokenizer)]
            else:
                inputs = embedding_inputs(body.get("input"))
            dims = body.get("dimensions")
            if dims is None:
                dims = self.cfg.embedding_dim
            elif not isinstance(dims, int) or isinstance(dims, bool):
                raise ApiError(400, "1 validation error:\n  dimensions: Input should be a valid integer",
                               type_="Bad Request", param="dimensions")
            elif dims < 1:
                raise ApiError(400, "Dimensions must be greater than 0", type_="BadRequestError",
                               param="dimensions")
            else:   # a Matryoshka cut keeps the first `dims` values: past the model's width, all of them
                dims = min(dims, self.cfg.embedding_dim)
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64", *BYTES_FORMATS):
                raise ApiError(400, f"Unknown encoding_format {fmt!r}", type_="BadRequestError",
                               param="encoding_format")
            dtype, endianness = binary_options(body)
        except ApiError as exc:
            return exc.response(STYLE)
        data = []
        total = 0
        encoded = [item if isinstance(item, list) else self.engine.tokenizer.encode(item) for item in inputs]
        if not all(encoded):        # vLLM's input processor: a prompt of no token is refused
            return ApiError(400, "The decoder prompt cannot be empty", type_="BadRequestError").response(STYLE)
        if fmt in BYTES_FORMATS:
            vectors = [embed(ids, dims, self.cfg.seed) for ids in encoded]
            return await bytes_response(request, f"embd-{uuid.uuid4().hex}", self.cfg.served_name, vectors,
                                        sum(map(len, encoded)), fmt, dtype, endianness)
        for i, ids in enumerate(encoded):
            total += len(ids)
            vector = embed(ids, dims, self.cfg.seed)
            emb: Any = vector
            if fmt == "base64":
                emb = base64.b64encode(array("f", vector).tobytes()).decode()
            data.append({"index": i, "object": "embedding", "embedding": emb})
        return json_response({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": self.cfg.served_name, "data": data,
                              "usage": {"prompt_tokens": total, "total_tokens": total,
                                        "completion_tokens": 0, "prompt_tokens_details": None}})

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.cfg.model, "parent": None, "max_model_len": self.cfg.max_model_len,
                "permission": [{"id": f"modelperm-{hashlib.md5(name.encode()).hexdigest()}",
                                "object": "model_permission", "created": self.created,
                                "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}

    async def models(self, request: web.Request) -> web.Response:
        cards = [self._model_card(n) for n in self.cfg.served_model_names]
        lora = self.engine.lora
        for name, path in (lora.registered.items() if lora is not None else ()):
            cards.append({**self._model_card(name), "root": path, "parent": self.cfg.served_name,
                          "max_model_len": None})
        return json_response({"object": "list", "data": cards})

    async def load_lora(self, request: web.Request) -> web.Response:
        return await self._lora_call(request, load=True)

    async def unload_lora(self, request: web.Request) -> web.Response:
        return await self._lora_call(request, load=False)

    async def _lora_call(self, request: web.Request, load: bool) -> web.Response:
        """vLLM's runtime adapter calls (VLLM_ALLOW_RUNTIME_LORA_UPDATING): plain-text success,
        the error envelope otherwise."""
        lora = self.engine.lora
        if not self.cfg.runtime_lora_updating:      # the routes vLLM adds only with the variable set
            return web.json_response({"detail": "Not Found"}, status=404)
        try:
            body = await read_json(request, require_json=True)
            if lora is None:
                raise ApiError(400, "LoRA is not enabled. Use --enable-lora to enable LoRA.", type_="BadRequestError")
            if load and self.cfg.lora_load_call_ms:
                await asyncio.sleep(self.cfg.lora_load_call_ms / 1000.0)
            try:
                text = lora.load(body.get("lora_name"), body.get("lora_path")) if load else \
                    lora.unload(body.get("lora_name"))
            except LoraFull:       # the plain WorkerLoRAManager's RuntimeError, as load_lora_adapter words it
                raise ApiError(400, "No free adapter slots.", type_="BadRequestError") from None
            except LoraError as e:
                raise ApiError(e.status, e.message, type_=e.type_) from None
        except ApiError as exc:
            return exc.response(STYLE)
        return web.Response(text=text)

    async def tokenize(self, request: web.Request) -> web.Response:
        tok = self.engine.tokenizer
        try:
            body = await read_json(request, require_json=True)
            self._check_model(body.get("model"))
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                    raise ApiError(400, "1 validation error:\n  messages: Input should be a valid list of messages",
                                   type_="Bad Request", param="messages")
                text = tok.render_chat(messages, rendered_tools(body.get("tools")))
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise ApiError(400, "1 validation error:\n  prompt: Field required", type_="Bad Request",
                               param="prompt")
        except ApiError as exc:
            return exc.response(STYLE)
        ids = tok.encode(text)
        return json_response({"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids,
                              "token_strs": tok.pieces(ids) if body.get("return_token_strs") else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, require_json=True)
            self._check_model(body.get("model"))
            tokens = body.get("tokens")
            ids = [] if tokens == [] else token_id_list(tokens, "tokens")
            if ids is None:
                raise ApiError(400, "1 validation error:\n  tokens: Input should be a list of integers",
                               type_="Bad Request", param="tokens")
        except ApiError as exc:
            return exc.response(STYLE)
        return json_response({"prompt": self.engine.tokenizer.decode(ids)})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.dead else 200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    async def load(self, request: web.Request) -> web.Response:
        return json_response({"server_load": self.engine.num_live})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.engine.metrics.render(self.engine),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


_I64 = 1 << 63


def _check_sampling(body: dict[str, Any], seed: Any, n: int) -> None:
    """What vLLM refuses of a request's ``seed`` (its request models bound it to a signed 64-bit
    integer). ``best_of`` is not read: vLLM V1 has no such field and ignores it, whatever its value."""
    if seed is not None:
        try:
            seed = lax_int(seed)
        except ValueError as e:
            raise ApiError(400, f"1 validation error:\n  seed: {e}", type_="Bad Request", param="seed") from None
        if not -_I64 <= seed < _I64:
            bound = f"greater than or equal to {-_I64}" if seed < 0 else f"less than or equal to {_I64 - 1}"
            raise ApiError(400, f"1 validation error:\n  seed: Input should be {bound}", type_="Bad Request",
                           param="seed")


def vocab_size(tokenizer: Any) -> int:
    """The ids a model's vocabulary holds: a real tokenizer's, the fake one's id space."""
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) else ID_SPACE


def check_logit_bias(bias: Any, vocab: int) -> None:
    """What vLLM refuses of a ``logit_bias`` (``dict[str, float]``): a key its SamplingParams cannot
    read as an integer (``int(key)``'s ValueError), and ids outside the vocabulary (its input
    processor's check, which lists them all)."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ApiError(400, "1 validation error:\n  logit_bias: Input should be a valid dictionary",
                       type_="Bad Request", param="logit_bias")
    ids = []
    for key in bias:
        try:
            ids.append(int(key))
        except ValueError as e:
            raise ApiError(400, str(e), type_="BadRequestError") from None
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                       f"{vocab}", type_="BadRequestError", param="logit_bias")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def embedding_inputs(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    ids = token_id_list(value, "input")
    if ids is not None:
        return [ids]
    if isinstance(value, list) and value:
        # vLLM's ``list[str] | list[list[int]]``: all strings or all token-id lists, never a mix
        if all(isinstance(item, str) for item in value):
            return list(value)
        out: list[str | list[int]] = []
        for item in value:
            item_ids = token_id_list(item, "input")
            if item_ids is None:
                break
            out.append(item_ids)
        else:
            return out
    raise ApiError(400, "1 validation error:\n  input: Input should be a string, a list of strings or "
                   "token ids", type_="Bad Request", param="input")


# vLLM's binary answers of /v1/embeddings and /pooling (``encoding_format`` "bytes", "bytes_only"):
# the vectors' bytes back to back as application/octet-stream (a StreamingResponse: chunked, no
# Content-Length), and, for "bytes", a ``metadata`` header of JSON saying where each vector is and
# the usage (vllm/utils/serial_utils.py, ``encode_pooling_bytes``)
BYTES_FORMATS = ("bytes", "bytes_only")
_DTYPES = {"float32": ("f", 4), "float16": ("e", 2), "bfloat16": ("f", 2)}


def binary_options(body: dict[str, Any]) -> tuple[str, str]:
    """A request's ``embed_dtype`` and ``endianness`` (vLLM's defaults "float32" and "native");
    the fp8 types vLLM also takes are not simulated."""
    dtype = body.get("embed_dtype") or "float32"
    endianness = body.get("endianness") or "native"
    if dtype not in _DTYPES:
        raise ApiError(400, f"embed_dtype {dtype!r} is not simulated", type_="BadRequestError", param="embed_dtype")
    if endianness not in ("native", "little", "big"):
        raise ApiError(400, f"Unknown endianness {endianness!r}", type_="BadRequestError", param="endianness")
    return dtype, endianness


def vector_bytes(vector: list[float], dtype: str, endianness: str) -> bytes:
    code, size = _DTYPES[dtype]
    order = {"little": "<", "big": ">"}.get(endianness, "=")
    raw = struct.pack(f"{order}{len(vector)}{code}", *vector)
    if dtype == "bfloat16":         # the upper half of each float32
        keep = slice(2, 4) if order == "<" or (order == "=" and sys.byteorder == "little") else slice(0, 2)
        raw = b"".join(raw[i:i + 4][keep] for i in range(0, len(raw), 4))
    return raw


async def bytes_response(request: web.Request, id_: str, model: str, vectors: list[list[float]], tokens: int,
                         fmt: str, dtype: str, endianness: str) -> web.StreamResponse:
    chunks, items, offset = [], [], 0
    for i, vector in enumerate(vectors):
        raw = vector_bytes(vector, dtype, endianness)
        chunks.append(raw)
        items.append({"index": i, "embed_dtype": dtype, "endianness": endianness, "start": offset,
                      "end": offset + len(raw), "shape": [len(vector)]})
        offset += len(raw)
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    if fmt == "bytes":
        resp.headers["metadata"] = json.dumps({"id": id_, "created": int(time.time()), "model": model, "data": items,
                                               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for raw in chunks:
        await resp.write(raw)
    await resp.write_eof()
    return resp


def embed(ids: list[int], dims: int, seed: int) -> list[float]:
    """A unit vector determined by the token ids: same text, same embedding."""
    digest = hashlib.blake2b(ids_bytes(ids), digest_size=16, key=str(seed).encode()).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    vec = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = sum(v * v for v in vec) ** 0.5 or 1.0
    return [v / norm for v in vec]


__all__ = ["VllmApi"]
