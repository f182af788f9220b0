"""A long shared system prompt and a conversation turn, for the prefix-routing tests."""

from __future__ import annotations

import aiohttp

from tests.support.http import chat_body, post

LONG_SYSTEM = ("You are the dispatcher of a railway switchyard. Trains arrive from the north and the "
               "south; every track has a length, a set of switches and a signal. ") * 12


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], headers: dict | None = None,
               **extra) -> tuple[str, dict]:
    """One turn of a conversation; which engine answered (``target-pod``) and the answer."""
    r = await post(url, chat_body(messages, **extra), headers, http=session)
    assert r.status == 200, r.body
    return r.headers["target-pod"], r.json()
