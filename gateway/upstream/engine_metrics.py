"""Parse an engine's Prometheus ``/metrics`` text into a typed ``EngineMetrics`` snapshot.

The scraper calls this every few seconds for every engine, and an engine's exposition runs to a
thousand lines (mostly histogram buckets) of which we need about a dozen. So this is a small
hand-rolled line parser rather than a general one: a line is kept only if it starts with one of
the wanted metric names (one C-level ``str.startswith`` against a tuple), and only kept lines are
split into name, labels and value. Label sets are parsed properly (quoted values may contain
commas, ``}`` and escaped quotes) but only when a label is needed (``model_name`` filtering, the
``block_size`` label of ``vllm:cache_config_info``).

Rules:

* Several label sets for one metric (data-parallel ranks, ``is_streaming``, ...) are combined:
  counts and counters are summed; ratios (KV usage, SGLang's cache hit rate) are averaged. A
  series with a non-empty ``priority`` label is left out: it is SGLang's per-priority breakdown
  of the total it also reports under ``priority=""``.
* With ``model`` given, series whose ``model_name`` label equals it are used; if none match, all
  series are (an engine serving one model under another served name still reports something).
* ``NaN``, infinite and negative samples are ignored, as are optional timestamps and comment lines;
  so is a figure whose series sum past a double's range (its rate would be NaN, which no
  comparison is true of: a strategy reading it would pick that engine every time, or never).
* ``process_start_time_seconds`` (the engine server's start, where its registry has a process
  collector) is kept as ``start_time``: a change between scrapes is a restarted engine
  (``gateway.upstream.monitor``).
* Rates need two scrapes: with ``prev`` the token throughputs are Δcounter/Δt, the vLLM prefix
  hit rate is Δhits/Δqueries and the recent TTFT mean is Δsum/Δcount. A counter that went down
  (engine restart) is read the Prometheus way: the new value is the increase since the reset.
"""

from __future__ import annotations

import math

from gateway.endpoints import ENGINES, EngineMetrics

# field ids
_RUNNING, _WAITING, _KV, _KV_OLD, _HITS, _QUERIES, _HITS_OLD, _QUERIES_OLD = range(8)
_PROMPT, _GEN, _TTFT_SUM, _TTFT_COUNT, _CACHE_INFO, _HIT_RATE, _GEN_TP = range(8, 15)
_QUEUE_SUM, _QUEUE_COUNT, _MAX_TOKENS, _LORA_INFO, _MAX_RUNNING, _KV_TOKENS = range(15, 21)
_START = 21

# prometheus_client's process collector: the engine server's start, unix seconds. vLLM serves the
# default registry, which has it (with one API server; several share a multiprocess registry,
# which has not); SGLang's /metrics is a multiprocess registry: none
_START_NAME = "process_start_time_seconds"

_NAMES: dict[str, dict[str, int]] = {
    "vllm": {
        "vllm:num_requests_running": _RUNNING,
        "vllm:num_requests_waiting": _WAITING,
        "vllm:kv_cache_usage_perc": _KV,
        "vllm:gpu_cache_usage_perc": _KV_OLD,                 # pre-V1 name
        "vllm:prefix_cache_hits_total": _HITS,
        "vllm:prefix_cache_queries_total": _QUERIES,
        "vllm:gpu_prefix_cache_hits_total": _HITS_OLD,        # early V1 name
        "vllm:gpu_prefix_cache_queries_total": _QUERIES_OLD,
        "vllm:prompt_tokens_total": _PROMPT,
        "vllm:generation_tokens_total": _GEN,
        "vllm:time_to_first_token_seconds_sum": _TTFT_SUM,
        "vllm:time_to_first_token_seconds_count": _TTFT_COUNT,
        "vllm:cache_config_info": _CACHE_INFO,
        "vllm:lora_requests_info": _LORA_INFO,
        "vllm:request_queue_time_seconds_sum": _QUEUE_SUM,
        "vllm:request_queue_time_seconds_count": _QUEUE_COUNT,
        _START_NAME: _START,
    },
    "sglang": {
        "sglang:num_running_reqs": _RUNNING,
        "sglang:num_queue_reqs": _WAITING,
        "sglang:token_usage": _KV,
        "sglang:cache_hit_rate": _HIT_RATE,
        "sglang:gen_throughput": _GEN_TP,
        "sglang:prompt_tokens_total": _PROMPT,
        "sglang:generation_tokens_total": _GEN,
        "sglang:time_to_first_token_seconds_sum": _TTFT_SUM,
        "sglang:time_to_first_token_seconds_count": _TTFT_COUNT,
        "sglang:queue_time_seconds_sum": _QUEUE_SUM,
        "sglang:queue_time_seconds_count": _QUEUE_COUNT,
        "sglang:max_total_num_tokens": _MAX_TOKENS,
        "sglang:max_running_requests": _MAX_RUNNING,
        _START_NAME: _START,
    },
}
_PREFIXES = {engine: tuple(names) for engine, names in _NAMES.items()}
_AVERAGED = frozenset((_KV, _KV_OLD, _HIT_RATE))
# The KV pool size is per data-parallel rank: ranks are summed like counts. vLLM reports it as
# labels of cache_config_info (kv_cache_size_tokens since it has it, else num_gpu_blocks x
# block_size), SGLang as a gauge. SGLang also tells its running-requests cap
# (sglang:max_running_requests, per rank: summed); vLLM does not export max_num_seqs.


def parse_labels(s: str) -> dict[str, str]:
    """Parse the inside of ``{...}``: ``a="x",b="y, \\"z\\""``. Unparseable input ends the parse
    (what was read so far is returned); it never raises."""
    labels: dict[str, str] = {}
    i, n = 0, len(s)
    while i < n:
        while i < n and s[i] in " ,\t":
            i += 1
        eq = s.find("=", i)
        if eq < 0:
            break
        name = s[i:eq].strip()
        q = eq + 1
        while q < n and s[q] == " ":
            q += 1
        if q >= n or s[q] != '"':
            break
        q += 1
        close = s.find('"', q)
        if close < 0:
            break
        if s.find("\\", q, close) < 0:         # fast path: no escapes before the closing quote
            labels[name] = s[q:close]
            i = close + 1
            continue
        out = []
        while q < n:
            c = s[q]
            if c == "\\" and q + 1 < n:
                nxt = s[q + 1]
                out.append("\n" if nxt == "n" else nxt)
                q += 2
            elif c == '"':
                break
            else:
                out.append(c)
                q += 1
        labels[name] = "".join(out)
        i = q + 1
    return labels


def _split_sample(line: str, name_len: int) -> tuple[str, str] | None:
    """``(labels_text, value_text)`` of a sample line whose metric name is ``line[:name_len]``."""
    if line[name_len] == "{":
        # the label block ends at the first '}' outside a quoted value
        i, n = name_len + 1, len(line)
        in_q = False
        while i < n:
            c = line[i]
            if in_q:
                if c == "\\":
                    i += 1
                elif c == '"':
                    in_q = False
            elif c == '"':
                in_q = True
            elif c == "}":
                break
            i += 1
        else:
            return None
        labels, rest = line[name_len + 1:i], line[i + 1:]
    else:
        labels, rest = "", line[name_len:]
    parts = rest.split()
    if not parts:
        return None
    return labels, parts[0]


def _adapters(labels: dict[str, str], name: str) -> frozenset[str]:
    return frozenset(a for a in labels.get(name, "").split(",") if a)


def _total_series(label_text: str) -> bool:
    """Whether a series labelled ``priority`` is a total: with ``--enable-priority-scheduling``
    SGLang reports running and queued requests under ``priority=""`` (the total) and again under
    ``priority="<n>"`` for each priority (``_log_gauge_queue_count``); summing both counted each
    request twice."""
    return parse_labels(label_text).get("priority", "") == ""


def _scan(text: str, engine: str, model: str | None) -> tuple[dict[int, list[float]], int | None, float | None,
                                                               tuple[float, dict[str, str]] | None]:
    names = _NAMES[engine]
    prefixes = _PREFIXES[engine]
    all_values: dict[int, list[float]] = {}
    matching: dict[int, list[float]] = {}    # only series whose model_name == model
    block_size: int | None = None
    gpu_blocks: float | None = None          # summed over cache_config_info series (one per rank)
    kv_tokens: float | None = None           # cache_config_info's kv_cache_size_tokens, summed likewise
    # vLLM sets lora_requests_info to the time of its stats log, a new label set each time the
    # adapters change (old series linger): the newest series is the one with the largest value
    lora: tuple[float, dict[str, str]] | None = None
    # a plain-text probe for the common case; names needing escapes always take the exact parse
    plain = model is not None and not any(c in model for c in '"\\\n')
    want_model = f'model_name="{model}"' if plain else None
    for line in text.split("\n"):
        if not line.startswith(prefixes):
            continue
        end = len(line)
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0:
            end = brace
        if 0 <= space < end:
            end = space
        field = names.get(line[:end].rstrip("\r"))
        if field is None or end >= len(line):
            continue
        split = _split_sample(line, end)
        if split is None:
            continue
        label_text, value_text = split
        if field == _CACHE_INFO:
            info = parse_labels(label_text)
            bs = info.get("block_size")
            if bs is not None and bs.isdigit():
                block_size = int(bs)
            nb = info.get("num_gpu_blocks")
            if nb is not None and nb.isdigit():
                gpu_blocks = (gpu_blocks or 0.0) + int(nb)
            kt = info.get("kv_cache_size_tokens")
            if kt is not None and kt.isdigit():
                kv_tokens = (kv_tokens or 0.0) + int(kt)
            continue
        if field == _LORA_INFO:
            try:
                stamp = float(value_text)
            except ValueError:
                continue
            if math.isfinite(stamp) and (lora is None or stamp >= lora[0]):
                lora = (stamp, parse_labels(label_text))
            continue
        if 'priority="' in label_text and not _total_series(label_text):
            continue                 # SGLang's per-priority breakdown of a total it also reports
        try:
            value = float(value_text)
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:    # every figure read here is a count, a ratio or a
            continue                                 # counter: a negative one is broken, left out
        all_values.setdefault(field, []).append(value)
        if model is not None and "model_name=" in label_text:
            # cheap check first; the exact parse handles escapes and look-alike labels
            if want_model is None or want_model in label_text:
                if parse_labels(label_text).get("model_name") == model:
                    matching.setdefault(field, []).append(value)
    # The model filter applies per metric: a metric with series of that model uses only those;
    # a metric with none (other served name, no model_name label) is used whole.
    all_values.update(matching)
    if kv_tokens is not None:                # group-aware: right for hybrid models too
        all_values[_KV_TOKENS] = [kv_tokens]
    return all_values, block_size, gpu_blocks, lora


def _combine(values: dict[int, list[float]], field: int) -> float | None:
    vals = values.get(field)
    if not vals:
        return None
    total = sum(vals)
    if total == math.inf:           # finite samples that sum past a double's range: as an infinite one
        return None
    return total / len(vals) if field in _AVERAGED else total


def _increase(cur: float | None, old: float | None) -> float | None:
    """Counter increase between two scrapes; a decrease means a reset (count from zero)."""
    if cur is None or old is None:
        return None
    d = cur - old
    return cur if d < 0 else d


def parse_engine_metrics(text: str, engine: str, now: float, prev: EngineMetrics | None = None,
                         model: str | None = None) -> EngineMetrics:
    """Build the snapshot for one scrape of ``engine`` ("vllm" or "sglang") taken at ``now``
    (monotonic seconds). ``prev`` is the previous snapshot of the same endpoint, for rates."""
    if engine not in _NAMES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    values, block_size, gpu_blocks, lora = _scan(text, engine, model)
    get = values.get

    m = EngineMetrics(scraped_at=now)
    m.running = _combine(values, _RUNNING)
    m.waiting = _combine(values, _WAITING)
    m.kv_usage = _combine(values, _KV)
    if m.kv_usage is None:
        m.kv_usage = _combine(values, _KV_OLD)
    m.prompt_tokens_total = _combine(values, _PROMPT)
    m.generation_tokens_total = _combine(values, _GEN)
    m.ttft_sum = _combine(values, _TTFT_SUM)
    m.ttft_count = _combine(values, _TTFT_COUNT)
    m.block_size = block_size if block_size is not None else (prev.block_size if prev else None)
    starts = values.get(_START)
    # the newest of several (there is one): a restart makes every one newer. Carried over when a
    # scrape lacks it, so the next one that has it is compared with the last known
    m.start_time = max(starts) if starts else (prev.start_time if prev is not None else None)
    m.queue_time_sum = _combine(values, _QUEUE_SUM)
    m.queue_time_count = _combine(values, _QUEUE_COUNT)
    if lora is not None:
        labels = lora[1]
        m.lora_running = _adapters(labels, "running_lora_adapters")
        m.lora_waiting = _adapters(labels, "waiting_lora_adapters")
        slots = labels.get("max_lora", "")
        m.max_lora = int(slots) if slots.isdigit() else None
    if engine == "vllm":
        m.kv_capacity_tokens = _combine(values, _KV_TOKENS)
        if m.kv_capacity_tokens is None and gpu_blocks is not None and block_size is not None:
            m.kv_capacity_tokens = gpu_blocks * block_size
    else:
        m.kv_capacity_tokens = _combine(values, _MAX_TOKENS)
        m.max_running = _combine(values, _MAX_RUNNING)
    if m.kv_capacity_tokens is None and prev is not None:
        m.kv_capacity_tokens = prev.kv_capacity_tokens

    # prefix cache hit rate
    if engine == "vllm":
        hits = _combine(values, _HITS) if get(_HITS) else _combine(values, _HITS_OLD)
        queries = _combine(values, _QUERIES) if get(_QUERIES) else _combine(values, _QUERIES_OLD)
        m.prefix_hits_total, m.prefix_queries_total = hits, queries
        if hits is not None and queries is not None:
            rate = None
            if (prev is not None and prev.prefix_queries_total is not None
                    and prev.prefix_hits_total is not None and queries > prev.prefix_queries_total
                    and hits >= prev.prefix_hits_total):
                rate = (hits - prev.prefix_hits_total) / (queries - prev.prefix_queries_total)
            elif queries > 0:
                rate = hits / queries
            if rate is not None:
                m.prefix_hit_rate = min(1.0, max(0.0, rate))
    else:
        m.prefix_hit_rate = _combine(values, _HIT_RATE)

    # throughputs
    dt = now - prev.scraped_at if prev is not None else 0.0
    if prev is not None and dt > 0:
        d = _increase(m.prompt_tokens_total, prev.prompt_tokens_total)
        if d is not None:
            m.prompt_throughput = d / dt
        d = _increase(m.generation_tokens_total, prev.generation_tokens_total)
        if d is not None:
            m.gen_throughput = d / dt
    gauge = _combine(values, _GEN_TP)
    if gauge is not None:
        m.gen_throughput = gauge

    # recent TTFT and queue-time means: over the last scrape interval, else carried over
    if prev is not None:
        m.ttft_recent_mean = _recent_mean(m.ttft_sum, m.ttft_count, prev.ttft_sum, prev.ttft_count,
                                          prev.ttft_recent_mean)
        m.queue_time_recent_mean = _recent_mean(m.queue_time_sum, m.queue_time_count, prev.queue_time_sum,
                                                prev.queue_time_count, prev.queue_time_recent_mean)
    return m


def _recent_mean(s: float | None, c: float | None, ps: float | None, pc: float | None,
                 carried: float | None) -> float | None:
    """Mean of a histogram's observations between two scrapes (Δsum/Δcount); ``carried`` when
    nothing was observed in between. A series absent from the previous scrape counts from zero
    (labelled histograms appear with their first observation)."""
    if c is None or s is None:
        return carried
    if pc is None or ps is None:
        pc = ps = 0.0
    dc, ds = (c, s) if c < pc else (c - pc, s - ps)      # c < pc: the engine restarted
    return ds / dc if dc > 0 else carried
