"""The routing benchmark's reachable-hit oracle (an infinite cache shared by the fleet)."""

from __future__ import annotations

from bench.routing import Sample, Workload, reachable_hit
from enginesim.tiny_tokenizer import TINY_DIR
from gateway.kv.tokenization import ModelTokenizer

SYSTEM = {"role": "system", "content": "You are assistant 3. " + "kqz lo abc the of " * 40}


def _sample(sent: float, ttft: float, messages: list[dict]) -> Sample:
    return Sample(sent=sent, ttft=ttft, e2e=ttft, status=200, messages=messages)


def test_reachable_counts_prefixes_prefilled_before_the_request():
    tok = ModelTokenizer(TINY_DIR)
    first = [SYSTEM, {"role": "user", "content": "question one"}]
    second = [SYSTEM, {"role": "user", "content": "question two"}]
    unique = [{"role": "user", "content": "something else entirely " * 20}]
    a, b, u = (tok.encode(tok.render(m)) for m in (first, second, unique))
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) // 16 * 16
    full_b = 16 * ((len(b) - 1) // 16)              # never the last token
    samples = [_sample(0.0, 0.5, first),
               _sample(0.1, 0.5, second),           # sent while the first was still prefilling
               _sample(1.0, 0.5, second),           # both done by now
               _sample(1.2, 0.5, unique)]
    reach, sent_before = reachable_hit(samples, Workload(warmup_s=0.0, duration_s=100.0), 16)
    total = len(a) + 2 * len(b) + len(u)
    assert reach == full_b / total
    assert sent_before == (common + full_b) / total


def test_only_measured_requests_count_but_all_feed_the_cache():
    w = Workload(warmup_s=1.0, duration_s=100.0)
    first = [SYSTEM, {"role": "user", "content": "question one"}]
    assert reachable_hit([_sample(0.0, 0.1, first)], w, 16) == (0.0, 0.0)
    reach, _ = reachable_hit([_sample(0.0, 0.1, first), _sample(2.0, 0.1, first)], w, 16)
    n = len(ModelTokenizer(TINY_DIR).encode(ModelTokenizer(TINY_DIR).render(first)))
    assert reach == 16 * ((n - 1) // 16) / n


def test_fallback_counters_are_summed_over_the_replicas():
    from bench.routing import fallbacks

    page = ('# HELP switchyard_routing_fallbacks_total ...\n'
            'switchyard_routing_fallbacks_total{reason="no_match",strategy="prefix-cache"} 3.0\n'
            'switchyard_kv_events_fallbacks_total{model="m",reason="no_events"} 2.0\n'
            'switchyard_routing_fallbacks_created{reason="no_match",strategy="prefix-cache"} 1.7e9\n')
    other = 'switchyard_routing_fallbacks_total{reason="no_match",strategy="prefix-cache"} 4.0\n'
    assert fallbacks([page, other]) == ['reason="no_match",strategy="prefix-cache"} 7',
                                        'model="m",reason="no_events"} 2']


def test_the_process_config_file_reads_back_as_the_in_process_config():
    import json

    from bench.routing import GatewayProcesses, gateway_config
    from gateway.config.schema import config_from_dict, parse_config

    raw = gateway_config("prefix-cache", True, ["http://127.0.1.1:8000", "http://127.0.1.2:8000"], str(TINY_DIR),
                         {"prefix_std_factor": 2})
    in_process = config_from_dict(raw, source="<bench>")
    from_file = parse_config(json.dumps(GatewayProcesses(raw, 1).raw), source="<file>")
    assert from_file.models == in_process.models and from_file.routing == in_process.routing
    assert from_file.models[0].kv_events.enabled and from_file.server.drain_delay_s == 0
    assert (from_file.scrape, from_file.health, from_file.server.log_level) == \
        (in_process.scrape, in_process.health, "warning")


def test_the_default_workload_is_unchanged_and_chat_bpe_is_about_400_requests():
    from bench.routing import WORKLOADS, make_schedule

    assert WORKLOADS["default"] == Workload()
    w = WORKLOADS["chat-bpe"]
    sched = make_schedule(w)
    n = sum(len(c.questions) for c in sched.conversations) + len(sched.singles)
    assert w.engines == 4 and 380 <= n <= 480
    assert len({c.system for c in sched.conversations}) == w.system_prompts
    assert make_schedule(w).systems == sched.systems                 # seeded


def test_the_chat_bpe_tokenizer_keys_chats_as_the_simulated_engine_tokenizes_them(tmp_path):
    import random

    from bench.chat_bpe import VOCAB_SIZE, TextSource, build
    from enginesim.hf_tokenizer import HFTokenizer

    d = build(tmp_path / "tok")
    tok, sim = ModelTokenizer(d), HFTokenizer(d)
    assert tok.tokenizer.get_vocab_size() == VOCAB_SIZE and not tok._whole
    text = TextSource(random.Random(3))
    messages = [{"role": "system", "content": text.text(300)}]
    for _ in range(3):
        messages += [{"role": "user", "content": text.text(40)}, {"role": "assistant", "content": " " + text.text(12)}]
        rendered = tok.render(messages)
        assert tok.encode(rendered) == tok.tokenizer.encode(rendered, add_special_tokens=False).ids \
            == sim.encode_chat(messages)
    ids = tok.encode(rendered)
    assert 3.5 < len(rendered) / len(ids) < 5.0          # characters a token, as English on Llama-3


def test_a_label_carries_its_own_routing_and_kv_events_keys():
    from bench.routing import split_label

    assert split_label("prefix-cache") == ("prefix-cache", False, {}, {})
    assert split_label("prefix-cache+events@prefix_min_match_tokens=0,tokenize_inline_chars=256") == \
        ("prefix-cache", True, {"prefix_min_match_tokens": 0}, {"tokenize_inline_chars": 256})


def test_every_workload_parses(capsys):
    import pytest

    from bench.routing import main

    for argv in (["--help"], ["--workload", "chat-bpe", "--help"], ["--workload", "slo", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0, argv
    assert "chat-bpe" in capsys.readouterr().out


def test_the_views_lag_is_read_per_source_from_the_gateways_pages():
    from bench.routing import view_lag
    page = ('switchyard_view_lag_seconds_sum{source="replica"} 0.5\n'
            'switchyard_view_lag_seconds_count{source="replica"} 100.0\n'
            'switchyard_view_lag_seconds_bucket{le="0.001",source="replica"} 40.0\n'
            'switchyard_view_lag_recent_seconds{percentile="50",source="replica"} 0.002\n'
            'switchyard_view_lag_recent_seconds{percentile="99",source="replica"} 0.009\n'
            'switchyard_view_lag_seconds_count{source="worker"} 0.0\n')
    lag = view_lag([page, page])
    assert list(lag) == ["replica"]                     # a source with no batch is left out
    assert lag["replica"]["count"] == 200 and lag["replica"]["sum"] == 1.0
    assert lag["replica"]["p50"] == [0.002, 0.002] and lag["replica"]["p99"] == [0.009, 0.009]


def test_each_strategys_engines_tokenize_with_an_empty_segment_cache():
    """Simulators in one process share a tokenizer per directory, and with it a cache of tokenized
    prompt segments: without emptying it, the first strategy's engines tokenized every prompt while
    the later ones found them cached, CPU that slowed the first run alone."""
    from enginesim.hf_tokenizer import forget_segments, load

    sim = load(TINY_DIR)
    assert load(TINY_DIR) is sim                      # shared by the engines of a process
    ids = sim.encode_chat([SYSTEM, {"role": "user", "content": "question one"}])
    assert sim._cache
    forget_segments()
    assert not sim._cache and sim._cached_chars == 0
    assert sim.encode_chat([SYSTEM, {"role": "user", "content": "question one"}]) == ids


async def test_engines_cache_their_answers_with_the_flag():
    """``--engines-cache-output``: the benchmark's engines cache the blocks their answers fill."""
    from dataclasses import replace

    from bench.routing import EngineModel, start_engines

    w = Workload(engines=1)
    for em, want in ((EngineModel(), False), (replace(EngineModel(), cache_output_blocks=True), True)):
        sims = await start_engines(w, em, False, str(TINY_DIR))
        try:
            assert sims[0].engine.cfg.cache_output_blocks is want
        finally:
            for s in sims:
                await s.close()
