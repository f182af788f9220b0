"""The monitor's rounds beside an engine that never answers: each endpoint's health probe, /metrics
scrape and LoRA discovery read of /v1/models runs on its own, under its own timeout, so the other
engines are probed, scraped and read every interval while it hangs, and it is not asked again
before its last one ended."""

from __future__ import annotations

import asyncio
import contextlib

from tests.support.factories import model_block
from tests.support.http import sim_state
from tests.support.metrics import metric
from tests.support.waiting import wait_for

NO_DISCOVERY = {"discovery_interval_s": 0}      # no periodic GET /v1/models for adapters
# a wait far longer than the test: a probe or scrape of the silent engine is still running at its end
HELD = {"interval_s": 0.1, "timeout_s": 60.0}


class Silent:
    """A stand-in engine that takes connections, reads the requests and never answers; it counts
    the request heads that reached it, by path."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        with contextlib.suppress(Exception):
            while line := await reader.readline():
                if line.startswith(b"GET "):
                    self.paths.append(line.split()[1].decode())

    async def close(self) -> None:
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_an_engine_that_never_answers_holds_no_other_engines_probes_or_scrapes(sims, gateway):
    silent = Silent()
    url = await silent.start()
    try:
        engines = [await sims("vllm", "m") for _ in range(2)]
        gw = await gateway([model_block("m", "vllm", [url, *(e.url for e in engines)])],
                           health=HELD, scrape=HELD, lora=NO_DISCOVERY)
        names = [e.url.removeprefix("http://") for e in engines]

        async def counts() -> list[float]:
            page = await gw.metrics_text()
            return [metric(page, name, endpoint=n, result="ok") for n in names
                    for name in ("switchyard_engine_scrapes_total", "switchyard_health_probes_total")]

        async def fresh() -> bool:
            return min(await counts()) >= 5

        # five rounds of the others' at 0.1 s apart; held by the silent engine, one round took 60 s
        assert await wait_for(fresh, timeout=10.0, interval=0.05), await counts()
        # asked once each: a probe or a scrape still waiting is not doubled by the next round
        assert sorted(silent.paths) == ["/health", "/metrics"], silent.paths
    finally:
        await silent.close()


async def test_an_engine_that_never_answers_holds_no_other_engines_adapter_discovery(sims, gateway):
    """LoRA discovery reads every endpoint's /v1/models each ``discovery_interval_s``: beside an
    engine that never answers, the other engines are read every interval, and the silent one once."""
    silent = Silent()
    url = await silent.start()
    try:
        engines = [await sims("vllm", "m") for _ in range(2)]
        await gateway([model_block("m", "vllm", [url, *(e.url for e in engines)])],
                      health={"enabled": False}, scrape={"enabled": False, "timeout_s": 60.0},
                      lora={"discovery_interval_s": 0.1})

        async def reads() -> list[int]:
            return [sum(1 for r in (await sim_state(e.url))["received"] if r["path"] == "/v1/models")
                    for e in engines]

        async def fresh() -> bool:
            return min(await reads()) >= 5

        # five rounds of the others' at 0.1 s apart; held by the silent engine, one round took 60 s
        assert await wait_for(fresh, timeout=10.0, interval=0.05), await reads()
        assert silent.paths == ["/v1/models"], silent.paths
    finally:
        await silent.close()
