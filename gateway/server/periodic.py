"""A background task that one object starts and stops: the loop-lag sampler and the memory
reclaimer share it. ``start`` runs ``_run`` once as a named task (when ``_wanted`` says so);
``stop`` cancels it and waits for it to end."""

from __future__ import annotations

import asyncio
import contextlib


class Periodic:
    task_name = "switchyard-periodic"
    _task: asyncio.Task | None = None

    def _wanted(self) -> bool:
        return True

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._wanted() and self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
