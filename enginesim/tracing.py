"""Engine-side tracing, the way vLLM does it with ``--otlp-traces-endpoint``.

A request that arrives with a W3C ``traceparent`` (and ``tracestate``) carries them into the
engine; when the request finishes, one SERVER span ``llm_request`` is emitted under that parent,
back-dated to the request's arrival, with vLLM's ``gen_ai.*`` attributes (request id, prompt and
completion tokens, time in queue, TTFT, prefill time, end to end). A request without a
``traceparent`` gives a root span, an unsampled parent (flags ``00``) none, as vLLM's default
sampler does. Spans go to an OTLP/HTTP endpoint through a batch processor of their own (no
global provider: several simulated engines share a process in tests and the demo).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from opentelemetry import trace as otel
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from enginesim.sequence import Sequence

_PROPAGATOR = TraceContextTextMapPropagator()
_BATCH_DELAY_MS = 200        # a simulator: spans show up in the collector quickly


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace headers of a request, if it has a ``traceparent``."""
    tp = headers.get("traceparent")
    if tp is None:
        return None
    out = {"traceparent": tp}
    ts = headers.get("tracestate")
    if ts is not None:
        out["tracestate"] = ts
    return out


def traces_url(endpoint: str) -> str:
    """``host:port`` or a URL without a path → its OTLP/HTTP traces URL."""
    url = endpoint if endpoint.startswith(("http://", "https://")) else "http://" + endpoint
    scheme, rest = url.split("://", 1)
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host}/v1/traces" if not path.strip("/") else url


class SimTracer:
    def __init__(self, endpoint: str, engine: str, role: str, model: str) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": engine}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)),
                                                            schedule_delay_millis=_BATCH_DELAY_MS))
        self.tracer = self.provider.get_tracer("enginesim")
        self.role = role
        self.model = model

    def finished(self, seq: Sequence) -> None:
        """Emit the ``llm_request`` span of a finished request."""
        now_mono, now_ns = time.monotonic(), time.time_ns()

        def ns(t: float) -> int:
            return now_ns - int((now_mono - t) * 1e9)

        parent = _PROPAGATOR.extract(seq.trace_headers) if seq.trace_headers else None
        attrs: dict[str, str | int | float] = {
            "gen_ai.request.id": seq.id,
            "gen_ai.response.model": self.model,
            "gen_ai.request.max_tokens": seq.params.max_tokens,
            "gen_ai.usage.prompt_tokens": seq.prompt_tokens,
            "gen_ai.usage.completion_tokens": seq.completion_tokens,
            "gen_ai.latency.time_in_queue": seq.queue_time_s,
            "gen_ai.latency.e2e": seq.e2e_s,
            "gen_ai.latency.time_in_model_prefill": seq.prefill_time_s,
            "enginesim.role": self.role,
            "enginesim.cached_tokens": seq.cached_tokens,
        }
        if seq.ttft_s is not None:
            attrs["gen_ai.latency.time_to_first_token"] = seq.ttft_s
        if seq.finish_reason:
            attrs["enginesim.finish_reason"] = seq.finish_reason
        span = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER,
                                      attributes=attrs, start_time=ns(seq.arrival))
        if seq.finish_reason in ("abort", "error"):
            span.set_status(otel.Status(otel.StatusCode.ERROR, seq.error))
        span.end(end_time=ns(seq.finished_at or now_mono))

    async def close(self) -> None:
        """Flush and stop (in a thread: an export blocks)."""
        await asyncio.to_thread(self.provider.shutdown)
