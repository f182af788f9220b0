"""Mid-stream continuation: a stream whose engine fails after headers goes on on another endpoint.

Opt-in per model (``migration_limit: N``, at most N continuations per stream). What counts as a
failure: the connection breaking, an in-stream error event, the stream ending without completing,
a watchdog timeout (first chunk or idle). The whole-exchange ``upstream.total_timeout_s`` is not
one: it bounds the request, not a leg.

How (``handlers.continuation``): the request is sent again with what was already generated, as
token ids where the engine returns them (vLLM ``return_token_ids``, continued as a completion of
the prompt's ids followed by the generated ids) or else as text (``continue_final_message`` with
the partial assistant message; a completion's prompt extended), and ``max_tokens``/``min_tokens``
reduced by what was generated. The legs ask for usage on every chunk, so that count is exact. A
completion's ``echo`` (and a vLLM chat's): the prompt's text (the last message's) its first leg's
answer begins with is the client's, not generated, and is not sent back; the continuation goes
without ``echo``.

What the client sees: one SSE stream. Every event is decoded and re-serialized: the fields the
gateway asked for and the client did not (token ids, per-chunk usage) are removed, a continuation
leg's events carry the first leg's ``id``, ``created`` and ``model``, its role chunk is dropped,
completion chunks are re-framed as chat chunks when a chat is continued token-exactly, the failing
leg's error event is held back, and one final usage block covers every leg (prompt tokens of the
original prompt, completion tokens of all legs and the counts among them, ``completion_tokens_details``
and SGLang's ``reasoning_tokens``, summed as they are, and the cached tokens of the leg that ran the
original prompt: left out when that leg did not report them before it broke, as vLLM reports them
only in a stream's final usage). Nothing is replayed: each leg adds only what the client has not
seen. A stop string that begins in what the client received and ends in a continuation's first
characters, which the continuation's engine cannot see, is looked for by the gateway (``StopSeam``):
it ends the answer as the engine would have, and the leg is closed.

Not continued, the answer being whole: a leg that fails after its finish_reason (its end noted as
``after_end``; an error event of the engine's after it passed on as the plain relay passes it),
and one that fails once every token the answer may have was generated (its ``max_tokens``: no
engine takes a ``max_tokens`` of 0), which the gateway ends with finish_reason "length".
As in the plain relay, a leg's answer ends at its ``[DONE]``: an engine that writes on after it
has its connection closed, and nothing of what follows is passed on (``after_end: trailing``).

When it refuses (the client then gets today's final error event): guided decoding or
``response_format``, ``n > 1`` (or a batch of prompts), ``logprobs``, ``seed`` with sampling,
presence/frequency penalties (they count the output, which a continuation turns into prompt),
a tool call or reasoning already streamed, a completion prompt the text mode cannot extend, and
when the stream already used its ``migration_limit``.

Counted as ``switchyard_migrations_total{model, reason, outcome}`` and logged as ``migrations``
(one entry per failed leg: reason, outcome, endpoint).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from aiohttp import web

from gateway.config.schema import WatchdogConfig
from gateway.errors import ErrorClass, GatewayError
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.relay import (
    BROKEN_STREAM,
    END_GRACE_S,
    EOF_FAILURE,
    Relay,
    Watchdog,
    WatchdogFired,
    of_leg,
    open_sse,
    stream_failure,
    watchdog_fired,
)
from gateway.pipeline.sse import BOM, SSEScanner, engine_error, has_fields, string_code
from gateway.request import (
    CHAT,
    COMPLETIONS,
    InferenceRequest,
    body_bytes,
    lax_bool,
    lax_float,
    prompt_embeds,
)
from gateway.resilience.outcome import Outcome, of_status, unsupported_event
from gateway.upstream.h1client import UpstreamError, UpstreamResponse
from gateway.upstream.upstream import UpstreamFailure
from handlers import adapter_for
from handlers.continuation import (
    TEXT,
    TOKEN,
    Partial,
    at_length,
    continuation,
    echo_length,
    first_leg,
    fitted,
    min_tokens_of,
    text_mode_refusal,
)

if TYPE_CHECKING:
    from gateway.pipeline.context import RequestContext


class Legs(Protocol):
    """Who opened the stream's first leg and opens the legs that continue it (the pipeline): the
    migration is handed one when it begins, and calls it when a leg fails."""

    def abandon(self, ctx: RequestContext) -> None:
        """The failed leg's engine is told to stop (a P/D decode), before the next leg opens."""

    async def reopen(self, ctx: RequestContext, cont: InferenceRequest, avoid: set[str]) -> UpstreamResponse:
        """The leg of ``cont`` up to its response head, on an endpoint not in ``avoid``."""


class LegSilent(Exception):
    """The leg that was to continue a stream sent no head within the watchdog's first-chunk bound
    (an engine whose stream's head comes with its first token, SGLang): the watchdog's fire on that
    leg, as a silence after its head is (``Legs.reopen``). Its endpoint's breaker heard the timeout."""

    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__(f"no output from the engine for {seconds:g}s ({phase.replace('_', ' ')})")
        self.phase = phase
        self.seconds = seconds


class _NoLegs:
    """A migration nobody can continue (its legs are not the gateway's): every attempt fails."""

    def abandon(self, ctx: RequestContext) -> None:
        pass

    async def reopen(self, ctx: RequestContext, cont: InferenceRequest, avoid: set[str]) -> UpstreamResponse:
        raise GatewayError(503, "no other endpoint to continue the stream on", error_class=ErrorClass.NO_ENDPOINT)


NO_LEGS: Legs = _NoLegs()

# the usage's counts among the generated tokens, each summed over the legs as completion_tokens is:
# vLLM's (and OpenAI's) per-kind counts, and SGLang's reasoning tokens beside prompt_tokens
_COUNTS = ("completion_tokens_details", "reasoning_tokens")


def _add_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two legs' counts among their generated tokens (``_COUNTS``), summed: the integers of
    ``completion_tokens_details`` key by key, ``reasoning_tokens`` likewise; a null or a figure
    that is not an integer stays as the later leg gave it, or the earlier when the later has none."""
    out = dict(a)
    for k, v in b.items():
        prev = out.get(k)
        if k == "reasoning_tokens":
            out[k] = prev + v if type(prev) is int and type(v) is int else v if v is not None else prev
        elif isinstance(v, dict):
            merged = dict(prev) if isinstance(prev, dict) else {}
            for dk, dv in v.items():
                pv = merged.get(dk)
                merged[dk] = pv + dv if type(pv) is int and type(dv) is int else dv
            out[k] = merged
        elif v is not None or k not in out:
            out[k] = v
    return out


_UNKNOWN: Any = object()    # prompt_tokens_details no leg that ran the original prompt reported
_WHOLE: Any = object()      # a failed leg whose answer had all its tokens: nothing to continue

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
           "structured_outputs", "json_schema", "regex", "ebnf", "structural_tag")

# relay error classes of a failed stream → migration reason
REASONS = {ErrorClass.UPSTREAM_BROKEN: "broken", ErrorClass.UPSTREAM_STREAM_ERROR: "stream_error",
           ErrorClass.UPSTREAM_EOF: "eof", ErrorClass.WATCHDOG_IDLE: "idle_timeout",
           ErrorClass.WATCHDOG_FIRST_CHUNK: "first_chunk_timeout"}


async def _refusal(resp: UpstreamResponse) -> str:
    """The start of an engine's refusal (its error body), as text; "" when it does not come."""
    try:
        return (await asyncio.wait_for(resp.read_limited(8192), 5.0)).decode("utf-8", "replace")
    except (TimeoutError, UpstreamError):
        return ""


def refusal(ireq: InferenceRequest) -> str | None:
    """Why this request's stream could not be continued faithfully (None: it can)."""
    d = ireq.data
    rf = d.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        return "response_format"
    if any(d.get(k) is not None for k in _GUIDED):
        return "guided"
    # best_of is not one: neither engine generates its sequences now (vLLM V1 ignores it)
    n = d.get("n")
    if isinstance(n, int) and n > 1:
        return "n"
    if ireq.path == COMPLETIONS:
        prompt = d.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
            return "n"        # a batch of prompts: one choice each
        if prompt_embeds(d) is not None:
            return "prompt_embeds"    # vLLM's prompt as tensors: no text or token ids carry it on
    # fields read as the engines read them (pydantic's lax mode: "0.8" is 0.8, "false" is false); a
    # value they refuse is refused before anything streams
    lp = d.get("logprobs")
    if ireq.path == CHAT and lp is not None:
        lp = _lax(lax_bool, lp, True)     # a chat's is a flag: "false" and "0" ask for nothing
    if lp or d.get("top_logprobs") or d.get("prompt_logprobs") or (ireq.path == COMPLETIONS and isinstance(lp, int)):
        # a completion's logprobs is a count, and 0 asks for them too (vLLM sends a logprobs object
        # whenever it is not null: the sampled token's), as does false, which it reads as 0
        return "logprobs"
    if d.get("seed") is not None:
        t = d.get("temperature")
        if t is None or _lax(lax_float, t, 0.0) > 0:
            return "seed"     # a seeded sample: its draws cannot be resumed mid-way
    if any(d.get(k) is not None and _lax(lax_float, d[k], 1.0) != 0 for k in ("presence_penalty", "frequency_penalty")):
        return "penalty"
    if "include_reasoning" in d and _lax(lax_bool, d["include_reasoning"], True) is False:
        return "reasoning"    # hidden by the engine's reasoning parser, which a continuation would not run
    return None


def _lax(read, v: Any, default: Any) -> Any:
    """``v`` as the engine reads it (``read``: a ``gateway.request`` lax reader), else ``default``."""
    try:
        return read(v)
    except ValueError:
        return default


def _empty(v: Any) -> bool:
    return v is None or v == "" or v == [] or v == {}


def stops_of(data: dict[str, Any]) -> list[str]:
    """The request's stop strings, in its order (empty ones match nothing)."""
    stop = data.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop if isinstance(s, str) and s]


class StopSeam:
    """The stop strings a continuation's engine cannot see: those that begin in the text the client
    received and end in the continuation's first characters (an engine looks for them in its own
    output only). ``sent``: the client's text at the break.

    A stop string ``s`` starts before the seam at most ``len(s) - 1`` characters from its end, so
    only the last ``L - 1`` characters of ``sent`` (``L``: the longest stop string) and the first
    ``L - 1`` characters of the continuation are looked at; while what came of the continuation is a
    prefix of the rest of one, it is held back (``feed`` returns nothing), and once none can
    complete, it is released and the seam is done: the engine's own check covers the rest."""

    __slots__ = ("held", "include", "stops", "tail")

    def __init__(self, sent: str, stops: list[str], include: bool) -> None:
        longest = max(len(s) for s in stops)
        self.tail = sent[max(0, len(sent) - (longest - 1)):]
        self.stops = stops
        self.include = include        # the stop string is sent (include_stop_str_in_output, no_stop_trim)
        self.held = ""

    def feed(self, new: str, may_stop: bool = True, final: bool = False) -> tuple[str, str | None, bool]:
        """The continuation's next text → (text for the client, the stop string it completed or
        None, whether the seam is still open). ``may_stop``: more tokens were generated than the
        request's ``min_tokens`` (an engine checks stop strings only from there); ``final``: the
        continuation ended with this text, nothing more is held."""
        text = self.held + new
        joined = self.tail + text
        n = len(self.tail)
        pending = False
        for s in self.stops:          # in the request's order, as vLLM checks them
            for i in range(max(0, n - len(s) + 1), n):
                if joined.startswith(s, i):
                    if may_stop:
                        self.held = ""
                        return (text[:i + len(s) - n] if self.include else ""), s, False
                elif len(joined) - i < len(s) and s.startswith(joined[i:]):
                    pending = True
        if pending and not final:
            self.held = text
            return "", None, True
        self.held = ""
        return text, None, False


class Migration:
    """One stream's continuation state: set up by the pipeline (``begin``) with the ``Legs`` that
    open the next leg, driven by the relay (``stream``)."""

    def __init__(self, ireq: InferenceRequest, limit: int, mode: str, default_max: int | None,
                 refused: str | None, metrics: GatewayMetrics, legs: Legs = NO_LEGS, chat_echo: bool = False,
                 continuous_alone: bool = False) -> None:
        self.ireq = ireq                      # the client's request (ctx.ireq becomes the leg's)
        self.limit = limit
        self.mode = mode
        self.default_max = default_max
        self.refused = refused                # up-front refusal: the stream is relayed as today
        self.metrics = metrics
        self.legs = legs
        self.avoid: set[str] = set()
        self.log: list[dict[str, Any]] = []
        data = ireq.data
        self.chat = ireq.path == CHAT
        self.client_usage = ireq.include_usage
        so = data.get("stream_options")
        # what the client asked for of what every leg is asked for, read as the engine reads it:
        # vLLM puts the usage on every chunk only when include_usage is asked too, SGLang either way
        # (``continuous_alone``: ``EngineAdapter.continuous_usage_alone``)
        self.client_continuous = (self.client_usage or continuous_alone) and isinstance(so, dict) and _lax(
            lax_bool, so.get("continuous_usage_stats") or False, False)
        self.client_ids = _lax(lax_bool, data.get("return_token_ids") or False, False)
        self.partial = Partial(path=ireq.path, data=data)
        self._text: list[str] = []
        # echo: the answer begins with the prompt's text (a completion) or the last message's (a
        # vLLM chat), the client's own and not generated, so it is not sent back as what was
        # generated (``_observe_echo``). A prompt of token ids is echoed as text the gateway does
        # not know: only a token-exact continuation, which sends ids and not text, takes one
        self.echo = echo_length(ireq.path, data, chat_echo)
        self.echoed = False                   # the client received some of the echoed text
        self.leg = 0
        self.leg_path = ireq.path
        self.leg_completion = 0               # tokens of the current leg (its usage)
        self.leg_ids = 0                      # token ids of the current leg
        self.prompt_tokens: int | None = None
        # the prompt_tokens_details of the leg that ran the client's own prompt (the first, or one
        # that started over): a continuation's prompt is longer, on another engine's cache
        self.own_prompt = True
        self.prompt_details: Any = _UNKNOWN
        self.last_usage: dict[str, Any] | None = None
        # the counts among the generated tokens (``completion_tokens_details``'s, SGLang's
        # ``reasoning_tokens``): the legs before the current one's, summed, and the current one's
        self.done_counts: dict[str, Any] = {}
        self.leg_counts: dict[str, Any] = {}
        self.usage_event: dict[str, Any] | None = None
        self.first: dict[str, Any] | None = None
        self.template: dict[str, Any] | None = None       # a chat content chunk of the first leg
        self.tool_calls = False
        self.reasoning = False
        self.finished = False
        self.done = False
        self.error: Any = None
        self.after_end: str | None = None     # how the last leg's engine ended after its answer did
        self.fired: WatchdogFired | None = None   # the watchdog cut the leg just relayed
        self.stops = stops_of(data)
        self.seam: StopSeam | None = None     # a continuation's first characters, checked for stop strings
        self.cut: bytes | None = None         # a stop string across the seam ended the answer: its last event
        # the last leg broke once every token the answer may have was generated: the answer ends
        # there, and its engine's breaker hears the fault (``Relay.settle``)
        self.broke_whole: ErrorClass | None = None
        # the stream ends as a leg that never opened, the watchdog's fire before its head: its
        # failure (the client's last event), and its breaker was told already (``Relay.settle``)
        self.silent: tuple[ErrorClass, str] | None = None

    @property
    def active(self) -> bool:
        return self.refused is None and self.limit > 0

    # -- setup ---------------------------------------------------------------------------------

    @classmethod
    def begin(cls, ctx: RequestContext, limit: int, engine: str, metrics: GatewayMetrics,
              legs: Legs) -> Migration | None:
        """The stream's migration state, or None when it has none (not a stream, another API);
        ``legs`` opens its continuations. An eligible request's body is rewritten for the first leg."""
        ireq = ctx.ireq
        if limit <= 0 or ireq is None or not ireq.stream:
            return None
        if ctx.api is not None or ireq.path not in (CHAT, COMPLETIONS):
            # Messages, Responses, the pass-through paths: their events are not rebuilt across legs,
            # so such a stream ends with its API's error event, counted as refused_api
            return cls(ireq, limit, TEXT, None, "api", metrics, legs)
        adapter = adapter_for(engine)
        mode = adapter.continuation_mode(ireq)
        why = refusal(ireq) or (text_mode_refusal(ireq.path, ireq.data) if mode == TEXT else None)
        m = cls(ireq, limit, mode, adapter.default_max_tokens(ireq.path), why, metrics, legs, adapter.echoes_chat,
                adapter.continuous_usage_alone)
        if why is None:
            data = first_leg(ireq.data, mode)
            ctx.ireq = dataclasses.replace(ireq, data=data, body=body_bytes(data, ireq.body), include_usage=True)
        return m

    # -- the relay's side ----------------------------------------------------------------------

    def unmigrated(self, rec, error_class: ErrorClass) -> None:
        """A refused stream failed (the plain relay ran): count it."""
        reason = REASONS.get(error_class)
        if reason is not None and self.refused is not None:
            self._count(rec, reason, f"refused_{self.refused}", rec.endpoint)

    async def stream(self, relay: Relay, ctx: RequestContext, resp: UpstreamResponse, headers: dict[str, str],
                     wd: WatchdogConfig | None) -> web.StreamResponse:
        rec = ctx.rec
        out = await open_sse(ctx, headers, relay.whole)
        seen = SSEScanner()      # what the client receives: first token, gaps, finish
        ending = False           # end_stream (which records the stream) was called
        try:
            while True:
                try:
                    error_class, message = await self._leg(resp, out, seen, wd)
                    if error_class not in (None, ErrorClass.UPSTREAM_STREAM_ERROR, ErrorClass.UPSTREAM_STREAM_UNSUPPORTED):
                        # the gateway's words for it (an engine's error event keeps its own): a P/D
                        # decode's failure names the decode, as the plain relay's does
                        error_class, message = of_leg(ctx, (error_class, message))
                finally:
                    if resp.at_eof():
                        resp.release()
                    else:
                        resp.close()
                if self.fired is not None:
                    # the watchdog's fire as the plain relay notes it (log record, trace event,
                    # count), whether the stream is then continued or ends here
                    watchdog_fired(ctx, self.metrics, self.fired.phase, self.fired.seconds)
                    self.fired = None
                if error_class == ErrorClass.UPSTREAM_STREAM_UNSUPPORTED or (
                        error_class == ErrorClass.UPSTREAM_STREAM_ERROR and (self.finished or self.done)):
                    # the engine does not implement what the request asks (code 501): another
                    # endpoint would not either, and the endpoint is not charged (``of_answer``).
                    # Or its error event came after the answer's finish_reason: the answer is whole,
                    # and a continuation would add to it. Either way the client gets the engine's
                    # error event, as the plain relay passes it
                    event = string_code(b"data: " + orjson.dumps({"error": self.error}) + b"\n\ndata: [DONE]\n\n")
                    seen.feed(event, time.perf_counter())
                    await self._write(out, event)
                    err = self.error
                    message = str((err.get("message") if isinstance(err, dict) else err) or message)
                    rec.error_class, rec.error = error_class, message[:200]
                    self._reported(seen, broken=True)
                    ending = True
                    return await relay.end_stream(ctx, out, seen, None)
                if error_class is None:
                    if self.after_end is not None:      # as the plain relay notes it
                        rec.extra["after_end"] = self.after_end
                    await self._write(out, self._tail())
                    rec.delivered = True    # the client has the whole answer
                    break
                nxt = await self._next_leg(relay, ctx, error_class)
                if nxt is _WHOLE:
                    # the engine broke after the answer's last token, before its finish_reason: the
                    # answer ends as the engine would have ended it
                    end = self._length_end()
                    seen.feed(end, time.perf_counter())
                    await self._write(out, end + self._tail())
                    rec.delivered = True
                    break
                if nxt is None:             # the client gets the relay's final error event
                    if self.silent is not None:     # the last leg asked was silent before its head
                        error_class, message = self.silent
                    if error_class == ErrorClass.UPSTREAM_STREAM_ERROR and isinstance(self.error, dict):
                        message = str(self.error.get("message") or message)
                    rec.error_class, rec.error = error_class, message[:200]
                    self._reported(seen, broken=True)
                    ending = True
                    try:
                        return await relay.end_stream(ctx, out, seen, (error_class, message))
                    finally:
                        if self.leg and self.prompt_details is _UNKNOWN:
                            rec.cached_tokens = None      # not known, rather than another prompt's
                resp = nxt
        except (ConnectionResetError, asyncio.CancelledError) as e:
            # the client left: what it received is recorded as the plain relay records it (its
            # TTFT and gaps, what its tenant is charged), unless end_stream, which records it, ran
            if not ending:
                self._left(relay, rec, seen)
            if isinstance(e, ConnectionResetError):
                rec.error_class = ErrorClass.CLIENT_CANCEL
                raise asyncio.CancelledError from None
            raise
        # the legs' usage, summed: counted whether or not the client asked for it (its usage block
        # is written by the tail, past the scanner that sees what the client receives). It is
        # counted once, by end_stream: the scanner's own usage (the per-chunk usage a client with
        # continuous_usage_stats receives) is replaced, not counted beside it
        seen.usage = self._merged(final=True)
        if self.log:
            rec.extra["migrations"] = self.log
        try:
            return await relay.end_stream(ctx, out, seen, None)
        finally:
            if self.leg and self.prompt_details is _UNKNOWN:
                rec.cached_tokens = None      # not known, rather than another prompt's

    def _reported(self, seen: SSEScanner, broken: bool = False) -> None:
        """A stream that ends before its last leg's final usage (its client left, or an engine
        broke it off: ``broken``): the usage every leg reported so far, each asking for it on every
        chunk (the original prompt and the tokens generated), is the stream's. One an engine broke
        off before anything was generated has none, as a stream whose engine failed before its first
        token (a vLLM role chunk carries the prompt's usage): it is charged nothing."""
        if self.last_usage is None:
            return
        if broken and not self.partial.completion_tokens + max(self.leg_completion, self.leg_ids):
            return
        seen.usage = self._merged(final=True)

    def _left(self, relay: Relay, rec, seen: SSEScanner) -> None:
        """A stream its client left: what it received (first token, gaps), and the usage every leg
        reported so far (each asks for it on every chunk): the original prompt and the tokens
        generated, which its tenant is charged, at least a token for each generated chunk sent."""
        self._reported(seen)
        relay.observe_stream(rec, seen)
        if self.leg and self.prompt_details is _UNKNOWN:
            rec.cached_tokens = None      # not known, rather than another prompt's

    @staticmethod
    async def _write(out: web.StreamResponse, data: bytes) -> None:
        if data:
            try:
                await out.write(data)
            except ConnectionResetError:
                raise asyncio.CancelledError from None

    async def _leg(self, resp: UpstreamResponse, out: web.StreamResponse, seen: SSEScanner,
                   wd: WatchdogConfig | None) -> tuple[ErrorClass | None, str]:
        """Relay one leg; returns (None, "") when the stream completed, else the error class and
        message of its failure."""
        first_to = wd.first_chunk_timeout_s if wd is not None else 0.0
        idle_to = wd.idle_timeout_s if wd is not None else 0.0
        # the relay's watchdog: a wait fails when no bytes came, not when a timer ends the read (a
        # timer due in the loop iteration that read the engine's next bytes cancelled the read after them)
        watch = Watchdog(resp, first_to, idle_to) if first_to or idle_to else None
        first = watch is not None
        ended = False           # its [DONE] came: the engine's end is awaited END_GRACE_S at most
        buf = b""
        cr_ended = False        # the last read ended in a CR (a line's end, or half a CRLF)
        moved = False           # the last read held more than SSE comments (keep-alives are no progress)
        clock = time.perf_counter
        try:
            while True:
                if watch is not None and not first and moved and not ended:     # the end: END_GRACE_S in all
                    watch.since = watch.loop.time()
                try:
                    chunk = await resp.readany()
                except WatchdogFired as w:
                    if self.done or self.finished:    # the answer is whole ([DONE], or its finish_reason
                        self.after_end = w.phase      # came): the engine's end is not awaited further
                        break
                    self.fired = w
                    return stream_failure(w)
                if not chunk:
                    break
                if self.done:       # a read after [DONE]: none of it is the answer's (blank space aside)
                    if chunk.strip():
                        return self._trailing(resp)
                    continue
                # a line ends in CRLF, LF or a bare CR (SSE allows all three): each is read as an LF;
                # a CR that ends a read ends its line, and the LF of its CRLF, if the next read
                # brings one, is dropped
                if cr_ended and chunk[:1] == b"\n":
                    chunk = chunk[1:]
                cr_ended = chunk[-1:] == b"\r"
                buf += chunk
                parts = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n")
                buf = parts.pop()
                moved = has_fields(buf) or any(has_fields(ev) for ev in parts)
                if first and moved:
                    first = False
                    watch.first_chunk_came()        # type: ignore[union-attr]
                emitted = []
                failed = False
                trailing = False
                for ev in parts:
                    if self.done:       # an event after [DONE], in its read: not passed on
                        trailing = trailing or bool(ev.strip())
                        continue
                    r = self._event(ev)
                    if r is False:
                        failed = True         # what came before it in this read still goes out
                        if self.cut is not None:
                            emitted.append(self.cut)      # the answer's end: what follows is not read
                        break
                    if r:
                        emitted.append(r)
                if emitted:
                    data = b"".join(emitted)
                    seen.feed(data, clock())
                    await out.write(data)
                if failed:
                    return self._stream_error()
                if self.done and (trailing or buf.strip()):
                    return self._trailing(resp)
                if self.done and not ended:
                    # as the plain relay does: an engine that stalls after its last event does not
                    # hold a client that reads the body to its end, watchdog or not
                    ended = True
                    if watch is None:
                        watch = Watchdog(resp, 0.0, END_GRACE_S)
                    else:
                        watch.end_within(END_GRACE_S)
        except UpstreamError as e:          # the whole-exchange timeout, or the engine's side broke
            if self.done or self.finished:  # after its [DONE] or its finish_reason: the answer is whole,
                self.after_end = "broken"   # and a continuation would add to a finished answer
                return None, ""
            return stream_failure(e)
        finally:
            if watch is not None:
                watch.cancel()
        if buf.strip():
            r = self._event(buf)
            if r is False and self.cut is not None:
                r = self.cut
            elif r is False:
                return self._stream_error()
            if r:
                seen.feed(r, clock())
                await out.write(r)
        if self.done or self.finished:
            return None, ""
        return EOF_FAILURE

    def _trailing(self, resp: UpstreamResponse) -> tuple[None, str]:
        """The engine wrote on after its ``[DONE]``, as the plain relay reads it: the answer ended
        there (the gateway writes its own end), nothing after it is passed on, and the engine's
        connection, whose next bytes would be no answer's, is closed rather than kept."""
        self.after_end = "trailing"
        resp.close()
        return None, ""

    def _stream_error(self) -> tuple[ErrorClass, str]:
        """The failure of a leg that sent an error event: one with code 501 is the engine's 501, the
        request's own (``gateway.resilience.outcome.unsupported_event``), not a leg to continue.
        A leg a stop string across the seam ended is whole: its connection is closed, unread."""
        if self.cut is not None:
            return None, ""
        if unsupported_event(self.error):
            return ErrorClass.UPSTREAM_STREAM_UNSUPPORTED, "in-stream error"
        return ErrorClass.UPSTREAM_STREAM_ERROR, "in-stream error"

    async def _next_leg(self, relay: Relay, ctx: RequestContext, error_class: ErrorClass) -> UpstreamResponse | Any:
        """Open the leg that continues the stream, or None (refused, limit, or it failed: the
        relay then tells the failed endpoint's breaker, as for any stream), or ``_WHOLE`` (the
        failed leg had generated every token the answer may have: nothing to continue)."""
        rec = ctx.rec
        failed_ep = rec.endpoint
        failed = ctx.decision.endpoint if ctx.decision is not None else None
        self.metrics.child(self.metrics.upstream_errors, rec.model, failed_ep,
                           BROKEN_STREAM if error_class == ErrorClass.UPSTREAM_BROKEN else error_class).inc()
        reason = REASONS.get(error_class)
        self.partial.completion_tokens += max(self.leg_completion, self.leg_ids)
        self.leg_completion = self.leg_ids = 0
        self.done_counts = _add_counts(self.done_counts, self.leg_counts)
        self.leg_counts = {}
        if reason is None:                    # the whole-exchange timeout: not a leg's failure
            return None
        if at_length(self.partial, self.default_max):
            # the answer has all its tokens: a continuation would add to it (max_tokens is at least 1)
            self._count(rec, reason, "length", failed_ep)
            self.broke_whole = error_class
            return _WHOLE
        why = self._refused_now()
        if why is not None:
            self._count(rec, reason, f"refused_{why}", failed_ep)
            return None
        if len(self.log) >= self.limit:
            self._count(rec, reason, "limit", failed_ep)
            return None
        self.legs.abandon(ctx)
        self.avoid.add(failed_ep)
        self.partial.text = "".join(self._text)
        # nothing generated and nothing sent (an echoed prompt the client received is not sent again)
        restart = self.partial.completion_tokens == 0 and not self.partial.text and not self.echoed
        if restart:
            path, data = self.ireq.path, first_leg(self.ireq.data, self.mode)   # nothing generated: start over
        else:
            self.partial.prompt_tokens = self.prompt_tokens
            path, data = continuation(self.partial, self.mode, self.default_max)
        cont = dataclasses.replace(self.ireq, path=path, data=data, body=body_bytes(data, self.ireq.body),
                                   include_usage=True, continues=not restart)
        ctx.trace.event("migration", {"switchyard.migration.reason": reason, "switchyard.endpoint": failed_ep})
        ctx.trace.legs_broke(error_class)     # the broken leg's span ends here, as an error
        refused: str | None = None
        refit = False
        decision, prefill_ep = ctx.decision, rec.prefill_endpoint
        while True:
            # an engine that refuses the continuation before sending anything (a refused or reset
            # connection, a 5xx other than 501, 503 or 529), as a fresh request's retry would: the next endpoint
            # not tried yet is asked, until none is left
            try:
                resp = await self.legs.reopen(ctx, cont, set(self.avoid))
            except asyncio.CancelledError:
                # the client left before a leg took the continuation: the broken leg is counted as
                # any, and its fault told to its breaker (the endpoint asked hears a cancel)
                self._count(rec, reason, "cancelled", failed_ep)
                if relay.record is not None and failed is not None and self.silent is None:
                    relay.record(failed, Outcome.FAULT, error_class)
                self.silent = None        # (a silent leg's breaker heard it; the one asked hears the cancel)
                raise
            except GatewayError as e:
                return self._not_continued(ctx, decision, prefill_ep, reason, failed_ep, refused or e.message[:200])
            except LegSilent as e:
                # the watchdog's fire on the leg that took the continuation, as a silence after its
                # head would be: the failed leg was continued, and the stream goes on from this one's
                # failure (its breaker told), within migration_limit, on an endpoint not tried yet
                error_class = ErrorClass.watchdog(e.phase)
                ctx.trace.legs_broke(error_class)
                watchdog_fired(ctx, self.metrics, e.phase, e.seconds)
                self._count(rec, reason, "continued", failed_ep)
                if relay.record is not None and failed is not None:
                    relay.record(failed, Outcome.FAULT, error_class)
                reason, failed_ep, refused = REASONS[error_class], rec.endpoint, None
                failed = ctx.decision.endpoint if ctx.decision is not None else None
                decision, prefill_ep = ctx.decision, rec.prefill_endpoint
                self.silent = (error_class, str(e))
                self.avoid.add(failed_ep)
                if len(self.log) >= self.limit:
                    self._count(rec, reason, "limit", failed_ep)
                    return None
                ctx.trace.event("migration", {"switchyard.migration.reason": reason, "switchyard.endpoint": failed_ep})
                continue
            except UpstreamFailure as e:        # its breaker and upstream errors were told
                ctx.trace.legs_broke(e.kind)
                if not e.retryable or rec.endpoint in self.avoid:
                    return self._not_continued(ctx, decision, prefill_ep, reason, failed_ep, e.message[:200])
                refused = e.message[:200]
                self.avoid.add(rec.endpoint)
                continue
            if resp.status == 200:
                break
            if resp.status == 400 and not refit:
                # refused for passing the context (a text continuation's prompt can come out longer
                # than what was generated): sent again with the max_tokens that fits beside it
                refit = True
                data = fitted(cont.data, await _refusal(resp))
                if data is not None:
                    resp.close()
                    cont = dataclasses.replace(cont, data=data, body=body_bytes(data, self.ireq.body))
                    continue
            resp.close()
            ctx.trace.legs_broke(str(resp.status))
            ep = ctx.decision.endpoint if ctx.decision is not None else None
            outcome = of_status(resp.status, ep is not None and ep.api_key is not None)
            if not outcome.retryable or ep is None or ep.name in self.avoid:
                return self._not_continued(ctx, decision, prefill_ep, reason, failed_ep, f"status {resp.status}")
            self.metrics.child(self.metrics.upstream_errors, rec.model, ep.name, f"status_{resp.status}").inc()
            if relay.record is not None:
                relay.record(ep, outcome, f"status_{resp.status}")
            refused = f"status {resp.status}"
            self.avoid.add(ep.name)
        self._count(rec, reason, "continued", failed_ep)
        self.silent = None
        # a watchdog fire the continuation took (counted where it fired) no longer ends the answer:
        # the record's phase is a fire that did (a P/D decode's engine is then told to stop)
        rec.watchdog = None
        if relay.record is not None and failed is not None:    # the relay will record the new leg's end
            relay.record(failed, Outcome.FAULT, error_class)
        self.leg += 1
        self.leg_path = path
        self.own_prompt = restart
        self.done = self.finished = False
        self.cut = None
        self.error = None
        self.seam = None
        if self.stops and not restart and self.partial.text:
            d = self.ireq.data          # the stop string is sent with the answer: vLLM's key, SGLang's
            self.seam = StopSeam(self.partial.text, self.stops, any(
                _lax(lax_bool, d.get(k) or False, False) for k in ("include_stop_str_in_output", "no_stop_trim")))
        return resp

    def _not_continued(self, ctx: RequestContext, decision, prefill_ep: str | None, reason: str, failed_ep: str,
                       detail: str) -> None:
        """No leg continues the stream: it ends as the failed leg's, whose endpoint the request's
        record names and whose breaker hears the fault (not an endpoint that refused the
        continuation, whose own failure its breaker heard)."""
        ctx.decision = decision
        ctx.rec.endpoint, ctx.rec.prefill_endpoint = failed_ep, prefill_ep
        self._count(ctx.rec, reason, "failed", failed_ep, detail)

    def _refused_now(self) -> str | None:
        if self.tool_calls:
            return "tool_calls"
        if self.reasoning:
            return "reasoning"
        if self.mode == TOKEN and (self.partial.completion_tokens or self._text) and (
                self.partial.prompt_ids is None or not self.partial.token_ids):
            # the engine did not return them (vLLM sends no token_ids at all while it hides a
            # reasoning parser's output): nothing token-exact to send
            return "no_token_ids"
        if self.mode == TOKEN and self.echoed and self.partial.prompt_ids is None:
            return "no_token_ids"             # the prompt was echoed, its ids never came
        return None

    def _count(self, rec, reason: str, outcome: str, endpoint: str, detail: str | None = None) -> None:
        self.metrics.child(self.metrics.migrations, rec.model, reason, outcome).inc()
        entry = {"reason": reason, "outcome": outcome, "endpoint": endpoint, "tokens": self.partial.completion_tokens}
        if detail:
            entry["detail"] = detail
        self.log.append(entry)
        rec.extra["migrations"] = self.log

    # -- events --------------------------------------------------------------------------------

    def _event(self, raw: bytes) -> bytes | None | bool:
        """One upstream event → the bytes the client gets (None: nothing; False: the leg failed)."""
        payload = None
        if raw.startswith(BOM):              # a stream's byte order mark, before its first event
            raw = raw[3:]
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip() if payload is None else payload + b"\n" + line[5:].strip()
        if payload is None:
            return None                       # keep-alive comments, event:/id: lines
        if payload == b"[DONE]":
            self.done = True
            return None
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        err = obj.get("error") or engine_error(obj)     # a bare string stays one
        if err:
            self.error = err
            return False
        usage = obj.pop("usage", None)
        if isinstance(usage, dict):
            self._usage(usage)
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            if isinstance(usage, dict):
                self.usage_event = obj        # the leg's final usage chunk: the gateway writes its own
            return None
        ch = choices[0]
        if not isinstance(ch, dict):
            return None
        if self.leg == 0:
            return self._first_leg(obj, ch)
        return self._later_leg(obj, ch)

    def _usage(self, usage: dict[str, Any]) -> None:
        self.last_usage = usage
        c = usage.get("completion_tokens")
        if isinstance(c, int):
            self.leg_completion = c
        if "completion_tokens_details" in usage or "reasoning_tokens" in usage:
            self.leg_counts = {k: usage[k] for k in _COUNTS if k in usage}
        if self.own_prompt and isinstance(usage.get("prompt_tokens"), int):
            # the client's prompt, as the leg that ran it reported it (the first, or one that
            # started over because the first generated nothing): a continuation's is longer
            self.prompt_tokens = usage["prompt_tokens"]
        if self.own_prompt and "prompt_tokens_details" in usage:
            self.prompt_details = usage["prompt_tokens_details"]

    def _ids(self, obj: dict[str, Any], ch: dict[str, Any]) -> None:
        """Take the token ids out of an event; the client keeps them only if it asked for them,
        and the prompt's ids only as the first leg gave them."""
        keep_prompt = self.client_ids and self.leg == 0
        for holder in (obj, ch):          # chat: on the chunk; completions: in the choice
            if "prompt_token_ids" in holder:
                pids = holder["prompt_token_ids"]
                if self.partial.prompt_ids is None and isinstance(pids, list):
                    self.partial.prompt_ids = pids
                if not keep_prompt:
                    if holder is obj and self.chat:
                        holder["prompt_token_ids"] = None     # vLLM's chat chunk has the key, null
                    else:
                        del holder["prompt_token_ids"]
        tids = ch.get("token_ids")
        if isinstance(tids, list):
            self.partial.token_ids.extend(tids)
            self.leg_ids += len(tids)
            if not self.client_ids:
                if self.chat:
                    ch["token_ids"] = None
                else:
                    del ch["token_ids"]

    def _observe(self, ch: dict[str, Any]) -> None:
        if self.chat:
            delta = ch.get("delta")
            if isinstance(delta, dict):
                c = delta.get("content")
                if isinstance(c, str):
                    self._text.append(c)
                if not _empty(delta.get("tool_calls")):
                    self.tool_calls = True
                if not _empty(delta.get("reasoning_content")) or not _empty(delta.get("reasoning")):
                    self.reasoning = True
        else:
            t = ch.get("text")
            if isinstance(t, str):
                self._text.append(t)
        if ch.get("finish_reason") is not None:
            self.finished = True

    def _observe_echo(self, ch: dict[str, Any]) -> None:
        """A chunk while the echoed text comes (a completion's prompt, which vLLM and SGLang send
        with the first output's text; a vLLM chat's last message, in a chunk of its own): its
        characters are passed to the client and not taken for generated text, what follows is."""
        key = "content" if self.chat else "text"
        holder = ch.get("delta") if self.chat else ch
        t = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(t, str) and t:
            self.echoed = True
            cut = min(self.echo, len(t))
            self.echo -= cut
            holder = {**holder, key: t[cut:]}       # what is observed; the client's chunk is unchanged
            ch = {**ch, "delta": holder} if self.chat else holder
        self._observe(ch)

    def _encode(self, obj: dict[str, Any]) -> bytes:
        if self.client_continuous:
            obj["usage"] = self._merged(final=False)
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _first_leg(self, obj: dict[str, Any], ch: dict[str, Any]) -> bytes:
        if self.first is None:
            self.first = {k: obj.get(k) for k in ("id", "created", "model")}
        self._ids(obj, ch)
        if self.echo:
            self._observe_echo(ch)
        else:
            self._observe(ch)
        if (self.chat and isinstance(ch.get("delta"), dict) and "role" not in ch["delta"]) or not self.chat:
            self.template = obj
        return self._encode(obj)

    def _later_leg(self, obj: dict[str, Any], ch: dict[str, Any]) -> bytes | bool | None:
        self._ids(obj, ch)
        if self.chat and self.leg_path == COMPLETIONS:
            obj, ch = self._as_chat(obj, ch)
        elif self.chat:
            delta = ch.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
                if all(_empty(v) for v in delta.values()) and ch.get("finish_reason") is None:
                    return None               # the continuation's own role chunk
        if self.seam is not None and not self._at_seam(ch):
            return None                       # held back: it might complete a stop string
        if self.echo:                         # a leg that started over, echoing the prompt
            self._observe_echo(ch)
        else:
            self._observe(ch)
        if self.first is not None:
            obj.update(self.first)
        if self.cut is not None:              # a stop string across the seam: the answer's last event,
            self.cut = self._encode(obj)      # after which the leg is not read on (``_leg``)
            return False
        return self._encode(obj)

    def _at_seam(self, ch: dict[str, Any]) -> bool:
        """A continuation's chunk while the seam is open: its text checked with the client's for a
        stop string that completes across the seam. False: the chunk is held back. A stop string
        that completes ends the answer as the engine would have: its text up to the stop string
        (sent already: nothing more of this leg's), finish_reason "stop" with the matched string
        (vLLM's ``stop_reason``, SGLang's ``matched_stop``), the leg's usage as of this chunk."""
        seam = self.seam
        assert seam is not None
        delta = ch.get("delta") if self.chat else None
        key = "content" if self.chat else "text"
        holder = delta if isinstance(delta, dict) else ch
        new = holder.get(key)
        new = new if isinstance(new, str) else ""
        mn = min_tokens_of(self.ireq.data)          # vLLM looks for stop strings once more were generated
        may_stop = not (mn is not None and mn >= self.partial.completion_tokens + self.leg_completion)
        text, matched, still = seam.feed(new, may_stop, final=ch.get("finish_reason") is not None)
        if not still:
            self.seam = None
        if matched is not None:
            holder[key] = text
            ch["finish_reason"] = "stop"
            ch["matched_stop" if "matched_stop" in ch else "stop_reason"] = matched
            self.cut = b""
            if self.log:                      # the leg whose continuation it ended
                self.log[-1]["stop_at_seam"] = True
            return True
        if still:
            return False
        if text or key in holder:
            holder[key] = text
        return True

    def _as_chat(self, obj: dict[str, Any], ch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """A completion chunk of a token-exact continuation, framed as the chat chunk the first
        leg's engine would have sent."""
        fr = ch.get("finish_reason")
        tpl = self.template or {"object": "chat.completion.chunk", "choices": [{"index": 0}]}
        base = tpl["choices"][0] if tpl.get("choices") else {"index": 0}
        choice = {**base, "delta": {"content": ch.get("text", "")}, "logprobs": None, "finish_reason": fr}
        if fr is not None:
            choice["stop_reason"] = ch.get("stop_reason")
        if "token_ids" in choice or self.client_ids:
            choice["token_ids"] = ch.get("token_ids") if self.client_ids else None
        new = {**{k: v for k, v in tpl.items() if k != "usage"}, "choices": [choice]}
        for k in ("system_fingerprint",):
            if k in obj:
                new[k] = obj[k]
        return new, choice

    def _length_end(self) -> bytes:
        """The chunk an engine ends an answer cut by its length with: finish_reason "length" and no
        more text than a continuation held at the seam, in the shape of the stream's chunks (vLLM's
        ``stop_reason``, SGLang's ``matched_stop``)."""
        tpl = self.template or {"object": "chat.completion.chunk" if self.chat else "text_completion",
                                "choices": [{"index": 0}]}
        base = tpl["choices"][0] if tpl.get("choices") else {"index": 0}
        text = ""
        if self.seam is not None:     # what the seam held could complete no stop string now: the answer's end
            text = self.seam.feed("", final=True)[0]
            self.seam = None
        choice: dict[str, Any] = {"index": base.get("index", 0)}
        choice.update(({"delta": {"content": text}} if text else {"delta": {}}) if self.chat else {"text": text})
        choice.update(logprobs=None, finish_reason="length")
        choice["matched_stop" if "matched_stop" in base else "stop_reason"] = None
        if "token_ids" in base:
            choice["token_ids"] = [] if self.client_ids else None
        obj = {k: v for k, v in tpl.items() if k not in ("usage", "choices", "prompt_token_ids")}
        obj["choices"] = [choice]
        if self.first is not None:
            obj.update(self.first)
        return self._encode(obj)

    def _merged(self, final: bool) -> dict[str, Any]:
        """The usage of the whole stream so far: the original prompt, every leg's output."""
        usage = dict(self.last_usage or {})
        if not final:
            usage.pop("prompt_tokens_details", None)
        p = self.prompt_tokens if self.prompt_tokens is not None else usage.get("prompt_tokens", 0)
        c = self.partial.completion_tokens + max(self.leg_completion, self.leg_ids)
        usage.update(prompt_tokens=p, completion_tokens=c, total_tokens=(p or 0) + c)
        if self.done_counts:
            # what the legs before counted among their tokens, with the current leg's (a leg that
            # reported none of them, a token-exact continuation's completion, adds nothing)
            usage.update(_add_counts(self.done_counts, self.leg_counts))
        if final and self.leg:
            # the cached tokens are the original prompt's, as the leg that ran it reported them (a
            # continuation's prompt is the original one and what was generated, on another
            # engine); none when that leg did not report them before it broke (vLLM reports
            # them only in a stream's final usage)
            usage.pop("prompt_tokens_details", None)
            details = self.prompt_details
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                details = {**details, "cached_tokens": min(details["cached_tokens"], p or 0)}
            if details is not _UNKNOWN:
                usage["prompt_tokens_details"] = details
        return usage

    def _tail(self) -> bytes:
        """The end of a completed stream: the usage block (if the client asked) and [DONE]."""
        out = b""
        if self.client_usage:
            ev = dict(self.usage_event or {"object": "chat.completion.chunk" if self.chat else "text_completion",
                                           "choices": []})
            if self.first is not None:
                ev.update(self.first)
            # the client's object: a chat continued token-exactly ends with a completion's usage chunk
            ev["object"] = "chat.completion.chunk" if self.chat else "text_completion"
            ev["usage"] = self._merged(final=True)
            out += b"data: " + orjson.dumps(ev) + b"\n\n"
        return out + b"data: [DONE]\n\n"
