"""One exposition out of several workers' (``--workers N``): ``/metrics`` shows the whole gateway.

Each worker renders its own registry; the one answering a scrape reads its siblings' texts
(gateway/server/siblings.py) and merges them here, sample by sample, by name and identical label
set (pure; no I/O):

- counters, and histograms' ``_bucket``/``_sum``/``_count``: summed, so ``rate()`` and
  ``histogram_quantile()`` read the gateway's traffic (the event-loop lag histogram too: its
  buckets then count every worker's late timers);
- gauges: summed when they count something the workers hold each their own of (in-flight
  requests, connections, queued requests, tasks, memory, file descriptors). Those that are the same
  fact seen by every worker are not: a worker's view of an endpoint or an engine (readiness, the
  engine's own figures, a breaker's state, an index's size) takes the largest value, and what is
  healthy only when every worker's is (the shared state reachable, the last reload applied, the
  config generation, the freshest engine scrape's age, a start time, ``_created``) the smallest.
  ``GAUGE_RULES`` names every gauge that is not summed; a new gauge that is not additive belongs there;
  a sum is capped where one worker's value is (``CAPS``: an endpoint's admission headroom, 1e6);
- counters of an event of something the workers share, which every worker meets and counts (the
  shared state becoming unreachable or refusing writes, the view's Redis stream lost, a reload
  the parent sent to every worker, an endpoint's breaker ejecting it, one worker deciding and the
  others adopting it): the largest, so one outage or ejection counts once (``COUNTER_RULES``); the
  largest of what each worker's index counted, its restarted workers' counts added up
  (``merge_chains``).

No label is added: the series keep the names and labels one process exports, so dashboards and
alert rules read them unchanged. A series only some workers export (a model one of them has not
served yet) is the sum over those that do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

MAX, MIN, SUM = "max", "min", "sum"
OPENMETRICS = "application/openmetrics-text"      # the media type of an OpenMetrics page

# gauges that are not summed over workers (the rest are)
GAUGE_RULES: dict[str, str] = {
    # an endpoint or an engine as each worker sees it: the same thing N times
    "switchyard_endpoint_ready": MAX,
    "switchyard_endpoint_info": MAX,
    "switchyard_endpoint_fleet_in_flight": MAX,
    "switchyard_endpoint_admission_capacity": MAX,
    "switchyard_engine_running_requests": MAX,
    "switchyard_engine_waiting_requests": MAX,
    "switchyard_engine_kv_cache_usage_ratio": MAX,
    "switchyard_engine_prefix_cache_hit_ratio": MAX,
    "switchyard_engine_generation_tokens_per_second": MAX,
    "switchyard_engine_metrics_age_seconds": MIN,
    "switchyard_breaker_state": MAX,
    "switchyard_lora_adapter_endpoints": MAX,
    "switchyard_kv_events_index_blocks": MAX,
    "switchyard_kv_events_endpoint_live": MAX,
    "switchyard_prefix_index_blocks": MAX,
    "switchyard_prefix_index_capacity": MAX,
    "switchyard_prefix_index_entries": MAX,
    "switchyard_session_map_entries": MAX,      # each worker holds the whole map (the shared view)
    "switchyard_kubernetes_pods": MAX,
    "switchyard_kubernetes_pods_skipped": MAX,
    # the batch job store as the worker that runs batches sees it (the others export none)
    "switchyard_batches": MAX,
    "switchyard_batch_queue_age_seconds": MAX,
    "switchyard_batch_stored_bytes": MAX,
    # healthy only if every worker is
    "switchyard_state_up": MIN,
    "switchyard_view_redis_up": MIN,
    "switchyard_view_peers": MAX,
    "switchyard_view_lag_recent_seconds": MAX,
    "switchyard_config_last_reload_successful": MIN,
    "switchyard_config_generation": MIN,
    "switchyard_kubernetes_last_sync_timestamp_seconds": MIN,   # the worker that heard from the API the longest ago
    "switchyard_kv_events_fast_tokenizer": MIN,      # 1 only while every worker encodes with tiktoken
    "switchyard_admin_token_refused": MAX,            # 1 while any worker refuses the admin token
    # admission gives each worker its share of an endpoint's room: saturated for the gateway only when
    # no worker has any left (as the summed headroom is 0)
    "switchyard_endpoint_saturated": MIN,
    # the processes
    "process_start_time_seconds": MIN,
    "process_max_fds": MAX,
}


# counters that are not summed over workers (the rest are): each worker counts, on its own connection,
# an event of something they all share, so the sum would count one event once per worker
COUNTER_RULES: dict[str, str] = {
    "switchyard_state_outages": MAX,        # the shared state became unreachable or refused writes
    "switchyard_state_heartbeat_lost": MAX,  # the shared state lost the heartbeats (a restart, a flush)
    "switchyard_view_redis_lost": MAX,      # the routing view's Redis stream was lost
    "switchyard_directory_notices": MAX,    # a directory change every worker reads and applies to its mirror
    "switchyard_config_reload": MAX,        # a reload: the parent signals every worker, each applies it
    "switchyard_config_reload_deferred": MAX,   # the parent's, which reads the file for every worker
    # an endpoint's breaker moved: the worker that decided tells its siblings, which adopt the same
    # ejection or close (gateway/resilience/breaker.py), and each ejection ends on the same timer
    "switchyard_breaker_transitions": MAX,
    # each worker's copy of the session map (the shared view) pushes out the same entries
    "switchyard_session_map_evictions": MAX,
}


# summed gauges whose sum is capped as each worker's value is
CAPS: dict[str, float] = {
    "switchyard_endpoint_admission_headroom": 1e6,     # an endpoint nothing bounds: 1e6, not 1e6 per worker
}


def gauge_rule(name: str) -> str:
    if name.endswith("_created"):        # when a series started: the earliest worker's
        return MIN
    return GAUGE_RULES.get(name, SUM)


def _sum(values: list[float], upward: bool) -> float:
    """The values' sum rounded once (``math.fsum``): the same whatever the order or grouping of the
    parts, so a sum of parts that did not fall does not fall either (an answer that added a+b where
    the one before added b+a could be an ulp lower, and Prometheus reads any fall as a reset).
    ``upward``: never below the exact sum (what a restarted worker carries stands for several
    parts added later to others, and must not come out below them)."""
    if len(values) == 1:
        return values[0]
    try:
        total = math.fsum(values)
    except (OverflowError, ValueError):
        return sum(values)
    if upward and math.isfinite(total) and Fraction(total) < sum(map(Fraction, values)):
        total = math.nextafter(total, math.inf)
    return total


def _combine(rule: str, values: list[float], upward: bool) -> float:
    if rule == SUM:
        return _sum(values, upward)
    return max(values) if rule == MAX else min(values)


COUNTED = ("counter", "histogram", "summary")


def parse(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text))


def counts_only(families: Iterable[Metric]) -> list[Metric]:
    """The counters, histograms and summaries (what a process counted, not what it held), with when
    each of their series started: the ``X_created`` gauge families the text format gives them
    beside ``X`` (merged as the smallest, so a series a dead worker started first keeps its start;
    OpenMetrics reads a later ``_created`` as a counter reset)."""
    families = list(families)
    counted = {fam.name for fam in families if fam.type in COUNTED}
    return [fam for fam in families
            if fam.type in COUNTED or (fam.name.endswith("_created") and fam.name[:-len("_created")] in counted)]


def endpoints_of(families: Iterable[Metric]) -> set[tuple[str, str]]:
    """The (model, endpoint) of every sample labelled with both."""
    return {(s.labels["model"], s.labels["endpoint"]) for fam in families for s in fam.samples
            if "endpoint" in s.labels and "model" in s.labels}


def without_endpoints(families: Iterable[Metric], keep: set[tuple[str, str]]) -> list[Metric]:
    """``families`` without the counters', histograms' and summaries' samples (and their
    ``_created``) labelled with a (model, endpoint) not in ``keep`` (gauges are left as they are)."""
    out = []
    for fam in families:
        if fam.type not in COUNTED and not fam.name.endswith("_created"):
            out.append(fam)
            continue
        samples = [s for s in fam.samples if "endpoint" not in s.labels or "model" not in s.labels
                   or (s.labels["model"], s.labels["endpoint"]) in keep]
        if len(samples) == len(fam.samples):
            out.append(fam)
        elif samples:
            kept = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            kept.samples = samples
            out.append(kept)
    return out


def merge(parts: Iterable[str | list[Metric]], upward: bool = False,
          counter_rules: dict[str, str] = COUNTER_RULES) -> list[Metric]:
    """The families of several expositions (texts, or their families parsed) merged as the module
    docstring says, in the order they first appear (a family's samples in the order their series
    first appear). ``upward``: sums never below the exact sum (``_sum``). ``counter_rules``: the
    counters not summed (none, for the parts of one worker's index: ``merge_chains``)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, list]] = {}          # family → series key → [Sample, rule, values]
    for part in parts:
        for fam in (text_string_to_metric_families(part) if isinstance(part, str) else part):
            have = families.get(fam.name)
            if have is None:
                have = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                values[fam.name] = {}
            if fam.type == "gauge":
                rule = gauge_rule(fam.name)
            elif fam.type == "counter":
                rule = counter_rules.get(fam.name, SUM)
            else:
                rule = SUM if fam.type in (*COUNTED, "gaugehistogram") else MAX
            series = values[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                rule_s = MIN if s.name.endswith("_created") else rule
                got = series.get(key)
                if got is None:
                    series[key] = [s, rule_s, [s.value]]
                else:
                    got[2].append(s.value)
    out = []
    for name, fam in families.items():
        fam.samples = [Sample(s.name, s.labels, _combine(rule, vs, upward)) for s, rule, vs in values[name].values()]
        cap = CAPS.get(name)
        if cap is not None:
            fam.samples = [s._replace(value=min(cap, s.value)) if not s.name.endswith("_created") else s
                           for s in fam.samples]
        out.append(fam)
    return out


def merge_chains(chains: Iterable[list[str | list[Metric]]],
                 counter_rules: dict[str, str] = COUNTER_RULES) -> list[Metric]:
    """``merge`` of the workers' parts, each worker's given as a chain: its own exposition, then what
    it carries of its index's earlier workers (gateway/server/siblings.py). A counter of
    ``counter_rules`` is the largest of the chains' counts, each chain's added up over its workers
    (what that index counted since the gateway started); taken as the largest of all the parts, an
    event counted after every index's worker had been restarted was lost under the predecessors'
    counts. The rest is merged as ``merge`` does, part by part (summed)."""
    chains = [list(c) for c in chains]
    parts = [[parse(p) if isinstance(p, str) else p for p in chain] for chain in chains]
    families = merge([p for chain in parts for p in chain], counter_rules=counter_rules)
    ruled = [[[fam for fam in p if fam.type == "counter" and fam.name in counter_rules] for p in chain]
             for chain in parts]
    if not any(fams for chain in ruled for fams in chain):
        return families
    largest = {fam.name: fam for fam in merge([merge(chain, upward=True, counter_rules={}) for chain in ruled])}
    return [largest.get(fam.name, fam) if fam.name in counter_rules else fam for fam in families]


def counter_rules(shared_breakers: bool) -> dict[str, str]:
    """``COUNTER_RULES`` for a gateway whose workers share their breakers' ejections (the routing
    view's local bus, ``view.workers``), or not: then each worker's ejections are its own, decided
    on its own faults at moments of its own, and their counts are added up like any other's."""
    if shared_breakers:
        return COUNTER_RULES
    return {name: rule for name, rule in COUNTER_RULES.items() if name != "switchyard_breaker_transitions"}


class _Families:
    """What ``generate_latest`` reads: a registry that yields fixed families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(families: list[Metric], encoder: Callable[[Any], bytes] = generate_latest) -> bytes:
    """Prometheus text format, as one process's ``/metrics`` is (HELP and TYPE once per family); or
    what ``encoder`` writes (one of ``choose_encoder``'s: OpenMetrics, from ``openmetrics(families)``)."""
    return encoder(_Families(families))


def openmetrics(families: list[Metric]) -> list[Metric]:
    """The families of a text exposition (as ``parse`` reads them) as OpenMetrics has them: a
    counter's, a histogram's or a summary's ``_created`` samples in that family, each after its
    series' other samples, where the text format gives them a gauge family of their own (``X_created``
    beside ``X``, which OpenMetrics refuses as a clash of names); and each family's samples grouped
    by series (a histogram's buckets, ``_count``, ``_sum`` and ``_created`` together), which
    OpenMetrics requires. What prometheus_client's OpenMetrics encoder then writes of them is what it
    writes of the registry that made the text."""
    by_name = {fam.name: fam for fam in families}
    created: dict[str, Metric] = {}
    for fam in families:
        parent = by_name.get(fam.name[:-len("_created")]) if fam.name.endswith("_created") else None
        if fam.type == "gauge" and parent is not None and parent.type in COUNTED:
            created[parent.name] = fam
    out = []
    for fam in families:
        if created.get(fam.name[:-len("_created")]) is fam:
            continue                        # folded into its family
        extra = created.get(fam.name)
        if extra is None and fam.type not in ("histogram", "summary"):
            out.append(fam)
            continue
        groups: dict[tuple, list[Sample]] = {}
        for s in (*fam.samples, *(extra.samples if extra is not None else ())):
            labels = s.labels if fam.type != "histogram" else {k: v for k, v in s.labels.items() if k != "le"}
            if fam.type == "summary":
                labels = {k: v for k, v in labels.items() if k != "quantile"}
            groups.setdefault(tuple(sorted(labels.items())), []).append(s)
        whole = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        whole.samples = [s for group in groups.values() for s in group]
        out.append(whole)
    return out


def merge_texts(texts: Iterable[str | list[Metric]]) -> bytes:
    return render(merge(texts))
