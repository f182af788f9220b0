"""``python -m gateway --demo``: the gateway plus simulated engines in one process.

Two aggregated models (vLLM-speaking and SGLang-speaking, two replicas each), two P/D models
(one prefill + one decode each), and ``demo-kv`` (two vLLM replicas that publish KV-cache events,
routed by ``prefix-cache`` on what they report holding), on fixed loopback ports, so a newcomer's
first ``curl`` works with no GPU; and an alias, ``demo-chat``, that splits callers 90/10 over the two aggregated models
(a canary, sticky per user). With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, the gateway and the engines send traces
there.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.config.schema import config_from_dict
from gateway.observability.tracing import TracingConfig, resolve
from gateway.server.run import ListenError, serve

# each engine's tool-call parser, as `vllm serve --tool-call-parser` and SGLang's take it
TOOL_CALL_PARSERS = {"vllm": "hermes", "sglang": "qwen25"}

# (model, engine, role, port, simulator knobs, endpoint entry knobs): the P/D prefills' side ports
# are the vLLM KV side channel and the SGLang bootstrap port, which the SGLang endpoint names too
# demo-llama's engines queue by priority (vLLM --scheduling-policy priority), so the class admission
# writes into each request (engine_priority) orders what waits in them
DEMO_LLAMA_SCHEDULING = {"scheduling_policy": "priority"}
DEMO_ENGINES = [
    ("demo-llama", "vllm", "aggregated", 8101,
     {"enable_lora": True, "max_loras": 2, "lora_modules": ("sql-lora=adapters/sql-lora",), **DEMO_LLAMA_SCHEDULING},
     {}),
    ("demo-llama", "vllm", "aggregated", 8102, {"enable_lora": True, "max_loras": 2, **DEMO_LLAMA_SCHEDULING}, {}),
    ("demo-qwen", "sglang", "aggregated", 8111, {}, {}),
    ("demo-qwen", "sglang", "aggregated", 8112, {}, {}),
    ("demo-llama-pd", "vllm", "prefill", 8121, {"side_channel_port": 8125, "enable_lora": True, "max_loras": 2}, {}),
    ("demo-llama-pd", "vllm", "decode", 8122, {"enable_lora": True, "max_loras": 2}, {}),
    ("demo-qwen-pd", "sglang", "prefill", 8131, {"bootstrap_port": 8998}, {"bootstrap_port": 8998}),
    ("demo-qwen-pd", "sglang", "decode", 8132, {}, {}),
    # KV events: each engine publishes on its own ports (vLLM --kv-events-config), named by its
    # endpoint entry; both share the small tokenizer the gateway renders and tokenizes prompts with,
    # and cache the blocks their answers fill, as vLLM does (a conversation's next turn hits them)
    ("demo-kv", "vllm", "aggregated", 8141,
     {"tokenizer": str(TINY_DIR), "kv_events_port": 8145, "kv_events_replay_port": 8146, "cache_output_blocks": True},
     {"kv_events": {"port": 8145, "replay_port": 8146}}),
    # the second is data-parallel (two ranks, each its own cache, rank r publishing on port + r):
    # the gateway pins each request to the rank holding its prefix (X-data-parallel-rank)
    ("demo-kv", "vllm", "aggregated", 8142,
     {"tokenizer": str(TINY_DIR), "kv_events_port": 8147, "kv_events_replay_port": 8149, "data_parallel_size": 2,
      "cache_output_blocks": True},
     {"kv_events": {"port": 8147, "replay_port": 8149, "data_parallel_size": 2}}),
]

# every port the engines above take (HTTP, the P/D side ports, the KV-event publishers and their
# replay ports, rank r of a data-parallel engine on port + r), as a newcomer whose port is taken reads them
DEMO_ENGINE_PORTS = "8101-8150 and 8998"


# an alias as a canary roll-out looks: most users on one model, a sticky 10% on the other
# ten callers for the banner's loop; one of them (oscar) is in the 10%
DEMO_USERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "oscar")
# LoRA adapters of demo-llama: sql-lora is already loaded on :8101 (the gateway finds it in that
# engine's /v1/models); chat-lora is loaded on demand by the first request that names it
DEMO_ADAPTERS = {"sql-lora": "adapters/sql-lora", "chat-lora": "adapters/chat-lora"}
# demo-llama-pd's adapter, loaded on its prefill and its decode by the first request that names it
DEMO_PD_ADAPTERS = {"pd-lora": "adapters/pd-lora"}
# at most 4 adapters per engine (the least recently used idle one makes room), and an adapter the
# gateway loaded goes after 10 idle minutes
DEMO_LORA = {"max_adapters_per_endpoint": 4, "idle_unload_s": 600}
DEMO_ALIASES = [{"name": "demo-chat", "sticky": "user",
                 "targets": [{"model": "demo-llama", "weight": 90}, {"model": "demo-qwen", "weight": 10}]}]


# admission control on demo-llama: four requests at a time per replica, sixteen more may wait; a
# burst of forty shows the queue and the 429s with their computed Retry-After. Each request carries
# its class to the engine (vLLM: lower runs first), so a more urgent one passes those already waiting
# in an engine's queue
DEMO_ADMISSION = {"enabled": True, "max_in_flight_per_endpoint": 4, "queue_max": 16, "queue_timeout_s": 10,
                  "engine_priority": {"critical": -1, "standard": 0, "sheddable": 1}}


def demo_config(host: str | None, port: int | None, log_format: str = "auto", batch_dir: str | None = None) -> dict:
    """``batch_dir``: where the Files and Batches API keeps its files and jobs (None: batch off)."""
    models: dict[str, dict] = {}
    for model, engine, role, eport, _sim, entry in DEMO_ENGINES:
        m = models.setdefault(model, {"name": model, "engine": engine})
        url = f"http://127.0.0.1:{eport}"
        if role == "aggregated":
            m.setdefault("endpoints", []).append({"url": url, **entry} if entry else url)
            if model == "demo-llama":
                m["adapters"] = DEMO_ADAPTERS
            continue
        rs = m.setdefault("rolesets", [{"name": "rs-1", "prefill": [], "decode": []}])[0]
        rs[role].append({"url": url, **entry} if entry else url)
    models["demo-llama-pd"]["adapters"] = DEMO_PD_ADAPTERS
    models["demo-llama"]["admission"] = DEMO_ADMISSION
    models["demo-llama"]["migration_limit"] = 2      # a stream whose engine dies goes on elsewhere
    # prefix-cache on the engines' own reports; the endpoint entries name each engine's ports
    models["demo-kv"].update({"strategy": "prefix-cache", "tokenizer": str(TINY_DIR), "kv_events": {"enabled": True}})
    return {
        "listen": {"host": host or "127.0.0.1", "port": 8888 if port is None else port},
        # a page on any origin may call the demo from a browser (docs/apis.md, Browsers (CORS))
        "server": {"log_format": log_format, "cors_allowed_origins": ["*"]},
        "routing": {"strategy": "least-request"},
        "health": {"interval_s": 2.0},
        "scrape": {"interval_s": 1.0},
        "models": list(models.values()),
        "aliases": DEMO_ALIASES,
        "lora": DEMO_LORA,
        **({"batch": {"enabled": True, "dir": batch_dir, "poll_interval_s": 0.1}} if batch_dir else {}),
    }


BANNER = """
Switchyard demo: gateway on http://{host}:{{port}} with simulated engines
  demo-llama     vLLM,   2 replicas (127.0.0.1:8101, :8102)
  demo-qwen      SGLang, 2 replicas (127.0.0.1:8111, :8112)
  demo-llama-pd  vLLM P/D:   prefill 127.0.0.1:8121, decode :8122
  demo-qwen-pd   SGLang P/D: prefill 127.0.0.1:8131 (bootstrap 8998), decode :8132
  demo-kv        vLLM,   2 replicas (127.0.0.1:8141, :8142) publishing KV-cache events (ZMQ on
                 :8145 and :8147/:8148, replay :8146 and :8149/:8150); prefix-cache routes on what
                 each engine holds; :8142 has 2 data-parallel ranks, each request pinned to the
                 rank holding its prefix (X-data-parallel-rank, the log line's dp_rank)
  demo-chat      alias: 90% of users to demo-llama, 10% to demo-qwen (sticky per user)
  sql-lora, chat-lora   LoRA adapters of demo-llama (sql-lora loaded on :8101; chat-lora loaded
                 on demand by the first request that names it); pd-lora of demo-llama-pd, loaded
                 on its prefill and decode on demand; idle adapters the gateway loaded go after 10 min
  admission control on demo-llama: 4 requests at a time per replica, 16 more may queue, then 429;
                 the engines queue by the class the gateway writes in each request (engine_priority)

Try:
  curl -s http://{host}:{{port}}/v1/models
  curl -s http://{host}:{{port}}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-llama","messages":[{{{{"role":"user","content":"Hello!"}}}}]}}}}'
  curl -sN http://{host}:{{port}}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-qwen-pd","stream":true,"messages":[{{{{"role":"user","content":"Hello!"}}}}]}}}}'

  for u in {users}; do curl -si http://{host}:{{port}}/v1/chat/completions \\
       -H 'Content-Type: application/json' -d '{{{{"model":"demo-chat","user":"'$u'","messages":[{{{{"role":"user","content":"Hi"}}}}]}}}}' \\
       | grep -i '^x-served-model'; done

  for i in $(seq 40); do curl -s -o /dev/null -w '%{{{{http_code}}}} ' http://{host}:{{port}}/v1/chat/completions \\
       -H 'Content-Type: application/json' -d '{{{{"model":"demo-llama","max_tokens":64,"messages":[{{{{"role":"user","content":"Hi"}}}}]}}}}' & done; wait
  curl -s http://{host}:{{port}}/metrics | grep -E '^switchyard_admission_(shed|queue_depth)'

  # the python lines need the OpenAI SDK, which the gateway does not: pip install openai
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://{host}:{{port}}/v1', api_key='none'); \\
print(c.chat.completions.create(model='demo-llama-pd', messages=[{{{{'role':'user','content':'Hi'}}}}]).choices[0].message.content)"
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://{host}:{{port}}/v1', api_key='none'); \\
r = c.responses.create(model='demo-llama', input='Hi'); \\
print(c.responses.create(model='demo-llama', input='More', previous_response_id=r.id).output_text)"
  curl -sN http://{host}:{{port}}/v1/messages -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-llama","max_tokens":16,"stream":true,"messages":[{{{{"role":"user","content":"Hello!"}}}}]}}}}'
  curl -s http://{host}:{{port}}/v1/messages -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-qwen","max_tokens":16,"messages":[{{{{"role":"user","content":"Hello!"}}}}]}}}}'   # SGLang's dialect
  curl -si http://{host}:{{port}}/v1/messages -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-llama-pd","max_tokens":16,"messages":[{{{{"role":"user","content":"Hello!"}}}}]}}}}'   # over the P/D pair
  curl -s http://{host}:{{port}}/v1/rerank -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-qwen","query":"red apple","documents":["green pear","red apple pie"]}}}}'
  curl -s http://{host}:{{port}}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{{{"model":"chat-lora","messages":[{{{{"role":"user","content":"Hi"}}}}]}}}}'   # loads it, then answers
  curl -s http://{host}:{{port}}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{{{"model":"pd-lora","messages":[{{{{"role":"user","content":"Hi"}}}}]}}}}'     # loads it on both roles
  curl -sD - -o /dev/null http://{host}:{{port}}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-llama-pd","messages":[{{{{"role":"user","content":"Hi"}}}}]}}}}' | grep -i '^x-pd-decision'

A batch (OpenAI's Files and Batches API): it runs as the lowest priority class, on idle slots only:
  python -c "from openai import OpenAI; import json, time; c = OpenAI(base_url='http://{host}:{{port}}/v1', api_key='none'); \\
rows = [json.dumps(dict(custom_id='q%d' % i, method='POST', url='/v1/chat/completions', body=dict(model='demo-llama', \\
max_tokens=8, messages=[dict(role='user', content='Question %d' % i)]))) for i in range(3)]; \\
f = c.files.create(file=('in.jsonl', '\\n'.join(rows).encode()), purpose='batch'); \\
b = c.batches.create(input_file_id=f.id, endpoint='/v1/chat/completions', completion_window='24h'); \\
[time.sleep(0.2) for _ in iter(lambda: c.batches.retrieve(b.id).status in ('completed', 'failed'), True)]; \\
print(c.files.content(c.batches.retrieve(b.id).output_file_id).text)"

Mid-stream continuation (demo-llama has migration_limit 2): make a replica drop every stream after
4 tokens; of four streams sent at once (least-request puts some on each replica), those it was
serving finish on the other replica, one stream each to the client:
  curl -s http://127.0.0.1:8102/_sim/config -d '{{{{"fault":"drop_after=4"}}}}' >/dev/null
  for i in 1 2 3 4; do (curl -sN http://{host}:{{port}}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-llama","stream":true,"max_tokens":12,"messages":[{{{{"role":"user","content":"Go"}}}}]}}}}' | tail -c 200; echo) & done; wait
  curl -s http://{host}:{{port}}/metrics | grep '^switchyard_migrations_total'
  curl -s http://127.0.0.1:8102/_sim/config -d '{{{{"fault":"none"}}}}' >/dev/null

Breakers and retries: make a demo-llama replica sick (its /health stays fine; 70% of its answers a
500, the rest dropped connections), send traffic, watch its breaker open after 5 faults in a row
(x-retries shows each fault retried on the other replica), then heal it:
  curl -s http://127.0.0.1:8102/_sim/config -d '{{{{"fault":"status=500;p=0.7|drop_after=4"}}}}' >/dev/null
  for i in $(seq 30); do curl -s -o /dev/null -D - http://{host}:{{port}}/v1/chat/completions \\
       -H 'Content-Type: application/json' -d '{{{{"model":"demo-llama","messages":[{{{{"role":"user","content":"Hi"}}}}]}}}}' \\
       | grep -i -e '^HTTP' -e '^x-retries'; done
  curl -s http://{host}:{{port}}/metrics | grep -e '^switchyard_breaker_state' -e '^switchyard_retries_total'
  curl -s http://127.0.0.1:8102/_sim/config -d '{{{{"fault":"none"}}}}' >/dev/null

KV-cache events (demo-kv): the second turn of a conversation lands on the engine that reported
caching the first (cached_tokens in its usage); then the same two turns under a cache_salt, a
tenant's own cache (the engine folds the salt into its block hashes and names it in its events, so
the first salted turn finds nothing cached and the second finds the first); the gateway's event
index is in the metrics, and so are the answers it tokenized ahead of a conversation's next turn
(and, once a next turn sent one back, whether the engine held it: answers_met), the chats it put
together from their shape instead of rendering the chat template, and whether tiktoken encodes
the model's prompts (fast_tokenizer, with its checks against the tokenizers library):
  sys=$(for i in $(seq 40); do printf 'Rule %s: answer in one short line. ' $i; done)
  for salt in '' ',"cache_salt":"tenant-b"'; do for q in first second; do curl -s http://{host}:{{port}}/v1/chat/completions \\
       -H 'Content-Type: application/json' -d '{{{{"model":"demo-kv"'"$salt"',"max_tokens":4,"messages":[{{{{"role":"system","content":"'"$sys"'"}}}},{{{{"role":"user","content":"'$q' question"}}}}]}}}}' \\
       | grep -o '"cached_tokens":[0-9]*'; done; done
  curl -s http://{host}:{{port}}/metrics | grep -e '^switchyard_kv_events_index_blocks' -e '^switchyard_kv_events_endpoint_live' \\
       -e '^switchyard_kv_events_total' -e '^switchyard_kv_events_answers' -e '^switchyard_kv_events_chat_renders_total' \\
       -e '^switchyard_kv_events_fast_tokenizer'

Browsers (CORS; the demo lets any origin call it): a page's preflight, then its answer's CORS headers:
  curl -s -o /dev/null -D - -X OPTIONS http://{host}:{{port}}/v1/chat/completions -H 'Origin: https://app.example' \\
       -H 'Access-Control-Request-Method: POST' -H 'Access-Control-Request-Headers: authorization, content-type' \\
       | grep -i -e '^HTTP' -e '^access-control'

Status page: http://{host}:{{port}}/status    (live: endpoints, traffic, routing decisions, errors)
Metrics: http://{host}:{{port}}/metrics    Stop: Ctrl-C
{tracing}"""

TRACING_OFF = ("Tracing: off. With an OTLP collector (e.g. Jaeger) on :4318, run with "
               "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318\n")
TRACING_ON = "Tracing: the gateway and every simulated engine send spans to {endpoint}\n"


async def run_demo(host: str | None = None, port: int | None = None, log_format: str = "auto") -> None:
    import zmq

    from enginesim import SimConfig, start_sim

    # the engines answer requests offering tools with calls (TOOL_CALL_PARSERS)
    # tracing follows the OTEL_* variables (the gateway's tracing block is left at its defaults);
    # the engines trace like vLLM with --otlp-traces-endpoint, so their spans join the gateway's
    traces = resolve(TracingConfig())
    sim_traces = traces.endpoint if traces.enabled and traces.protocol == "http/protobuf" else ""
    sims = []
    batch_dir = tempfile.mkdtemp(prefix="switchyard-demo-batch-")     # the demo's batches end with it
    try:
        cfg = config_from_dict(demo_config(host, port, log_format, batch_dir), source="<demo>")
        if cfg.listen.port:     # its own port first: one taken (8888 is Jupyter's too) costs no engine start
            try:
                probe = await asyncio.get_running_loop().create_server(asyncio.Protocol, cfg.listen.host, cfg.listen.port)
            except OSError as e:
                raise ListenError(f"cannot listen on {cfg.listen.host}:{cfg.listen.port}: {e}") from None
            probe.close()
            await probe.wait_closed()
        for model, engine, role, eport, kw, _entry in DEMO_ENGINES:
            try:
                sims.append(await start_sim(SimConfig(engine=engine, model=model, role=role, port=eport,
                                                      host="127.0.0.1", seed=eport, otlp_traces_endpoint=sim_traces,
                                                      enable_responses_store=True,
                                                      tool_call_parser=TOOL_CALL_PARSERS[engine], **kw)))
            except (OSError, zmq.ZMQError) as e:      # a port taken: its HTTP port, a side port, a KV-event port
                raise ListenError(f"the demo cannot start its simulated engine {model} on 127.0.0.1:{eport}: {e} "
                                  f"(the demo's engines listen on 127.0.0.1 ports {DEMO_ENGINE_PORTS})") from None
        note = TRACING_ON.format(endpoint=traces.endpoint) if traces.enabled else TRACING_OFF
        await serve(cfg, ready_message=BANNER.format(host=cfg.listen.host, tracing=note, users=" ".join(DEMO_USERS)))
    finally:
        for s in sims:
            with contextlib.suppress(Exception):
                await s.close()
        shutil.rmtree(batch_dir, ignore_errors=True)
