"""vLLM P/D, context-first: a prefill leg, then the decode leg carrying its ``kv_transfer_params``.

Pure payload logic (no I/O): what the prefill body is, what a prefill answer must look like,
and what the decode body is. The gateway's P/D orchestration does the calls.
"""

from __future__ import annotations

import random
from typing import Annotated, Any, Protocol

import msgspec
import orjson

from gateway.apis.paths import (
    ANTHROPIC_PATHS,
    MESSAGES,
    PASSTHROUGH_PATHS,
    SGLANG_CLASSIFY,
    SGLANG_DETOKENIZE,
    SGLANG_TOKENIZE,
)
from gateway.endpoints import Endpoint
from gateway.request import CHAT, InferenceRequest, body_bytes, lax_int, usage_stream_options
from handlers.base import OPENAI_PATHS, BadPrefillAnswer, PDPlan, Unsplit, engine_message, openai_usage
from handlers.continuation import TEXT, TOKEN, multimodal, stop_strings, tools_on

# `vllm serve` answers the Anthropic Messages API (vllm/entrypoints/anthropic/api_router.py) and
# every pass-through path (rerank in three spellings, score, tokenize, detokenize, classify,
# pooling, Cohere embed, audio) but SGLang's spellings: vLLM classifies at /classify only, and
# tokenizes at /tokenize and /detokenize only (SGLang's /v1/tokenize and /v1/detokenize)
PATHS = OPENAI_PATHS | frozenset(ANTHROPIC_PATHS) | (
    frozenset(PASSTHROUGH_PATHS) - {SGLANG_CLASSIFY, SGLANG_TOKENIZE, SGLANG_DETOKENIZE})


class VLLMPDSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``pd.vllm`` config block."""

    rewrite_remote_host: Annotated[bool, msgspec.Meta(description="Point the decode's kv_transfer_params.remote_host at the prefill endpoint's host (vLLM reports its configured side-channel host, localhost by default).")] = True


# What a prefill request carries: "run the prompt, keep the KV for a remote decode".
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Dropped from the prefill: they conflict with max_tokens=1 / stream=false (kept for decode), and
# the choices asked (n, and best_of, which vLLM V1 ignores, for an older vLLM's sake): vLLM forks a
# request of several into child requests that each run
# the prompt and keep its blocks for a decode, and the decode's choices all read the blocks its
# kv_transfer_params name, so one choice is prefilled (more would stay pinned until their lease ran
# out, VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens", "n", "best_of")


def prefill_body(data: dict[str, Any], original: bytes = b"", messages: bool = False) -> bytes:
    """The prefill leg's body. ``messages``: a Messages request (``/v1/messages``), whose only
    output bound is ``max_tokens`` (vLLM's Messages request has no ``max_completion_tokens``; it
    builds its chat request's two bounds from ``max_tokens``)."""
    body = {k: v for k, v in data.items() if k not in _PREFILL_DROP}
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    body["max_tokens"] = 1
    if not messages:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    return body_bytes(body, original)


def kv_params_from_answer(raw: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill answer; ``None`` when the prefill engine runs no
    KV connector (the decode then recomputes the prompt, as vLLM's own proxy does)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadPrefillAnswer("prefill answer is not JSON") from None
    if not isinstance(data, dict):
        raise BadPrefillAnswer("prefill answer is not a JSON object")
    if data.get("error") is not None or data.get("object") == "error":
        # an error object in a 200 (a proxy's, or vLLM's older ErrorResponse): the prefill did not
        # run, which is not an engine without a KV connector (``kv_transfer_params: null``)
        raise BadPrefillAnswer(f"prefill answered an error: {engine_message(raw, 256)}")
    kv = data.get("kv_transfer_params")
    if kv is None:
        return None
    if not isinstance(kv, dict):
        raise BadPrefillAnswer("prefill kv_transfer_params is not an object")
    return kv


def decode_body(data: dict[str, Any], kv: dict[str, Any] | None, prefill_host: str | None,
                extra: dict[str, Any] | None = None, original: bytes = b"") -> bytes:
    """The client's request plus the prefill's ``kv_transfer_params``.

    vLLM reports its configured side-channel host (``localhost`` by default), which a decode on
    another machine cannot reach, so ``remote_host`` is pointed at the prefill endpoint's host
    when ``prefill_host`` is given. ``extra`` overrides top-level keys (e.g. stream_options).
    A prefill that answered none (no KV connector): the decode gets none and computes the prompt
    itself; the client's own are dropped, as they are from the prefill's body (the legs' params
    are the gateway's: a client does not point the decode at a host to pull KV from).
    """
    body = dict(data)
    if extra:
        body.update(extra)
    if kv is not None:
        kv = dict(kv)
        if prefill_host is not None:
            kv["remote_host"] = prefill_host
        body["kv_transfer_params"] = kv
    else:
        body.pop("kv_transfer_params", None)
    return body_bytes(body, original)


class HasVLLMSettings(Protocol):
    """What the adapter reads of the model's ``pd`` config block."""

    vllm: VLLMPDSettings


class VLLMAdapter:
    """Context-first: the prefill runs to completion, then the decode carries its KV params."""

    engine = "vllm"
    echoes_chat = True      # serving_chat: echo sends the last message's content when its role is the answer's
    continuous_usage_alone = False  # should_include_usage: continuous usage only with include_usage

    def check_pd_body(self, ireq: InferenceRequest) -> None:
        return None          # the bodies are rebuilt from the parsed request

    def pd_plan(self, ireq: InferenceRequest, checked: Any, *, prefill: Endpoint,
                settings: HasVLLMSettings, rng: random.Random) -> PDPlan:
        # a Messages stream always carries its usage (``include_usage``): nothing asked, nothing stripped
        return PDPlan(concurrent=False, prefill_body=prefill_body(ireq.data, ireq.body, ireq.path == MESSAGES),
                      decode_body=None, strip_usage=usage_stream_options(ireq) is not None)

    def decode_body(self, ireq: InferenceRequest, prefill_answer: bytes, *, prefill: Endpoint,
                    settings: HasVLLMSettings) -> bytes:
        kv = kv_params_from_answer(prefill_answer)
        host = prefill.host if settings.vllm.rewrite_remote_host else None
        return decode_body(ireq.data, kv, host, usage_stream_options(ireq), ireq.body)

    usage = staticmethod(openai_usage)     # OpenAI's usage object as it is: no frame around it

    def serves(self, path: str) -> bool:
        return path in PATHS

    def unsplit(self, ireq: InferenceRequest, context: int | None = None) -> Unsplit | None:
        """A request of several choices is split (the decode's choices all read the prefill's
        blocks). A batch of prompts is not: vLLM runs each prompt as a request of its own, and its
        answer carries the first one's kv_transfer_params (OpenAIServingCompletion), which the
        decode would give every prompt. Nor are prompt logprobs (a completion's echo with logprobs,
        or prompt_logprobs): they come from the prompt's forward pass, which a decode that loads
        the prompt's KV does not run (vLLM reads no cached prefix for them). Nor is a request of no
        tokens (its bound below 1: a chat's ``max_completion_tokens`` when it names one, else its
        ``max_tokens``), or of a ``min_tokens`` above that bound or below 0, which vLLM refuses: its prefill leg, sent ``max_tokens: 1`` and no
        ``min_tokens``, would compute the prompt and pin its blocks for a decode that then refuses
        it; run whole, the decode answers its own 400. So is a request whose bound does not fit beside its prompt in the decode's
        ``context`` (its ``max_model_len``, when its ``/v1/models`` listed it): vLLM refuses a prompt
        plus bound past it. The gateway's estimate of a text prompt (a token every four characters)
        can be off, so it is counted at half (a token every eight characters) and its template's
        tokens not at all: the request is unsplit only when it surely does not fit (a prompt of
        token ids counts exactly). One that does fit and is unsplit all the same is only prefilled
        on its decode."""
        data = ireq.data
        # a chat's bound is its max_completion_tokens when it names one, else its max_tokens
        key = "max_completion_tokens" if ireq.path == CHAT and data.get("max_completion_tokens") is not None \
            else "max_tokens"
        bound = _lax_int(data.get(key))
        if bound is not None and bound < 1:
            return Unsplit("no_generation", "a request of no tokens", key,
                           "vLLM generates at least one token, and its prefill leg would pin the prompt's blocks "
                           "for a decode that refuses the request")
        # vLLM's Messages request has no min_tokens (its model drops it). best_of is no refusal:
        # vLLM V1 has no such field and ignores it
        least = None if ireq.path == MESSAGES else _lax_int(data.get("min_tokens"))
        if least is not None and (least < 0 or (bound is not None and least > bound)):
            return Unsplit("min_tokens", "a min_tokens out of its bounds", "min_tokens",
                           "vLLM refuses it, and the prefill leg, sent none, would pin the prompt's blocks "
                           "for a decode that refuses the request")
        if ireq.sequences > ireq.fan:
            return Unsplit("several_prompts", "a batch of prompts", "prompt",
                           "vLLM's prefill answers the KV transfer parameters of a batch's first prompt alone, "
                           "which its decode would read for every prompt")
        if context is not None and bound is not None and bound + _least_prompt_tokens(ireq) > context:
            return Unsplit("context", "a request past the model's context length", key,
                           "vLLM refuses a prompt and its bound past max_model_len, and the prefill leg, sent "
                           "max_tokens: 1, would pin the prompt's blocks for a decode that refuses the request")
        if data.get("prompt_logprobs") is not None or (
                ireq.path != CHAT and data.get("echo") is True and data.get("logprobs") is not None):
            return Unsplit("prompt_logprobs", "prompt logprobs", "logprobs",
                           "they come from the prompt's forward pass, which a decode that loads its KV does not run")
        return None

    # a decode without kv_transfer_params prefills the prompt itself (vLLM's proxy relies on it)
    decode_runs_whole = True
    head_with_first_token = False   # a stream's head goes out at once, before its first token
    # OpenAIServing._get_data_parallel_rank (vllm/entrypoints/openai): an int in this header pins the
    # request to that engine core of a --data-parallel-size engine, past its internal load balancer
    dp_rank_header = "X-data-parallel-rank"
    # its Messages usage has no cache reads: input_tokens is the prompt's count
    messages_input_has_cache_reads = False
    # its Messages request takes a top-level kv_transfer_params, passed into the chat request it
    # builds, and its answer carries the chat answer's (vllm/entrypoints/anthropic/): context-first
    # P/D runs on /v1/messages as on chat
    messages_pd_refusal = None
    # a background stream's events are made by its background task and kept for the replays of
    # GET /v1/responses/{id}?stream=true&starting_after=N (entrypoints/openai/serving_responses.py)
    streams_background_responses = True

    def lora_load(self, name: str, path: str) -> tuple[str, bytes]:
        # needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=true on the engine
        return "/v1/load_lora_adapter", orjson.dumps({"lora_name": name, "lora_path": path})

    def lora_load_error(self, status: int, answer: bytes) -> str | None:
        if status == 200:
            return None
        message = engine_message(answer)
        if status == 400 and "has already been loaded" in message:    # another gateway was first
            return None
        return f"status {status}: {message}{_no_runtime_updating(status, message)}"

    def lora_unload(self, name: str) -> tuple[str, bytes]:
        return "/v1/unload_lora_adapter", orjson.dumps({"lora_name": name})

    def lora_unload_error(self, status: int, answer: bytes) -> str | None:
        if status == 200:
            return None
        message = engine_message(answer)
        if status == 404 and "cannot be found" in message:     # gone already (another gateway, a restart)
            return None
        return f"status {status}: {message}{_no_runtime_updating(status, message)}"

    def lora_full(self, error: str) -> bool:
        # the plain WorkerLoRAManager's add_adapter when its --max-cpu-loras cache is full (the LRU
        # manager, vLLM's default, evicts from that cache instead and never answers this)
        return "No free adapter slots" in error

    def lora_loaded(self, answer: bytes) -> set[str] | None:
        return None      # a plain-text "Success: ..." answer

    def lora_fields(self, name: str) -> dict[str, Any]:
        return {}        # vLLM serves an adapter under its own name in ``model``

    def lora_missing(self, status: int, message: str, name: str) -> bool:
        # the serving layer's check of ``model``: "The model `sql` does not exist."
        return status == 404 and f"`{name}`" in message and "does not exist" in message

    def continuation_mode(self, ireq: InferenceRequest) -> str:
        """Token-exact (``return_token_ids`` + a prompt of ids) unless the continuation must go
        through the chat parsers (tools) or the stream may hold text back (stop strings: vLLM
        sends a token's ids before its text when the text could begin a stop string, so the
        client's text and the ids would disagree at the seam), or its messages carry media (an
        image's ids are placeholders: a completion of them would go on without the image)."""
        if (ireq.path == CHAT and (tools_on(ireq.data) or multimodal(ireq.data))) or stop_strings(ireq.data):
            return TEXT
        return TOKEN

    def default_max_tokens(self, path: str) -> int | None:
        """vLLM's default: 16 for a completion; the rest of the context for chat (left unset)."""
        return None if path == CHAT else 16


VLLM = VLLMAdapter()


def _no_runtime_updating(status: int, message: str) -> str:
    """What a runtime adapter call's 404 ``{"detail": "Not Found"}`` means: FastAPI's answer for a
    route it does not have, as vLLM started without VLLM_ALLOW_RUNTIME_LORA_UPDATING=true has none."""
    if status == 404 and message == "Not Found":
        return " (the engine serves no runtime LoRA calls: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)"
    return ""


def _least_prompt_tokens(ireq: InferenceRequest) -> int:
    """The fewest tokens ``ireq``'s prompt surely has: its count when it is token ids, else half the
    gateway's estimate (a token every eight characters; the template's own tokens not counted),
    and at least one."""
    n = ireq.prompt_tokens_est
    return max(1, n if ireq.prompt_tokens_exact else n // 2)


def _lax_int(v: Any) -> int | None:
    """``v`` as vLLM's request model reads an int, or None (absent, null, or not one: the engine
    answers that itself)."""
    if v is None:
        return None
    try:
        return lax_int(v)
    except ValueError:
        return None
