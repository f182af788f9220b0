"""Tokenizing a prompt piece on the event loop against a hop to the tokenizer thread:
``python -m bench.kv_hop [--tokenizer DIR] [--fast on|off]``.

``kv_events.tokenize_inline_chars`` (default 1024) decides which uncached pieces of a request
``KVEventsManager.prepare`` sends to the tokenizer threads instead of tokenizing them on the event
loop. This measures both sides per piece size, with the chat-bpe tokenizer (``bench/chat_bpe.py``:
32k tokens, Llama-3's split) by default, encoded by tiktoken (``kv_events.fast_tokenizer``; ``--fast
off``: by the tokenizers library), on English-like text it has not seen (its word cache warm,
as a running gateway's is):

* *inline*: CPU time of ``ModelTokenizer._encode_one`` on the calling thread (what the loop would
  spend, and every other request wait);
* *hop*: the time from the request's ``await tok.prepare([piece], executor, 0)`` to its return
  (``ModelTokenizer.prepare``: the submit, the encode in the thread, the result stored back on the
  loop), on an idle loop and on a loop kept busy by a task that runs 1 ms of Python per turn (a
  loaded gateway: the thread waits for the GIL to start and to hand the ids back). p50 / mean in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

SIZES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_hop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="", help="a tokenizer directory (default: the chat-bpe one)")
    ap.add_argument("--rounds", type=int, default=60, help="hops per size and loop state")
    ap.add_argument("--fast", choices=["on", "off"], default="on",
                    help="kv_events.fast_tokenizer: tiktoken where it encodes alike (default on)")
    args = ap.parse_args(argv)

    import uvloop

    from bench.chat_bpe import TextSource, tokenizer_dir
    from gateway.kv.tokenization import ModelTokenizer

    tok = ModelTokenizer(args.tokenizer or tokenizer_dir(), fast=args.fast == "on")
    print(f"encoder: {'tiktoken' if tok.fast else 'tokenizers'}")
    src = TextSource(random.Random(5))
    for _ in range(200):
        tok._encode_one(src.text(300))

    def piece(chars: int) -> str:
        return src.text(chars // 3 + 10)[:chars]

    def inline_us(chars: int, n: int = 100) -> float:
        ps = [piece(chars) for _ in range(n)]
        t0 = time.thread_time()
        for p in ps:
            tok._encode_one(p)
        return 1e6 * (time.thread_time() - t0) / n

    async def hop_ms(chars: int, busy: bool) -> tuple[float, float]:
        executor = ThreadPoolExecutor(1)
        loop = asyncio.get_running_loop()
        stop = False

        async def spin() -> None:
            while not stop:
                t = time.perf_counter()
                while time.perf_counter() - t < 0.001:
                    pass
                await asyncio.sleep(0)

        bg = loop.create_task(spin()) if busy else None
        lat = []
        for _ in range(args.rounds):
            p = piece(chars)
            t0 = time.perf_counter()
            await tok.prepare([p], executor, 0)
            lat.append(1e3 * (time.perf_counter() - t0))
            await asyncio.sleep(0.002)
        stop = True
        if bg is not None:
            await bg
        executor.shutdown()
        return statistics.median(lat), statistics.fmean(lat)

    async def run() -> None:
        print("| piece (characters) | inline, CPU (ms) | hop, idle loop p50 / mean (ms) | hop, busy loop p50 / mean (ms) |")
        print("|---:|---:|---:|---:|")
        for chars in SIZES:
            inline = inline_us(chars) / 1000
            idle = await hop_ms(chars, False)
            busy = await hop_ms(chars, True)
            print(f"| {chars} | {inline:.2f} | {idle[0]:.2f} / {idle[1]:.2f} | {busy[0]:.2f} / {busy[1]:.2f} |",
                  flush=True)

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
