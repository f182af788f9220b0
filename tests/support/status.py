"""The status tests' admin token and their chat request."""

from __future__ import annotations

from tests.support.http import bearer, chat_body, post

CHAT = [{"role": "user", "content": "What does a switchyard do?"}]
ADMIN = "admin-token-0123456789"


async def chat(gw, model: str, *, stream: bool = False, rid: str | None = None, key: str = "none",
               headers: dict[str, str] | None = None) -> int:
    """One chat completion, read to the end; its status."""
    headers = {**bearer(key), **({"x-request-id": rid} if rid else {}), **(headers or {})}
    return (await post(gw, chat_body(CHAT, model=model, stream=stream), headers)).status
