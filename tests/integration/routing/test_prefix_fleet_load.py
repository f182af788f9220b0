"""prefix-cache's fleet-aware load: requests another gateway put on the holder (seen in the engine's
own running + waiting at the scrape) move a conversation off it; this gateway's view alone does not."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from tests.support.factories import model_block
from tests.support.routing import LONG_SYSTEM, chat


@pytest.mark.parametrize("mode", ["fleet", "local"])
async def test_other_gateways_requests_on_the_holder_move_the_conversation(sims, gateway, mode):
    engines = [await sims("vllm", "m", prefill_ms_per_token=0.01) for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")],
                       routing={"prefix_imbalance_abs": 2, "prefix_load": mode})
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where is train 7?"}]
    async with aiohttp.ClientSession() as s:
        holder, _ = await chat(s, gw.url, messages)
        ep = next(e for e in gw.gw.pool.endpoints() if e.name == holder)
        sim_url = next(e.url for e in engines if e.url.endswith(holder))
        # "another gateway": 3 requests straight to the holder's engine, stuck before their first token
        stuck = [asyncio.create_task(chat(s, sim_url, [{"role": "user", "content": f"other {i}"}],
                                          {"x-sim-fault": "stall_before_first=inf"})) for i in range(3)]
        try:
            for _ in range(300):                              # the scrape (every 0.2 s) sees them
                m = ep.metrics
                if m is not None and (m.running or 0) + (m.waiting or 0) >= 3:
                    break
                await asyncio.sleep(0.02)
            assert ep.metrics.gateway_in_flight == 0 and ep.in_flight == 0
            messages += [{"role": "assistant", "content": "On track 3."}, {"role": "user", "content": "And 9?"}]
            pod, _ = await chat(s, gw.url, messages)
            if mode == "fleet":
                assert pod != holder                              # spread 3 > 2: the less loaded engines
                assert ('switchyard_routing_fallbacks_total{reason="load_imbalance",strategy="prefix-cache"} 1.0'
                        in await gw.metrics_text())
            else:
                assert pod == holder                              # this gateway sees no load there
        finally:
            for t in stuck:
                t.cancel()
            for t in stuck:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
