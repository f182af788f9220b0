"""Prefill/decode orchestration: the two legs, fail-fast, aborts and the decode watchdog.

vLLM (context-first): the prefill leg runs to completion (``max_tokens=1``, ``stream=false``,
``kv_transfer_params.do_remote_decode=true``); its ``kv_transfer_params`` go into the decode
leg, which the client receives. A failed prefill fails the request at once, with no decode leg.

SGLang (bootstrap): both legs start together with the same bootstrap triple and gateway-owned
``rid``; the prefill answers only after the decode took the KV. A terminal prefill failure aborts
the decode (``/abort_request``, sent again after a delay unless the decode answered) and fails
the client if nothing was sent yet; once the decode streams, a late prefill failure is logged
and the stream runs on.

The decode watchdog is armed when the decode leg starts (SGLang: once the prefill succeeded): a
first-chunk bound for streams, a whole-answer bound for non-streams (off by default), and an
idle bound between chunks (in the relay). On fire the decode is aborted and counted by phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
import structlog
from aiohttp import web

from gateway.errors import GatewayError, normalize_upstream_error
from gateway.h1client import UpstreamConnectError, UpstreamError, UpstreamResponse, UpstreamTimeout
from gateway.request import usage_stream_options
from gateway.upstream import UpstreamFailure, open_leg
from handlers import sglang as sglang_handler
from handlers import vllm as vllm_handler

if TYPE_CHECKING:
    from gateway.endpoints import Endpoint
    from gateway.pipeline import Gateway, RequestRecord
    from gateway.request import InferenceRequest
    from gateway.trackers import Charge
    from routers.base import Decision

log = structlog.get_logger("switchyard.pd")


@dataclass
class PDCharges:
    prefill: Charge
    pending_decode: Charge
    token_active: Charge
    token_kv: Charge


class PrefillFailed(Exception):
    """Classes: request_setup, timeout, canceled, transport, http_status, bad_response."""

    def __init__(self, failure_class: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.failure_class = failure_class
        self.message = message
        self.status = status

    def client_error(self, prefill: Endpoint) -> GatewayError:
        status = {"http_status": 502, "bad_response": 502, "timeout": 504}.get(self.failure_class, 503)
        return GatewayError(status, f"prefill request to {prefill.name} failed ({self.failure_class}): "
                                    f"{self.message[:256]}",
                            code=f"pd_prefill_{self.failure_class}",
                            header=("x-error-pd-prefill", self.failure_class),
                            error_class=f"pd_prefill_{self.failure_class}")


def _decode_header_timeout(gw: Gateway, ireq: InferenceRequest) -> float | None:
    wd = gw.config.watchdog_for(ireq.model)
    limit = wd.first_chunk_timeout_s if ireq.stream else wd.response_timeout_s
    return limit or gw.config.upstream.first_byte_timeout_s or None


def _watchdog_error(gw: Gateway, rec: RequestRecord, decode: Endpoint, ireq: InferenceRequest,
                    limit: float | None) -> GatewayError:
    phase = "first_chunk" if ireq.stream else "response"
    gw.metrics.child(gw.metrics.watchdog_fires, rec.model, phase).inc()
    rec.error_class = f"watchdog_{phase}"
    verb = "start" if ireq.stream else "finish"
    return GatewayError(504, f"decode endpoint {decode.name} did not {verb} responding within {limit:g}s",
                        code="upstream_timeout", header=("x-error-pd-decode", "true"), error_class=rec.error_class)


async def forward_pd(gw: Gateway, request: web.Request, ireq: InferenceRequest, decision: Decision,
                     charges: PDCharges, rec: RequestRecord,
                     members: list[tuple[str, bytes]] | None) -> web.StreamResponse:
    prefill = decision.prefill
    assert prefill is not None
    rec.extra["prefill_endpoint"] = prefill.name
    rec.endpoint = decision.endpoint.name
    decision.headers["prefill-target-pod"] = prefill.name
    if decision.endpoint.engine == "sglang":
        return await _sglang(gw, request, ireq, decision, charges, rec, members)
    return await _vllm(gw, request, ireq, decision, charges, rec)


def _record_prefill_failure(gw: Gateway, rec: RequestRecord, f: PrefillFailed, stage: str) -> None:
    gw.metrics.child(gw.metrics.pd_prefill_failures, rec.model, f.failure_class, stage).inc()
    rec.extra["prefill_failure"] = f.failure_class


async def _call_prefill(gw: Gateway, ireq: InferenceRequest, prefill: Endpoint, body: bytes,
                        headers: dict[str, str], rec: RequestRecord) -> bytes:
    """POST the prefill body; returns the 200 answer bytes or raises PrefillFailed."""
    timeout = gw.config.pd_for(ireq.model).prefill_timeout_s or None
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            resp = await gw.upstream.post(prefill.url + ireq.path, body, headers)
            try:
                raw = await resp.read()
            finally:
                resp.release()      # back to the pool when fully read; closed (engine aborts) otherwise
            status = resp.status
    except TimeoutError:
        raise PrefillFailed("timeout", f"no answer within {timeout:g}s") from None
    except UpstreamTimeout as e:    # upstream.total_timeout_s
        raise PrefillFailed("timeout", str(e)) from None
    except UpstreamConnectError as e:
        raise PrefillFailed("transport", f"cannot connect: {e}") from None
    except UpstreamError as e:
        raise PrefillFailed("transport", f"{type(e).__name__}: {e}") from None
    finally:
        rec.extra["prefill_ms"] = round((time.perf_counter() - start) * 1000, 3)
    gw.metrics.child(gw.metrics.pd_prefill_time, rec.model).observe(time.perf_counter() - start)
    rec.extra["prefill_status"] = status
    if status != 200:
        _, err = normalize_upstream_error(status, raw)
        raise PrefillFailed("http_status", f"status {status}: {err['error']['message']}", status)
    return raw


# -- vLLM ------------------------------------------------------------------------------------------


async def _vllm(gw: Gateway, request: web.Request, ireq: InferenceRequest, decision: Decision,
                charges: PDCharges, rec: RequestRecord) -> web.StreamResponse:
    prefill, decode = decision.prefill, decision.endpoint
    cfg = gw.config.pd_for(ireq.model)
    headers = gw.upstream_headers(ireq)
    prefill_start = time.perf_counter()
    try:
        raw = await _call_prefill(gw, ireq, prefill, vllm_handler.prefill_body(ireq.data), headers, rec)
        kv = vllm_handler.kv_params_from_answer(raw)
    except vllm_handler.BadPrefillAnswer as e:
        f = PrefillFailed("bad_response", str(e))
        _record_prefill_failure(gw, rec, f, "before_response")
        raise f.client_error(prefill) from None
    except PrefillFailed as f:
        _record_prefill_failure(gw, rec, f, "before_response")
        raise f.client_error(prefill) from None
    finally:
        charges.prefill.release()
        charges.token_active.release()
    prefill_end = time.perf_counter()
    extra = usage_stream_options(ireq)
    strip_usage = extra is not None
    body = vllm_handler.decode_body(ireq.data, kv, prefill.host if cfg.vllm.rewrite_remote_host else None, extra)
    charges.pending_decode.release()
    limit = _decode_header_timeout(gw, ireq)
    decode_start = time.perf_counter()
    try:
        resp = await open_leg(gw.upstream, decode.url + ireq.path, body, headers, limit)
    except UpstreamFailure as f:
        if f.kind == "timeout":   # the watchdog: no answer from the decode in time (closing it aborts)
            raise _watchdog_error(gw, rec, decode, ireq, limit) from None
        gw.metrics.child(gw.metrics.upstream_errors, rec.model, decode.name, f.kind).inc()
        rec.error_class = f"decode_{f.kind}"
        raise GatewayError(502, f"decode endpoint unavailable: {f.message}", code="upstream_unavailable",
                           header=("x-error-pd-decode", f.kind), error_class=rec.error_class) from None
    wd = gw.config.watchdog_for(ireq.model)
    out = await gw.relay_answer(request, ireq, resp, decision, rec, strip_usage, wd)
    _observe_phases(gw, rec, prefill_start, prefill_end, decode_start)
    if rec.error_class and rec.error_class.startswith("watchdog_"):
        gw.metrics.child(gw.metrics.watchdog_fires, rec.model, rec.error_class[len("watchdog_"):]).inc()
    return out


def _observe_phases(gw: Gateway, rec: RequestRecord, prefill_start: float, prefill_end: float | None,
                    decode_start: float) -> None:
    m = gw.metrics
    now = time.perf_counter()
    m.child(m.pd_decode_time, rec.model).observe(now - decode_start)
    if rec.ttft is not None and prefill_end is not None:
        first_token = rec.started + rec.ttft
        rec.extra["kv_transfer_ms"] = round((first_token - prefill_end) * 1000, 3)
        m.child(m.pd_kv_transfer_time, rec.model).observe(max(0.0, first_token - prefill_end))


# -- SGLang ----------------------------------------------------------------------------------------


async def _abort(gw: Gateway, ep: Endpoint, rid: str, model: str, *, again_unless: asyncio.Future | None = None) -> None:
    """POST /abort_request {rid}; a second time after a delay unless ``again_unless`` is done
    (the abort may overtake the request it aborts)."""
    cfg = gw.config.pd_for(model)
    if not cfg.sglang.abort_timeout_s:
        gw.metrics.child(gw.metrics.pd_aborts, model, "skipped_disabled").inc()
        return
    for attempt in range(2):
        try:
            async with asyncio.timeout(cfg.sglang.abort_timeout_s):
                r = await gw.upstream.post(ep.url + "/abort_request", orjson.dumps({"rid": rid}),
                                           {"Content-Type": "application/json"})
                try:
                    await r.read()
                finally:
                    r.release()
                result = "ok" if r.status == 200 else "error"
        except (TimeoutError, UpstreamError):
            result = "error"
        gw.metrics.child(gw.metrics.pd_aborts, model, result).inc()
        if attempt == 0:
            if not cfg.sglang.abort_retry_delay_s:
                return
            await asyncio.sleep(cfg.sglang.abort_retry_delay_s)
            if again_unless is not None and again_unless.done() and not again_unless.cancelled():
                return


async def _sglang(gw: Gateway, request: web.Request, ireq: InferenceRequest, decision: Decision,
                  charges: PDCharges, rec: RequestRecord,
                  members: list[tuple[str, bytes]] | None) -> web.StreamResponse:
    prefill, decode = decision.prefill, decision.endpoint
    cfg = gw.config.pd_for(ireq.model)
    if members is None:
        members = sglang_handler.split_members(ireq.body)
    rid = sglang_handler.new_rid(ireq.request_id)
    rec.extra["rid"] = rid
    port = prefill.bootstrap_port or cfg.sglang.default_bootstrap_port
    extra = usage_stream_options(ireq)
    strip_usage = extra is not None
    p_body, d_body = sglang_handler.build_bodies(
        members, bootstrap_host=sglang_handler.bootstrap_host_of(prefill.host), bootstrap_port=port,
        room=sglang_handler.new_room(gw.router_ctx.rng), rid=rid, decode_extra=extra)
    headers = gw.upstream_headers(ireq)
    prefill_start = time.perf_counter()
    prefill_end: list[float] = []

    async def run_prefill() -> None:
        try:
            await _call_prefill(gw, ireq, prefill, p_body, headers, rec)
            prefill_end.append(time.perf_counter())
        finally:
            charges.prefill.release()
            charges.token_active.release()

    prefill_task = asyncio.create_task(run_prefill())
    decode_task = asyncio.create_task(open_leg(gw.upstream, decode.url + ireq.path, d_body, headers,
                                               gw.config.upstream.first_byte_timeout_s or None))
    charges.pending_decode.release()
    decode_start = time.perf_counter()
    resp: UpstreamResponse | None = None
    try:
        await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task.done():
            exc = prefill_task.exception()
            if isinstance(exc, PrefillFailed):
                stage = "before_response"
                _record_prefill_failure(gw, rec, exc, stage)
                if not decode_task.done():
                    gw.spawn(_abort(gw, decode, rid, ireq.model, again_unless=decode_task))
                raise exc.client_error(prefill)
            if exc is not None:
                raise exc
            # prefill done: the decode holds the KV; arm the watchdog on its first answer
            limit = _decode_header_timeout(gw, ireq)
            try:
                async with asyncio.timeout(limit):
                    resp = await asyncio.shield(decode_task)
            except TimeoutError:
                gw.spawn(_abort(gw, decode, rid, ireq.model))
                raise _watchdog_error(gw, rec, decode, ireq, limit) from None
        else:
            # the decode answered first (its headers come with its first token): the prefill's
            # answer may still be on its way; let it finish in the background
            resp = decode_task.result()
            gw.spawn(_late_prefill(gw, prefill_task, rec, ireq))
    except UpstreamFailure as f:
        gw.spawn(_abort(gw, prefill, rid, ireq.model))
        if f.kind == "timeout":
            raise _watchdog_error(gw, rec, decode, ireq, gw.config.upstream.first_byte_timeout_s) from None
        gw.metrics.child(gw.metrics.upstream_errors, rec.model, decode.name, f.kind).inc()
        rec.error_class = f"decode_{f.kind}"
        raise GatewayError(502, f"decode endpoint unavailable: {f.message}", code="upstream_unavailable",
                           header=("x-error-pd-decode", f.kind), error_class=rec.error_class) from None
    except asyncio.CancelledError:
        # the client went away: stop both legs, and tell SGLang (it notices a closed
        # connection only seconds later)
        gw.spawn(_abort(gw, decode, rid, ireq.model))
        if not prefill_task.done():
            gw.spawn(_abort(gw, prefill, rid, ireq.model))
        raise
    finally:
        if resp is None:
            for t in (prefill_task, decode_task):
                if not t.done():
                    t.cancel()
            if decode_task.done() and not decode_task.cancelled() and decode_task.exception() is None:
                decode_task.result().close()
            for t in (prefill_task, decode_task):
                with contextlib.suppress(BaseException):
                    await t
    if resp.status != 200 and not prefill_task.done():
        gw.spawn(_abort(gw, prefill, rid, ireq.model))    # the prefill would wait for a decode that gave up
        prefill_task.cancel()
    wd = gw.config.watchdog_for(ireq.model)
    try:
        out = await gw.relay_answer(request, ireq, resp, decision, rec, strip_usage, wd)
    except asyncio.CancelledError:
        gw.spawn(_abort(gw, decode, rid, ireq.model))
        raise
    if rec.error_class and rec.error_class.startswith("watchdog_"):
        gw.metrics.child(gw.metrics.watchdog_fires, rec.model, rec.error_class[len("watchdog_"):]).inc()
        gw.spawn(_abort(gw, decode, rid, ireq.model))
    _observe_phases(gw, rec, prefill_start, prefill_end[0] if prefill_end else None, decode_start)
    return out


async def _late_prefill(gw: Gateway, task: asyncio.Task, rec: RequestRecord, ireq: InferenceRequest) -> None:
    try:
        await task
    except PrefillFailed as f:
        _record_prefill_failure(gw, rec, f, "after_response")
        log.warning("prefill failed after the decode started streaming; the stream continues",
                    request_id=rec.request_id, failure_class=f.failure_class, error=f.message)
    except (asyncio.CancelledError, Exception):
        pass
