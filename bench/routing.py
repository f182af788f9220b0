"""Routing quality: ``python -m bench.routing [--quick] [--strategies ...] [--seed N]``.

(``--workload slo``: latency objectives met per strategy, on engines of different speeds:
``bench/routing_slo.py``.)

How much faster does each strategy make a fleet of engines than a plain load balancer? One
process, one event loop: ``--engines`` simulated vLLM engines (``enginesim``, in-process, with a
bounded KV pool and prefix caching), the real gateway in front of them on loopback, and an
open-loop load generator that measures TTFT at the client (request sent → first chunk carrying
generated text). Every strategy gets fresh engines (cold KV caches, their tokenizers' segment
caches emptied), the same seeded arrival schedule and the same prompts.

``--gateway-process`` runs the gateway as users run it, in its own process (``python -m gateway
--config FILE --port P``; ``--replicas N``: N processes), so the CPU it spends (tokenizing for
KV-event routing, say) no longer delays the simulated engines' timers and the load generator, which
stay in the benchmark's process. Its config is the one the in-process run builds, written to a
temporary file, plus ``drain_delay_s: 0`` so a SIGTERM stops it at once. ``--workers N`` starts each
process with ``--workers N`` (its workers share one routing view over the local bus), ``--redis URL``
sets ``state.redis_url`` (the replicas share the view and their in-flight counts through Redis):
``--workers 2`` and ``--replicas 2 --redis URL`` against one worker show what sharing the view keeps. The benchmark waits until
each process answers ``/ready`` and its ``/metrics`` shows every engine ready; with KV events, in
both modes, until every engine's PUB socket has seen one subscriber per gateway finish its
handshake (a ZMQ socket monitor on the engine's side). What the in-process run reads off the
gateway's objects comes from outside: the imbalance column counts at the engines (each one's live
requests, staged + waiting + running, sampled every 100 ms) instead of the gateway's per-endpoint
in-flight count, which leaves out the time a request spends in the gateway before and after the
engine has it; the fallback counters are scraped from each process's ``/metrics`` at the end (in
both modes summed over the replicas); the replicas' "load seen by replica 1" line is not printed
(it reads a replica's endpoint objects). The processes are stopped with SIGTERM, SIGKILL after
10 s, whatever ended the run; ``loop lag`` stays the benchmark process's.

Workload (defaults; ``--quick`` shortens the run, not the shape):

* conversations arrive as a Poisson process; each picks one of ``system_prompts`` long system
  prompts by a Zipf popularity, lasts 2–6 turns, and waits an exponential think time after each
  answer before its next turn (whose prompt is the whole conversation so far, answers included);
* a share of single-turn requests with unique prompts (no reusable prefix) arrives on its own
  Poisson process;
* one engine's KV pool holds under a third of the system prompts and the fleet's pools about a
  fifth of the distinct prompt text of a run, so an engine keeps a prefix only if it keeps seeing it.

The engines' latency model makes prefill dominate TTFT (``prefill_ms_per_token`` per uncached
prompt token, like a GPU prefilling ~10k tokens/s), so a cache hit matters; ``max_num_seqs`` caps
each engine's concurrency (the rest queue), so load matters too; decode slows a little with the
batch size. The sims only sleep: their time model does not depend on the CPU.

Per strategy: mean, p50 and p99 TTFT of the requests sent after the warm-up, completed requests
and output tokens per second, the engines' prefix-cache hit rate (cached / prompt tokens, from the
usage they report) beside the *reachable* hit rate (``reachable_hit``: an infinite cache shared by
the fleet, over the same requests; unique prompts and first turns are misses for any strategy),
and load imbalance: the gateway's in-flight count per engine (``--gateway-process``: the engine's
own count) sampled every 100 ms, averaged over time per engine, max over mean (1.0 = perfectly
even; ``peak`` is the mean of the per-sample max/mean). ``loop lag`` is how late the 100 ms sampler
woke up on average: if it grows, the process is CPU-bound and the TTFTs include the load
generator's own delay. The report's footer says which mode ran.

The engines publish KV events in every run (``--engines-publish always``), whatever the strategy:
a fleet configured for events publishes them whatever the gateway routes by, and publishing costs
the simulated engines CPU in the benchmark's process (their timers and the load generator share
its loop), so only the same engines under every strategy compare the routing alone.
``--engines-publish events`` has only the ``+events`` runs' engines publish.

Outputs a Markdown table on stdout and, with matplotlib (``pip install -e '.[bench]'``), a plot of
the TTFT distribution per strategy (``--plot``, default ``bench/routing.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import orjson

from bench.procs import signal_group, start_group, terminate

REPO = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
STRATEGIES = [
    "random", "round-robin", "least-request", "power-of-two", "least-kv-cache", "least-waiting",
    "throughput", "least-latency", "session-affinity", "vtc-basic", "prefix-cache",
    "prefix-cache+events", "prefix-cache:3,least-request:2,least-kv-cache:2", "prefix-cache:2,least-request:1",
]
QUICK_STRATEGIES = ["random", "least-request", "least-kv-cache", "prefix-cache", "prefix-cache" + "+events",
                    "prefix-cache:3,least-request:2,least-kv-cache:2"]
RECOMMENDED = "prefix-cache"
EVENTS = "+events"        # suffix: the strategy with KV events on (engines publish, the gateway subscribes)
KV_EVENTS: dict = {}      # extra kv_events keys (--kv-events KEY=VALUE)
VIEW: dict = {}        # the gateways' view block (--view), e.g. flush_delay_s
# which runs' engines publish KV events (--engines-publish): "always", the same engines for every
# strategy (a fleet configured for events publishes whatever the gateway routes by), or "events",
# only under the +events strategies (their engines then do work the others' do not)
ENGINES_PUBLISH = {"mode": "always"}
_WORDS_SEED = 7919


@dataclass(frozen=True)
class EngineModel:
    ttft_base_ms: float = 10.0
    prefill_ms_per_token: float = 0.1
    itl_ms: float = 25.0
    itl_growth_per_running: float = 1.0
    max_num_seqs: int = 8
    kv_blocks: int = 1536          # × 16 tokens = 24k tokens per engine
    block_size: int = 16
    max_model_len: int = 32768
    cache_output_blocks: bool = False  # the engines cache the blocks their answers fill (vLLM does)


@dataclass(frozen=True)
class Workload:
    engines: int = 8
    duration_s: float = 45.0       # arrivals happen in [0, duration)
    warmup_s: float = 12.0         # requests sent before this are not measured
    conversation_rate: float = 14.0  # new conversations per second
    unique_rate: float = 9.0       # unique single-turn requests per second
    system_prompts: int = 40
    system_tokens: int = 2000
    zipf_s: float = 0.8
    turns: tuple[int, int] = (2, 6)
    user_tokens: tuple[int, int] = (40, 160)
    unique_tokens: tuple[int, int] = (600, 1800)
    think_s: float = 1.5
    max_tokens: int = 16
    users: int = 24                # vtc-basic: conversations belong to this many users
    seed: int = 1
    # the text and the tokenizer (engines and gateway): "pseudo", short pseudo-words one token each of
    # the shared test tokenizer; "english", English-like text (``bench.chat_bpe``) whose sizes above
    # count words (about 1.35 tokens each) for a 32k-token BPE with Llama-3's split and chat template
    text: str = "pseudo"


# ``--workload``: named workloads (the default is ``Workload()``)
WORKLOADS: dict[str, Workload] = {
    "default": Workload(),
    # 4 engines, a real-sized BPE tokenizer (bench/chat_bpe.py), multi-turn chats on 12 long shared
    # system prompts (about 2,000 tokens each, Zipf popularity) and a few unique prompts: about 400
    # streamed requests over 30 s of arrivals
    "chat-bpe": Workload(engines=4, duration_s=30.0, warmup_s=6.0, conversation_rate=3.2, unique_rate=1.0,
                         system_prompts=16, system_tokens=1480, user_tokens=(30, 120), unique_tokens=(450, 1300),
                         text="english"),
}


# -- the schedule -----------------------------------------------------------------------------------


def _vocab() -> list[str]:
    """Short words (one sim token each: whitespace + at most four characters)."""
    rng = random.Random(_WORDS_SEED)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 4))) for _ in range(4000)]


def _pseudo_text(rng: random.Random, vocab: list[str], tokens: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(tokens))


def tokenizer_dir(w: Workload) -> str:
    """The tokenizer directory the engines and the gateway load for ``w``'s text."""
    if w.text == "english":
        from bench.chat_bpe import tokenizer_dir as bpe_dir

        return str(bpe_dir())
    from enginesim.tiny_tokenizer import TINY_DIR

    return str(TINY_DIR)


@dataclass
class Conversation:
    cid: int
    start: float
    system: int
    user: str
    questions: list[str]
    thinks: list[float]


@dataclass
class Single:
    start: float
    prompt: str
    user: str


@dataclass
class Schedule:
    systems: list[str]
    conversations: list[Conversation]
    singles: list[Single]


def make_schedule(w: Workload) -> Schedule:
    rng = random.Random(w.seed)
    if w.text == "english":
        from bench.chat_bpe import TextSource

        text = TextSource(rng).text
    else:
        vocab = _vocab()

        def text(tokens: int) -> str:
            return _pseudo_text(rng, vocab, tokens)

    systems = [f"System prompt {i}: you are assistant number {i}. " + text(w.system_tokens)
               for i in range(w.system_prompts)]
    weights = [1.0 / (i + 1) ** w.zipf_s for i in range(w.system_prompts)]
    convs: list[Conversation] = []
    t = rng.expovariate(w.conversation_rate)
    while t < w.duration_s:
        turns = rng.randint(*w.turns)
        convs.append(Conversation(
            cid=len(convs), start=t, system=rng.choices(range(w.system_prompts), weights)[0],
            user=f"user-{rng.randrange(w.users)}",
            questions=[f"Question {k}: " + text(rng.randint(*w.user_tokens)) for k in range(turns)],
            thinks=[rng.expovariate(1.0 / w.think_s) for _ in range(turns)]))
        t += rng.expovariate(w.conversation_rate)
    singles: list[Single] = []
    t = rng.expovariate(w.unique_rate) if w.unique_rate > 0 else math.inf
    while t < w.duration_s:
        singles.append(Single(start=t, prompt=f"Unique request {len(singles)}: "
                              + text(rng.randint(*w.unique_tokens)),
                              user=f"user-{rng.randrange(w.users)}"))
        t += rng.expovariate(w.unique_rate)
    return Schedule(systems, convs, singles)


# -- one request --------------------------------------------------------------------------------------


@dataclass
class Sample:
    sent: float                    # seconds since the run's start
    ttft: float | None
    e2e: float
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    endpoint: str = ""
    kind: str = "turn"
    messages: list[dict] | None = None    # what was sent (for the reachable-hit oracle)


async def send(session: aiohttp.ClientSession, url: str, t0: float, messages: list[dict], w: Workload,
               headers: dict[str, str], kind: str) -> tuple[Sample, str]:
    body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": w.max_tokens, "stream": True,
                         "stream_options": {"include_usage": True}, "ignore_eos": True})
    start = time.perf_counter()
    sample = Sample(sent=start - t0, ttft=None, e2e=0.0, status=0, kind=kind, messages=list(messages))
    parts: list[str] = []
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as r:
            sample.status = r.status
            sample.endpoint = r.headers.get("target-pod", "")
            if r.status != 200:
                await r.read()
            else:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = orjson.loads(line[6:])
                    for choice in event.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if sample.ttft is None:
                                sample.ttft = time.perf_counter() - start
                            parts.append(text)
                    usage = event.get("usage")
                    if usage:
                        sample.prompt_tokens = usage.get("prompt_tokens") or 0
                        sample.output_tokens = usage.get("completion_tokens") or 0
                        sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (TimeoutError, aiohttp.ClientError) as e:
        sample.status = -1
        parts = [str(e)]
    sample.e2e = time.perf_counter() - start
    return sample, "".join(parts)


# -- one strategy -------------------------------------------------------------------------------------


@dataclass
class Result:
    strategy: str
    requests: int
    errors: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_rps: float
    output_tps: float
    cache_hit: float
    reachable_hit: float     # the oracle's share (reachable_hit()): what a single infinite cache would hit
    imbalance: float
    imbalance_peak: float
    loop_lag_ms: float
    mean_in_flight: float
    wall_s: float
    ttfts_ms: list[float] = field(default_factory=list, repr=False)


def reachable_hit(samples: list[Sample], w: Workload, block_size: int) -> tuple[float, float]:
    """The hit rate an infinite cache shared by the whole fleet would reach on this run's requests:
    the share of the measured requests' prompt tokens whose full blocks (the engine's rule: never
    the prompt's last token) were a prefix of a request whose prefill had finished (sent + TTFT)
    before this one was sent. The second figure counts any earlier-sent request (no prefill time),
    an upper bound. No routing can beat the first on this schedule; unique single-turn prompts and
    first turns with a system prompt no one sent before are misses for every strategy."""
    from gateway.kv.tokenization import ModelTokenizer, chain_keys

    tok = ModelTokenizer(tokenizer_dir(w))
    ok = sorted((s for s in samples if s.status == 200 and s.ttft is not None and s.messages), key=lambda s: s.sent)
    keyed = []
    for s in ok:
        ids = tok.encode(tok.render(s.messages or []))
        keys = chain_keys(0, ids, block_size)[:max(0, len(ids) - 1) // block_size]
        keyed.append((s, keys, len(ids)))
    # arrivals (1) after availabilities (0) at equal times
    timeline = sorted([(s.sent + (s.ttft or 0.0), 0, i) for i, (s, _, _) in enumerate(keyed)]
                      + [(s.sent, 1, i) for i, (s, _, _) in enumerate(keyed)])
    done: set[int] = set()
    sent: set[int] = set()
    hit = hit_sent = total = 0
    for _, kind, i in timeline:
        s, keys, n = keyed[i]
        if kind == 0:
            done.update(keys)
            continue
        if w.warmup_s <= s.sent < w.duration_s:
            total += n
            hit += block_size * next((j for j, k in enumerate(keys) if k not in done), len(keys))
            hit_sent += block_size * next((j for j, k in enumerate(keys) if k not in sent), len(keys))
        sent.update(keys)
    return (hit / total, hit_sent / total) if total else (0.0, 0.0)


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def split_label(label: str) -> tuple[str, bool, dict, dict]:
    """A strategy label: ``SPEC[+events][@KEY=VALUE,...]`` → (spec, events, routing keys, kv_events
    keys). The keys after ``@`` apply to that label's run only (so two settings can alternate in one
    run): a ``kv_events`` key when the block has it, else a ``routing`` key; values are JSON, or the
    git revision of ``ref`` (``--gateway-process``: the gateway runs from that revision's tree)."""
    from gateway.kv.settings import KVEventsConfig

    head, _, tail = label.partition("@")
    routing: dict = {}
    kv: dict = {}
    for item in filter(None, tail.split(",")):
        key, _, value = item.partition("=")
        if key == "ref":
            kv[key] = value
            continue
        (kv if key in KVEventsConfig.__struct_fields__ else routing)[key] = json.loads(value)
    return head.removesuffix(EVENTS), head.endswith(EVENTS), routing, kv


_TREES: dict[str, tempfile.TemporaryDirectory] = {}     # git revision → its exported tree (``@ref=``)


def source_tree(ref: str) -> Path:
    """The files of git revision ``ref`` of this repository, exported once per run."""
    import io
    import tarfile

    if ref not in _TREES:
        d = tempfile.TemporaryDirectory(prefix="bench-routing-tree-")
        raw = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            tar.extractall(d.name, filter="data")
        _TREES[ref] = d
    return Path(_TREES[ref].name)


def gateway_config(spec: str, events: bool, endpoints: list[str], tokenizer: str, routing: dict,
                   kv_events: dict | None = None) -> dict:
    """The gateway's config, the same in both modes: ``config_from_dict`` in process, a JSON file
    (which is YAML) for ``--gateway-process``."""
    model = {"name": MODEL, "engine": "vllm", "strategy": spec, "endpoints": endpoints, "tokenizer": tokenizer}
    if events:
        model["kv_events"] = {"enabled": True, "port": 5557, "replay_port": 5558, **KV_EVENTS, **(kv_events or {})}
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "server": {"shutdown_grace_s": 1.0, "log_level": "warning"},
        "health": {"interval_s": 5.0},
        "scrape": {"interval_s": 0.5},
        "routing": dict(routing),
        "models": [model],
        **({"view": dict(VIEW)} if VIEW else {}),
    }


FALLBACKS = ("switchyard_routing_fallbacks_total{", "switchyard_kv_events_fallbacks_total{")
_CHILDREN: list[subprocess.Popen] = []     # gateway processes alive (main() stops them on any exit)


def fallbacks(pages: list[str]) -> list[str]:
    """The fallback counters of the gateways' ``/metrics`` pages, summed over the replicas."""
    total: dict[str, float] = {}
    for page in pages:
        for line in page.splitlines():
            if line.startswith(FALLBACKS):
                key, _, value = line.rpartition(" ")
                labels = key.split("{", 1)[1]
                total[labels] = total.get(labels, 0.0) + float(value)
    return [f"{labels} {n:g}" for labels, n in total.items()]


def gateway_means(pages: list[str]) -> dict[str, float]:
    """Mean seconds of a few of the gateways' own histograms (routing decision, event-loop lag),
    over the replicas, from their ``/metrics`` pages."""
    sums: dict[str, list[float]] = {}
    for page in pages:
        for line in page.splitlines():
            for name in ("switchyard_routing_decision_seconds", "switchyard_event_loop_lag_seconds",
                         "switchyard_time_to_first_token_seconds"):
                for part in ("_sum", "_count"):
                    if line.startswith(name + part):
                        acc = sums.setdefault(name, [0.0, 0.0])
                        acc[part == "_count"] += float(line.rpartition(" ")[2])
    return {name: total / n for name, (total, n) in sums.items() if n}


def view_lag(pages: list[str]) -> dict[str, dict[str, object]]:
    """The shared view's lag (a batch's sending to its applying) per source ("worker", "replica"),
    from the gateways' ``/metrics`` pages: the batches counted and their mean over all the pages,
    and each page's p50 and p99 of its last batches (``switchyard_view_lag_recent_seconds``)."""
    out: dict[str, dict[str, object]] = {}
    for page in pages:
        for line in page.splitlines():
            if not line.startswith("switchyard_view_lag_"):
                continue
            key, _, value = line.rpartition(" ")
            source = key.partition('source="')[2].partition('"')[0]
            if not source:
                continue
            acc = out.setdefault(source, {"sum": 0.0, "count": 0.0, "p50": [], "p99": []})
            if key.startswith("switchyard_view_lag_seconds_sum"):
                acc["sum"] += float(value)              # type: ignore[operator]
            elif key.startswith("switchyard_view_lag_seconds_count"):
                acc["count"] += float(value)            # type: ignore[operator]
            elif key.startswith("switchyard_view_lag_recent_seconds"):
                q = "p50" if 'percentile="50"' in key else "p99" if 'percentile="99"' in key else None
                if q:
                    acc[q].append(float(value))         # type: ignore[union-attr]
    return {k: v for k, v in out.items() if v["count"]}


def engines_ttft(sims: list) -> float | None:
    """Mean TTFT the engines measured (request received → first token), over all of them."""
    from prometheus_client import generate_latest

    acc = [0.0, 0.0]
    for s in sims:
        for line in generate_latest(s.engine.metrics.registry).decode().splitlines():
            for k, part in enumerate(("_sum", "_count")):
                if line.startswith("vllm:time_to_first_token_seconds" + part):
                    acc[k] += float(line.rpartition(" ")[2])
    return acc[0] / acc[1] if acc[1] else None


def watch_subscriptions(sims: list) -> list:
    """A monitor on each engine's KV-event PUB socket, reporting finished ZMTP handshakes (a
    subscriber connected); set up before the gateways start, read by ``subscribed``."""
    import zmq

    return [s.engine.kv_events.pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) for s in sims]


async def subscribed(sims: list, monitors: list, per_engine: int, timeout: float = 30.0) -> bool:
    """Until every engine has seen ``per_engine`` subscribers connect (one per gateway); False on
    timeout. The SUB sends its subscription right after the handshake; a first batch lost in that
    instant costs nothing, since a subscriber whose first message is not seq 0 replays from 0."""
    import zmq
    from zmq.utils.monitor import parse_monitor_message

    async def one(monitor) -> None:
        n = 0
        while n < per_engine:
            if parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                n += 1

    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(one(m) for m in monitors))
        return True
    except TimeoutError:
        return False
    finally:
        close_monitors(sims, monitors)


def close_monitors(sims: list, monitors: list) -> None:
    """Stop the monitors (idempotent); an open one would hang the engine's ``zmq`` context at close."""
    for s, m in zip(sims, monitors, strict=False):
        if not m.closed:
            with contextlib.suppress(Exception):
                s.engine.kv_events.pub.disable_monitor()
            m.close(0)


class GatewayProcesses:
    """``--gateway-process``: ``replicas`` × ``python -m gateway --config FILE --port P``, each in its
    own process group, stderr (and stdout) to the benchmark's stderr."""

    def __init__(self, raw: dict, replicas: int, workers: int = 1, redis_url: str | None = None,
                 profile: str = "", tree: Path | None = None) -> None:
        # drain_delay_s 0: a SIGTERM stops at once (the in-process gateways are not drained at all)
        self.raw = {**raw, "server": {**raw["server"], "drain_delay_s": 0}}
        if redis_url:       # the replicas share their routing view (and in-flight counts) through Redis
            self.raw["state"] = {"redis_url": redis_url}
        self.replicas = replicas
        self.workers = workers
        self.profile = profile          # a cProfile output path per replica (``PATH.N``), or ""
        self.tree = tree                # the source tree the gateway runs from (None: this checkout)
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.dir: tempfile.TemporaryDirectory | None = None

    def start(self) -> None:
        from gateway.server.run import free_port

        self.dir = tempfile.TemporaryDirectory(prefix="bench-routing-")
        path = Path(self.dir.name) / "gateway.yaml"
        path.write_text("# written by bench/routing.py --gateway-process\n" + json.dumps(self.raw, indent=1) + "\n")
        for n in range(self.replicas):
            port = free_port()
            prof = ["-m", "cProfile", "-o", f"{self.profile}.{n}"] if self.profile else []
            tree = self.tree or REPO
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
            p = start_group([sys.executable, *prof, "-m", "gateway", "--config", str(path), "--port", str(port),
                             "--workers", str(self.workers)],
                            cwd=tree, stdin=subprocess.DEVNULL, stdout=sys.stderr, env=env)
            _CHILDREN.append(p)
            self.procs.append(p)
            self.ports.append(port)

    async def get(self, session: aiohttp.ClientSession, port: int, path: str) -> tuple[int, str]:
        async with session.get(f"http://127.0.0.1:{port}{path}") as r:
            return r.status, await r.text()

    async def wait_ready(self, session: aiohttp.ClientSession, engines: int, timeout: float = 60.0) -> None:
        """Until each process answers ``/ready`` with 200 and its ``/metrics`` shows every engine
        ready (``switchyard_endpoint_ready``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for p, port in zip(self.procs, self.ports, strict=True):
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"the gateway on port {port} exited with {p.returncode} while starting")
                if loop.time() > deadline:
                    raise RuntimeError(f"the gateway on port {port} was not ready after {timeout:g} s")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    if (await self.get(session, port, "/ready"))[0] == 200:
                        page = (await self.get(session, port, "/metrics"))[1]
                        ready = sum(1 for line in page.splitlines()
                                    if line.startswith("switchyard_endpoint_ready{") and float(line.rpartition(" ")[2]) == 1)
                        if ready >= engines:
                            break
                await asyncio.sleep(0.05)

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) the processes spent so far, summed over the replicas: ``all``
        and the event loop's thread (``loop``, the main thread); the rest is the other threads' (the
        tokenizer threads, ZeroMQ's I/O thread, the tokenizers library's own pool)."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {"all": 0.0, "loop": 0.0}
        for p in self.procs:
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{p.pid}/task").iterdir():
                    with contextlib.suppress(OSError):
                        raw = (task / "stat").read_text()
                        fields = raw[raw.rindex(")") + 2:].split()
                        t = (int(fields[11]) + int(fields[12])) / tick
                        out["all"] += t
                        if task.name == str(p.pid):
                            out["loop"] += t
        return out

    async def metrics(self, session: aiohttp.ClientSession) -> list[str]:
        pages = []
        for port in self.ports:
            try:
                pages.append((await self.get(session, port, "/metrics"))[1])
            except (aiohttp.ClientError, TimeoutError) as e:
                print(f"    /metrics of the gateway on port {port}: {e!r}", file=sys.stderr)
        return pages

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to each, then wait (with the event loop running: the engines answer meanwhile),
        SIGKILL to any still there after ``grace`` seconds."""
        for p in self.procs:
            signal_group(p, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(p.poll() is None for p in self.procs) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for p, port in zip(self.procs, self.ports, strict=True):
            if p.poll() is None:
                print(f"    the gateway on port {port} ignored SIGTERM for {grace:g} s: killed", file=sys.stderr)
                signal_group(p, signal.SIGKILL)
                p.wait(5)
            elif p.returncode != 0:
                print(f"    the gateway on port {port} exited with {p.returncode}", file=sys.stderr)
            if p in _CHILDREN:
                _CHILDREN.remove(p)
        if self.dir is not None:
            self.dir.cleanup()


async def start_engines(w: Workload, em: EngineModel, events: bool, tok: str) -> list:
    """The simulated engines. Every engine publishes events (one PUB socket each): with events on,
    each endpoint is its own model block in the gateway's eyes only for the port, so the endpoints
    share the default ports by binding each sim's PUB and replay sockets on its own loopback address,
    127.0.B.1, 127.0.B.2, ...; when one of those is taken (another run of this benchmark), on the
    next block B."""
    import zmq

    from enginesim import SimConfig, start_sim

    blocks = (w.engines - 1) // 200 + 1
    for base in range(1, 255 - blocks, blocks):
        sims: list = []
        try:
            for i in range(w.engines):
                host = f"127.0.{base + i // 200}.{1 + i % 200}" if events else "127.0.0.1"
                sims.append(await start_sim(SimConfig(
                    engine="vllm", model=MODEL, port=0, host=host, seed=w.seed, tokenizer=tok,
                    kv_events_port=5557 if events else -1, kv_events_replay_port=5558 if events else -1,
                    **asdict(em))))
            return sims
        except zmq.ZMQError as e:
            for s in sims:
                with contextlib.suppress(Exception):
                    await s.close()
            if e.errno != zmq.EADDRINUSE:
                raise
            print(f"    the KV-event ports on 127.0.{base}.* are taken: trying the next addresses", file=sys.stderr)
    raise RuntimeError("no free loopback block for the engines' KV-event ports")


async def run_strategy(label: str, sched: Schedule, w: Workload, em: EngineModel,
                       routing: dict | None = None, replicas: int = 1, gateway_process: bool = False,
                       workers: int = 1, redis_url: str | None = None, profile: str = "") -> Result:
    from enginesim.hf_tokenizer import forget_segments
    from gateway.config.schema import config_from_dict
    from gateway.server.app import GATEWAY_KEY
    from gateway.server.run import start
    from routers.prefix_cache import fleet_load

    wall0 = time.perf_counter()
    spec, events, routing_over, kv_over = split_label(label)
    ref = kv_over.pop("ref", None)
    if ref is not None and not gateway_process:
        raise SystemExit(f"{label}: @ref= needs --gateway-process")
    tok = tokenizer_dir(w)
    forget_segments()         # every strategy's engines start with cold tokenizer caches, not only the first's
    control = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    sims: list = []
    monitors: list = []
    gateways: list = []
    procs: GatewayProcesses | None = None
    try:
        sims += await start_engines(w, em, events or ENGINES_PUBLISH["mode"] == "always", tok)
        raw = gateway_config(spec, events, [s.url for s in sims], tok, {**(routing or {}), **routing_over}, kv_over)
        cfg = config_from_dict(raw, source="<bench>")     # checked here in both modes
        monitors = watch_subscriptions(sims) if events else []
        if gateway_process:
            procs = GatewayProcesses(raw, replicas, workers, redis_url, profile, source_tree(ref) if ref else None)
            procs.start()
            await procs.wait_ready(control, w.engines)
            ports = procs.ports
        else:
            gateways = [await start(cfg) for _ in range(replicas)]
            ports = [p for _, _, p in gateways]
        if events and not await subscribed(sims, monitors, replicas * workers):
            print("    not every gateway subscribed to every engine's KV events within 30 s", file=sys.stderr)
        if procs is not None:
            print(f"    {replicas} gateway process{'es' if replicas > 1 else ''} ready"
                  f"{' and subscribed' if events else ''} {time.perf_counter() - wall0:.1f} s after the start",
                  file=sys.stderr)
        urls = [f"http://127.0.0.1:{p}/v1/chat/completions" for p in ports]
        eps_per_gw = [g[1][GATEWAY_KEY].pool.endpoints(MODEL) for g in gateways]
        engines = [s.engine for s in sims]
        cpu0 = procs.cpu() if procs is not None else None
        samples, in_flight_samples, lags, seen = await drive(sched, w, urls, eps_per_gw, engines,
                                                             cfg.routing.metrics_max_age_s, fleet_load)
        if procs is not None and cpu0 is not None and samples:
            cpu = {k: v - cpu0[k] for k, v in procs.cpu().items()}
            print(f"    gateway CPU per request: {1000 * cpu['all'] / len(samples):.2f} ms (event loop "
                  f"{1000 * cpu['loop'] / len(samples):.2f}, other threads "
                  f"{1000 * (cpu['all'] - cpu['loop']) / len(samples):.2f}) over {len(samples)} requests", file=sys.stderr)
        pages = (await procs.metrics(control) if procs is not None
                 else [g[1][GATEWAY_KEY].metrics.render().decode() for g in gateways])
        engine_ttft = engines_ttft(sims)
    finally:
        if procs is not None:
            await procs.stop()
        for r, _, _ in gateways:
            await r.cleanup()
        await control.close()
        close_monitors(sims, monitors)
        for s in sims:
            with contextlib.suppress(Exception):
                await s.close()

    if seen[0]:
        print(f"    load seen by replica 1: local {seen[1] / seen[0]:.0%} of the fleet's in-flight, "
              f"fleet estimate {seen[2] / seen[0]:.0%}", file=sys.stderr)
    reach = reachable_hit(samples, w, em.block_size)
    print(f"    reachable hit: {reach[0]:.1%} (prefill done before the request), {reach[1]:.1%} (sent before)",
          file=sys.stderr)
    measured = [s for s in samples if w.warmup_s <= s.sent < w.duration_s]
    ok = [s for s in measured if s.status == 200 and s.ttft is not None]
    ttfts = sorted(s.ttft * 1000 for s in ok)
    window = w.duration_s - w.warmup_s
    prompt = sum(s.prompt_tokens for s in ok)
    per_engine = [statistics.fmean(col) for col in zip(*in_flight_samples, strict=True)] if in_flight_samples else []
    mean_load = statistics.fmean(per_engine) if per_engine else 0.0
    peaks = [max(row) / statistics.fmean(row) for row in in_flight_samples if sum(row) > 0]
    result = Result(
        strategy=label + (f" ×{replicas} replicas" if replicas > 1 else "") + (f" ×{workers} workers" if workers > 1 else ""),
        requests=len(ok), errors=len(measured) - len(ok),
        ttft_mean_ms=statistics.fmean(ttfts) if ttfts else math.nan,
        ttft_p50_ms=_pct(ttfts, 0.5), ttft_p99_ms=_pct(ttfts, 0.99),
        throughput_rps=len(ok) / window, output_tps=sum(s.output_tokens for s in ok) / window,
        cache_hit=sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        reachable_hit=reach[0],
        imbalance=max(per_engine) / mean_load if mean_load else math.nan,
        imbalance_peak=statistics.fmean(peaks) if peaks else math.nan,
        loop_lag_ms=1000 * statistics.fmean(lags) if lags else 0.0, mean_in_flight=mean_load,
        wall_s=time.perf_counter() - wall0, ttfts_ms=ttfts)
    fb = fallbacks(pages)
    if fb:
        print("    fallbacks: " + "; ".join(fb), file=sys.stderr)
    means = gateway_means(pages)
    ttft = means.pop("switchyard_time_to_first_token_seconds", None)
    if means:
        print("    gateway: " + ", ".join(f"{name.removeprefix('switchyard_').removesuffix('_seconds')} mean "
                                        f"{1000 * v:.3f} ms" for name, v in means.items()), file=sys.stderr)
    for source, lag in view_lag(pages).items():
        print(f"    view lag from {source}s (send -> apply): {lag['count']:.0f} batches, mean "
              f"{1000 * lag['sum'] / lag['count']:.2f} ms; recent p50 "      # type: ignore[operator]
              + " / ".join(f"{1000 * v:.2f}" for v in lag["p50"]) + " ms, p99 "   # type: ignore[union-attr]
              + " / ".join(f"{1000 * v:.2f}" for v in lag["p99"]) + " ms (per gateway)", file=sys.stderr)  # type: ignore[union-attr]
    if ttft is not None and engine_ttft is not None:
        print(f"    TTFT mean seen by the gateway {1000 * ttft:.1f} ms, by the engines {1000 * engine_ttft:.1f} ms: "
              f"{1000 * (ttft - engine_ttft):.2f} ms in the gateway (routing, tokenizing, the leg's send, the "
              f"first chunk's relay)", file=sys.stderr)
    return result


async def drive(sched: Schedule, w: Workload, urls: list[str], eps_per_gw: list, engines: list,
                max_age: float, fleet_load) -> tuple[list[Sample], list[list[int]], list[float], list[float]]:
    """The load generator and the 100 ms sampler: the samples, the in-flight rows (one count per
    engine: the in-process gateways' ``eps_per_gw`` summed, or with those empty, the engines' own
    live requests), the sampler's lags, and (in-process replicas) the first replica's view of the load."""
    samples: list[Sample] = []
    in_flight_samples: list[list[int]] = []
    lags: list[float] = []
    seen = [0.0, 0.0, 0.0]        # sampled in-flight: all replicas, replica 0 alone, replica 0's fleet estimate
    pick = random.Random(w.seed + 17)
    stop_sampling = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    loop = asyncio.get_running_loop()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        loop_t0 = loop.time()

        async def sampler() -> None:
            while not stop_sampling.is_set():
                want = loop.time() + 0.1
                await asyncio.sleep(0.1)
                lags.append(max(0.0, loop.time() - want))
                if w.warmup_s <= time.perf_counter() - t0 <= w.duration_s:
                    if not eps_per_gw:     # --gateway-process: what the engines hold (staged, waiting, running)
                        in_flight_samples.append([e.num_live for e in engines])
                        continue
                    row = [sum(eps[i].in_flight for eps in eps_per_gw) for i in range(w.engines)]
                    in_flight_samples.append(row)
                    if len(eps_per_gw) > 1:       # what the first replica's load guard sees, against the truth
                        now = time.monotonic()
                        seen[0] += sum(row)
                        seen[1] += sum(ep.in_flight for ep in eps_per_gw[0])
                        seen[2] += sum(fleet_load(ep, now, max_age) for ep in eps_per_gw[0])

        async def conversation(c: Conversation) -> None:
            await asyncio.sleep(max(0.0, loop_t0 + c.start - loop.time()))
            messages: list[dict] = [{"role": "system", "content": sched.systems[c.system]}]
            headers = {"user": c.user, "x-session-key": f"conversation-{c.cid}"}
            for k, question in enumerate(c.questions):
                if time.perf_counter() - t0 >= w.duration_s:
                    return                                     # no new turns after the arrivals end
                messages.append({"role": "user", "content": question})
                url = urls[pick.randrange(len(urls))]       # replicas: each request to any of them
                sample, answer = await send(session, url, t0, messages, w, headers, "turn")
                samples.append(sample)
                if sample.status != 200:
                    return
                messages.append({"role": "assistant", "content": answer})
                if time.perf_counter() - t0 + c.thinks[k] >= w.duration_s:
                    return                                     # the next turn would come after the end
                await asyncio.sleep(c.thinks[k])

        async def single(s: Single) -> None:
            await asyncio.sleep(max(0.0, loop_t0 + s.start - loop.time()))
            url = urls[pick.randrange(len(urls))]
            sample, _ = await send(session, url, t0, [{"role": "user", "content": s.prompt}], w,
                                   {"user": s.user}, "unique")
            samples.append(sample)

        sampling = asyncio.create_task(sampler())
        tasks = [asyncio.create_task(conversation(c)) for c in sched.conversations]
        tasks += [asyncio.create_task(single(s)) for s in sched.singles]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            stop_sampling.set()
            await sampling
    return samples, in_flight_samples, lags, seen


# -- report --------------------------------------------------------------------------------------------


def markdown(results: list[Result], baseline: str = "random") -> str:
    base = next((r for r in results if r.strategy.split(" ×")[0] == baseline), None)
    out = ["| strategy | TTFT mean (ms) | vs random | TTFT p50 (ms) | TTFT p99 (ms) | req/s | output tok/s "
           "| cache hit | reachable | imbalance (peak) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = f"{r.ttft_mean_ms / base.ttft_mean_ms:.2f}×" if base and base.ttft_mean_ms else "–"
        errors = f" ({r.errors} errors)" if r.errors else ""
        out.append(f"| `{r.strategy}`{errors} | {r.ttft_mean_ms:.0f} | {ratio} | {r.ttft_p50_ms:.0f} | "
                   f"{r.ttft_p99_ms:.0f} | {r.throughput_rps:.1f} | {r.output_tps:.0f} | {r.cache_hit:.0%} | "
                   f"{r.reachable_hit:.0%} | "
                   f"{r.imbalance:.2f} ({r.imbalance_peak:.2f}) |")
    return "\n".join(out)


def plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import box_and_save

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    cmap = plt.get_cmap("tab20")
    for i, r in enumerate(results):
        if not r.ttfts_ms:
            continue
        n = len(r.ttfts_ms)
        ys = [(k + 1) / n for k in range(n)]
        style = "-" if "prefix" in r.strategy else "--"
        width = 2.4 if r.strategy == RECOMMENDED else 1.3
        ax1.plot(r.ttfts_ms, ys, style, lw=width, color=cmap(i % 20), label=r.strategy)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT at the client (ms, log scale)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT distribution (CDF)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, loc="lower right")
    labels = [r.strategy.replace(",", ",\n") for r in results]
    box_and_save(fig, ax2, [r.ttfts_ms or [math.nan] for r in results], labels, title, path, fontsize=7)


def main(argv: list[str] | None = None) -> int:
    workloads = [*sorted(WORKLOADS), "conversations", "slo"]     # conversations: the default one
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", choices=workloads, default="default")
    known, rest = pre.parse_known_args(argv)
    if known.workload == "slo":        # latency objectives on engines of different speeds (bench/routing_slo.py)
        from bench.routing_slo import main as slo_main

        return slo_main(rest)
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=workloads, default="default",
                    help="default (or conversations): 8 engines, pseudo-word prompts, the shared test tokenizer; "
                         "chat-bpe: 4 engines, English-like chats, a 32k-token byte-level BPE built offline "
                         "(bench/chat_bpe.py), about 400 requests; slo: requests with latency objectives on engines "
                         "of different speeds, attainment per strategy (bench/routing_slo.py)")
    ap.add_argument("--quick", action="store_true",
                    help="5 strategies, 20 s of arrivals each (< 2 min; the default run takes ~10 min)")
    ap.add_argument("--strategies", nargs="+", help="strategy strings (default: all built-ins + combos)")
    ap.add_argument("--engines", type=int)
    ap.add_argument("--duration", type=float, help="seconds of arrivals per strategy")
    ap.add_argument("--warmup", type=float, help="seconds of arrivals not measured")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", default=str(Path(__file__).with_name("routing.png")),
                    help="PNG path ('' to skip)")
    ap.add_argument("--json", default="", help="write the results (with raw TTFTs) to this file")
    ap.add_argument("--kv-events", nargs="*", default=[], metavar="KEY=VALUE",
                    help="kv_events keys for the +events strategies, e.g. speculative_ttl_s=5")
    ap.add_argument("--replicas", type=int, default=1,
                    help="gateway replicas in front of the same engines, each request sent to a random one")
    ap.add_argument("--kv-blocks", type=int, help="KV blocks per engine (16 tokens each; default 1536)")
    ap.add_argument("--engines-cache-output", action="store_true",
                    help="the engines also cache the blocks their answers fill, as vLLM and SGLang do "
                         "(enginesim cache_output_blocks; by default they cache prompts only)")
    ap.add_argument("--routing", nargs="*", default=[], metavar="KEY=VALUE",
                    help="routing config knobs for the gateway, e.g. prefix_std_factor=2")
    ap.add_argument("--view", nargs="*", default=[], metavar="KEY=VALUE",
                    help="view config knobs for the gateway (with --workers or --replicas), e.g. flush_delay_s=0.01")
    ap.add_argument("--gateway-process", action="store_true",
                    help="run each gateway replica as its own process (python -m gateway) instead of in the "
                         "benchmark's event loop; engines and load generator stay in the benchmark")
    ap.add_argument("--workers", type=int, default=1,
                    help="with --gateway-process: each gateway replica runs with --workers N (one routing view "
                         "shared over the local bus)")
    ap.add_argument("--redis", default="", metavar="URL",
                    help="with --gateway-process: state.redis_url of every replica (the routing view and in-flight "
                         "counts shared across replicas), e.g. redis://127.0.0.1:6379/0")
    ap.add_argument("--gateway-profile", default="", metavar="DIR",
                    help="with --gateway-process: run each gateway under cProfile, its stats written to "
                         "DIR/<strategy>.<replica> when it stops (its event loop's thread only)")
    ap.add_argument("--engines-publish", choices=["always", "events"], default="always",
                    help="always (default): every run's engines publish KV events, so every strategy faces the "
                         "same engines; events: only the +events runs' engines do")
    args = ap.parse_args(argv)
    ENGINES_PUBLISH["mode"] = args.engines_publish
    if (args.workers > 1 or args.redis) and not args.gateway_process:
        ap.error("--workers and --redis need --gateway-process")
    if args.gateway_profile:
        if not args.gateway_process:
            ap.error("--gateway-profile needs --gateway-process")
        Path(args.gateway_profile).mkdir(parents=True, exist_ok=True)

    from gateway.observability.logs import configure_logging

    configure_logging("json", "warning")
    w = replace(WORKLOADS["default" if args.workload == "conversations" else args.workload], seed=args.seed)
    if args.quick:
        w = replace(w, duration_s=min(w.duration_s, 20.0), warmup_s=min(w.warmup_s, 6.0))
    if args.engines:
        w = replace(w, engines=args.engines)
    if args.duration:
        w = replace(w, duration_s=args.duration, warmup_s=args.warmup if args.warmup is not None
                    else min(w.warmup_s, args.duration / 4))
    elif args.warmup is not None:
        w = replace(w, warmup_s=args.warmup)
    em = EngineModel(**({"kv_blocks": args.kv_blocks} if args.kv_blocks else {}),
                     cache_output_blocks=args.engines_cache_output)
    routing: dict = {}
    for item in args.routing:
        key, _, value = item.partition("=")
        routing[key] = json.loads(value)
    for item in args.view:
        key, _, value = item.partition("=")
        VIEW[key] = json.loads(value)
    for item in args.kv_events:
        key, _, value = item.partition("=")
        KV_EVENTS[key] = json.loads(value)
    strategies = args.strategies or (QUICK_STRATEGIES if args.quick else STRATEGIES)
    sched = make_schedule(w)
    n_req = sum(len(c.questions) for c in sched.conversations) + len(sched.singles)
    print(f"workload: {w.engines} engines, {len(sched.conversations)} conversations + {len(sched.singles)} "
          f"unique requests (≤{n_req} requests) over {w.duration_s:.0f} s, seed {w.seed}", file=sys.stderr)

    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run

    results: list[Result] = []
    t0 = time.perf_counter()
    try:
        for spec in strategies:
            profile = str(Path(args.gateway_profile) / "".join(c if c.isalnum() else "_" for c in spec)) \
                if args.gateway_profile else ""
            r = runner(run_strategy(spec, sched, w, em, routing, args.replicas, args.gateway_process,
                                    args.workers, args.redis or None, profile))
            results.append(r)
            print(f"  {spec:<50} mean {r.ttft_mean_ms:7.0f} ms  p50 {r.ttft_p50_ms:6.0f}  p99 {r.ttft_p99_ms:6.0f}  "
                  f"hit {r.cache_hit:4.0%} (reachable {r.reachable_hit:4.0%})  imbalance {r.imbalance:.2f} ({r.imbalance_peak:.2f})  "
                  f"{r.requests} ok {r.errors} err  in-flight/engine {r.mean_in_flight:.1f}  lag {r.loop_lag_ms:.1f} ms  "
                  f"{r.wall_s:.0f} s",
                  file=sys.stderr, flush=True)
    finally:
        for p in list(_CHILDREN):       # a run that ended before its own clean-up (Ctrl-C)
            terminate(p)
            _CHILDREN.remove(p)
        for d in _TREES.values():
            d.cleanup()
    total = time.perf_counter() - t0
    print(markdown(results))
    gateways = f"{args.replicas} gateway replicas" if args.replicas > 1 else "the gateway"
    if args.workers > 1:
        gateways += f" with {args.workers} workers each" if args.replicas > 1 else f" with {args.workers} workers"
    if args.redis:
        gateways += " sharing Redis"
    mode = (f"{gateways} as {'their own processes' if args.replicas > 1 else 'its own process'} "
            f"(`--gateway-process`; imbalance counted at the engines)" if args.gateway_process
            else f"{gateways} in the benchmark's process and event loop")
    print(f"\n{w.engines} engines, {w.duration_s:.0f} s of arrivals per strategy ({w.warmup_s:.0f} s warm-up), "
          f"seed {w.seed}; {mode}; engines publishing KV events "
          f"{'in every run' if args.engines_publish == 'always' else 'only under +events'}"
          f"{', caching their answers' if args.engines_cache_output else ''}; total run {total:.0f} s")
    if args.plot:
        try:
            plot(results, Path(args.plot), f"Switchyard routing benchmark: {w.engines} simulated vLLM engines, "
                 f"{len(sched.conversations)} conversations over {w.system_prompts} system prompts "
                 f"+ {len(sched.singles)} unique prompts, seed {w.seed}")
            print(f"plot: {args.plot}", file=sys.stderr)
        except ImportError:
            print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": asdict(w), "engine": asdict(em),
                                               "gateway_process": args.gateway_process, "replicas": args.replicas,
                                               "results": [asdict(r) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
