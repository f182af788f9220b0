"""``python -m enginesim --engine vllm|sglang --role aggregated|prefill|decode --port N --model NAME [knobs]``."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from enginesim.config import config_from_args
from enginesim.server import start_sim


async def _serve() -> None:
    cfg = config_from_args()
    server = await start_sim(cfg)
    extra = ""
    if server.side_channel_port is not None:
        extra = f" (NIXL side channel on port {server.side_channel_port}, reported as {cfg.side_channel_host})"
    if server.bootstrap_port is not None:
        extra = f" (bootstrap server on port {server.bootstrap_port})"
    print(f"enginesim: {cfg.engine} {cfg.role} model={cfg.served_name} on {server.url}{extra}",
          file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await server.wait_ready()
        print(f"enginesim: ready on {server.url}", file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await server.close()


def main() -> None:
    try:
        import uvloop
    except ImportError:  # optional: plain asyncio works the same, only slower
        asyncio.run(_serve())
    else:
        uvloop.run(_serve())


if __name__ == "__main__":
    main()
