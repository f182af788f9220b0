"""Engine /metrics text → EngineMetrics: names, label sets, rates between scrapes, robustness."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.endpoints import EngineMetrics
from gateway.upstream.engine_metrics import parse_engine_metrics, parse_labels

TTFT_BUCKETS = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0",
                "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0", "+Inf"]


def vllm_text(*, engines=("0",), model="llama-8b", running=3.0, waiting=1.0, kv=0.42, hits=10240.0,
              queries=20480.0, prompt=5000.0, gen=2500.0, ttft_sum=12.5, ttft_count=50.0, block_size=16) -> str:
    """A vLLM 0.33-style exposition (vLLM's own /metrics); per-engine values are the same."""
    out = []
    def family(name: str, kind: str, help_: str) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
    for e in engines:
        out.append(f'vllm:num_requests_running{{engine="{e}",model_name="{model}"}} {running}')
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
    for e in engines:
        out.append(f'vllm:num_requests_waiting{{engine="{e}",model_name="{model}"}} {waiting}')
    family("vllm:num_requests_waiting_by_reason", "gauge", "Waiting requests by reason.")
    for e in engines:
        out.append(f'vllm:num_requests_waiting_by_reason{{engine="{e}",model_name="{model}",reason="capacity"}} 7.0')
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
    for i, e in enumerate(engines):
        out.append(f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="{model}"}} {kv + 0.1 * i}')
    for name, val in (("prefix_cache_queries", queries), ("prefix_cache_hits", hits),
                      ("prompt_tokens", prompt), ("generation_tokens", gen), ("prompt_tokens_cached", 99.0)):
        family(f"vllm:{name}", "counter", f"{name} in tokens.")
        for e in engines:
            out.append(f'vllm:{name}_total{{engine="{e}",model_name="{model}"}} {val}')
            out.append(f'vllm:{name}_created{{engine="{e}",model_name="{model}"}} 1.767e+09')
    family("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.")
    for e in engines:
        for i, le in enumerate(TTFT_BUCKETS):
            cum = ttft_count if le == "+Inf" else min(ttft_count, float(i * 3))
            out.append(f'vllm:time_to_first_token_seconds_bucket{{engine="{e}",le="{le}",model_name="{model}"}} {cum}')
        out.append(f'vllm:time_to_first_token_seconds_count{{engine="{e}",model_name="{model}"}} {ttft_count}')
        out.append(f'vllm:time_to_first_token_seconds_sum{{engine="{e}",model_name="{model}"}} {ttft_sum}')
    family("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.")
    for e in engines:
        out.append(f'vllm:iteration_tokens_total_bucket{{engine="{e}",le="+Inf",model_name="{model}"}} 10.0')
        out.append(f'vllm:iteration_tokens_total_count{{engine="{e}",model_name="{model}"}} 10.0')
        out.append(f'vllm:iteration_tokens_total_sum{{engine="{e}",model_name="{model}"}} 300.0')
    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    for e in engines:
        out.append(f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",calculate_kv_scales="False",'
                   f'enable_prefix_caching="True",engine="{e}",gpu_memory_utilization="0.9",num_gpu_blocks="27153",'
                   f'prefix_caching_hash_algo="sha256"}} 1.0')
    family("http_requests_total", "counter", "Total number of requests by method, status and handler.")
    out.append('http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 42.0')
    return "\n".join(out) + "\n"


def sglang_text(*, model="qwen", dp_ranks=(None,), running=4.0, queue=2.0, token_usage=0.3, hit_rate=0.6,
                gen_tp=812.5, prompt=(3000.0, 1000.0), gen=(1500.0, 500.0), ttft_sum=(6.0, 2.0),
                ttft_count=(30.0, 10.0), with_gen_tp=True) -> str:
    """An SGLang 0.5-style exposition (SGLang's own /metrics): multiprocess collector, no _created;
    scheduler metrics per DP rank; tokenizer metrics split by is_streaming."""
    out = []
    def sched_labels(dp) -> str:
        dp_label = f',dp_rank="{dp}"' if dp is not None else ""
        return f'engine_type="unified"{dp_label},model_name="{model}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    for name, val in (("num_running_reqs", running), ("num_queue_reqs", queue), ("token_usage", token_usage),
                      ("cache_hit_rate", hit_rate), ("gen_throughput", gen_tp), ("num_used_tokens", 1234.0)):
        if name == "gen_throughput" and not with_gen_tp:
            continue
        out.append(f"# HELP sglang:{name} Multiprocess metric")
        out.append(f"# TYPE sglang:{name} gauge")
        for dp in dp_ranks:
            out.append(f"sglang:{name}{{{sched_labels(dp)}}} {val}")
    for name, vals in (("prompt_tokens", prompt), ("generation_tokens", gen)):
        out.append(f"# HELP sglang:{name}_total Multiprocess metric")
        out.append(f"# TYPE sglang:{name}_total counter")
        for streaming, v in zip(("true", "false"), vals, strict=True):
            out.append(f'sglang:{name}_total{{engine_type="unified",is_streaming="{streaming}",model_name="{model}"}} {v}')
    out.append("# HELP sglang:time_to_first_token_seconds Multiprocess metric")
    out.append("# TYPE sglang:time_to_first_token_seconds histogram")
    for streaming, s, c in zip(("true", "false"), ttft_sum, ttft_count, strict=True):
        labels = f'engine_type="unified",is_streaming="{streaming}",model_name="{model}"'
        out.append(f'sglang:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} {c / 2}')
        out.append(f'sglang:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {c}')
        out.append(f"sglang:time_to_first_token_seconds_count{{{labels}}} {c}")
        out.append(f"sglang:time_to_first_token_seconds_sum{{{labels}}} {s}")
    return "\n".join(out) + "\n"


# -- vLLM -----------------------------------------------------------------------------------------


def test_vllm_single_scrape():
    m = parse_engine_metrics(vllm_text(), "vllm", now=100.0)
    assert m.scraped_at == 100.0
    assert (m.running, m.waiting, m.kv_usage) == (3.0, 1.0, 0.42)
    assert (m.prefix_hits_total, m.prefix_queries_total) == (10240.0, 20480.0)
    assert m.prefix_hit_rate == 0.5                       # cumulative: no previous scrape
    assert (m.prompt_tokens_total, m.generation_tokens_total) == (5000.0, 2500.0)
    assert (m.ttft_sum, m.ttft_count) == (12.5, 50.0)
    assert m.block_size == 16
    # rates need two scrapes
    assert m.prompt_throughput is None and m.gen_throughput is None and m.ttft_recent_mean is None


def test_a_negative_figure_is_left_out_not_read():
    """An engine reporting -5 waiting or a KV usage of -1 (a bug, a broken exporter) would win every
    least-waiting or least-kv-cache decision; such a figure counts as not reported."""
    m = parse_engine_metrics(vllm_text(waiting=-5.0, kv=-1.0), "vllm", now=100.0)
    assert (m.running, m.waiting, m.kv_usage) == (3.0, None, None)


def test_a_sum_past_a_doubles_range_is_not_read():
    """Series of one counter (data-parallel ranks) near a double's largest value sum to infinity:
    that figure is not read, as an infinite sample is not, and its rate is unknown, not NaN."""
    text = ('vllm:prompt_tokens_total{engine="0"} 1e308\nvllm:prompt_tokens_total{engine="1"} 1e308\n'
            'vllm:generation_tokens_total{engine="0"} 7\n')
    first = parse_engine_metrics(text, "vllm", now=100.0)
    second = parse_engine_metrics(text, "vllm", now=105.0, prev=first)
    assert (second.prompt_tokens_total, second.prompt_throughput) == (None, None)
    assert (second.generation_tokens_total, second.gen_throughput) == (7.0, 0.0)


def test_vllm_rates_from_two_scrapes():
    first = parse_engine_metrics(vllm_text(), "vllm", now=100.0)
    second = parse_engine_metrics(
        vllm_text(hits=10540.0, queries=20880.0, prompt=5500.0, gen=2750.0, ttft_sum=13.5, ttft_count=54.0),
        "vllm", now=105.0, prev=first)
    assert second.prompt_throughput == pytest.approx(100.0)
    assert second.gen_throughput == pytest.approx(50.0)
    assert second.prefix_hit_rate == pytest.approx(300 / 400)      # over the interval, not cumulative
    assert second.ttft_recent_mean == pytest.approx(1.0 / 4)


def test_vllm_idle_interval_falls_back_and_carries():
    first = parse_engine_metrics(vllm_text(), "vllm", now=100.0)
    second = parse_engine_metrics(vllm_text(ttft_sum=13.5, ttft_count=54.0), "vllm", now=105.0, prev=first)
    third = parse_engine_metrics(vllm_text(ttft_sum=13.5, ttft_count=54.0), "vllm", now=110.0, prev=second)
    assert third.prefix_hit_rate == 0.5                  # no new queries: cumulative ratio
    assert third.ttft_recent_mean == pytest.approx(0.25)  # no new requests: carried over
    assert third.prompt_throughput == 0.0 and third.gen_throughput == 0.0


def test_vllm_counter_reset_after_engine_restart():
    first = parse_engine_metrics(vllm_text(), "vllm", now=100.0)
    restarted = parse_engine_metrics(
        vllm_text(hits=30.0, queries=40.0, prompt=200.0, gen=100.0, ttft_sum=0.5, ttft_count=2.0),
        "vllm", now=110.0, prev=first)
    assert restarted.prompt_throughput == pytest.approx(20.0)       # counted from zero
    assert restarted.gen_throughput == pytest.approx(10.0)
    assert restarted.prefix_hit_rate == pytest.approx(0.75)          # cumulative
    assert restarted.ttft_recent_mean == pytest.approx(0.25)


def test_vllm_data_parallel_sums_counts_and_averages_kv():
    m = parse_engine_metrics(vllm_text(engines=("0", "1")), "vllm", now=1.0)
    assert (m.running, m.waiting) == (6.0, 2.0)
    assert m.kv_usage == pytest.approx((0.42 + 0.52) / 2)
    assert (m.prompt_tokens_total, m.ttft_count) == (10000.0, 100.0)
    assert m.prefix_hit_rate == 0.5


def test_vllm_old_gpu_cache_name_is_a_fallback():
    text = vllm_text().replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_engine_metrics(text, "vllm", now=1.0).kv_usage == 0.42
    both = vllm_text() + 'vllm:gpu_cache_usage_perc{engine="0",model_name="llama-8b"} 0.99\n'
    assert parse_engine_metrics(both, "vllm", now=1.0).kv_usage == 0.42


def test_block_size_is_carried_when_absent():
    prev = EngineMetrics(scraped_at=0.0, block_size=32)
    text = "\n".join(line for line in vllm_text().splitlines() if "cache_config_info" not in line)
    assert parse_engine_metrics(text, "vllm", now=1.0, prev=prev).block_size == 32
    assert parse_engine_metrics(text, "vllm", now=1.0).block_size is None


def test_model_filter():
    text = vllm_text(model="a", running=3.0) + vllm_text(model="b", running=5.0, kv=0.8)
    assert parse_engine_metrics(text, "vllm", now=1.0, model="a").running == 3.0
    b = parse_engine_metrics(text, "vllm", now=1.0, model="b")
    assert (b.running, b.kv_usage) == (5.0, 0.8)
    # no series of that model: all of them count
    assert parse_engine_metrics(text, "vllm", now=1.0, model="zzz").running == 8.0
    assert parse_engine_metrics(text, "vllm", now=1.0).running == 8.0


def test_model_filter_with_escapes_in_the_name():
    name = 'we,ird"}name'
    escaped = name.replace('"', '\\"')
    text = (f'vllm:num_requests_running{{engine="0",model_name="{escaped}"}} 2\n'
            'vllm:num_requests_running{engine="0",model_name="other"} 9\n')
    assert parse_engine_metrics(text, "vllm", now=0.0, model=name).running == 2.0


# -- SGLang ---------------------------------------------------------------------------------------


def test_sglang_single_scrape():
    m = parse_engine_metrics(sglang_text(), "sglang", now=50.0)
    assert (m.running, m.waiting, m.kv_usage, m.prefix_hit_rate) == (4.0, 2.0, 0.3, 0.6)
    assert m.gen_throughput == 812.5                       # the engine's own gauge
    assert (m.prompt_tokens_total, m.generation_tokens_total) == (4000.0, 2000.0)   # is_streaming summed
    assert (m.ttft_sum, m.ttft_count) == (8.0, 40.0)
    assert m.block_size is None and m.prefix_queries_total is None


def test_sglang_priority_breakdown_is_not_counted_twice():
    # --enable-priority-scheduling (SGLang 0.5.23, metrics_collector._log_gauge_queue_count): the
    # total under priority="", then one series per priority seen; only the total counts
    lab = 'engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="{}",tp_rank="0"'
    text = "\n".join([
        f"sglang:num_running_reqs{{{lab.format('')}}} 5.0",
        f"sglang:num_running_reqs{{{lab.format('0')}}} 3.0",
        f"sglang:num_running_reqs{{{lab.format('10')}}} 2.0",
        f"sglang:num_queue_reqs{{{lab.format('')}}} 1.0",
        f"sglang:num_queue_reqs{{{lab.format('10')}}} 1.0",
        f"sglang:token_usage{{{lab.format('')}}} 0.25",
    ]) + "\n"
    for model in (None, "qwen"):
        m = parse_engine_metrics(text, "sglang", now=1.0, model=model)
        assert (m.running, m.waiting, m.kv_usage) == (5.0, 1.0, 0.25)


def test_sglang_rates_and_dp_ranks():
    first = parse_engine_metrics(sglang_text(with_gen_tp=False), "sglang", now=10.0)
    second = parse_engine_metrics(
        sglang_text(dp_ranks=(0, 1), with_gen_tp=False, prompt=(3100.0, 1100.0), gen=(1540.0, 510.0),
                    ttft_sum=(7.0, 2.0), ttft_count=(34.0, 10.0)),
        "sglang", now=12.0, prev=first)
    assert second.running == 8.0 and second.waiting == 4.0
    assert second.kv_usage == pytest.approx(0.3) and second.prefix_hit_rate == pytest.approx(0.6)
    assert second.prompt_throughput == pytest.approx(100.0)
    assert second.gen_throughput == pytest.approx(25.0)    # derived: no gauge
    assert second.ttft_recent_mean == pytest.approx(0.25)


# -- parsing robustness ------------------------------------------------------------------------------


def test_odd_but_valid_exposition():
    text = (
        "# HELP vllm:num_requests_running x\n"
        "# TYPE vllm:num_requests_running gauge\n"
        "\n"
        'vllm:num_requests_running{engine="0",model_name="a,b} c",note="say \\"hi\\", {ok}"} 2 1767000000000\r\n'
        'vllm:num_requests_running{engine="1",model_name="a,b} c"} NaN\n'
        "vllm:num_requests_waiting 4e0\n"
        'vllm:kv_cache_usage_perc{engine="0"} +Inf\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.25\n'
        'vllm:prefix_cache_hits_total{engine="0"} -Inf\n'
        "vllm:num_requests_running_extra 100\n"
        "vllm:generation_tokens_total{broken\n"
        "vllm:prompt_tokens_total{}\n"
        "vllm:prompt_tokens_total not-a-number\n"
        "# vllm:num_requests_waiting 99\n"
    )
    m = parse_engine_metrics(text, "vllm", now=0.0, model="a,b} c")
    assert m.running == 2.0            # NaN sample ignored, timestamp ignored
    assert m.waiting == 4.0            # no labels
    assert m.kv_usage == 0.25          # +Inf ignored
    assert m.prefix_hits_total is None and m.prefix_hit_rate is None
    assert m.generation_tokens_total is None and m.prompt_tokens_total is None


def test_empty_and_foreign_text():
    for text in ("", "garbage\n{}\n", vllm_text()):
        m = parse_engine_metrics(text, "sglang", now=3.0)
        assert m.scraped_at == 3.0
        assert m.running is None and m.kv_usage is None and m.gen_throughput is None


def test_unknown_engine():
    with pytest.raises(ValueError):
        parse_engine_metrics("", "trtllm", now=0.0)


@pytest.mark.parametrize("text, expected", [
    ('', {}),
    ('a="1"', {"a": "1"}),
    ('a="1",b="x,y"', {"a": "1", "b": "x,y"}),
    ('a="say \\"hi\\"",b="back\\\\slash",c="new\\nline"', {"a": 'say "hi"', "b": "back\\slash", "c": "new\nline"}),
    ('a="}",b=""', {"a": "}", "b": ""}),
    ('a="1",', {"a": "1"}),
    ('a=1', {}),
    ('a="unterminated', {}),
])
def test_parse_labels(text, expected):
    assert parse_labels(text) == expected


# -- agreement with the reference parser -------------------------------------------------------------

_FIELDS = {
    "vllm": {"running": ["vllm:num_requests_running"], "waiting": ["vllm:num_requests_waiting"],
             "kv_usage": ["vllm:kv_cache_usage_perc", "avg"], "prefix_hits_total": ["vllm:prefix_cache_hits_total"],
             "prefix_queries_total": ["vllm:prefix_cache_queries_total"],
             "prompt_tokens_total": ["vllm:prompt_tokens_total"],
             "generation_tokens_total": ["vllm:generation_tokens_total"],
             "ttft_sum": ["vllm:time_to_first_token_seconds_sum"],
             "ttft_count": ["vllm:time_to_first_token_seconds_count"]},
    "sglang": {"running": ["sglang:num_running_reqs"], "waiting": ["sglang:num_queue_reqs"],
               "kv_usage": ["sglang:token_usage", "avg"], "prefix_hit_rate": ["sglang:cache_hit_rate", "avg"],
               "gen_throughput": ["sglang:gen_throughput"], "prompt_tokens_total": ["sglang:prompt_tokens_total"],
               "generation_tokens_total": ["sglang:generation_tokens_total"],
               "ttft_sum": ["sglang:time_to_first_token_seconds_sum"],
               "ttft_count": ["sglang:time_to_first_token_seconds_count"]},
}


@pytest.mark.parametrize("engine, text", [
    ("vllm", vllm_text()),
    ("vllm", vllm_text(engines=("0", "1", "2"), kv=0.123, running=7.0, ttft_sum=0.333)),
    ("sglang", sglang_text()),
    ("sglang", sglang_text(dp_ranks=(0, 1, 2, 3), token_usage=0.07)),
])
def test_agrees_with_prometheus_client(engine, text):
    samples: dict[str, list[float]] = {}
    block_sizes = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s.value)
            if s.name == "vllm:cache_config_info":
                block_sizes.add(int(s.labels["block_size"]))
    m = parse_engine_metrics(text, engine, now=0.0)
    for field, (name, *how) in _FIELDS[engine].items():
        vals = samples[name]
        want = sum(vals) / len(vals) if how else sum(vals)
        assert math.isclose(getattr(m, field), want), field
    if engine == "vllm":
        assert {m.block_size} == block_sizes


def test_lora_requests_info_newest_series_wins():
    text = ('vllm:lora_requests_info{max_lora="4",running_lora_adapters="b",waiting_lora_adapters=""} 1.8e9\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,c",waiting_lora_adapters="d"} 1.9e9\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9\n')
    m = parse_engine_metrics(text, "vllm", 0.0)
    assert m.lora_running == {"a", "c"} and m.lora_waiting == {"d"} and m.max_lora == 4
    assert parse_engine_metrics("", "vllm", 0.0).lora_running is None


def test_capacity_the_engines_tell():
    """SGLang's running cap and KV pool; vLLM's pool from kv_cache_size_tokens when it has it."""
    sched = 'engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    text = sglang_text() + (f'sglang:max_running_requests{{cap_source="requested",{sched}}} 48\n'
                            f'sglang:max_total_num_tokens{{{sched}}} 200000\n')
    m = parse_engine_metrics(text, "sglang", now=1.0)
    assert (m.max_running, m.kv_capacity_tokens) == (48.0, 200000.0)
    assert parse_engine_metrics(sglang_text(), "sglang", now=1.0).max_running is None
    text = ('vllm:cache_config_info{block_size="16",engine="0",kv_cache_max_concurrency="2.5",'
            'kv_cache_size_tokens="10576",num_gpu_blocks="661"} 1.0\n')
    m = parse_engine_metrics(text, "vllm", now=1.0)
    assert m.kv_capacity_tokens == 10576 and m.max_running is None
    m = parse_engine_metrics(text.replace('kv_cache_size_tokens="10576",', ""), "vllm", now=1.0)
    assert m.kv_capacity_tokens == 661 * 16


def test_process_start_time_is_read_and_carried_when_absent():
    start = ("# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
             "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.76401234567e+09\n")
    m = parse_engine_metrics(vllm_text() + start, "vllm", 100.0)
    assert m.start_time == 1764012345.67
    assert parse_engine_metrics(vllm_text(), "vllm", 105.0, prev=m).start_time == 1764012345.67
    assert parse_engine_metrics(vllm_text(), "vllm", 100.0).start_time is None
    # an engine that reports it though its kind usually does not (SGLang with a process collector)
    assert parse_engine_metrics("process_start_time_seconds 12.5\n", "sglang", 1.0).start_time == 12.5
