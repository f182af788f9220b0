"""``python -m gateway --demo``: the gateway plus simulated engines in one process.

A vLLM-speaking model with two replicas and an SGLang-speaking model with two replicas, on fixed
loopback ports, so a newcomer's first ``curl`` works with no GPU.
"""

from __future__ import annotations

import contextlib

from gateway.config import config_from_dict
from gateway.server import serve

DEMO_ENGINES = [
    # (model, engine, port)
    ("demo-llama", "vllm", 8101),
    ("demo-llama", "vllm", 8102),
    ("demo-qwen", "sglang", 8111),
    ("demo-qwen", "sglang", 8112),
]


def demo_config(host: str | None, port: int | None) -> dict:
    models: dict[str, dict] = {}
    for model, engine, eport in DEMO_ENGINES:
        m = models.setdefault(model, {"name": model, "engine": engine, "endpoints": []})
        m["endpoints"].append(f"http://127.0.0.1:{eport}")
    return {
        "listen": {"host": host or "127.0.0.1", "port": 8888 if port is None else port},
        "routing": {"strategy": "least-request"},
        "health": {"interval_s": 2.0},
        "scrape": {"interval_s": 1.0},
        "models": list(models.values()),
    }


BANNER = """
Switchyard demo: gateway on http://{host}:{{port}} with simulated engines
  demo-llama  (vLLM,   2 replicas: 127.0.0.1:8101, 127.0.0.1:8102)
  demo-qwen   (SGLang, 2 replicas: 127.0.0.1:8111, 127.0.0.1:8112)

Try:
  curl -s http://{host}:{{port}}/v1/models
  curl -s http://{host}:{{port}}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-llama","messages":[{{{{"role":"user","content":"Hello!"}}}}]}}}}'
  curl -sN http://{host}:{{port}}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{{{"model":"demo-qwen","stream":true,"messages":[{{{{"role":"user","content":"Hello!"}}}}]}}}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='http://{host}:{{port}}/v1', api_key='none'); \\
print(c.chat.completions.create(model='demo-llama', messages=[{{{{'role':'user','content':'Hi'}}}}]).choices[0].message.content)"

Metrics: http://{host}:{{port}}/metrics    Stop: Ctrl-C
"""


async def run_demo(host: str | None = None, port: int | None = None) -> None:
    from enginesim import SimConfig, start_sim

    sims = []
    try:
        for model, engine, eport in DEMO_ENGINES:
            sims.append(await start_sim(SimConfig(engine=engine, model=model, port=eport, host="127.0.0.1",
                                                  seed=eport)))
        cfg = config_from_dict(demo_config(host, port), source="<demo>")
        await serve(cfg, ready_message=BANNER.format(host=cfg.listen.host))
    finally:
        for s in sims:
            with contextlib.suppress(Exception):
                await s.close()
