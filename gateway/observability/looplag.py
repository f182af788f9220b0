"""Event-loop lag: how late the loop runs a timer, the first sign that one process is saturated.

Everything in the gateway shares one event loop, so a callback that hogs it (a huge JSON body, a
burst of connections, a slow synchronous call) delays every stream's next chunk. A background
task asks to wake up every ``interval`` seconds and observes how much later than asked it ran,
into ``switchyard_event_loop_lag_seconds``. It costs one timer per interval and touches no request:
the request path does not know it exists.

The measurement uses ``time.perf_counter`` (uvloop's ``loop.time()`` has millisecond steps);
timers themselves fire on a millisecond clock, so lags below about 1 ms are noise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.server.periodic import Periodic


class LoopLagMonitor(Periodic):
    task_name = "switchyard-loop-lag"

    def __init__(self, observe: Callable[[float], None], interval: float = 0.5) -> None:
        self.observe = observe
        self.interval = interval

    def _wanted(self) -> bool:
        return self.interval > 0

    async def _run(self) -> None:
        interval, observe, clock = self.interval, self.observe, time.perf_counter
        while True:
            asked = clock() + interval
            await asyncio.sleep(interval)
            observe(max(0.0, clock() - asked))
