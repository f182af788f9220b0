"""What both engine front ends do the same way around the engine core.

Fault resolution, the "fault says fail now" rejection, and the two ways to drain a request's
outputs (all at once for a non-streaming answer, one by one with drop/keep-alive handling for a
stream). The engine-specific modules only decide shapes and header timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from enginesim.engine import Engine
from enginesim.errors import ApiError
from enginesim.faults import FaultSpec, FaultSpecError
from enginesim.sequence import Sequence, StepOutput
from enginesim.wire import drop_connection

FAULT_HEADER = "x-sim-fault"


def request_fault(engine: Engine, request: web.Request) -> FaultSpec:
    """This request's fault: the ``x-sim-fault`` header if present, else the engine default."""
    try:
        return engine.resolve_fault(request.headers.get(FAULT_HEADER))
    except FaultSpecError as exc:
        raise ApiError(400, f"invalid {FAULT_HEADER} header: {exc}", type_="BadRequestError") from None


def request_priority(engine: Engine, request: web.Request, body: dict) -> int | None:
    """The priority a request names, which a priority-scheduled queue orders by: the body's
    ``priority``, or on vLLM an ``X-Vllm-Priority`` header, which it reads over the body's; None when
    neither names an integer. Raises ``ApiError`` (vLLM without priority scheduling, not 0); called
    before the request is queued."""
    if engine.cfg.engine == "vllm" and (raw := request.headers.get("X-Vllm-Priority")) is not None:
        with contextlib.suppress(ValueError):
            return _vllm_priority(engine, int(raw))
    value = body.get("priority")
    priority = value if isinstance(value, int) and not isinstance(value, bool) else None
    return _vllm_priority(engine, priority) if engine.cfg.engine == "vllm" else priority


def _vllm_priority(engine: Engine, priority: int | None) -> int | None:
    """vLLM's input processor refuses a priority other than 0 without ``--scheduling-policy
    priority`` (its OpenAI server answers the ValueError with a 400)."""
    if priority and not engine.cfg.priority_scheduling:
        raise ApiError(400, f"Got priority {priority} but Priority scheduling is not enabled.",
                       type_="BadRequestError")
    return priority


DP_RANK_HEADER = "x-data-parallel-rank"


def request_dp_rank(engine: Engine, request: web.Request) -> int | None:
    """The data-parallel rank the request pins (``X-data-parallel-rank``, any case), else ``None``.
    vLLM ignores a value that is not an int (SGLang answers 400); a rank outside
    ``data_parallel_size`` is a 400 on both. Ranks asked for are remembered (``asked_ranks``)."""
    value = request.headers.get(DP_RANK_HEADER)
    if value is None:
        return None
    try:
        rank = int(value)
    except ValueError:
        if engine.cfg.engine == "sglang":
            raise ApiError(400, f"Invalid X-Data-Parallel-Rank header: must be an integer, got '{value}'",
                           type_="BadRequestError") from None
        return None
    if not 0 <= rank < len(engine.pools):
        raise ApiError(400, f"data_parallel_rank {rank} is out of range [0, {len(engine.pools)}).",
                       type_="BadRequestError")
    engine.asked_ranks.append(rank)
    return rank


def check_fault_status(engine: Engine, fault: FaultSpec) -> None:
    """``status=N``: fail before anything is sent, in the engine's error shape."""
    if fault.status is not None:
        engine.counts.errors += 1
        raise ApiError(fault.status, f"Simulated fault: HTTP {fault.status}")


class Dropped(Exception):
    """The ``drop_after`` fault cut the connection; the handler must not write anything else."""


async def slow_headers(engine: Engine, fault: FaultSpec) -> None:
    """``slow_headers=S``: hold the response back; a server shutdown cuts the wait short."""
    if not fault.slow_headers:
        return
    delay = None if math.isinf(fault.slow_headers) else fault.slow_headers
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay):
            await engine.stopping.wait()


async def at_end(engine: Engine, request: web.Request, fault: FaultSpec) -> None:
    """A stream's faults after its last event: ``stall_at_end=S`` holds its end back (a server
    shutdown cuts the wait short), ``drop_at_end=1`` then aborts the connection (``Dropped``)."""
    if fault.stall_at_end:
        delay = None if math.isinf(fault.stall_at_end) else fault.stall_at_end
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await engine.stopping.wait()
    if fault.drop_at_end:
        drop_connection(request)
        raise Dropped


def _maybe_drop(engine: Engine, request: web.Request, seq: Sequence, out: StepOutput, sent: int) -> None:
    drop_after = seq.fault.drop_after
    if drop_after is not None and out.token_ids and sent >= drop_after:
        engine.fail(seq, f"Simulated connection drop after {sent} tokens")
        drop_connection(request)
        raise Dropped


@dataclass
class Collected:
    text: str
    final: StepOutput


async def collect(engine: Engine, request: web.Request, seq: Sequence) -> Collected:
    """Wait for the whole answer (non-streaming). ``Dropped`` if the fault cuts the connection."""
    parts: list[str] = []
    sent = 0
    while True:
        out = await seq.channel.get()
        assert out is not None
        _maybe_drop(engine, request, seq, out, sent)
        sent += len(out.token_ids)
        parts.append(out.text)
        if out.finish_reason is not None:
            return Collected("".join(parts), out)


async def outputs(engine: Engine, request: web.Request, seq: Sequence,
                  keepalive_s: float = 0.0) -> AsyncIterator[StepOutput | None]:
    """The outputs of a stream in order, ending with the finishing one.

    Yields ``None`` when ``keepalive_s`` passes without output (time for a keep-alive frame), and
    raises ``Dropped`` when the ``drop_after`` fault fires.
    """
    sent = 0
    while True:
        out = await seq.channel.get(keepalive_s or None)
        if out is None:
            yield None
            continue
        _maybe_drop(engine, request, seq, out, sent)
        sent += len(out.token_ids)
        yield out
        if out.finish_reason is not None:
            return


def merged_outputs(engine: Engine, request: web.Request,
                   seqs: list[Sequence]) -> tuple[asyncio.Queue[tuple[int, StepOutput | Dropped]], list[asyncio.Future]]:
    """The outputs of several streams (the choices of one request) in one queue, each as
    ``(index, output)`` in the order they come, a stream's ``Dropped`` in the place of its next
    output; the tasks that feed it, for the caller to cancel when it is done."""
    came: asyncio.Queue[tuple[int, StepOutput | Dropped]] = asyncio.Queue()

    async def pump(i: int, s: Sequence) -> None:
        try:
            async with contextlib.aclosing(outputs(engine, request, s)) as stream:
                async for out in stream:
                    if out is not None:
                        came.put_nowait((i, out))
        except Dropped as exc:
            came.put_nowait((i, exc))

    return came, [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(seqs)]
