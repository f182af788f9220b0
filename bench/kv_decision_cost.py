"""Cost of a routing decision on KV events: ``python -m bench.kv_decision_cost``.

``prefix-cache`` on the event index, exactly as the pipeline calls it (``router.route`` on a parsed
request, the post-decision bookkeeping included), for prompts of exactly 8k, 32k and 128k tokens
(8,192, 32,768 and 131,072) of the shared test tokenizer (``enginesim.tiny_tokenizer``) over 8
endpoints whose index holds the conversation's earlier turns. A prompt is a system prompt, seven
earlier turns and a new user message of ``--turn-tokens`` (about 200 tokens, a chat question).
Four cases per size: a *new turn* of a known conversation (the previous turn was routed, so the
system prompt and earlier turns come from the tokenization cache and only the new message is
tokenized and hashed), a *cold* prompt (the engines hold it but the gateway's caches are empty: the
whole text is tokenized and hashed), a *unique* prompt of the same size that no engine holds (only
probed: keys stop where no cache reaches), and the approximate index alone for comparison. p50 /
p99 in ms over ``--rounds`` decisions.
The new message itself must be tokenized (about 1.5 µs a token with this tokenizer).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import orjson

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint
from gateway.kv.index import EventIndex, root_key
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer, chain_keys
from gateway.kv.wire import Batch, BlockStored
from gateway.request import CHAT, parse
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


def _exact(tok: ModelTokenizer, system: str, rest: list[dict], tokens: int) -> str:
    """``system`` padded with one-token pieces until the whole prompt has exactly ``tokens`` tokens."""
    for _ in range(20):
        n = len(tok.encode(tok.render([{"role": "system", "content": system}, *rest])))
        if n == tokens:
            return system
        if n > tokens:
            system = system[:len(system) - 2 * (n - tokens)]     # cut about n - tokens words' worth
        else:
            system += " 7" * (tokens - n)
    raise RuntimeError(f"could not size the prompt to {tokens} tokens")


def _forget(tok: ModelTokenizer) -> None:
    """Empty the tokenizer's caches (pieces, prefix keys, probes)."""
    tok._segments.clear()
    tok._segment_chars = 0
    tok._prefixes.clear()
    tok._prefix_blocks = 0
    tok._probes.clear()


def measure(tokens: int, rounds: int, seed: int = 1, turn_tokens: int = 200) -> dict[str, tuple[float, float]]:
    rng = random.Random(seed)
    tok = ModelTokenizer(TINY_DIR)
    settings = KVEventsConfig(enabled=True, max_request_blocks=1 << 20, max_blocks_per_endpoint=1 << 22)
    index = EventIndex({"m": tok}, lambda m: settings)
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in range(8)]
    ctx = RouterContext(precise_index=_View(index))
    router = PrefixCacheRouter(ctx)
    approx = PrefixCacheRouter(RouterContext())
    states = [index.track(ep, settings) for ep in eps]
    words = tokens // 2                          # the pseudo-words are about 1.9 tokens each
    turns = [_words(rng, int(words * 0.25 / 7)) for _ in range(7)]
    question = _words(rng, turn_tokens // 2)
    history: list[dict] = []
    for t in turns:
        history += [{"role": "user", "content": t}, {"role": "assistant", "content": "ok " * 8}]

    def new_turn(r: int) -> list[dict]:
        return [{"role": "user", "content": f"round {r}: " + question}]

    system = _exact(tok, "You are assistant 1. " + _words(rng, int(words * 0.7)), history + new_turn(0), tokens)
    messages = [{"role": "system", "content": system}, *history]

    def body(msgs):
        return orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 4})

    # the engines hold the conversation so far (as events would say): endpoint 3 all of it
    ids = tok.encode(tok.render(messages))
    prompt_tokens = len(tok.encode(tok.render(messages + new_turn(0))))
    keys = chain_keys(root_key("m", None, 16), ids, 16)
    for j, st in enumerate(states):
        held = len(keys) if j == 3 else len(keys) // (j + 2)
        index.apply(st, Batch(0.0, [BlockStored(list(range(held)), None, ids[:held * 16], 16)], 0))
    out: dict[str, list[float]] = {"new turn": [], "cold prompt": [], "unique prompt": [], "approximate index": []}
    for r in range(rounds):
        msgs = messages + new_turn(r)
        # the previous turn went through the router (as in a conversation): its prefix is cached
        router.route(parse(CHAT, body(messages), {}, f"p{r}"), eps)
        req = parse(CHAT, body(msgs), {}, f"r{r}")
        t = time.perf_counter()
        router.route(req, eps)
        out["new turn"].append(time.perf_counter() - t)
        req = parse(CHAT, body(msgs), {}, f"a{r}")
        t = time.perf_counter()
        approx.route(req, eps)
        out["approximate index"].append(time.perf_counter() - t)
    for r in range(max(3, rounds // 10)):        # after the new turns: these empty the caches
        msgs = messages + new_turn(r)
        _forget(tok)                             # the engines hold it, the gateway tokenized nothing yet
        req = parse(CHAT, body(msgs), {}, f"c{r}")
        t = time.perf_counter()
        router.route(req, eps)
        out["cold prompt"].append(time.perf_counter() - t)
        unique = [{"role": "system", "content": f"unique {r} " + system}, *msgs[1:]]
        req = parse(CHAT, body(unique), {}, f"u{r}")
        t = time.perf_counter()
        router.route(req, eps)
        out["unique prompt"].append(time.perf_counter() - t)
    return {k: (1000 * _pct(v, 0.5), 1000 * _pct(v, 0.99)) for k, v in out.items() if v} | \
        {"tokens": (float(prompt_tokens), statistics.fmean([0.0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[8192, 32768, 131072])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--turn-tokens", type=int, default=200, help="tokens of the new user message (about)")
    args = ap.parse_args()
    print("| prompt | case | p50 (ms) | p99 (ms) |\n|---|---|---:|---:|")
    for size in args.sizes:
        res = measure(size, args.rounds, turn_tokens=args.turn_tokens)
        n = int(res.pop("tokens")[0])
        for case, (p50, p99) in res.items():
            print(f"| {size // 1024}k ({n} tokens) | {case} | {p50:.2f} | {p99:.2f} |")


if __name__ == "__main__":
    main()
