"""The one interface through which the gateway meets an engine's protocol differences.

An ``EngineAdapter`` is pure (no I/O): it checks a body before routing, plans the P/D legs (their
bodies, whether they run together, how to abort one), builds a decode body from a prefill's
answer, reads usage from an answer, and says which client paths the engine serves. ``gateway/pd/orchestrator.py`` runs whatever plan it is given; no
module outside ``handlers/`` branches on the engine's name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from gateway.endpoints import Endpoint
from gateway.request import CHAT, COMPLETIONS, EMBEDDINGS, InferenceRequest


class BodyError(ValueError):
    """A request body this engine's P/D protocol cannot carry; the gateway answers 400 before any
    endpoint is chosen."""


@dataclass(frozen=True)
class Unsplit:
    """Why an engine's P/D pairs cannot serve a request, which then runs whole (gateway/pd/decide.py):
    the decision's ``reason``, what of the request it is (``what``, the field ``param``) and why."""

    reason: str
    what: str
    param: str
    why: str


class BadPrefillAnswer(ValueError):
    """A 200 prefill answer the decode cannot use (not JSON, not an object, bad params)."""


@dataclass(frozen=True, slots=True)
class AbortSpec:
    """How to tell an endpoint to drop a request: POST each of ``bodies`` to ``path`` (one a
    request the engine holds: a batch's prompts may be several); sent a second time after
    ``retry_delay_s`` (an abort may overtake the request it aborts). ``timeout_s`` 0: never."""

    path: str
    bodies: tuple[bytes, ...]
    timeout_s: float
    retry_delay_s: float


@dataclass(slots=True)
class PDPlan:
    concurrent: bool                 # both legs start together (else: prefill, then decode)
    prefill_body: bytes
    decode_body: bytes | None        # None: built from the prefill's answer (``decode_body``)
    abort: AbortSpec | None = None   # None: closing a leg's connection is how the engine learns
    strip_usage: bool = False        # the gateway asked the decode for usage the client did not
    log: dict[str, Any] = field(default_factory=dict)   # fields for the request's log line


class EngineAdapter(Protocol):
    engine: str
    # a chat's ``echo`` sends the last message back first (vLLM); else the key is ignored
    echoes_chat: bool
    # ``stream_options.continuous_usage_stats`` puts the usage on every chunk without
    # ``include_usage`` too (SGLang reads the two apart); else only with it (vLLM)
    continuous_usage_alone: bool

    def check_pd_body(self, ireq: InferenceRequest) -> Any:
        """Refuse (``BodyError``) a body the P/D legs cannot carry; the result goes to ``pd_plan``."""
        ...

    def pd_plan(self, ireq: InferenceRequest, checked: Any, *, prefill: Endpoint, settings: Any,
                rng: random.Random) -> PDPlan:
        """The legs' bodies for a P/D request. ``settings`` is the model's ``pd`` config block."""
        ...

    def decode_body(self, ireq: InferenceRequest, prefill_answer: bytes, *, prefill: Endpoint,
                    settings: Any) -> bytes:
        """A sequential plan's decode body from the prefill's answer (``BadPrefillAnswer``)."""
        ...

    def usage(self, answer: dict[str, Any]) -> dict[str, Any] | None:
        """The usage object of a non-streaming answer, in OpenAI's spelling."""
        ...

    def serves(self, path: str) -> bool:
        """Whether the engine answers POST ``path`` (its API surface: Messages, rerank, audio...)."""
        ...

    # -- LoRA adapters and conditional P/D ------------------------------------------------------

    # whether a decode endpoint computes a prompt itself when asked without the P/D fields
    decode_runs_whole: bool

    def unsplit(self, ireq: InferenceRequest, context: int | None = None) -> Unsplit | None:
        """Why the engine's P/D legs cannot serve ``ireq`` (several choices, a batch of prompts,
        prompt logprobs, a request past the chosen decode's ``context`` length when it is known),
        which then runs whole, on the decode or a combined endpoint, or is refused
        (gateway/pd/decide.py); None when they can."""
        ...

    # whether a stream's head comes with its first token (SGLang's server awaits it before it
    # answers), rather than at once (vLLM's): the relay then takes the stream from that read
    head_with_first_token: bool

    # the request header that pins a request to one data-parallel rank of the engine (gateway/kv/dp_rank.py)
    dp_rank_header: str

    # why the engine's P/D legs cannot carry a Messages request (``/v1/messages``, count_tokens),
    # or None when they can: its Messages request must take the P/D fields its legs need
    messages_pd_refusal: str | None

    # whether the engine streams a ``background`` Responses request and keeps its events for a
    # ``GET ?stream=true`` replay (vLLM), rather than answering it with its queued response whole
    # whatever its ``stream`` says, and reading a GET's ``stream`` not at all (SGLang)
    streams_background_responses: bool

    # whether the ``input_tokens`` of the engine's Messages usage already counts the prompt tokens
    # it read from its cache (SGLang's: the whole prompt), rather than leaving them to
    # ``cache_read_input_tokens`` as Anthropic's does (gateway/apis/anthropic.py)
    messages_input_has_cache_reads: bool

    def lora_load(self, name: str, path: str) -> tuple[str, bytes]:
        """(path, body) of the engine's runtime call that loads adapter ``name`` from ``path``."""
        ...

    def lora_load_error(self, status: int, answer: bytes) -> str | None:
        """``None`` when the load answer means the adapter is there now, else the engine's message."""
        ...

    def lora_unload(self, name: str) -> tuple[str, bytes]:
        """(path, body) of the engine's runtime call that unloads adapter ``name``."""
        ...

    def lora_unload_error(self, status: int, answer: bytes) -> str | None:
        """``None`` when the unload answer means the adapter is gone now, else the engine's message."""
        ...

    def lora_full(self, error: str) -> bool:
        """Whether a load's error (``lora_load_error``) says the engine holds as many adapters as it may."""
        ...

    def lora_loaded(self, answer: bytes) -> set[str] | None:
        """The adapters a successful load's answer says the engine holds now (None: it does not
        say): an engine that made room by unloading another tells it this way."""
        ...

    def lora_fields(self, name: str) -> dict[str, Any]:
        """Members a request body needs, beyond ``model``, to run on adapter ``name``."""
        ...

    def lora_missing(self, status: int, message: str, name: str) -> bool:
        """Whether the engine's error answer (``status``, its message) to a request for adapter
        ``name`` says the engine does not have that adapter (restarted, or unloaded by another)."""
        ...

    # -- mid-stream continuation (gateway/pipeline/migration.py) ------------------------------------------

    def continuation_mode(self, ireq: InferenceRequest) -> str:
        """How a stream of this engine is continued elsewhere: ``token`` or ``text``
        (``handlers.continuation``)."""
        ...

    def default_max_tokens(self, path: str) -> int | None:
        """The engine's max_tokens when a request names none; None: the rest of the context."""
        ...


def engine_message(answer: bytes, limit: int = 500) -> str:
    """The message of an engine's error answer: OpenAI's ``error.message``, SGLang's
    ``error_message`` or ``message``, else the text itself (bounded)."""
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return answer.decode("utf-8", "replace").strip()[:limit]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:limit]
        for key in ("error_message", "message", "detail", "error"):
            if isinstance(data.get(key), str) and data[key]:
                return data[key][:limit]
    return answer.decode("utf-8", "replace").strip()[:limit]


# what every engine serves (the Responses API too: vLLM and SGLang both have it)
OPENAI_PATHS = frozenset({CHAT, COMPLETIONS, EMBEDDINGS, "/v1/responses"})


def openai_usage(answer: dict[str, Any]) -> dict[str, Any] | None:
    usage = answer.get("usage")
    return usage if isinstance(usage, dict) else None
