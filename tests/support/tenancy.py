"""The tenancy tests' API keys and users, and what a burst of SDK calls got."""

from __future__ import annotations

import asyncio

import openai

CHAT = [{"role": "user", "content": "Tell me about switchyards and trains."}]
ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789"
KEYS = {"api_keys": [{"key": ALICE, "user": "alice"}, {"key": BOB, "user": "bob"}]}


async def outcomes(coros) -> list:
    """What a concurrent batch got, as a sorted multiset: 200s first, then SDK exception names
    (which request of a burst wins a slot is up to the scheduler, how many win is not)."""
    out = []
    for r in await asyncio.gather(*coros, return_exceptions=True):
        if isinstance(r, openai.APIStatusError):
            out.append(type(r).__name__)
        elif isinstance(r, BaseException):
            raise r
        else:
            out.append(200)
    return sorted(out, key=str)
