"""Cost of a routing decision on KV events: ``python -m bench.kv_decision_cost``.

``prefix-cache`` on the event index, exactly as the pipeline calls it (``router.route`` on a parsed
request, the post-decision bookkeeping included), for conversations of 8k, 32k and 128k tokens of
the shared test tokenizer (``enginesim.tiny_tokenizer``) over 8 endpoints whose index holds the
conversation's earlier turns. Three cases per size: a *new turn* of a known conversation (the
system prompt and earlier turns come from the tokenization cache; only the new message is
tokenized and hashed), a *cold* prompt (nothing cached: the whole text is tokenized and hashed),
and the approximate index alone for comparison. p50 / p99 in ms over ``--rounds`` decisions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import orjson

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv_index import EventIndex, root_key
from gateway.kv_settings import KVEventsConfig
from gateway.kv_wire import Batch, BlockStored
from gateway.request import CHAT, parse
from gateway.tokenization import ModelTokenizer, chain_keys
from routers.base import RouterContext
from routers.prefix_cache import PrefixCacheRouter


class _View:
    def __init__(self, index: EventIndex) -> None:
        self.index = index

    def covers(self, model: str) -> bool:
        return True

    def match(self, req, candidates):
        return self.index.match(req, candidates)

    def routed(self, req, ep):
        self.index.routed(req, ep)


def _words(rng: random.Random, n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 4))) for _ in range(n))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(tokens: int, rounds: int, seed: int = 1) -> dict[str, tuple[float, float]]:
    rng = random.Random(seed)
    tok = ModelTokenizer(TINY_DIR)
    settings = KVEventsConfig(enabled=True, max_request_blocks=1 << 20, max_blocks_per_endpoint=1 << 22)
    index = EventIndex({"m": tok}, lambda m: settings)
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in range(8)]
    ctx = RouterContext(precise_index=_View(index))
    router = PrefixCacheRouter(ctx)
    approx = PrefixCacheRouter(RouterContext())
    states = [index.track(ep, settings) for ep in eps]
    system = "You are assistant 1. " + _words(rng, int(tokens * 0.7))
    turns = [_words(rng, int(tokens * 0.3 / 8)) for _ in range(8)]
    messages = [{"role": "system", "content": system}]
    for t in turns[:-1]:
        messages += [{"role": "user", "content": t}, {"role": "assistant", "content": "ok " * 8}]

    def body(msgs):
        return orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 4})

    # the engines hold the conversation so far (as events would say): endpoint 3 all of it
    ids = tok.encode(tok.render(messages))
    keys = chain_keys(root_key("m", None, 16), ids, 16)
    for j, st in enumerate(states):
        held = len(keys) if j == 3 else len(keys) // (j + 2)
        index.apply(st, Batch(0.0, [BlockStored(list(range(held)), None, ids[:held * 16], 16)], 0))
    out: dict[str, list[float]] = {"new turn": [], "cold prompt": [], "approximate index": []}
    for r in range(rounds):
        msgs = messages + [{"role": "user", "content": f"round {r}: " + turns[-1]}]
        req = parse(CHAT, body(msgs), {}, f"r{r}")
        t = time.perf_counter()
        router.route(req, eps)
        out["new turn"].append(time.perf_counter() - t)
        req = parse(CHAT, body(msgs), {}, f"a{r}")
        t = time.perf_counter()
        approx.route(req, eps)
        out["approximate index"].append(time.perf_counter() - t)
        if r < max(3, rounds // 10):
            cold = [{"role": "system", "content": f"cold {r} " + system}, *msgs[1:]]
            req = parse(CHAT, body(cold), {}, f"c{r}")
            t = time.perf_counter()
            router.route(req, eps)
            out["cold prompt"].append(time.perf_counter() - t)
    return {k: (1000 * _pct(v, 0.5), 1000 * _pct(v, 0.99)) for k, v in out.items() if v} | \
        {"tokens": (float(len(ids)), statistics.fmean([0.0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[8192, 32768, 131072])
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    print("| prompt | case | p50 (ms) | p99 (ms) |\n|---|---|---:|---:|")
    for size in args.sizes:
        res = measure(size, args.rounds)
        n = int(res.pop("tokens")[0])
        for case, (p50, p99) in res.items():
            print(f"| {size // 1024}k ({n} tokens) | {case} | {p50:.2f} | {p99:.2f} |")


if __name__ == "__main__":
    main()
