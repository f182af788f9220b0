"""Batch tests' helpers: a JSONL file from rows, and waiting for a batch to reach a final state."""

from __future__ import annotations

from typing import Any

import openai
import orjson

from tests.support.waiting import until

FINAL = ("completed", "failed", "expired", "cancelled")


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


async def run_to_end(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 60.0):
    """The batch once it reached a final state (the test fails if it does not within ``timeout``)."""
    found = None

    async def final() -> bool:
        nonlocal found
        found = await client.batches.retrieve(batch_id)
        return found.status in FINAL

    await until(final, timeout=timeout, interval=0.05)
    return found
