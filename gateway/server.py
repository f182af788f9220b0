"""Run the gateway: listen, serve, and drain on SIGTERM.

Drain: ``/ready`` turns 503 and new requests are refused with 503 at once; requests in flight
(streams included) get up to ``server.shutdown_grace_s`` to finish; then the listener closes and
the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket

import structlog
from aiohttp import web

from gateway.app import GATEWAY_KEY, build_app
from gateway.config import Config

log = structlog.get_logger("switchyard.server")


async def start(config: Config, *, reuse_port: bool = False) -> tuple[web.AppRunner, web.Application, int]:
    """Start serving; returns the runner, the app and the bound port (useful with port 0)."""
    app = build_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)  # the grace period is waited out in drain_and_stop
    await runner.setup()
    site = web.TCPSite(runner, config.listen.host, config.listen.port, reuse_port=reuse_port or None,
                       backlog=1024)
    await site.start()
    port = config.listen.port
    server = site._server
    if server is not None and server.sockets:
        port = server.sockets[0].getsockname()[1]
    return runner, app, port


async def drain_and_stop(runner: web.AppRunner, app: web.Application, grace: float) -> None:
    gw = app[GATEWAY_KEY]
    gw.begin_drain()
    log.info("draining", in_flight=gw.in_flight, grace_s=grace)
    finished = await gw.wait_idle(grace)
    if not finished:
        log.warning("grace period over; closing remaining requests", in_flight=gw.in_flight)
    await runner.cleanup()


async def serve(config: Config, *, ready_message: str | None = None, reuse_port: bool = False) -> None:
    runner, app, port = await start(config, reuse_port=reuse_port)
    log.info("listening", host=config.listen.host, port=port, models=[m.name for m in config.models])
    if ready_message:
        print(ready_message.format(port=port), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await drain_and_stop(runner, app, config.server.shutdown_grace_s)
        log.info("stopped")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
