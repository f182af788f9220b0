"""Prometheus metrics with the real vLLM / SGLang names, labels and (roughly) buckets.

Each simulated engine owns a private ``CollectorRegistry``: tests and the gateway's demo mode run
several engines in one process, and the global registry would mix them up. The engine calls the
``on_*`` hooks as a request moves through its life; gauges are read from the engine at scrape time,
through ``ScrapeSource`` (the engine imports this module, so this module does not import the engine).
"""

from __future__ import annotations

import time
from collections.abc import Sized
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from enginesim.config import SimConfig
from enginesim.kvcache import BlockPool
from enginesim.sequence import Sequence

# vLLM's default buckets (v1 Prometheus logger).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# SGLang's TTFT buckets, with a few sub-100 ms buckets in front because simulated latencies are tiny.
SGLANG_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0,
                       8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0)
SGLANG_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                          60.0, 120.0, 300.0, 600.0)

FINISH_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to ``max_value``, for per-request token-count histograms."""
    out: list[float] = []
    mantissas = (1, 2, 5)
    exponent = 0
    while True:
        for m in mantissas:
            value = m * 10 ** exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class RollingRates(Protocol):
    """SGLang's rolling signals, kept by the engine."""

    def cache_hit_rate(self) -> float: ...
    def gen_throughput(self) -> float: ...


class RoleGauges(Protocol):
    """The serving role's own gauges (SGLang's P/D queues)."""

    def gauges(self) -> dict[str, float]: ...


class ScrapeSource(Protocol):
    """What ``render`` reads from the engine at scrape time; ``Engine`` is one."""

    @property
    def cfg(self) -> SimConfig: ...
    @property
    def running(self) -> Sized: ...
    @property
    def waiting(self) -> Sized: ...
    @property
    def pool(self) -> BlockPool: ...
    @property
    def stats(self) -> RollingRates: ...
    @property
    def started_at(self) -> float: ...
    @property
    def role(self) -> RoleGauges: ...


class EngineMetrics(Protocol):
    """What the engine reports as a request moves through its life."""

    registry: CollectorRegistry

    def on_admitted(self, seq: Sequence) -> None: ...
    def on_prefill_done(self, seq: Sequence) -> None: ...
    def on_token(self, seq: Sequence, itl_s: float | None) -> None: ...
    def on_finish(self, seq: Sequence) -> None: ...
    def on_pd_event(self, kind: str) -> None: ...
    def render(self, engine: ScrapeSource) -> bytes: ...


class VllmMetrics:
    def __init__(self, cfg: SimConfig) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": cfg.served_name, "engine": "0"}
        names = list(self._labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r)

        self.lora_info: Gauge | None = None
        # vLLM serves prometheus_client's default registry, whose process collector reports the
        # server's start (unix seconds): here the simulator's own start, so a restart changes it.
        # SGLang's /metrics is a multiprocess registry with no process collector: it has none
        self.start_time = Gauge("process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.", registry=r)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local prefix cache hits).")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.success = counter("vllm:request_success", "Count of successfully processed requests.",
                               ("finished_reason",))
        for reason in FINISH_REASONS:
            self.success.labels(**self._labels, finished_reason=reason)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         VLLM_TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        VLLM_ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", VLLM_REQUEST_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", VLLM_REQUEST_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", VLLM_REQUEST_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", VLLM_REQUEST_BUCKETS)
        tokens = token_buckets(cfg.max_model_len)
        self.req_prompt_tokens = hist("vllm:request_prompt_tokens",
                                      "Number of prefill tokens processed.", tokens)
        self.req_generation_tokens = hist("vllm:request_generation_tokens",
                                          "Number of generation tokens processed.", tokens)
        # the KV pool's size, as vLLM's CacheConfig.metrics_info() exports it: blocks and block size,
        # the group-aware size in tokens and the concurrency it allows at max_model_len. vLLM has no
        # series for max_num_seqs: its running cap is not exported.
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                      "num_cpu_blocks", "num_gpu_blocks", "prefix_caching_hash_algo", "kv_cache_size_tokens",
                      "kv_cache_max_concurrency", "engine"],
                     registry=r)
        kv_tokens = cfg.kv_blocks * cfg.block_size
        info.labels(block_size=str(cfg.block_size), cache_dtype="auto",
                    enable_prefix_caching=str(cfg.enable_prefix_caching), gpu_memory_utilization="0.9",
                    num_cpu_blocks="None", num_gpu_blocks=str(cfg.kv_blocks),
                    prefix_caching_hash_algo="sha256", kv_cache_size_tokens=str(kv_tokens),
                    kv_cache_max_concurrency=str(kv_tokens / max(1, cfg.max_model_len)), engine="0").set(1)

    def on_admitted(self, seq: Sequence) -> None:
        labels = self._labels
        self.queue_time.labels(**labels).observe(seq.queue_time_s)
        self.prefix_queries.labels(**labels).inc(seq.prompt_tokens)
        self.prefix_hits.labels(**labels).inc(seq.cached_tokens)

    def on_prefill_done(self, seq: Sequence) -> None:
        self.prompt_tokens.labels(**self._labels).inc(seq.prompt_tokens)
        self.prompt_tokens_cached.labels(**self._labels).inc(seq.cached_tokens)

    def on_token(self, seq: Sequence, itl_s: float | None) -> None:
        labels = self._labels
        self.generation_tokens.labels(**labels).inc()
        if itl_s is None:
            self.ttft.labels(**labels).observe(seq.ttft_s or 0.0)
            self.prefill_time.labels(**labels).observe(seq.prefill_time_s)
        else:
            self.itl.labels(**labels).observe(itl_s)

    def on_finish(self, seq: Sequence) -> None:
        labels = self._labels
        self.success.labels(**labels, finished_reason=seq.finish_reason or "abort").inc()
        self.e2e.labels(**labels).observe(seq.e2e_s)
        self.req_prompt_tokens.labels(**labels).observe(seq.prompt_tokens)
        self.req_generation_tokens.labels(**labels).observe(seq.completion_tokens)
        if seq.first_token_at is not None and seq.finished_at is not None:
            self.decode_time.labels(**labels).observe(seq.finished_at - seq.first_token_at)

    def on_pd_event(self, kind: str) -> None:
        pass  # vLLM's NIXL metrics are not simulated

    def render(self, engine: ScrapeSource) -> bytes:
        labels = self._labels
        lora = getattr(engine, "lora", None)
        if lora is not None:    # the current label set gets the current time; older sets keep theirs
            if self.lora_info is None:
                self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                       ["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
                                       registry=self.registry)
            self.lora_info.labels(**lora.info_labels()).set(time.time())
        self.start_time.set(engine.started_at)
        self.running.labels(**labels).set(len(engine.running))
        self.waiting.labels(**labels).set(len(engine.waiting))
        self.kv_usage.labels(**labels).set(engine.pool.usage)
        return generate_latest(self.registry)


class SglangMetrics:
    """SGLang's names. Its multiprocess collector has no ``_created`` series, so they are dropped."""

    def __init__(self, cfg: SimConfig) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._sched = {"model_name": cfg.served_name, "engine_type": cfg.engine_type, "tp_rank": "0",
                       "pp_rank": "0", "moe_ep_rank": "0"}
        self._tok = {"model_name": cfg.served_name, "engine_type": cfg.engine_type}
        sched, tok = list(self._sched), list(self._tok)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, sched, registry=r)

        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.max_total_tokens = gauge("sglang:max_total_num_tokens",
                                      "Maximum total number of tokens in the KV cache pool.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.utilization = gauge("sglang:utilization", "The utilization.")
        streaming = [*tok, "is_streaming"]
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                                     streaming, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens",
                                         "Number of generation tokens processed.", streaming, registry=r)
        self.num_requests = Counter("sglang:num_requests", "Number of requests processed.",
                                    streaming, registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens.",
                                     [*tok, "cache_source"], registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.", tok, registry=r)
        self.aborted.labels(**self._tok)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              streaming, buckets=SGLANG_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             tok, buckets=SGLANG_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", streaming,
                             buckets=SGLANG_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                                    tok, buckets=SGLANG_LATENCY_BUCKETS, registry=r)
        self.max_total_tokens.labels(**self._sched).set(cfg.kv_blocks * cfg.block_size)
        # the running-requests cap and what set it (recent SGLang: requested, estimated, kv_capacity...)
        Gauge("sglang:max_running_requests", "Maximum running requests.", [*sched, "cap_source"],
              registry=r).labels(**self._sched, cap_source="requested").set(cfg.max_num_seqs)
        # P/D: the disaggregation queues and transfer counters (only on prefill/decode engines).
        self.pd_gauges: dict[str, Gauge] = {}
        self.pd_counters: dict[str, Counter] = {}
        if cfg.role != "aggregated":
            self.pd_gauges = {
                "num_prefill_bootstrap_queue_reqs": gauge("sglang:num_prefill_bootstrap_queue_reqs",
                                                          "The number of requests in the prefill bootstrap queue."),
                "num_prefill_inflight_queue_reqs": gauge("sglang:num_prefill_inflight_queue_reqs",
                                                         "The number of requests in the prefill inflight queue."),
                "num_decode_prealloc_queue_reqs": gauge("sglang:num_decode_prealloc_queue_reqs",
                                                        "The number of requests in the decode prealloc queue."),
                "num_decode_transfer_queue_reqs": gauge("sglang:num_decode_transfer_queue_reqs",
                                                        "The number of requests in the decode transfer queue."),
                "kv_transfer_latency_ms": gauge("sglang:kv_transfer_latency_ms",
                                                "The latency of the last KV transfer in ms."),
            }
            self.pd_counters = {
                "bootstrap_failed": Counter("sglang:num_bootstrap_failed_reqs",
                                            "The number of bootstrap failed requests.", sched, registry=r),
                "transfer_failed": Counter("sglang:num_transfer_failed_reqs",
                                           "The number of transfer failed requests.", sched, registry=r),
            }
            for counter in self.pd_counters.values():
                counter.labels(**self._sched)

    def _streaming(self, seq: Sequence) -> dict[str, str]:
        return {**self._tok, "is_streaming": str(seq.stream)}

    def on_admitted(self, seq: Sequence) -> None:
        self.queue_time.labels(**self._tok).observe(seq.queue_time_s)

    def on_prefill_done(self, seq: Sequence) -> None:
        pass

    def on_token(self, seq: Sequence, itl_s: float | None) -> None:
        if itl_s is None:
            self.ttft.labels(**self._streaming(seq)).observe(seq.ttft_s or 0.0)
        else:
            self.itl.labels(**self._tok).observe(itl_s)

    def on_finish(self, seq: Sequence) -> None:
        labels = self._streaming(seq)
        self.prompt_tokens.labels(**labels).inc(seq.prompt_tokens)
        self.generation_tokens.labels(**labels).inc(seq.completion_tokens)
        self.num_requests.labels(**labels).inc()
        self.cached_tokens.labels(**self._tok, cache_source="device").inc(seq.cached_tokens)
        self.e2e.labels(**labels).observe(seq.e2e_s)
        if seq.finish_reason == "abort":
            self.aborted.labels(**self._tok).inc()

    def on_pd_event(self, kind: str) -> None:
        counter = self.pd_counters.get(kind)
        if counter is not None:
            counter.labels(**self._sched).inc()

    def render(self, engine: ScrapeSource) -> bytes:
        s = self._sched
        self.running.labels(**s).set(len(engine.running))
        self.queue.labels(**s).set(len(engine.waiting))
        self.token_usage.labels(**s).set(engine.pool.usage)
        self.used_tokens.labels(**s).set(engine.pool.used_blocks * engine.pool.block_size)
        self.cache_hit_rate.labels(**s).set(engine.stats.cache_hit_rate())
        self.gen_throughput.labels(**s).set(engine.stats.gen_throughput())
        self.utilization.labels(**s).set(len(engine.running) / engine.cfg.max_num_seqs)
        for name, value in engine.role.gauges().items():
            if name in self.pd_gauges:
                self.pd_gauges[name].labels(**s).set(value)
        text = generate_latest(self.registry)
        return b"".join(line for line in text.splitlines(keepends=True) if b"_created" not in line)


def make_metrics(cfg: SimConfig) -> EngineMetrics:
    return VllmMetrics(cfg) if cfg.engine == "vllm" else SglangMetrics(cfg)


__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics", "ScrapeSource", "make_metrics"]
