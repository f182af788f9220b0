"""Mid-stream scenario: streams whose engine dies mid-way, with and without migration.

Four engines serve one model (round-robin); two of them are dying: one drops the connection after
16 tokens of half its streams, one ends half its streams with an in-stream error after 24 tokens,
and a third stalls half its streams after 20 tokens (the idle watchdog, 0.5 s, ends them). Every
stream asks for 64 tokens. The same requests run with ``migration_limit: 0`` (today) and
``migration_limit: 2``; the report gives the completion rate (a stream that ends with its finish
reason and ``[DONE]``, no error event) and, for completed streams, whether the content is
byte-identical to the same request answered by a healthy engine directly (enginesim's output is a
deterministic function of its context). Run for vLLM (token-exact continuation) and SGLang
(``continue_final_message``). Engines and gateways are processes on loopback (the runner's
harness); the figures are outcomes, not latency.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

NAME = "mid-stream"
SIM = ["--ttft-base-ms", "2", "--prefill-ms-per-token", "0", "--itl-ms", "2"]
FAULTS = ["drop_after=16;p=0.5", "error_after=24;p=0.5", "stall_after=20:30;p=0.5", ""]


def add_args(ap) -> None:
    ap.add_argument("--mid-requests", type=int, default=400, help="mid-stream: streams per engine type and variant")
    ap.add_argument("--mid-concurrency", type=int, default=16)
    ap.add_argument("--mid-breakers", action="store_true", help="mid-stream: keep the default breakers on")


def _events(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        block = block.strip()
        if block.startswith(b"data:"):
            d = block[5:].strip()
            out.append("[DONE]" if d == b"[DONE]" else orjson.loads(d))
    return out


def _content(events: list) -> tuple[str, bool]:
    text, ok = [], bool(events) and events[-1] == "[DONE]"
    for e in events:
        if isinstance(e, dict):
            if e.get("error"):
                ok = False
            for c in e.get("choices") or ():
                text.append((c.get("delta") or {}).get("content") or "")
    return "".join(text), ok


async def _stream(h, url: str, body: dict) -> tuple[str, bool]:
    try:
        async with h.session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return "", False
            return _content(_events(await r.read()))
    except Exception:
        return "", False


def _migrations(metrics: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("switchyard_migrations_total{"):
            labels = dict(p.split("=", 1) for p in line[line.index("{") + 1:line.index("}")].split(","))
            key = f"{labels['reason'].strip(chr(34))}/{labels['outcome'].strip(chr(34))}"
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


async def _one_engine(h, engine: str, n: int, conc: int, breakers: bool) -> dict[str, Any]:
    urls = []
    for i, f in enumerate(FAULTS):
        url, _ = await h.engine(f"mid-{engine}-{i}", engine, "m", *SIM, *(["--fault", f] if f else []))
        urls.append(url)
    ref_url, ref_p = await h.engine(f"mid-{engine}-ref", engine, "m", *SIM)
    bodies = [{"model": "m", "stream": True, "max_tokens": 64,
               "messages": [{"role": "user", "content": f"story number {i} about a gateway"}]} for i in range(n)]
    sem = asyncio.Semaphore(conc)

    async def bounded(url, b):
        async with sem:
            return await _stream(h, url, b)

    refs = await asyncio.gather(*(bounded(ref_url, b) for b in bodies))
    h.stop(ref_p)
    out: dict[str, Any] = {}
    for limit in (0, 2):
        gw, p = await h.gateway(f"mid-{engine}-gw-{limit}", {
            "health": {"interval_s": 1.0},
            "breaker": {"enabled": breakers},   # off: every variant meets the dying engines as often
            "watchdog": {"idle_timeout_s": 0.5, "first_chunk_timeout_s": 5.0, "aggregated": True},
            "models": [{"name": "m", "engine": engine, "strategy": "round-robin", "endpoints": urls,
                        "migration_limit": limit}]})
        got = await asyncio.gather(*(bounded(gw, b) for b in bodies))
        metrics = await h.metrics(gw)
        h.stop(p)
        done = [i for i, (_, ok) in enumerate(got) if ok]
        out[f"migration_limit={limit}"] = {
            "streams": n, "completed": len(done), "completion_rate": round(len(done) / n, 4),
            "byte_identical": sum(1 for i in done if got[i][0] == refs[i][0]),
            "differing": [{"i": i, "got": got[i][0], "ref": refs[i][0]} for i in done if got[i][0] != refs[i][0]][:3],
            "migrations": _migrations(metrics)}
    return out


async def run(h, args) -> dict[str, Any]:
    return {engine: await _one_engine(h, engine, args.mid_requests, args.mid_concurrency, args.mid_breakers)
            for engine in ("vllm", "sglang")}


def report(r: dict[str, Any]) -> str:
    lines = ["## Mid-stream: streams whose engine dies mid-way", "",
             "| engine | migration_limit | completed | byte-identical to an unbroken run | migrations (reason/outcome) |",
             "|---|---|---|---|---|"]
    for engine, variants in r.items():
        for name, v in variants.items():
            migr = ", ".join(f"{k} {int(c)}" for k, c in sorted(v["migrations"].items())) or "-"
            lines.append(f"| {engine} | {name.split('=')[1]} | {v['completed']}/{v['streams']} "
                         f"({v['completion_rate']:.1%}) | {v['byte_identical']}/{v['completed']} | {migr} |")
    return "\n".join(lines)
