"""A request inside the engine, and what it produces: shared by the engine, its roles and metrics.

This module sits at the bottom of the engine's imports (it needs only the fault spec and the KV
allocation type), so the engine core, the roles, the metrics and the HTTP layer can all speak of a
``Sequence`` without importing each other.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from enginesim.faults import NO_FAULT, FaultSpec
from enginesim.kvcache import Allocation


class Phase(enum.Enum):
    STAGING = "staging"  # parked by the role before the queue (SGLang P/D bootstrap / KV transfer)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class StepOutput:
    """One engine step for one request: new tokens, the text they add, and maybe the finish."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # stop | length | abort | error
    message: str | None = None  # abort / error detail
    status: int | None = None  # an abort that carries an HTTP status (SGLang): answered as an error
    code: int | None = None  # an error's status (the ``error_code`` fault): answered with it, not 500
    code_text: bool = False  # the error's ``code`` goes out as a string ("501"; ``error_code`` quoted)


class Channel:
    """Ordered outputs of one request for one reader; a timed-out ``get`` never loses an item."""

    def __init__(self) -> None:
        self._items: deque[StepOutput] = deque()
        self._event = asyncio.Event()

    def push(self, item: StepOutput) -> None:
        self._items.append(item)
        self._event.set()

    async def get(self, timeout: float | None = None) -> StepOutput | None:
        """Next output; ``None`` if ``timeout`` seconds pass without one."""
        while not self._items:
            self._event.clear()
            if timeout is None:
                await self._event.wait()
                continue
            try:
                async with asyncio.timeout(timeout):
                    await self._event.wait()
            except TimeoutError:
                return None
        return self._items.popleft()


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    id: str  # the id clients see (vLLM: chatcmpl-<x>; SGLang: the rid)
    rid: str  # the engine-internal id: abort matching, P/D remote_request_id
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    cache_root: bytes
    output_key: str
    fault: FaultSpec = NO_FAULT
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    phase: Phase = Phase.WAITING
    hashes: list[bytes] = field(default_factory=list)
    lora: str | None = None                 # the adapter's name (KV events' lora_name)
    cache_salt: str | None = None           # folded into the first block's hash (KV events' extra_keys)
    alloc: Allocation | None = None
    rank: int = 0                           # the data-parallel rank (its cache pool) that runs it
    priority: int | None = None             # the priority it named (body, or vLLM's X-Vllm-Priority header)
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # generated text so far (truncated at a matched stop string)
    sent_chars: int = 0  # how much of ``text`` went out in outputs
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # matched stop string, or EOS_TOKEN_ID
    error: str | None = None
    admitted_at: float | None = None
    prefill_done_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    role_data: dict[str, Any] = field(default_factory=dict)
    lora: str | None = None          # the LoRA adapter it runs on
    lora_held: bool = False          # it holds a GPU slot for that adapter (enginesim/lora.py)
    trace_headers: dict[str, str] | None = None  # the request's W3C traceparent/tracestate (enginesim.tracing)
    tool_calls: Any = None  # the calls it answers with (enginesim.tools.ToolCalls), or None: text
    first_token: int | None = None  # forced first output token (SGLang decode: the prefill's token)
    channel: Channel = field(default_factory=Channel)
    admitted: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def queue_time_s(self) -> float:
        return (self.admitted_at or time.monotonic()) - self.arrival

    @property
    def prefill_time_s(self) -> float:
        if self.admitted_at is None or self.prefill_done_at is None:
            return 0.0
        return self.prefill_done_at - self.admitted_at

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e_s(self) -> float:
        return (self.finished_at or time.monotonic()) - self.arrival

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "rid": self.rid, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "generated": self.completion_tokens,
                "priority": self.priority}
