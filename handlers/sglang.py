"""SGLang P/D, bootstrap: both legs carry the same bootstrap host/port/room and ``rid``.

The bodies are built from the client's parsed request and serialized once each (orjson): the
top-level members the gateway controls are removed and its own appended, and every other member
(messages, tools, ...) keeps its order and value, the same bytes on both legs. A body that names a
controlled key twice is refused before any endpoint is chosen: the gateway and the engine must not
read two different requests out of one body.
"""

from __future__ import annotations

import itertools
import os
import random
import re
from typing import Annotated, Any, Protocol

import msgspec
import orjson

from gateway.apis.paths import (
    ANTHROPIC_PATHS,
    DETOKENIZE_PATHS,
    SGLANG_CLASSIFY,
    TOKENIZE_PATHS,
    TRANSCRIPTIONS,
)
from gateway.endpoints import Endpoint
from gateway.request import CHAT, COMPLETIONS, InferenceRequest, body_bytes, usage_stream_options
from handlers.base import OPENAI_PATHS, AbortSpec, PDPlan, Unsplit, engine_message, openai_usage
from handlers.base import BodyError as _BodyError
from handlers.continuation import TEXT


class SGLangPDSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``pd.sglang`` config block."""

    default_bootstrap_port: Annotated[int, msgspec.Meta(ge=0, le=65535, description="KV bootstrap port of a prefill endpoint when neither the endpoint nor its roleset sets one.")] = 8998
    abort_timeout_s: Annotated[float, msgspec.Meta(ge=0, description="After a failed prefill, how long the /abort_request call to the decode may take, in seconds (0: no abort is sent).")] = 3.0
    abort_retry_delay_s: Annotated[float, msgspec.Meta(ge=0, description="Send a second abort after this delay, in seconds (0: only one).")] = 2.0


# SGLang's HTTP server (python/sglang/srt/entrypoints/http_server.py) has rerank, score and its
# OpenAI-style classify under /v1 only, tokenize and detokenize under both spellings,
# transcription; no /rerank, /v2/rerank, /score, audio translation, /pooling or /v2/embed, and its
# /classify is its native one (text or input_ids, no model field: not vLLM's)
# its Anthropic handler (sglang/srt/entrypoints/anthropic/) serves the Messages API and count_tokens
PATHS = OPENAI_PATHS | frozenset({"/v1/rerank", "/v1/score", SGLANG_CLASSIFY, *TOKENIZE_PATHS, *DETOKENIZE_PATHS,
                                  TRANSCRIPTIONS, *ANTHROPIC_PATHS})

# keys the gateway writes into both bodies
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")
# keys the gateway writes or removes in the prefill body
PREFILL_KEYS = ("max_tokens", "max_completion_tokens", "stream", "stream_options", "min_tokens")
CONTROLLED = frozenset(BOOTSTRAP_KEYS + PREFILL_KEYS)

ROOM_LIMIT = 2**63

_NONCE = os.urandom(4).hex()
_COUNTER = itertools.count(1)


def _new_nonce() -> None:
    """A forked process (a worker of ``server.workers``) draws its own nonce: two workers with the
    parent's would make the same rids, and an abort of one request would stop another's."""
    global _NONCE, _COUNTER
    _NONCE, _COUNTER = os.urandom(4).hex(), itertools.count(1)


os.register_at_fork(after_in_child=_new_nonce)


class BodyError(_BodyError):
    """The body cannot be split into top-level members (not a JSON object, or a duplicate
    controlled key)."""


def new_rid(request_id: str) -> str:
    """``<request-id>-<16 hex>``: a process nonce and a counter, fixed width, so no rid is a
    prefix of another (SGLang's /abort_request matches by prefix)."""
    return f"{request_id}-{_NONCE}{next(_COUNTER) & 0xFFFFFFFF:08x}"


def new_room(rng: random.Random | None = None) -> int:
    return (rng or random).randrange(ROOM_LIMIT)


# One JSON token the member splitter must see: a whole string (escapes included), or a structural
# character. Numbers, true/false/null and whitespace are skipped by the regex engine, so the
# Python loop below runs once per string or bracket, never once per byte of a long prompt.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\],:]', re.DOTALL)
_WS = b" \t\r\n"


def split_members(body: bytes) -> list[tuple[str, bytes]]:
    """Top-level ``(key, raw member bytes)`` pairs of a JSON object, in order. The body must
    already be known to be valid JSON (the gateway parsed it once)."""
    tokens = _TOKEN.finditer(body)
    first = next(tokens, None)
    if first is None or body[first.start()] != 0x7B or body[:first.start()].strip(_WS):
        raise BodyError("request body is not a JSON object")
    out: list[tuple[str, bytes]] = []
    depth = 0
    key: str | None = None           # the member being read (depth 0), None between members
    start = 0
    for m in tokens:
        c = body[m.start()]
        if depth:
            if c == 0x7B or c == 0x5B:
                depth += 1
            elif c == 0x7D or c == 0x5D:
                depth -= 1
        elif key is None:
            if c == 0x7D and not out:
                return out
            if c != 0x22:
                raise BodyError("expected a key")
            key, start = orjson.loads(m.group()), m.start()
        elif c == 0x2C or c == 0x7D:
            out.append((key, body[start:m.start()].rstrip(_WS)))
            key = None
            if c == 0x7D:
                return out
        elif c == 0x7B or c == 0x5B:
            depth = 1
    raise BodyError("unterminated object")


def check_members(members: list[tuple[str, bytes]]) -> None:
    seen: set[str] = set()
    for key, _ in members:
        if key in CONTROLLED:
            if key in seen:
                raise BodyError(f'duplicate top-level key "{key}" in SGLang request body')
            seen.add(key)


_QUOTED_CONTROLLED = tuple(b'"%s"' % k.encode() for k in CONTROLLED)   # as they appear in the body


def duplicate_controlled_key(body: bytes) -> str | None:
    """A controlled key the client wrote twice at the top level, if any. The engine and the gateway
    could read such a body differently, so it is refused. Scanning is cheap: the exact splitter
    runs only when a controlled key's name appears more than once anywhere in the body."""
    count = body.count
    for quoted in _QUOTED_CONTROLLED:
        if count(quoted) > 1:
            break
    else:
        return None
    try:
        check_members(split_members(body))
    except BodyError as e:
        return str(e)
    return None


def build_bodies(data: dict[str, Any], *, bootstrap_host: str | list[str], bootstrap_port: int | list[int],
                 room: int | list[int], rid: str | list[str], decode_extra: dict[str, Any] | None = None,
                 original: bytes = b"") -> tuple[bytes, bytes]:
    """(prefill body, decode body) from the client's parsed request, serialized once each.

    Both get the bootstrap triple and the rid (client values overwritten; a batch's, lists of one
    a prompt). The prefill also gets
    ``max_tokens=1``, ``max_completion_tokens=1``, ``stream=false`` and loses ``stream_options``
    and ``min_tokens``. ``decode_extra`` replaces top-level decode keys (e.g. stream_options when
    the gateway asks for usage). The client's other members keep their order and values, so both
    legs carry the same bytes for them (the same prompt, token for token).
    """
    boot = {"bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port, "bootstrap_room": room, "rid": rid}
    extra = decode_extra or {}
    decode = {k: v for k, v in data.items() if k not in boot and k not in extra}
    decode.update(extra)
    decode.update(boot)
    prefill = {k: v for k, v in data.items() if k not in CONTROLLED}
    prefill.update(max_tokens=1, max_completion_tokens=1, stream=False)
    prefill.update(boot)
    return body_bytes(prefill, original), body_bytes(decode, original)


def listed_prompts(ireq: InferenceRequest) -> int | None:
    """How many prompts a completion's list of prompts (strings or token id lists) holds: SGLang
    runs it as a batch, even of one prompt. None for any other request."""
    prompt = ireq.data.get("prompt") if ireq.path == COMPLETIONS else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return None


def bootstrap_host_of(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class HasSGLangSettings(Protocol):
    """What the adapter reads of the model's ``pd`` config block."""

    sglang: SGLangPDSettings


class SGLangAdapter:
    """Bootstrap: both legs start together with the same bootstrap triple and gateway-owned rid;
    an abandoned leg is dropped with ``/abort_request {rid}``."""

    engine = "sglang"
    echoes_chat = False     # its chat request has no echo (only its completion request has)
    continuous_usage_alone = True   # should_include_usage reads continuous_usage_stats apart from include_usage

    def check_pd_body(self, ireq: InferenceRequest) -> None:
        dup = duplicate_controlled_key(ireq.body)
        if dup is not None:
            raise BodyError(dup)

    def pd_plan(self, ireq: InferenceRequest, checked: None, *, prefill: Endpoint,
                settings: HasSGLangSettings, rng: random.Random) -> PDPlan:
        """A completion's list of prompts (even of one) is a batch to SGLang, which holds its prompt i
        by a rid of its own (``<rid>_i`` of one rid) and passes an abort on only for a rid it holds:
        both legs name each prompt's rid and bootstrap room (a fresh one each, as sgl-router's PD
        mode does), and an abort names each prompt's rid."""
        own = settings.sglang
        rid = new_rid(ireq.request_id)
        host = bootstrap_host_of(prefill.host)
        port = prefill.bootstrap_port or own.default_bootstrap_port
        extra = usage_stream_options(ireq, self.continuous_usage_alone)
        batch = listed_prompts(ireq)
        if batch is None:
            p_body, d_body = build_bodies(ireq.data, bootstrap_host=host, bootstrap_port=port, room=new_room(rng),
                                          rid=rid, decode_extra=extra, original=ireq.body)
            held = [rid]
        else:
            held = [f"{rid}_{i}" for i in range(batch)]
            p_body, d_body = build_bodies(ireq.data, bootstrap_host=[host] * batch, bootstrap_port=[port] * batch,
                                          room=[new_room(rng) for _ in range(batch)], rid=held,
                                          decode_extra=extra, original=ireq.body)
        abort = AbortSpec("/abort_request", tuple(orjson.dumps({"rid": r}) for r in held), own.abort_timeout_s,
                          own.abort_retry_delay_s)
        return PDPlan(concurrent=True, prefill_body=p_body, decode_body=d_body, abort=abort,
                      strip_usage=extra is not None, log={"rid": rid})

    def decode_body(self, ireq: InferenceRequest, prefill_answer: bytes, *, prefill: Endpoint,
                    settings: HasSGLangSettings) -> bytes:
        raise NotImplementedError("SGLang plans carry both bodies")

    usage = staticmethod(openai_usage)     # OpenAI's usage object as it is: no frame around it

    def unsplit(self, ireq: InferenceRequest, context: int | None = None) -> Unsplit | None:
        """SGLang sends a prompt's n samples (and the prefill-only request caching its prefix first)
        with the prompt's one bootstrap room (TokenizerManager._handle_batch_request; a list of
        rooms gives them all its first), so its P/D legs would pair them by a room they share: such
        a request is not split. A batch's prompts each have a room of their own (``pd_plan``), and
        are. Nor are prompt logprobs (a completion's echo with logprobs)."""
        if ireq.choices * ireq.fan > ireq.sequences:       # n > 1
            return Unsplit("several_choices", "n > 1", "n", "SGLang sends a prompt's samples with its one "
                           "bootstrap room, so its prefill and decode legs cannot pair them")
        if ireq.path == COMPLETIONS and ireq.data.get("echo") is True and ireq.data.get("logprobs"):
            # OpenAIServingCompletion asks them (logprob_start_len 0, for logprobs of 1 or more) of
            # the prompt's forward pass, which a decode-mode server skips: it builds the prompt's
            # batch from the KV it got (disaggregation/decode.py); sgl-router takes them from the
            # prefill's answer
            return Unsplit("prompt_logprobs", "prompt logprobs", "logprobs",
                           "they come from the prompt's forward pass, which an SGLang decode that loads its KV "
                           "does not run")
        return None

    def serves(self, path: str) -> bool:
        return path in PATHS

    # a decode-mode server takes only requests with a bootstrap room: it never prefills by itself
    decode_runs_whole = False
    # its OpenAI server awaits a stream's first chunk before it sends the head (an early error is
    # still an HTTP error)
    head_with_first_token = True
    # OpenAIServingBase.extract_routed_dp_rank_from_header (sglang/srt/entrypoints/openai): the header
    # wins over the body's routed_dp_rank (older releases: data_parallel_rank) and the
    # DataParallelController sends the request to that rank's scheduler
    dp_rank_header = "X-Data-Parallel-Rank"
    # its Messages usage: input_tokens is the prompt's whole count, and cache_read_input_tokens
    # the cached part of it (AnthropicServing in sglang/srt/entrypoints/anthropic/serving.py)
    messages_input_has_cache_reads = True
    # its Anthropic request (sglang/srt/entrypoints/anthropic/protocol.py) has no bootstrap fields and
    # drops unknown ones, so neither leg would meet the other on a bootstrap room
    messages_pd_refusal = ("SGLang's Anthropic Messages request has no bootstrap_host, bootstrap_port or "
                           "bootstrap_room, so its prefill and decode servers cannot pair on it")
    # its create_responses returns a background request's queued response before it looks at
    # ``stream``, and its retrieve_responses takes no query: no background stream, no replay
    # (srt/entrypoints/openai/serving_responses.py)
    streams_background_responses = False

    def lora_load(self, name: str, path: str) -> tuple[str, bytes]:
        return "/load_lora_adapter", orjson.dumps({"lora_name": name, "lora_path": path})

    def lora_load_error(self, status: int, answer: bytes) -> str | None:
        return _lora_call_error(status, answer, ("already loaded", "already exists"))

    def lora_unload(self, name: str) -> tuple[str, bytes]:
        return "/unload_lora_adapter", orjson.dumps({"lora_name": name})

    def lora_unload_error(self, status: int, answer: bytes) -> str | None:
        # gone already ("LoRA with name X does not exist. ...") is done
        return _lora_call_error(status, answer, ("does not exist",))

    def lora_full(self, error: str) -> bool:
        # the tokenizer manager's refusal at --max-loaded-loras ("... Maximum number of loaded LoRA
        # adapters is N. Please unload some LoRA adapters before loading new ones.")
        return "Maximum number of loaded LoRA adapters" in error

    def lora_loaded(self, answer: bytes) -> set[str] | None:
        # ``{success, error_message, loaded_adapters: {name: path}}``; since 0.5.23 a load at
        # --max-loaded-loras succeeds and unloads the least recently used adapter, named only by
        # its absence here
        try:
            loaded = orjson.loads(answer).get("loaded_adapters")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return {str(a) for a in loaded} if isinstance(loaded, dict | list) else None

    def lora_fields(self, name: str) -> dict[str, Any]:
        return {"lora_path": name}      # SGLang picks the adapter by its name in lora_path

    def lora_missing(self, status: int, message: str, name: str) -> bool:
        # the tokenizer manager's refusal of a lora_path it has not loaded
        return status in (400, 404) and name in message and "not loaded" in message

    def continuation_mode(self, ireq: InferenceRequest) -> str:
        """Text: a chat continues its final assistant message (``continue_final_message``), a
        completion its prompt. SGLang's token fields on the OpenAI surface (``return_token_ids``,
        chat ``input_ids``) are recent and not in every deployed version, so they are not relied on."""
        return TEXT

    def default_max_tokens(self, path: str) -> int | None:
        """SGLang's default: 16 for a completion, its sampling default of 128 new tokens for chat."""
        return 128 if path == CHAT else 16


SGLANG = SGLangAdapter()


def _lora_call_error(status: int, answer: bytes, fine: tuple[str, ...]) -> str | None:
    """SGLang's answer to a LoRA load or unload: ``None`` when it succeeded (or its message says
    the wanted state holds already: one of ``fine``), else the status and the engine's message."""
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        data = None
    if status == 200 and isinstance(data, dict) and data.get("success") is not False:
        return None
    message = engine_message(answer)
    if any(phrase in message for phrase in fine):
        return None
    return f"status {status}: {message}"
