"""Conditional disaggregation: after the ``pd`` strategy chose a pair, run the request whole when
splitting it does not pay.

Disaggregating costs a prefill leg, a KV transfer and a second queue. It pays when the decode
would otherwise compute many prompt tokens; it does not when the prompt is short, or when the
chosen decode already holds most of it (the next turn of a conversation whose earlier turns it
decoded). Per model (the ``pd`` block; 0 turns a rule off, and with all of them 0 every request is
disaggregated, the behaviour before this rule existed):

- ``disaggregate_min_prompt_tokens``: a prompt shorter than this runs whole (``short_prompt``);
- ``disaggregate_min_uncached_tokens``: fewer uncached tokens than this on the chosen decode runs
  whole (``cached_on_decode``). When the model's engines publish KV events and the decode's events
  are live, the uncached tokens are the prompt's tokens (the model's tokenizer) less what the
  decode's engine reports it holds (``gateway.kv.events``); otherwise they are the prompt estimate
  times the share the approximate prefix index does not hold for the decode. Both record the
  decode of every P/D request (after a transfer, or a local run, the decode's cache holds the
  prompt), so a follow-up turn finds its history there;
- ``local_prefill_pressure``: when the prefill endpoints of the chosen roleset have more prefills
  in flight each, on average, than this, and the decode has headroom (its KV usage below
  ``local_max_decode_kv_usage``, or unknown), the request runs whole (``prefill_pressure``).

Running whole means, in order: on the chosen decode, if its engine computes a prompt itself when
asked without the P/D fields (vLLM: a decode without ``kv_transfer_params`` prefills locally;
SGLang's decode-mode server refuses a request without a bootstrap room); else on the least-loaded
combined endpoint of the model (equal ones at random); else the request is disaggregated anyway
(``no_local_path``).

A request the engine's pairs cannot serve (its adapter's ``unsplit``) runs whole, before any rule:
on the chosen decode when its engine prefills by itself, else on the least-loaded combined
endpoint (equal ones at random), else it is refused with 400. vLLM: a completion's batch of prompts (``several_prompts``:
its prefill answers the first prompt's KV params alone), prompt logprobs (``prompt_logprobs``:
a decode that loads the prompt's KV does not run the forward pass they come from) and a request of
no tokens (``no_generation``: ``max_tokens`` 0) or of a ``min_tokens`` out of its bounds
(``min_tokens``), or whose bound surely does not fit
beside its prompt in the decode's ``max_model_len`` (``context``), which vLLM refuses once its
prefill pinned the prompt's blocks; SGLang: several
choices (``several_choices``, ``n`` > 1: a prompt's samples share its bootstrap room) and prompt
logprobs (``prompt_logprobs``, a completion's echo with logprobs, likewise).

A request that generates nothing (the Messages API's count_tokens) runs whole on the chosen decode
(``no_generation``) before any rule, on either engine: it only renders and counts the prompt, which
a decode-mode server does without the scheduler that would want the P/D fields.

The decision is counted in ``switchyard_pd_decisions_total{model,mode,reason}`` (mode:
``disaggregated``, ``decode``, ``combined``; a ``pd`` choice of a combined endpoint by the
strategy itself is counted with the strategy's reason), answered in ``x-pd-decision: <mode>;
reason=<reason>`` and logged as ``pd_mode``, ``pd_reason``, ``decode_uncached_tokens`` and
``decode_uncached_source`` (``events`` or ``approximate``).
"""

from __future__ import annotations

import dataclasses
import random
from functools import partial
from typing import TYPE_CHECKING, Any

from gateway.endpoints import Endpoint
from gateway.errors import GatewayError
from gateway.observability.metrics import Counter
from gateway.request import body_bytes
from routers.pd import in_bucket
from routers.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from gateway.config.schema import Config
    from gateway.pipeline.context import RequestContext
    from handlers.base import Unsplit
    from routers.base import PreciseIndex

HEADER = "x-pd-decision"
WHOLE_ROLES = ("combined", "aggregated")


class PDDecisionMetrics:
    def __init__(self, registry) -> None:
        self.decisions = Counter("switchyard_pd_decisions", "P/D strategy decisions: disaggregated, or run whole on "
                                 "the decode or a combined endpoint, and why", ["model", "mode", "reason"],
                                 registry=registry)


class PDDecider:
    def __init__(self, config: Config, index: PrefixIndex, metrics: PDDecisionMetrics,
                 precise: PreciseIndex | None = None, rng: random.Random | None = None) -> None:
        self.metrics = metrics
        self.precise = precise
        self.rng = rng or random.Random()
        self._children: dict[tuple[str, str, str], Any] = {}
        self.reconfigure(config, index)

    def reconfigure(self, config: Config, index: PrefixIndex) -> None:
        self.config = config
        self.index = index

    def decide(self, ctx: RequestContext, engine: Any, candidates: list[Endpoint]) -> list[Endpoint]:
        """Decide for ``ctx.decision`` (a ``pd`` decision), changing it to a whole-request one when
        the rules say so; returns the candidates a retry of the whole request may use."""
        ireq, d = ctx.ireq, ctx.decision
        assert ireq is not None and d is not None
        if d.prefill is None:       # the strategy itself chose a combined endpoint
            self._record(ctx, "combined", d.reason or "pd_strategy", None)
            return candidates
        decode, n = d.endpoint, ireq.prompt_tokens_est
        if ctx.api is not None and not ctx.api.generates(ireq.path):
            d.prefill = None        # nothing to generate, no KV to move (count_tokens): whole on the decode
            self._record(ctx, "decode", "no_generation", None)
            return [decode]
        unsplit = engine.unsplit(ireq, decode.max_model_len)
        if unsplit is not None:
            return self._whole(ctx, engine, candidates, unsplit)
        cfg = self.config.pd_for(ireq.model)
        uncached = self._uncached_on_events(ctx, decode)
        if uncached is None:
            match = self.index.match(ireq, [decode]).get(decode, 0.0)
            uncached = round(n * (1.0 - match / 100.0))
            ctx.rec.extra["decode_uncached_source"] = "approximate"
        # the decode holds this prompt's KV after either mode; recorded once the leg is written
        ctx.after_write.append(partial(self.index.insert, ireq, decode))
        reason = None
        if cfg.disaggregate_min_prompt_tokens and n < cfg.disaggregate_min_prompt_tokens:
            reason = "short_prompt"
        elif cfg.disaggregate_min_uncached_tokens and uncached < cfg.disaggregate_min_uncached_tokens:
            reason = "cached_on_decode"
        elif cfg.local_prefill_pressure and self._pressed(d.prefill, candidates, cfg.local_prefill_pressure) \
                and self._headroom(decode, cfg.local_max_decode_kv_usage):
            reason = "prefill_pressure"
        if reason is None:
            rules = cfg.disaggregate_min_prompt_tokens or cfg.disaggregate_min_uncached_tokens or \
                cfg.local_prefill_pressure
            self._record(ctx, "disaggregated", "uncached" if rules else "always", uncached)
            return candidates
        if engine.decode_runs_whole:
            d.prefill = None
            _without_kv_params(ctx)
            self._record(ctx, "decode", reason, uncached)
            return [decode]
        combined = [c for c in candidates if c.role in WHOLE_ROLES and in_bucket(c, n)]
        if combined:
            low = min(c.in_flight + c.remote_in_flight for c in combined)
            # equal ones at random, as the strategy's own ties (the first listed took them all)
            d.endpoint = self.rng.choice([c for c in combined if c.in_flight + c.remote_in_flight == low])
            d.prefill = None
            self._record(ctx, "combined", reason, uncached)
            return combined
        self._record(ctx, "disaggregated", "no_local_path", uncached)
        return candidates

    def _whole(self, ctx: RequestContext, engine: Any, candidates: list[Endpoint], unsplit: Unsplit) -> list[Endpoint]:
        """A request the engine's pairs cannot serve (``unsplit``): whole on the chosen decode when
        its engine prefills by itself, else on the least-loaded combined endpoint (equal ones at
        random), else refused (400, naming the field)."""
        reason = unsplit.reason
        ireq, d = ctx.ireq, ctx.decision
        assert ireq is not None and d is not None
        if engine.decode_runs_whole:
            d.prefill = None
            _without_kv_params(ctx)
            self._record(ctx, "decode", reason, None)
            return [d.endpoint]
        combined = [c for c in candidates if c.role in WHOLE_ROLES and in_bucket(c, ireq.prompt_tokens_est)]
        if not combined:
            raise GatewayError(400, f"{unsplit.what} is not served by P/D pairs of the model `{ireq.model}`, and it "
                                    f"has no combined endpoint to run it whole: {unsplit.why}", param=unsplit.param)
        low = min(c.in_flight + c.remote_in_flight for c in combined)
        d.endpoint = self.rng.choice([c for c in combined if c.in_flight + c.remote_in_flight == low])
        d.prefill = None
        self._record(ctx, "combined", reason, None)
        return combined

    def _uncached_on_events(self, ctx: RequestContext, decode: Endpoint) -> int | None:
        """The prompt's tokens the decode's engine does not report holding, or None when its events
        are not live (none, stalled) or the prompt cannot be tokenized: the approximate index decides."""
        precise, ireq = self.precise, ctx.ireq
        assert ireq is not None
        if precise is None or not precise.covers(ireq):
            return None
        found = precise.match(ireq, [decode])
        if found is None or decode in found[2]:
            return None
        held, tokens, _ = found
        ctx.after_write.append(partial(precise.routed, ireq, decode))
        ctx.rec.extra["decode_uncached_source"] = "events"
        return max(0, tokens - held.get(decode, 0))

    @staticmethod
    def _pressed(prefill: Endpoint, candidates: list[Endpoint], limit: int) -> bool:
        peers = [c for c in candidates if c.role == "prefill" and c.roleset == prefill.roleset]
        return sum(c.prefill_in_flight for c in peers) / max(1, len(peers)) > limit

    def _headroom(self, decode: Endpoint, max_kv: float) -> bool:
        m = decode.fresh_metrics(self.config.routing.metrics_max_age_s)
        return m is None or m.kv_usage is None or m.kv_usage < max_kv

    def _record(self, ctx: RequestContext, mode: str, reason: str, uncached: int | None) -> None:
        """The answer's header now; the count and the log fields once the leg is written."""
        assert ctx.ireq is not None and ctx.decision is not None
        ctx.decision.headers[HEADER] = f"{mode}; reason={reason}"
        ctx.after_write.append(partial(self._count, ctx, mode, reason, uncached))

    def _count(self, ctx: RequestContext, mode: str, reason: str, uncached: int | None) -> None:
        assert ctx.ireq is not None
        model = ctx.ireq.model
        child = self._children.get((model, mode, reason))
        if child is None:
            child = self._children[(model, mode, reason)] = self.metrics.decisions.labels(model, mode, reason)
        child.inc()
        extra = ctx.rec.extra
        extra["pd_mode"], extra["pd_reason"] = mode, reason
        if uncached is not None:
            extra["decode_uncached_tokens"] = uncached


def _without_kv_params(ctx: RequestContext) -> None:
    """A request run whole on a decode is a local prefill: the client's own ``kv_transfer_params``
    are dropped (they would have the decode pull KV from where they point), as from a P/D leg's."""
    ireq = ctx.ireq
    assert ireq is not None
    if "kv_transfer_params" in ireq.data:
        data = {k: v for k, v in ireq.data.items() if k != "kv_transfer_params"}
        ctx.ireq = dataclasses.replace(ireq, data=data, body=body_bytes(data, ireq.body))
