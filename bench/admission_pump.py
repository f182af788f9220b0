"""What one pump of a full admission queue costs: ``python -m bench.admission_pump [--waiters N] [--grants G]``.

The queue holds ``--waiters`` requests (``queue_max``'s default, 1000) of one model with two endpoints,
both full; then room for ``--grants`` requests appears on one of them and the pump runs once,
handing them out. Thread CPU time of that pump (``time.thread_time``), best of five rounds, in
three queues:

- ``1000 users x 1``: every waiter its own user's;
- ``10 users x 100``: ten users' lines (the order moves between them at each grant);
- ``40 bound + rest``: the first 40 waiters bound to the full endpoint (a Responses follow-up's
  engine), passed over at every walk, the rest free to go to the one with room.

It prints, per queue, the microseconds of the pump and a digest of the order it granted in, so
that two versions of the pump can be compared for speed and for the same order.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gateway.admission.queue import Waiter  # noqa: E402
from gateway.admission.service import Admission  # noqa: E402
from gateway.config.schema import config_from_dict  # noqa: E402
from gateway.observability.metrics import GatewayMetrics  # noqa: E402
from gateway.server.app import pool_from_config  # noqa: E402

CAP = 1 << 20          # max_in_flight_per_endpoint: the room is what the endpoints' loads leave


def _setup(kind: str, waiters: int, grants: int):
    cfg = config_from_dict({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1", "http://127.0.0.1:2"]}],
                            "scrape": {"enabled": False},
                            "admission": {"enabled": True, "max_in_flight_per_endpoint": CAP}})
    pool = pool_from_config(cfg)
    adm = Admission(cfg, pool, GatewayMetrics(), clock=lambda: 1000.0)
    adm.settings("m")
    busy, idle = pool.endpoints("m")
    busy.in_flight = idle.in_flight = CAP
    q = adm._models["m"].queue
    loop = asyncio.get_running_loop()
    bound = 40 if kind == "bound" else 0
    users = {"one": waiters, "ten": 10}.get(kind, waiters)
    for i in range(waiters):
        w = Waiter(1, f"u{i % users}", 100, 1000.0, loop.create_future(), candidates=[busy],
                   widen=i >= bound, cost=float(50 + (i * 7) % 100))
        q.push(w)
    order: list[int] = []
    take = q.take

    def taking(w):
        order.append(w.seq)
        take(w)
    q.take = taking
    idle.in_flight = CAP - grants
    return adm, order


async def _round(kind: str, waiters: int, grants: int) -> tuple[float, list[int]]:
    adm, order = _setup(kind, waiters, grants)
    t0 = time.thread_time()
    adm._pump("m")
    return time.thread_time() - t0, order


async def _measure(kind: str, waiters: int, grants: int) -> tuple[float, str, int]:
    best, digest, n = float("inf"), "", 0
    for _ in range(5):
        took, order = await _round(kind, waiters, grants)
        best = min(best, took)
        digest, n = hashlib.sha256(repr(order).encode()).hexdigest()[:12], len(order)
    return best * 1e6, digest, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waiters", type=int, default=1000)
    ap.add_argument("--grants", type=int, default=200)
    args = ap.parse_args()
    print(f"## One pump: {args.waiters} waiters, room for {args.grants}\n")
    print("| queue | pump (µs) | granted | order digest |\n|---|---|---|---|")
    for kind, name in (("one", f"{args.waiters} users x 1"), ("ten", f"10 users x {args.waiters // 10}"),
                       ("bound", "40 bound + rest")):
        us, digest, n = asyncio.run(_measure(kind, args.waiters, args.grants))
        print(f"| {name} | {us:,.0f} | {n} | {digest} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
