"""Adapter-aware routing and conditional disaggregation, measured: ``python bench/lora_pd.py``.

Everything runs in this process on 127.0.0.1: simulated vLLM engines (``enginesim``) and a gateway.
TTFT is measured at the client, from sending the request to the first streamed content chunk.

``--scenario lora``: 4 engines serving one base model with LoRA on, ``--max-loras`` GPU slots each
and a cold load of ``--lora-load-ms`` whenever an adapter enters a slot; ``--adapters`` adapters
registered on every engine, each with its own system prompt. ``--clients`` closed-loop clients
send ``--requests`` chat requests in all, each for an adapter drawn uniformly, once with
``routing-strategy: least-request`` and once with the adapter-aware default (``lora-affinity``).

``--scenario pd``: one vLLM prefill and one vLLM decode engine (a roleset), and ``--conversations``
conversations of ``--turns`` turns played by as many clients; each turn resends the history plus a
new user message. Once with the default (every request disaggregated) and once with
``pd.disaggregate_min_uncached_tokens: 512`` (a turn whose history the decode holds runs whole on
the decode).

The report: requests, mean / p50 / p99 TTFT per arm, and the ratio of the means; ``--json`` writes
it to a file. ``--plot [PATH]`` draws each arm's TTFT distribution (CDF, and a box of p1..p99) with
matplotlib (``pip install -e '.[bench]'``): by default ``bench/lora.png`` for ``lora`` and
``bench/pd_conditional.png`` for ``pd``, with every setting the figure depends on in its title.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import textwrap
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plots import box_and_save  # noqa: E402
from enginesim import SimConfig, start_sim  # noqa: E402
from gateway.config.schema import config_from_dict  # noqa: E402
from gateway.server.run import start  # noqa: E402

WORDS = ("route", "adapter", "cache", "token", "engine", "queue", "batch", "decode", "prefill", "slot")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def gateway(models: list[dict], **blocks):
    raw = {"listen": {"host": "127.0.0.1", "port": 0}, "scrape": {"interval_s": 0.25},
           "health": {"interval_s": 1.0}, "server": {"log_level": "warning", "shutdown_grace_s": 1.0},
           "models": models, **blocks}
    runner, _app, port = await start(config_from_dict(raw, source="<bench>"))
    return runner, f"http://127.0.0.1:{port}"


async def ttft(session: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> float:
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"status {r.status}: {await r.text()}")
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


PLOTS = {"lora": Path(__file__).with_name("lora.png"), "pd": Path(__file__).with_name("pd_conditional.png")}


def settings_line(args) -> str:
    """Every knob the figures of a scenario depend on, for the plot's title and the printout."""
    if args.scenario == "lora":
        return (f"4 simulated vLLM engines, {args.adapters} adapters, {args.max_loras} GPU slots each, "
                f"{args.lora_load_ms:g} ms cold load; {args.clients} closed-loop clients, {args.requests} "
                f"streams of {args.max_tokens} tokens; ttft_base 5 ms, prefill 0.02 ms/token; seed {args.seed}")
    return (f"1 prefill + 1 decode (simulated vLLM), {args.conversations} conversations x {args.turns} turns, "
            f"{args.max_tokens} tokens per answer; prefill {args.prefill_ms_per_token:g} ms/token, KV transfer "
            f"{args.kv_transfer_ms_per_token:g} ms/token; conditional: disaggregate_min_uncached_tokens 512; "
            f"seed {args.seed}")


def plot(report: dict, samples: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a["arm"] for a in report["arms"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for i, arm in enumerate(arms):
        v = sorted(1000 * x for x in samples[arm])
        n = len(v)
        ax1.plot(v, [(k + 1) / n for k in range(n)], "--" if i == 0 else "-", lw=1.4 if i == 0 else 2.2,
                 label=f"{arm} (mean {report['arms'][i]['mean_ms']:.0f} ms)")
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT at the client (ms, log scale)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT distribution (CDF)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8, loc="lower right")
    box_and_save(fig, ax2, [[1000 * x for x in samples[a]] for a in arms], arms, title, path, fontsize=8)


def summary(name: str, values: list[float]) -> dict:
    v = sorted(values)
    return {"arm": name, "requests": len(v), "mean_ms": round(1000 * statistics.fmean(v), 1),
            "p50_ms": round(1000 * v[len(v) // 2], 1), "p99_ms": round(1000 * v[min(len(v) - 1, int(len(v) * 0.99))], 1)}


# -- LoRA ------------------------------------------------------------------------------------------

async def lora_arm(args, strategy: str | None) -> list[float]:
    names = [f"task-{i}" for i in range(args.adapters)]
    sims = [await start_sim(SimConfig(port=0, model="base", enable_lora=True, max_loras=args.max_loras,
                                      lora_load_ms=args.lora_load_ms, lora_modules=tuple(f"{n}=org/{n}" for n in names),
                                      ttft_base_ms=5.0, prefill_ms_per_token=0.02, itl_ms=5.0, seed=i))
            for i in range(4)]
    runner, url = await gateway([{"name": "base", "endpoints": [s.url for s in sims]}],
                                lora={"discovery_interval_s": 0.2})
    rng = random.Random(args.seed)
    prompts = {n: f"You are the {n} assistant. " + text(rng, 300) for n in names}
    headers = {"routing-strategy": strategy} if strategy else {}
    out: list[float] = []
    left = args.requests
    try:
        await asyncio.sleep(0.6)        # discovery and a first scrape
        async with aiohttp.ClientSession() as session:
            async def client(seed: int) -> None:
                nonlocal left
                crng = random.Random(seed)
                while left > 0:
                    left -= 1
                    name = crng.choice(names)
                    body = {"model": name, "max_tokens": args.max_tokens,
                            "messages": [{"role": "system", "content": prompts[name]},
                                         {"role": "user", "content": text(crng, 20)}]}
                    out.append(await ttft(session, url, body, headers))
            await asyncio.gather(*(client(args.seed * 1000 + c) for c in range(args.clients)))
    finally:
        await runner.cleanup()
        for s in sims:
            await s.close()
    return out


# -- conditional P/D -------------------------------------------------------------------------------

async def pd_arm(args, conditional: bool) -> list[float]:
    common = {"model": "m", "ttft_base_ms": 5.0, "prefill_ms_per_token": args.prefill_ms_per_token,
              "kv_transfer_ms_per_token": args.kv_transfer_ms_per_token, "itl_ms": 5.0, "port": 0}
    p = await start_sim(SimConfig(role="prefill", **common))
    d = await start_sim(SimConfig(role="decode", **common))
    pd = {"disaggregate_min_uncached_tokens": 512} if conditional else {}
    runner, url = await gateway([{"name": "m", "rolesets": [{"name": "rs", "prefill": [p.url], "decode": [d.url]}],
                                  **({"pd": pd} if pd else {})}])
    out: list[float] = []
    try:
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as session:
            async def conversation(seed: int) -> None:
                rng = random.Random(seed)
                messages = [{"role": "system", "content": f"Conversation {seed}. " + text(rng, 400)}]
                for _ in range(args.turns):
                    messages.append({"role": "user", "content": text(rng, 60)})
                    out.append(await ttft(session, url, {"model": "m", "messages": messages,
                                                         "max_tokens": args.max_tokens}, {}))
                    messages.append({"role": "assistant", "content": text(rng, args.max_tokens)})
            await asyncio.gather(*(conversation(args.seed * 1000 + c) for c in range(args.conversations)))
    finally:
        await runner.cleanup()
        await p.close()
        await d.close()
    return out


async def main_async(args, samples: dict[str, list[float]] | None = None) -> dict:
    """The report; each arm's TTFTs (seconds) go into ``samples`` when given (for the plot)."""
    report: dict = {"scenario": args.scenario, "settings": settings_line(args)}
    if args.scenario == "lora":
        arms = [("least-request", await lora_arm(args, "least-request")), ("lora-affinity", await lora_arm(args, None))]
    else:
        arms = [("always-disaggregate", await pd_arm(args, False)), ("conditional", await pd_arm(args, True))]
    if samples is not None:
        samples.update(arms)
    base, best = (summary(name, v) for name, v in arms)
    report["arms"] = [base, best]
    report["mean_ttft_ratio"] = round(best["mean_ms"] / base["mean_ms"], 3)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=("lora", "pd"), default="lora")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--lora-load-ms", type=float, default=100.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    ap.add_argument("--kv-transfer-ms-per-token", type=float, default=0.1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", nargs="?", const="", default=None, metavar="PATH",
                    help="draw the TTFT distributions (default path: bench/lora.png or bench/pd_conditional.png)")
    args = ap.parse_args(argv)
    samples: dict[str, list[float]] = {}
    report = asyncio.run(main_async(args, samples))
    print(report["settings"])
    print(f"{'arm':22} {'requests':>8} {'mean ms':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for a in report["arms"]:
        print(f"{a['arm']:22} {a['requests']:8d} {a['mean_ms']:9.1f} {a['p50_ms']:8.1f} {a['p99_ms']:8.1f}")
    print(f"mean TTFT ratio: {report['mean_ttft_ratio']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot is not None:
        path = Path(args.plot) if args.plot else PLOTS[args.scenario]
        what = "adapter-aware routing" if args.scenario == "lora" else "conditional disaggregation"
        try:
            title = textwrap.fill(f"Switchyard {what}: {report['settings']}", 150)
            plot(report, samples, path, f"{title}\nmean TTFT ratio {report['mean_ttft_ratio']:.2f}")
            print(f"plot: {path}", file=sys.stderr)
        except ImportError:
            print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
