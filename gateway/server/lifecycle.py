"""The gateway's lifecycle: requests in flight, drain, and the tasks that outlive a request.

``enter``/``leave`` bracket every request so that a drain can wait for the last one; after
``begin_drain`` (the listener closed) new requests on connections still open get 503 with
``Connection: close``. When the
grace period is over (or a second signal stops the gateway at once), ``cut`` ends the clients'
requests still running: each answers the 503 of a gateway shutting down, a stream as its last
event, before the connections close.
``spawn`` runs fire-and-forget work (aborts, a late prefill's result) that must outlive the
request that started it: each task stays referenced until done and is awaited at shutdown.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from gateway.errors import ErrorClass, GatewayError


def shutting_down() -> GatewayError:
    """The answer of a request the gateway will not serve because it stops."""
    return GatewayError(503, "the gateway is shutting down", code="service_unavailable",
                        headers={"Retry-After": "1", "Connection": "close"}, error_class=ErrorClass.DRAINING)


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.cutting = False
        self.in_flight = 0
        # ``wait_idle``'s waits, told when no request is left in flight (nothing to tell per request
        # while none waits: only a stop does)
        self._idle_waiters: list[asyncio.Future] = []
        self._background: set[asyncio.Task] = set()
        self._clients: set[asyncio.Task] = set()      # the tasks of the clients' requests in flight
        # what ``cut`` ends besides those tasks: requests in flight that run no handler yet (the
        # edge's fast lane holding one for its body, gateway/server/edge.py ``EdgeServer.cut_held``);
        # each returns how many it ended
        self._cut_hooks: list[Callable[[], int]] = []

    def enter(self, task: asyncio.Task | None = None) -> None:
        """``task``: the task a client's request runs in, which ``cut`` may end (None: a request of
        the gateway's own, a batch line, which its runner stops)."""
        self.in_flight += 1
        if task is not None:
            self._clients.add(task)

    def leave(self, task: asyncio.Task | None = None) -> None:
        self.in_flight -= 1
        if task is not None:
            self._clients.discard(task)
        if self.in_flight == 0 and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    def cut(self) -> int:
        """End every client request still in flight now: its task is cancelled, and the pipeline,
        seeing ``cutting``, answers it as a gateway shutting down (gateway/pipeline/pipeline.py)
        while its connection is still open. Returns how many were cut."""
        self.cutting = True
        tasks = [t for t in self._clients if not t.done()]
        for t in tasks:
            t.cancel()
        return len(tasks) + sum(hook() for hook in self._cut_hooks)

    def on_cut(self, hook: Callable[[], int]) -> None:
        """``hook`` is called by ``cut`` too: it ends the requests in flight it knows of that run no
        task ``cut`` could cancel, and returns how many."""
        self._cut_hooks.append(hook)

    def was_cut(self, task: asyncio.Task | None) -> bool:
        """Whether ``task``, a client's request, was cancelled by ``cut`` (not by its client)."""
        return self.cutting and task is not None and task in self._clients

    def tracked(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """``handler``, of requests outside the pipeline that may run long (the batch API's: an
        upload whose body is still coming, a file's content on its way), in flight as the pipeline's
        requests are: the drain waits for them, one arriving on a kept-alive connection once the
        listener closed gets the 503 of a gateway shutting down, and one ``cut`` ends is answered
        with it while nothing of its own answer was written (else its connection closes). A
        ``GatewayError`` raised here is answered by the application's error middleware."""
        @functools.wraps(handler)
        async def run(request: web.Request) -> web.StreamResponse:
            task = request.task if request.transport is not None else None
            self.enter(task)
            try:
                self.check_open()
                return await handler(request)
            except asyncio.CancelledError:
                if not self.was_cut(task) or request.writer.output_size:
                    raise
                task.uncancel()
                raise shutting_down() from None
            finally:
                self.leave(task)
        return run

    def check_open(self) -> None:
        if self.draining:
            raise shutting_down()

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every request in flight ended within ``timeout`` seconds (at once when none is)."""
        if self.in_flight == 0:
            return True
        w = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(w)
        try:
            async with asyncio.timeout(timeout):
                await w
            return True
        except TimeoutError:
            return False
        finally:
            if w in self._idle_waiters:
                self._idle_waiters.remove(w)

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
