"""What a worker's catch-up costs the two workers' event loops: ``python bench/view_catch_up.py``.

    python bench/view_catch_up.py                            # 100,000 sessions, 131,072 blocks, 3 rounds
    python bench/view_catch_up.py --sessions 20000 --blocks 16384 --rounds 5

A worker that starts, or that missed a sibling's batches, asks the sibling for its whole routing
view (gateway/view/service.py ``snapshot``) and merges it (``_merge``). Both run in parts, one a
loop turn, so that both workers go on serving meanwhile. This builds one view of the given size in
a ``RoutingView`` (eight endpoints, the gateway's collector settings), then times making it and
merging it into an empty view, in this process, with a task that counts the loop's turns and
records the longest: the figure that matters is the longest turn (how long a request arriving
meanwhile could wait), not the total. Prints each round and the median.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gateway.config.schema import config_from_dict  # noqa: E402
from gateway.observability.metrics import GatewayMetrics  # noqa: E402
from gateway.server.app import pool_from_config  # noqa: E402
from gateway.server.run import tune_gc  # noqa: E402
from gateway.view.service import RoutingView, WorkerSlot  # noqa: E402
from gateway.view.wire import view_parts  # noqa: E402
from routers.base import RouterContext  # noqa: E402

URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(8)]


def view(cfg) -> tuple[RoutingView, RouterContext]:
    pool = pool_from_config(cfg)
    v = RoutingView(cfg, pool, GatewayMetrics(), WorkerSlot(0, 2, "/nonexistent", "g"))
    ctx = RouterContext(settings=cfg.routing, sessions=v.sessions)
    v.attach(ctx)
    return v, ctx


async def timed(work) -> tuple[float, float, int]:
    """(total seconds, longest loop turn in seconds, turns) while ``work`` runs."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = time.perf_counter()
    await work
    total = time.perf_counter() - start
    done = True
    await t
    return total, max(gaps), len(gaps)


async def main(a: argparse.Namespace) -> None:
    tune_gc()
    cfg = config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": URLS}]}, source="<bench>")
    src, sctx = view(cfg)
    eps = src.pool.endpoints("m")
    for i in range(a.sessions):
        src.sessions.put(f"m\0s:session-{i}", eps[i % len(eps)], None)
    for c in range(a.blocks // 64):
        sctx.prefix_index.apply_insert([hash((c, j)) & (2**64 - 1) for j in range(64)], eps[c % len(eps)])
    made, merged = [], []
    for r in range(a.rounds):
        holder: list[bytes] = []

        async def make(into: list[bytes]) -> None:
            into.append(await src.snapshot())

        m = await timed(make(holder))
        dst, dctx = view(cfg)
        g = await timed(dst._merge(view_parts(holder[0]), "g/0"))
        assert len(dst.sessions) == len(src.sessions) and len(dctx.prefix_index) == len(sctx.prefix_index)
        made.append(m)
        merged.append(g)
        print(f"round {r + 1}: {len(holder[0]) / 1e6:.1f} MB; made in {m[0] * 1e3:.0f} ms over {m[2]} turns, "
              f"longest {m[1] * 1e3:.1f} ms; merged in {g[0] * 1e3:.0f} ms over {g[2]} turns, longest {g[1] * 1e3:.1f} ms")
    med = statistics.median
    print(f"{len(src.sessions):,} sessions, {len(sctx.prefix_index):,} blocks, median of {a.rounds}: "
          f"make {med(x[0] for x in made) * 1e3:.0f} ms (longest turn {med(x[1] for x in made) * 1e3:.1f} ms), "
          f"merge {med(x[0] for x in merged) * 1e3:.0f} ms (longest turn {med(x[1] for x in merged) * 1e3:.1f} ms)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--blocks", type=int, default=131_072)
    ap.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
