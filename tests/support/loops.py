"""Tests that run once per event loop: the default asyncio loop and uvloop, which ``python -m gateway``
runs on. The two split reads and writes differently and fire flow control at different moments."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
import uvloop

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def on_both_loops(fn):
    """Turn ``async def test_x(**params)`` into a plain test run once per event loop (a ``loop``
    parameter is added; other parameters still come from ``parametrize``)."""
    sig = inspect.signature(fn)

    def test(loop: str, **kwargs: Any) -> None:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            runner.run(fn(**kwargs))

    test.__signature__ = sig.replace(parameters=[
        inspect.Parameter("loop", inspect.Parameter.POSITIONAL_OR_KEYWORD), *sig.parameters.values()])
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(test, attr, getattr(fn, attr))
    return pytest.mark.parametrize("loop", list(LOOPS))(test)
