"""The gateway's lifecycle: requests in flight, drain, and the tasks that outlive a request.

``enter``/``leave`` bracket every request so that a drain can wait for the last one; after
``begin_drain`` new requests on kept-alive connections get 503 with ``Connection: close``.
``spawn`` runs fire-and-forget work (aborts, a late prefill's result) that must outlive the
request that started it: each task stays referenced until done and is awaited at shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from gateway.errors import ErrorClass, GatewayError


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task] = set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def check_open(self) -> None:
        if self.draining:
            raise GatewayError(503, "the gateway is shutting down", code="service_unavailable",
                               headers={"Retry-After": "1", "Connection": "close"}, error_class=ErrorClass.DRAINING)

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close_background(self, timeout: float = 5.0) -> None:
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=timeout)
            for t in pending:
                t.cancel()
