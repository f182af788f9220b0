"""A stream that keeps each write it is given, as a pipe's reader would see them at worst: for tests
of what reaches stderr in one write."""

from __future__ import annotations

import io


class Writes(io.RawIOBase):
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.writes.append(bytes(b))
        return len(b)
