"""Resilience benchmarks (issue 15): what clients see when engines fail or the fleet is overloaded.

``python -m bench.resilience --scenario sick-engine[,other]`` (``make bench-resilience``) runs each
named scenario and writes one Markdown report (stdout, ``bench/out/resilience-<stamp>.md`` and
``.json``, ``resilience-latest.*``). A scenario is a module ``bench/resilience_<name>.py``,
registered with one line in ``SCENARIOS``, exposing:

- ``add_args(parser)``: its own options (prefixed with its name);
- ``async run(h: Harness, args) -> dict``: the figures (JSON-able), using the harness below;
- ``report(result: dict) -> str``: its Markdown section.

The harness starts simulated engines (``python -m enginesim``) and gateways (``python -m gateway``)
as processes on loopback ports, each in its own session and stopped by its pid on every exit path,
and has a small streaming client that records what a client sees: the status, the time to the
first token, whether the stream completed, and the ``target-pod`` / ``x-retries`` headers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.soak import Procs, free_port, machine_info, wait_http

# scenario name → module; one line per scenario
SCENARIOS: dict[str, str] = {
    "sick-engine": "bench.resilience_sick",
    "overload": "bench.resilience_overload",
    "mid-stream": "bench.resilience_midstream",
    "priorities": "bench.resilience_priorities",
    "fairness": "bench.resilience_fairness",
    "slo-overload": "bench.resilience_slo",
    "engine-death": "bench.resilience_death",
}

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"


@dataclass
class Answer:
    """What one client saw."""

    status: int = 0
    ok: bool = False                 # a 200 whose stream completed (``[DONE]``, no error event)
    ttft: float | None = None        # seconds to the first content token
    latency: float = 0.0
    endpoint: str = ""
    prefill: str = ""                # P/D: the prefill endpoint (``prefill-target-pod``)
    retries: int = 0
    error: str = ""
    started: float = 0.0


@dataclass
class Harness:
    logdir: Path
    procs: Procs = field(init=False)
    session: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        self.procs = Procs(self.logdir)

    async def __aenter__(self) -> Harness:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=120))
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()
        self.procs.stop_all()

    # -- processes -----------------------------------------------------------------------------

    async def engine(self, name: str, engine: str = "vllm", model: str = "m", *extra: str) -> tuple[str, Any]:
        port = free_port()
        p = self.procs.start(name, [sys.executable, "-m", "enginesim", "--engine", engine, "--role", "aggregated",
                                    "--host", "127.0.0.1", "--port", str(port), "--model", model, *extra])
        url = f"http://127.0.0.1:{port}"
        assert self.session is not None
        if not await wait_http(self.session, url + "/health", p, 30):
            raise RuntimeError(f"engine {name} did not start (see {self.logdir}/{name}.log)")
        return url, p

    async def gateway(self, name: str, config: dict) -> tuple[str, Any]:
        port = free_port()
        cfg = {"listen": {"host": "127.0.0.1", "port": port},
               "server": {"log_level": "warning", "shutdown_grace_s": 2, "drain_delay_s": 0}, **config}
        path = self.logdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        p = self.procs.start(name, [sys.executable, "-m", "gateway", "--config", str(path)])
        url = f"http://127.0.0.1:{port}"
        assert self.session is not None
        if not await wait_http(self.session, url + "/ready", p, 30):
            raise RuntimeError(f"gateway {name} did not start (see {self.logdir}/{name}.log)")
        return url, p

    def stop(self, p) -> None:
        self.procs.stop(p, grace=2.0)

    async def sim_config(self, url: str, **cfg) -> None:
        assert self.session is not None
        async with self.session.post(url + "/_sim/config", json=cfg) as r:
            r.raise_for_status()

    async def metrics(self, url: str) -> str:
        assert self.session is not None
        async with self.session.get(url + "/metrics") as r:
            return await r.text()

    # -- the client ----------------------------------------------------------------------------

    async def chat(self, base: str, model: str = "m", max_tokens: int = 16, prompt: str = "hello there",
                   headers: dict[str, str] | None = None) -> Answer:
        """One streaming chat completion, as a client sees it."""
        assert self.session is not None
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                "max_tokens": max_tokens}
        a = Answer(started=time.perf_counter())
        try:
            async with self.session.post(base + "/v1/chat/completions", json=body, headers=headers or {}) as r:
                a.status = r.status
                a.endpoint = r.headers.get("target-pod", "")
                a.prefill = r.headers.get("prefill-target-pod", "")
                a.retries = int(r.headers.get("x-retries", "0"))
                if r.status != 200:
                    a.error = f"status {r.status}"
                    await r.read()
                else:
                    done = False
                    buf = b""
                    async for chunk in r.content.iter_any():
                        buf += chunk
                        while b"\n\n" in buf:
                            event, buf = buf.split(b"\n\n", 1)
                            data = event.removeprefix(b"data: ")
                            if data == b"[DONE]":
                                done = True
                                continue
                            with contextlib.suppress(orjson.JSONDecodeError):
                                obj = orjson.loads(data)
                                if "error" in obj:
                                    a.error = "error event"
                                elif a.ttft is None and obj.get("choices") and \
                                        obj["choices"][0].get("delta", {}).get("content"):
                                    a.ttft = time.perf_counter() - a.started
                    a.ok = done and not a.error
                    if not a.ok and not a.error:
                        a.error = "incomplete stream"
        except (aiohttp.ClientError, TimeoutError) as e:
            a.error = type(e).__name__
        a.latency = time.perf_counter() - a.started
        return a

    async def load(self, base: str, n: int, concurrency: int, **kw) -> list[Answer]:
        """``n`` requests, ``concurrency`` at a time (closed loop)."""
        answers: list[Answer] = []
        left = iter(range(n))

        async def worker() -> None:
            for _ in left:
                answers.append(await self.chat(base, **kw))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return answers


async def read_stream(r, t0: float) -> tuple[bool, float | None]:
    """Read a streamed answer to its end: whether it ended with ``[DONE]``, and the seconds from
    ``t0`` to its first chunk carrying generated text (None: none came)."""
    done, ttft, buf = False, None, b""
    async for chunk in r.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                done = True
            elif ttft is None and b'"content":"' in data and b'"content":""' not in data:
                ttft = time.perf_counter() - t0
    return done, ttft


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(answers: list[Answer]) -> dict:
    ttfts = [a.ttft for a in answers if a.ok and a.ttft is not None]
    errors: dict[str, int] = {}
    for a in answers:
        if not a.ok:
            errors[a.error] = errors.get(a.error, 0) + 1
    return {"requests": len(answers), "failed": sum(1 for a in answers if not a.ok),
            "error_rate": sum(1 for a in answers if not a.ok) / max(1, len(answers)),
            "ttft_p50_ms": _ms(quantile(ttfts, 0.5)), "ttft_p99_ms": _ms(quantile(ttfts, 0.99)),
            "retried": sum(1 for a in answers if a.retries), "retries": sum(a.retries for a in answers),
            "errors": errors}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=",".join(SCENARIOS),
                    help=f"comma-separated scenarios (default: all): {', '.join(SCENARIOS)}")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--logdir", type=Path, default=None, help="keep the processes' logs here")
    modules = {name: importlib.import_module(mod) for name, mod in SCENARIOS.items()}
    for m in modules.values():
        m.add_args(ap)
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.scenario.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    result: dict[str, Any] = {"machine": machine_info(), "scenarios": {}}
    with contextlib.ExitStack() as stack:
        logdir = args.logdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="resilience-")))
        logdir.mkdir(parents=True, exist_ok=True)
        for name in names:
            async def one(name=name):
                async with Harness(logdir) as h:
                    return await modules[name].run(h, args)
            print(f"# {name} ...", file=sys.stderr, flush=True)
            result["scenarios"][name] = asyncio.run(one())
    m = result["machine"]
    md = [f"# Resilience benchmarks ({m['date']}, commit {m['commit']}, {m['cpus']} CPUs: {m['cpu']}, "
          f"Python {m['python']})", ""]
    for name, r in result["scenarios"].items():
        md += [modules[name].report(r), ""]
    text = "\n".join(md)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    for suffix, data in ((".md", text), (".json", orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())):
        (args.out / f"resilience-{stamp}{suffix}").write_text(data)
        (args.out / f"resilience-latest{suffix}").write_text(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
