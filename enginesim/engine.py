"""The engine core: a waiting queue, a bounded running set, the KV pool and the token loop.

The waiting queue is first come first served, or with priority scheduling (vLLM's
``--scheduling-policy priority``, SGLang's ``--enable-priority-scheduling``) ordered by each
request's priority in its engine's direction, then by arrival.

Each admitted request gets its own producer task that sleeps through prefill and decode and pushes
``StepOutput``s into the request's ``Channel``; the HTTP layer reads the channel and frames the
outputs for its engine. Keeping production separate from the HTTP writer matters for fidelity: a
real engine keeps generating while a client is slow, and an SGLang engine keeps generating for a
while after the client is gone.

State changes are synchronous: ``abort`` takes the request out of the queue or running set, frees
its KV blocks and counts it *before* it returns, so ``/_sim/state`` is exact the moment an abort
happens. The producer task is merely cancelled afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from enginesim.config import SimConfig
from enginesim.errors import RequestFailed
from enginesim.faults import NO_FAULT, FaultSpec, parse_fault
from enginesim.hf_tokenizer import load as load_tokenizer
from enginesim.kv_events import KVEventPublisher, RankedPublishers
from enginesim.kvcache import BlockPool, root_key
from enginesim.lora import LoraSlots
from enginesim.metrics import EngineMetrics, make_metrics
from enginesim.role_factory import make_role
from enginesim.roles import Role
from enginesim.sequence import Channel, Phase, SamplingParams, Sequence, StepOutput
from enginesim.tokenizer import EOS_TOKEN_ID, FakeTokenizer, OutputSource
from enginesim.tracing import SimTracer

log = logging.getLogger("enginesim")


@dataclass
class Counts:
    started: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    waiting_peak: int = 0        # the longest the waiting queue has been (after scheduling)


class RollingStats:
    """SGLang-style rolling signals: recent generation throughput and prefix-cache hit rate."""

    WINDOW_S = 5.0

    def __init__(self) -> None:
        self._token_times: deque[float] = deque()
        self._hits: deque[tuple[int, int]] = deque(maxlen=128)

    def token(self, now: float) -> None:
        self._token_times.append(now)
        self._prune(now)

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._hits.append((prompt_tokens, cached_tokens))

    def _prune(self, now: float) -> None:
        while self._token_times and now - self._token_times[0] > self.WINDOW_S:
            self._token_times.popleft()

    def gen_throughput(self) -> float:
        self._prune(time.monotonic())
        return len(self._token_times) / self.WINDOW_S

    def cache_hit_rate(self) -> float:
        total = sum(p for p, _ in self._hits)
        return sum(c for _, c in self._hits) / total if total else 0.0


class Engine:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.tokenizer = FakeTokenizer() if not cfg.tokenizer else load_tokenizer(cfg.tokenizer)
        # one KV cache pool per data-parallel rank (each its own prefix cache); ``pool`` is rank 0's
        self.pools = [BlockPool(cfg.kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
                      for _ in range(cfg.data_parallel_size)]
        self.pool = self.pools[0]
        self.kv_events: KVEventPublisher | RankedPublishers | None = None
        if cfg.kv_events_port >= 0 and cfg.data_parallel_size > 1:
            self.kv_events = RankedPublishers(cfg.host, cfg.kv_events_port, cfg.kv_events_replay_port,
                                              cfg.kv_events_topic, cfg.kv_events_encoding, cfg.data_parallel_size)
            for pool, pub in zip(self.pools, self.kv_events.ranks, strict=True):
                pool.events = pub
        elif cfg.kv_events_port >= 0:
            self.kv_events = KVEventPublisher(cfg.host, cfg.kv_events_port, cfg.kv_events_replay_port,
                                              cfg.kv_events_topic, cfg.kv_events_encoding)
            self.pool.events = self.kv_events
        for pool in self.pools:
            pool.extra_keys = cfg.engine == "vllm"      # SGLang's events carry no extra keys
        self._last_rank = -1                            # the rank the engine's own balancer chose last
        self.asked_ranks: deque[int] = deque(maxlen=1024)   # ranks requests pinned (X-data-parallel-rank)
        self.rng = random.Random(cfg.seed)
        self.waiting: deque[Sequence] = deque()
        self.staging: dict[Sequence, None] = {}  # parked by the role before the queue
        self.running: dict[Sequence, None] = {}  # insertion-ordered set
        self.counts = Counts()
        self.aborted_ids: deque[str] = deque(maxlen=256)
        self.abort_requests: deque[str] = deque(maxlen=1024)  # SGLang /abort_request rids, hit or not
        self.stats = RollingStats()
        self.metrics: EngineMetrics = make_metrics(cfg)
        self.default_fault = parse_fault(cfg.fault, cfg.role)
        self.role: Role = make_role(cfg, self)
        self.lora: LoraSlots | None = None
        if cfg.enable_lora:
            self.lora = LoraSlots(cfg.max_loras, cfg.lora_load_ms,
                                  dict(m.split("=", 1) for m in cfg.lora_modules), cfg.max_loaded_loras,
                                  evict_when_full=cfg.lora_full_evicts)
        self.ready = False
        self.dead = False
        self.closing = False
        self.stopping = asyncio.Event()  # set with ``closing``, for waits that must end at shutdown
        self.started_at = time.time()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.tracer: SimTracer | None = None
        if cfg.otlp_traces_endpoint:
            self.tracer = SimTracer(cfg.otlp_traces_endpoint, cfg.engine, cfg.role, cfg.served_name)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()
        await self.role.start()
        if self.cfg.engine == "sglang" and self.cfg.startup_delay_s > 0:
            self._spawn(self._become_ready(self.cfg.startup_delay_s))
        else:
            # vLLM's startup delay is enforced at the socket (no accept until ready), see server.py.
            self._set_ready()

    async def _become_ready(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._set_ready()

    def _set_ready(self) -> None:
        self.ready = True
        self._schedule()

    def shutdown(self) -> None:
        """Stop admitting and abort everything live, so open streams end promptly."""
        self.closing = True
        self.stopping.set()
        for seq in self.live():
            self.abort(seq, "Server is shutting down")

    async def close(self) -> None:
        self.shutdown()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.role.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.tracer is not None:
            await self.tracer.close()

    def reset(self) -> None:
        """Zero counters and metrics (test helper); live requests are not touched."""
        self.counts = Counts()
        self.aborted_ids.clear()
        self.abort_requests.clear()
        self.stats = RollingStats()
        self.metrics = make_metrics(self.cfg)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- requests -------------------------------------------------------------------------------

    def new_sequence(self, *, seq_id: str, rid: str, prompt_ids: list[int], params: SamplingParams,
                     stream: bool, fault: FaultSpec, cache_salt: str | None = None,
                     lora: str | None = None, dp_rank: int | None = None) -> Sequence:
        """``dp_rank``: the rank the request asked for (``X-data-parallel-rank``, checked by the API
        layer against ``data_parallel_size``); ``None``: the engine's balancer picks (``pick_rank``)."""
        model_key = f"{self.cfg.model}\0{lora or ''}"
        root = root_key(model_key, cache_salt or "")
        seq = Sequence(id=seq_id, rid=rid, prompt_ids=prompt_ids, params=params, stream=stream,
                       cache_root=root, output_key=model_key, fault=fault, lora=lora, cache_salt=cache_salt)
        if self.cfg.enable_prefix_caching:
            seq.hashes = self.pool.block_hashes(prompt_ids, root)
        if len(self.pools) > 1:
            seq.rank = self.pick_rank() if dp_rank is None else dp_rank
        return seq

    def pick_rank(self) -> int:
        """vLLM's internal DP load balancer, as the simulator sees it: the rank with the fewest
        running + waiting requests; among equals, the one after the rank it chose last (vLLM counts
        a choice on its rank until the next stats update, so back-to-back requests spread over
        ranks). Blind to which rank caches the prompt."""
        n = len(self.pools)
        load = [0] * n
        for s in (*self.running, *self.waiting, *self.staging):
            load[s.rank] += 1
        low = min(load)
        for i in range(1, n + 1):
            r = (self._last_rank + i) % n
            if load[r] == low:
                self._last_rank = r
                return r
        return 0

    def resolve_fault(self, header: str | None) -> FaultSpec:
        """The fault for one request: header spec if given, else the default; ``p=`` rolls here."""
        spec = parse_fault(header, self.cfg.role) if header is not None else self.default_fault
        if not spec.active:
            return spec
        return spec.roll(self.rng.random) or NO_FAULT

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt that can ever run: the context length, or what the whole pool holds."""
        return min(self.cfg.max_model_len, self.cfg.kv_blocks * self.cfg.block_size)

    def submit(self, seq: Sequence) -> None:
        """Queue a request and start its producer; it runs once the scheduler admits it.

        A request the role wants to park first (SGLang P/D bootstrap) is staged instead and
        joins the queue when the role's ``stage`` returns.
        """
        self.counts.started += 1
        if self.role.wants_stage(seq):
            seq.phase = Phase.STAGING
            self.staging[seq] = None
        else:
            self._enqueue(seq)
        seq.task = self._spawn(self._run(seq))
        self._schedule()
        self.counts.waiting_peak = max(self.counts.waiting_peak, len(self.waiting))

    def queue_rank(self, seq: Sequence) -> tuple[float, float]:
        """Where a request stands in a priority-scheduled queue, lowest first: vLLM runs a lower
        ``priority`` first (0 when it names none); SGLang a higher one, and one that names none after
        every one that does (its default is the lowest priority); then the earliest arrival."""
        if self.cfg.engine == "sglang":
            rank = math.inf if seq.priority is None else -seq.priority
        else:
            rank = seq.priority or 0
        return (rank, seq.arrival)

    def _enqueue(self, seq: Sequence) -> None:
        """Put a request in the waiting queue: at its tail (first come first served), or with
        priority scheduling after every request that goes before it or equal (a short walk from the
        tail: a queue stays within what the engine holds)."""
        if not self.cfg.priority_scheduling:
            self.waiting.append(seq)
            return
        key = self.queue_rank(seq)
        i = len(self.waiting)
        while i > 0 and self.queue_rank(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def _schedule(self) -> None:
        """Admit waiting requests from the queue's head while a slot and KV blocks are free."""
        if not self.ready or self.closing:
            return
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            pool = self.pools[seq.rank]
            alloc = pool.allocate(seq.hashes, seq.prompt_tokens)
            if alloc is None:
                break  # head of line waits for KV; the queue's order is not skipped
            self.waiting.popleft()
            alloc.token_ids = seq.prompt_ids
            alloc.lora_name = seq.lora
            alloc.cache_salt = seq.cache_salt
            seq.alloc = alloc
            seq.cached_tokens = alloc.hit_blocks * pool.block_size
            seq.phase = Phase.RUNNING
            seq.admitted_at = time.monotonic()
            self.running[seq] = None
            self.stats.admitted(seq.prompt_tokens, seq.cached_tokens)
            self.metrics.on_admitted(seq)
            seq.admitted.set()

    def reschedule(self) -> None:
        """Admit what fits now, e.g. after a role freed pinned KV blocks."""
        self._schedule()

    async def _run(self, seq: Sequence) -> None:
        try:
            await self._stall(seq.fault.hang)
            if seq.phase is Phase.STAGING:
                await self.role.stage(seq)
                self.staging.pop(seq, None)
                if seq.finished:
                    return
                seq.phase = Phase.WAITING
                self._enqueue(seq)
                self._schedule()
            await seq.admitted.wait()
            if seq.lora is not None and self.lora is not None:
                await self.lora.acquire(seq.lora)      # a GPU slot; a cold load when not resident
                seq.lora_held = True
            cfg = self.cfg
            uncached = seq.prompt_tokens - seq.cached_tokens
            compute_s = (cfg.ttft_base_ms + cfg.prefill_ms_per_token * uncached) / 1000.0
            await self.role.prefill(seq, compute_s)
            assert seq.alloc is not None
            self.pools[seq.rank].commit(seq.alloc)
            seq.prefill_done_at = time.monotonic()
            self.metrics.on_prefill_done(seq)
            if seq.params.max_tokens == 0:
                # SGLang's prefill-only request (max_new_tokens 0): the prompt's KV, no token
                self._finish(seq, "length", StepOutput((), "", "length"))
                return
            await self._stall(seq.fault.stall_before_first)
            source = OutputSource(self.tokenizer, cfg.seed, seq.output_key, seq.prompt_ids)
            params = seq.params
            while True:
                n = seq.completion_tokens
                if n > 0:
                    await asyncio.sleep(self._itl_s())
                if seq.fault.stall_after is not None and n == seq.fault.stall_after[0]:
                    await self._stall(seq.fault.stall_after[1])
                if seq.fault.error_after is not None and n == seq.fault.error_after:
                    self.fail(seq, f"Simulated engine failure after {n} tokens", seq.fault.error_code,
                              seq.fault.error_code_text)
                    return
                allow_eos = not params.ignore_eos and n >= params.min_tokens
                token = source.next_token(allow_eos, cfg.eos_probability)
                if n == 0 and seq.first_token is not None:
                    token = seq.first_token  # the prefill's draw from the same context
                source.advance(token)
                self._emit(seq, token)
                if seq.finished:
                    return
        except asyncio.CancelledError:
            if not seq.finished:
                self.abort(seq, "Request cancelled")
            raise
        except RequestFailed as exc:
            if exc.abort_status is not None:
                self.abort(seq, str(exc), status=exc.abort_status)
            else:
                self.fail(seq, str(exc))
        except Exception as exc:  # a bug in the simulator must still end the request
            log.exception("request %s failed", seq.id)
            self.fail(seq, f"Internal server error: {exc}")

    async def _stall(self, seconds: float | None) -> None:
        if seconds is None:
            return
        if math.isinf(seconds):
            await asyncio.get_running_loop().create_future()  # never resolves: until aborted
        else:
            await asyncio.sleep(seconds)

    def _itl_s(self) -> float:
        cfg = self.cfg
        ms = cfg.itl_ms + cfg.itl_growth_per_running * max(0, len(self.running) - 1)
        if cfg.itl_jitter_ms:
            ms += self.rng.uniform(-cfg.itl_jitter_ms, cfg.itl_jitter_ms)
        return max(0.0, ms) / 1000.0

    def _emit(self, seq: Sequence, token: int) -> None:
        now = time.monotonic()
        itl = None if seq.last_token_at is None else now - seq.last_token_at
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.last_token_at = now
        seq.output_ids.append(token)
        self.stats.token(now)
        self.metrics.on_token(seq, itl)
        if seq.alloc is not None:
            pool = self.pools[seq.rank]
            pool.grow(seq.alloc, seq.prompt_tokens + seq.completion_tokens)
            # the KV of every token but the newest is computed: a block of them that fills is cached
            computed = seq.prompt_tokens + seq.completion_tokens - 1
            if self.cfg.cache_output_blocks and computed % pool.block_size == 0 and computed > seq.prompt_tokens:
                pool.extend(seq.alloc, seq.prompt_ids, seq.output_ids, computed, seq.cache_root)

        params = seq.params
        finish: str | None = None
        if token == EOS_TOKEN_ID:
            finish, seq.stop_reason = "stop", EOS_TOKEN_ID
        else:
            seq.text += self.tokenizer.piece(token)
            if params.stop and seq.completion_tokens >= params.min_tokens:
                hit = _first_stop(seq.text, params.stop)
                if hit is not None:
                    seq.text = seq.text[:hit[0]]
                    finish, seq.stop_reason = "stop", hit[1]
        if finish is None and seq.completion_tokens >= params.max_tokens:
            finish = "length"
        # Hold back text that could still turn out to be the start of a stop string.
        visible = len(seq.text)
        if finish is None and params.stop:
            visible -= max(len(s) for s in params.stop) - 1
        visible = max(visible, seq.sent_chars)
        delta = seq.text[seq.sent_chars:visible]
        seq.sent_chars = visible
        out = StepOutput((token,), delta, finish)
        if finish is None:
            seq.channel.push(out)
        else:
            self._finish(seq, finish, out)

    def abort(self, seq: Sequence, message: str = "Aborted", status: int | None = None) -> None:
        """Finish with ``abort``; with ``status`` the client gets an error with that HTTP status."""
        self._finish(seq, "abort", StepOutput((), "", "abort", message, status))

    def fail(self, seq: Sequence, message: str, code: int | None = None, code_text: bool = False) -> None:
        """Finish with the internal reason ``error`` (the HTTP layer turns it into a 500/stream error,
        or one with ``code``; ``code_text``: its error's ``code`` written as a string)."""
        self._finish(seq, "error", StepOutput((), "", "error", message, code=code, code_text=code_text))

    def _finish(self, seq: Sequence, reason: str, out: StepOutput) -> None:
        if seq.finished:
            return
        phase = seq.phase
        seq.phase = Phase.FINISHED
        seq.finish_reason = reason
        seq.error = out.message
        seq.finished_at = time.monotonic()
        if phase is Phase.STAGING:
            self.staging.pop(seq, None)
        elif phase is Phase.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        else:
            self.running.pop(seq, None)
        if seq.alloc is not None and not self.role.retain_blocks(seq):
            self.pools[seq.rank].free(seq.alloc)
        if seq.lora_held and self.lora is not None:
            seq.lora_held = False
            self.lora.release(seq.lora)
        self.role.on_finish(seq)
        if reason == "abort":
            self.counts.aborted += 1
            self.aborted_ids.append(seq.id)
        elif reason == "error":
            self.counts.errors += 1
        else:
            self.counts.completed += 1
        self.metrics.on_finish(seq)
        if self.tracer is not None:
            self.tracer.finished(seq)
        seq.channel.push(out)
        task = seq.task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
        self._schedule()

    def client_gone(self, seq: Sequence) -> None:
        """The client disconnected. vLLM aborts at once; SGLang notices only after a delay."""
        if seq.finished:
            return
        if self.cfg.engine == "vllm" or self.cfg.sglang_abort_delay_s <= 0:
            self.abort(seq, "Client disconnected")
        else:
            self._spawn(self._abort_later(seq, self.cfg.sglang_abort_delay_s))

    async def _abort_later(self, seq: Sequence, delay: float) -> None:
        await asyncio.sleep(delay)
        self.abort(seq, "Client disconnected")

    def abort_matching(self, rid_prefix: str) -> int:
        """SGLang ``/abort_request``: abort every live request whose rid starts with the prefix,
        when one of them has that very rid (its tokenizer manager passes an abort on only for a rid
        it holds a request of: a batch's prompts are held by their own rids)."""
        self.abort_requests.append(rid_prefix)
        live = self.live()
        if not any(s.rid == rid_prefix for s in live):
            return 0
        hits = [s for s in live if s.rid.startswith(rid_prefix)]
        for seq in hits:
            self.abort(seq, "Abort requested")
        return len(hits)

    def abort_all(self) -> int:
        live = self.live()
        for seq in live:
            self.abort(seq, "Abort requested")
        return len(live)

    # -- introspection --------------------------------------------------------------------------

    def live(self) -> list[Sequence]:
        """Every unfinished request: staged, waiting and running."""
        return [*self.staging, *self.waiting, *self.running]

    @property
    def num_live(self) -> int:
        return len(self.staging) + len(self.waiting) + len(self.running)

    def snapshot(self) -> dict[str, Any]:
        return {
            "engine": self.cfg.engine,
            "role": self.cfg.role,
            "model": self.cfg.served_name,
            "ready": self.ready,
            "dead": self.dead,
            "running": [s.summary() for s in self.running],
            # Staged requests (parked in a P/D queue before the scheduler) count as waiting here.
            "waiting": [s.summary() for s in [*self.staging, *self.waiting]],
            "counts": {"started": self.counts.started, "completed": self.counts.completed,
                       "aborted": self.counts.aborted, "errors": self.counts.errors,
                       "waiting_peak": self.counts.waiting_peak},
            "aborted_ids": list(self.aborted_ids),
            "abort_requests": list(self.abort_requests),
            "kv": {"total_blocks": self.pool.num_blocks, "used_blocks": self.pool.used_blocks,
                   "cached_blocks": self.pool.cached_blocks, "block_size": self.pool.block_size,
                   **({"ranks": [{"used_blocks": p.used_blocks, "cached_blocks": p.cached_blocks}
                                 for p in self.pools]} if len(self.pools) > 1 else {})},
            **({"pd": pd} if (pd := self.role.state()) is not None else {}),
            **({"lora": self.lora.state()} if self.lora is not None else {}),
        }


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


# The request record types live in enginesim.sequence; importing them from here keeps working.
__all__ = ["Channel", "Counts", "Engine", "Phase", "RollingStats", "SamplingParams", "Sequence", "StepOutput"]
