"""The connections the monitor's health probes, /metrics scrapes and LoRA discovery reads hold to
an engine: a burst of them (several at once to one engine) opens one connection each, and once
it is over the gateway keeps one of them to the engine, on which the next probes go, not all of
them (taken in turn, each would stay open until the keep-alive runs out, which it never would).

Connections are counted on the real sockets: the gateway's ESTABLISHED ones to the engine's port
in /proc/net/tcp, and the client port each request reached a stand-in engine from."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from gateway.server.app import MONITOR_KEY
from tests.support.factories import model_block
from tests.support.waiting import until, wait_for

FAST = {"interval_s": 0.05, "timeout_s": 5.0}
NO_DISCOVERY = {"discovery_interval_s": 0}      # no periodic GET /v1/models for adapters
# the engines keep an idle connection far longer than the test runs: one the gateway holds
# to them is closed by the gateway, never by the engine's keep-alive
ENGINE_KEEPALIVE_S = 600.0


def connections_to(port: int) -> int:
    """The ESTABLISHED loopback TCP connections whose far end is ``port``: the gateway's to the
    engine listening there (the engine's own side of each has ``port`` as its local port)."""
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) == port:
            n += 1
    return n


def monitor(gw):
    return gw.runner.app[MONITOR_KEY]


async def test_after_a_burst_of_probes_and_scrapes_one_connection_per_engine_stays(sims, gateway):
    engines = [await sims("vllm", "m", keepalive_timeout_s=ENGINE_KEEPALIVE_S) for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [s.url for s in engines])],
                       health=FAST, scrape=FAST, lora=NO_DISCOVERY)
    mon = monitor(gw)
    eps = mon.pool.endpoints("m")
    await until(lambda: all(ep.healthy and ep.metrics is not None for ep in eps))
    # a burst: four probes and four scrapes of every endpoint at once (a round's probe overlapping
    # its scrape and a discovery read is the same, on a smaller scale)
    await asyncio.gather(*(call for ep in eps for call in (*(mon.probe(ep) for _ in range(4)),
                                                             *(mon.scrape_one(ep) for _ in range(4)))))
    assert all(ep.healthy for ep in eps)

    def held() -> list[int]:
        return [connections_to(s.port) for s in engines]

    # the rounds go on, one probe and one scrape per engine each: at rest, one connection each
    assert await wait_for(lambda: held() == [1, 1, 1]), f"connections held to each engine at rest: {held()}"


class StandIn:
    """A stand-in engine that answers /health and remembers the client port each probe came
    from; while ``hold`` is armed, it keeps the first probes waiting until ``hold_n`` of them
    are in flight together (so that many connections are open to it at once)."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.hold_n = 0
        self._waiting = 0
        self._go = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def health(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername")[1])
        if self.hold_n:
            self._waiting += 1
            if self._waiting >= self.hold_n:
                self.hold_n = 0
                self._go.set()
            await self._go.wait()
        return web.Response(text="")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=ENGINE_KEEPALIVE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        self._go.set()
        if self._runner is not None:
            await self._runner.cleanup()


async def test_after_a_burst_the_next_probes_all_go_over_one_kept_connection(gateway):
    engine = StandIn()
    url = await engine.start()
    try:
        gw = await gateway([model_block("m", "vllm", [url])],
                           health=FAST, scrape={"enabled": False}, lora=NO_DISCOVERY)
        mon = monitor(gw)
        [ep] = mon.pool.endpoints("m")
        await until(lambda: len(engine.peers) >= 3)
        engine.hold_n = 4
        before = len(engine.peers)
        assert all(await asyncio.gather(*(mon.probe(ep) for _ in range(4))))
        # the burst held four probes at once: four connections were open to the engine together
        assert len(set(engine.peers[before:])) >= 4
        after = len(engine.peers)
        await until(lambda: len(engine.peers) >= after + 12)
        later = engine.peers[after:]
        assert len(set(later)) == 1, f"probes after the burst came from {len(set(later))} connections"
        assert connections_to(engine.port) <= 1
    finally:
        await engine.close()
