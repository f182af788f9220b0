"""``--workers N``: the config file a reload applies is read once, by the parent, for every worker.

At a reload the parent reads the file, writes what it read into its private run directory
(gateway/server/rundir.py) under the number of the reload it is about to tell the workers of
(gateway/server/heartbeat.py), and only then checks it and signals the workers. A worker that
applies that reload parses the text the parent read, not the file: a file rewritten between the
parent's read and a worker's (a ConfigMap updated twice in a row, a worker whose loop was busy when
the SIGHUP came) used to leave the workers on different configs under one generation, and a worker
the parent restarted on a third. A file the parent could not read is handed as its error, which
every worker's reload is refused with.

The parent keeps the text of its last two reloads: a worker reads the number of the last told
reload, then its text; if the parent has told two more meanwhile and removed that text, the worker
reads the number again (it has moved on) and takes the newer one, which is what it would apply
next anyway.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import orjson

from gateway.config.schema import Config, ConfigError

KEPT = 2        # reloads whose text the parent keeps: the last told, and the one it is telling


class HandedError(ConfigError):
    """The error the parent met reading the file, as its refusal says it."""

    def __init__(self, key_path: str | None, text: str) -> None:
        ValueError.__init__(self, text)
        self.key_path = key_path        # type: ignore[assignment]


class ConfigHandoff:
    """The run directory's ``reload-<n>.json`` files: the parent's ``put``, a worker's ``get``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._written: list[int] = []       # the parent's, oldest first

    def _path(self, seq: int) -> str:
        return os.path.join(self.directory, f"reload-{seq}.json")

    def put(self, seq: int, text: str | None = None, error: BaseException | None = None) -> None:
        """The parent, before it tells reload ``seq``: the file's ``text``, or the ``error`` met
        reading it. Written aside and renamed, so a worker reads it whole or not at all; raises
        ``OSError`` when it cannot be written (the parent then refuses the reload)."""
        if error is not None:
            body: dict[str, Any] = {"error": str(error) if isinstance(error, ValueError)
                                    else f"{type(error).__name__}: {error}",
                                    "key_path": getattr(error, "key_path", None)}
        else:
            body = {"text": text}
        path = self._path(seq)
        staged = path + ".tmp"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(orjson.dumps(body))
            os.replace(staged, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(staged)
            raise
        self._written.append(seq)
        while len(self._written) > KEPT:
            with contextlib.suppress(OSError):
                os.unlink(self._path(self._written.pop(0)))

    def get(self, seq: int, parse: Callable[[str], Config]) -> Callable[[], Config] | None:
        """A worker: the loader of reload ``seq`` (``parse`` applied to the parent's text, or the
        parent's error raised), or None when the parent wrote none for it or has removed it."""
        try:
            with open(self._path(seq), "rb") as f:
                body = orjson.loads(f.read())
        except (OSError, orjson.JSONDecodeError):
            return None
        if "error" in body:
            def refused() -> Config:
                raise HandedError(body.get("key_path"), body["error"])
            return refused
        text = body["text"]
        return lambda: parse(text)
