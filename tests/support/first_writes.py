"""The first write of each stream the gateway answers: where it was made, and what it held."""

from __future__ import annotations

import asyncio

import pytest


def record_first_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[asyncio.Task | None, bytes]]:
    """Every write of a stream whose head was held for it: the task it was made in (None: a read
    callback) and the bytes, head included."""
    from gateway.pipeline.whole import WrittenStream
    firsts: list[tuple[asyncio.Task | None, bytes]] = []
    send = WrittenStream._send

    def recording(self, data):
        if self.holding:
            firsts.append((asyncio.current_task(), self._held + data))
        return send(self, data)

    monkeypatch.setattr(WrittenStream, "_send", recording)
    return firsts


def assert_written_from_reads(firsts: list[tuple[asyncio.Task | None, bytes]], n: int) -> None:
    """``n`` first writes, each the client's head and first event in one write, made with no task
    running (an upstream connection's read callback)."""
    assert len(firsts) == n, firsts
    for task, data in firsts:
        assert task is None
        head, _, first = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"text/event-stream" in head and b"data: {" in first
