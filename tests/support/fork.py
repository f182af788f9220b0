"""What a function returns in a forked child process, as a worker of ``server.workers`` is forked
from its parent."""

from __future__ import annotations

import os
from collections.abc import Callable


def drawn_in_child(draw: Callable[[], str], n: int = 3) -> list[str]:
    """``draw()`` called ``n`` times in a child forked now, its results read back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child writes its draws and leaves at once: no test teardown runs in the copy
        try:
            os.close(r)
            os.write(w, "\n".join(draw() for _ in range(n)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode().split("\n")
    os.waitpid(pid, 0)
    return out
