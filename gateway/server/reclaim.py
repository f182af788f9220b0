"""Giving memory back to the system after a burst of requests ends.

When thousands of requests end at once (idle streams whose clients all leave), the objects they
used are freed, but the process's RSS stays near its high-water mark:

- CPython's small-object allocator returns a 1 MiB arena only when every block in it is free.
  The interpreter's free lists (tuples, lists, dicts, contexts, ...) keep freed objects scattered
  over many arenas, each of which then stays mapped. Only a full collection clears those lists,
  and with the gateway's collector tuning (``gateway.server.run.tune_gc``) an idle gateway runs none.
- glibc's ``free`` gives heap memory back only from the top of the heap; ``malloc_trim(0)`` also
  releases the free pages inside it.

A timer every ``interval`` seconds reads the requests in flight. Once they fell by at least
``min_drop`` from their peak, are below half of it, and stopped falling (a reading no lower than
the one before: the burst of endings is over), it runs ``gc.collect()`` and, where the C library
has it, ``malloc_trim(0)``; the peak then restarts from the current count. It never runs during
steady traffic, and once per burst. The collection is the one cost (tens of ms with tens of
thousands of live objects), paid once per burst instead of never.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
from collections.abc import Callable

from gateway.server.periodic import Periodic


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class MemoryReclaimer(Periodic):
    """Watches ``in_flight()``; ``on_reclaim`` is told each time memory was handed back."""

    task_name = "switchyard-memory-reclaim"

    def __init__(self, in_flight: Callable[[], int], min_drop: int = 1000, interval: float = 0.2,
                 on_reclaim: Callable[[], None] | None = None) -> None:
        self.in_flight = in_flight
        self.min_drop = min_drop
        self.interval = interval
        self.on_reclaim = on_reclaim
        self.peak = 0
        self.last = 0        # the previous reading
        self.runs = 0
        self._trim = _malloc_trim()

    def _wanted(self) -> bool:
        return self.min_drop > 0

    def check(self) -> bool:
        """One reading of the requests in flight; True when it reclaimed."""
        n = self.in_flight()
        falling, self.last = n < self.last, n
        if n > self.peak:
            self.peak = n
            return False
        if falling or self.peak - n < self.min_drop or 2 * n >= self.peak:
            return False
        self.peak = n
        self.reclaim()
        return True

    def reclaim(self) -> None:
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        self.runs += 1
        if self.on_reclaim is not None:
            self.on_reclaim()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.check()
