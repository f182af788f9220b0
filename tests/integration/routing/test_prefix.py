"""prefix-cache through the gateway: a conversation returns to its engine and leaves it when overloaded."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from routers.session import encode_session_id
from tests.support.factories import model_block
from tests.support.routing import LONG_SYSTEM, chat

# -- through the gateway -------------------------------------------------------------------------



async def test_gateway_sends_a_conversation_back_to_its_engine_and_leaves_it_when_overloaded(sims, gateway):
    engines = [await sims("vllm", "m", prefill_ms_per_token=0.01) for _ in range(3)]
    gw = await gateway([model_block("m", "vllm", [e.url for e in engines], strategy="prefix-cache")],
                       routing={"prefix_imbalance_abs": 2})
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where is train 7?"}]
    async with aiohttp.ClientSession() as s:
        holder, first = await chat(s, gw.url, messages)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for turn in range(3):
            messages += [{"role": "assistant", "content": "On track 3."},
                         {"role": "user", "content": f"And train {turn}?"}]
            pod, data = await chat(s, gw.url, messages)
            assert pod == holder                                     # back to the engine with the prefix
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 200   # and it was a cache hit

        # overload the holder: 3 requests stuck on it (pinned there with session-affinity)
        ep = next(e for e in gw.gw.pool.endpoints() if e.name == holder)
        pin = {"routing-strategy": "session-affinity", "x-session-id": encode_session_id(ep.address),
               "x-sim-fault": "stall_before_first=inf"}
        stuck = [asyncio.create_task(chat(s, gw.url, [{"role": "user", "content": f"block {i}"}], pin))
                 for i in range(3)]
        try:
            for _ in range(200):
                if ep.in_flight == 3:
                    break
                await asyncio.sleep(0.01)
            assert ep.in_flight == 3
            messages += [{"role": "user", "content": "One more?"}]
            pod, _ = await chat(s, gw.url, messages)
            assert pod != holder                                      # spread 3 > 2: least loaded instead
            assert ('switchyard_routing_fallbacks_total{reason="load_imbalance",strategy="prefix-cache"} 1.0'
                    in await gw.metrics_text())
        finally:
            for t in stuck:
                t.cancel()
            for t in stuck:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
