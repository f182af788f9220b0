"""The event loop's CPU per request on the KV-events path, on ``bench.routing``'s chat-bpe traffic:
``python -m bench.kv_chat_cost [--passes N]``.

The requests of ``bench.routing --workload chat-bpe`` (its schedule, seed 1: multi-turn chats on 16
long shared system prompts, the whole conversation resent each turn, and a few unique prompts), in
arrival order, go through what the pipeline runs for a request of a model with ``kv_events``:
``KVEventsManager.prepare`` (rendered, tokenized, a long piece in the tokenizer thread), the
``prefix-cache`` router's ``route`` (the match, the decision, ``routed``), and the tokenizing ahead
of a chat's next turn (awaited before the next request, as a think time would let it finish). The
engines are simulated in the index: the chosen endpoint reports its prompt's blocks stored
(``EventIndex.apply`` of one ``BlockStored``) before the next request, so every request meets the
index state the benchmark's would. Answers are a dozen words of the same text, told to the router
as the relay tells them (``kv_events.tokenize_answers``: tokenized ahead of the next turn). Plain
chats are put together from their shape (``kv_events.chat_shapes``; ``--shapes off`` renders each).

Per request it prints the event loop thread's CPU (``time.thread_time``) split into prepare, route
and the ahead task's steps on the loop, the event apply apart, and the other threads' CPU
(process CPU minus the loop's); the best pass of ``--passes`` (each from empty caches), so noise
from other load on the machine matters less. ``decisions`` is a digest of every request's chosen
endpoint: two trees that route alike print the same one.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import time

import orjson


def requests(w, sched, tok, answer_words: int = 12) -> list[tuple[bytes, dict[str, str], list[int], str]]:
    """The benchmark's requests in arrival order (a turn 0.3 s plus its think time after the one
    before): (body, headers, the prompt's token ids as the engine has them, the answer)."""
    from bench.chat_bpe import TextSource

    timed: list[tuple[float, int, int]] = []       # (time, conversation or -1 - single, turn)
    for c in sched.conversations:
        t = c.start
        for k in range(len(c.questions)):
            if t >= w.duration_s:
                break
            timed.append((t, c.cid, k))
            t += 0.3 + c.thinks[k]
    timed += [(s.start, -1 - i, 0) for i, s in enumerate(sched.singles)]
    timed.sort()
    answers = TextSource(random.Random(7))
    convs = {c.cid: (c, [{"role": "system", "content": sched.systems[c.system]}]) for c in sched.conversations}
    out = []
    for _, cid, k in timed:
        if cid >= 0:
            c, msgs = convs[cid]
            msgs.append({"role": "user", "content": c.questions[k]})
            body = {"model": "m", "messages": msgs, "max_tokens": 16, "stream": True}
            headers = {"x-session-key": f"conversation-{cid}"}
        else:
            body = {"model": "m", "messages": [{"role": "user", "content": sched.singles[-1 - cid].prompt}],
                    "max_tokens": 16, "stream": True}
            headers = {}
        ids = tok.tokenizer.encode(tok.render(body["messages"]), add_special_tokens=False).ids
        answer = answers.text(answer_words)
        out.append((orjson.dumps(body), headers, ids, answer))
        if cid >= 0:
            msgs.append({"role": "assistant", "content": answer})
    return out


async def one_pass(tok_dir: str, w, reqs, answers: bool = True, answer_blocks: bool = False,
                   shapes: bool = True, fast: bool = True, inline: int = 1024) -> dict[str, float]:
    from prometheus_client import CollectorRegistry

    from gateway.endpoints import Endpoint
    from gateway.kv.events import KVEventsManager
    from gateway.kv.index import request_root
    from gateway.kv.settings import KVEventsConfig
    from gateway.kv.tokenization import ModelTokenizer, chain_keys
    from gateway.kv.wire import Batch, BlockStored
    from gateway.request import CHAT, parse
    from routers.base import RouterContext
    from routers.prefix_cache import PrefixCacheRouter

    tok = ModelTokenizer(tok_dir, fast=fast)
    cfg = KVEventsConfig(enabled=True, tokenize_answers=answers, chat_shapes=shapes, fast_tokenizer=fast,
                         tokenize_inline_chars=inline)
    tok.shapes_off = tok.shapes_off or not shapes      # as build_kv_events applies it
    m = KVEventsManager(lambda model: cfg, None, CollectorRegistry(), {"m": tok})  # type: ignore[arg-type]
    eps = [Endpoint(url=f"http://10.0.0.{i}:8000", model="m") for i in range(w.engines)]
    states = {ep: m.index.track(ep, cfg) for ep in eps}
    for st in states.values():
        m.index.apply(st, Batch(0.0, [BlockStored([], None, [], 16)], 0))
    router = PrefixCacheRouter(RouterContext(precise_index=m, rng=random.Random(1)))
    tt = time.thread_time
    totals = {"prepare": 0.0, "route": 0.0, "ahead": 0.0, "apply": 0.0, "threads": 0.0, "prepare_wall": 0.0}
    wall = time.perf_counter
    digest = hashlib.sha1()
    for n, (body, headers, ids, answer) in enumerate(reqs):
        req = parse(CHAT, body, headers, f"r{n}")
        p0, t0, w0 = time.process_time(), tt(), wall()
        await m.prepare(req, eps)
        t1 = tt()
        totals["prepare_wall"] += wall() - w0
        d = router.route(req, eps)
        t2 = tt()
        if req.answered is not None:          # the relay tells the answer once it is relayed
            req.answered(answer)
        for task in list(m._ahead):
            await task
        await asyncio.sleep(0)
        t3 = tt()
        p1 = time.process_time()
        totals["prepare"] += t1 - t0
        totals["route"] += t2 - t1
        totals["ahead"] += t3 - t2
        totals["threads"] += (p1 - p0) - (t3 - t0)
        digest.update(d.endpoint.url.encode())
        # the engine stores the prompt's blocks: one BlockStored, its hashes our keys
        if answer_blocks:     # the engine caches the answer's blocks too (vLLM does, once they fill)
            ids = ids + tok.tokenizer.encode(answer.strip(), add_special_tokens=False).ids
        keys = chain_keys(request_root(req, "m", 16), ids, 16)
        batch = Batch(0.0, [BlockStored(keys, None, ids[:len(keys) * 16], 16)], 0)
        a0 = tt()
        m.index.apply(states[d.endpoint], batch)
        totals["apply"] += tt() - a0
    await m.close()
    n = len(reqs)
    out = {k: 1000 * v / n for k, v in totals.items()}
    out["loop"] = out["prepare"] + out["route"] + out["ahead"]
    out["n"] = n
    out["digest"] = digest.hexdigest()[:12]    # type: ignore[assignment]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_chat_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--answer-words", type=int, default=12, help="words in each answer (default 12)")
    ap.add_argument("--answer-blocks", action="store_true",
                    help="the chosen engine reports the answer's blocks stored too (as vLLM caches them)")
    ap.add_argument("--answers", choices=["on", "off"], default="on",
                    help="kv_events.tokenize_answers: the answers tokenized ahead of the next turn (default on)")
    ap.add_argument("--shapes", choices=["on", "off"], default="on",
                    help="kv_events.chat_shapes: plain chats put together from their shape, not rendered (default on)")
    ap.add_argument("--fast", choices=["on", "off"], default="on",
                    help="kv_events.fast_tokenizer: tiktoken in the tokenizers library's place (default on)")
    ap.add_argument("--inline", type=int, default=1024, help="kv_events.tokenize_inline_chars (default 1024)")
    args = ap.parse_args(argv)

    import uvloop

    from bench.routing import WORKLOADS, make_schedule, tokenizer_dir

    w = WORKLOADS["chat-bpe"]
    sched = make_schedule(w)
    from gateway.kv.tokenization import ModelTokenizer

    tok_dir = tokenizer_dir(w)
    reqs = requests(w, sched, ModelTokenizer(tok_dir), args.answer_words)
    best: dict[str, float] | None = None
    for _ in range(args.passes):
        r = uvloop.run(one_pass(tok_dir, w, reqs, args.answers == "on", args.answer_blocks, args.shapes == "on",
                                    args.fast == "on", args.inline))
        if best is None or r["loop"] < best["loop"]:
            best = r
    assert best is not None
    print(f"{best['n']} requests, best of {args.passes} passes, ms per request: loop {best['loop']:.3f} "
          f"(prepare {best['prepare']:.3f} of {best['prepare_wall']:.3f} wall, route {best['route']:.3f}, ahead {best['ahead']:.3f}); "
          f"event apply {best['apply']:.3f}; other threads {best['threads']:.3f}; decisions {best['digest']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
