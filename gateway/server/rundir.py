"""The ``--workers`` parent's private directory: the workers' sockets for each other.

Created before the fork (``mkdtemp``: mode 0700, so only this user's processes reach the sockets)
and removed by the parent when it exits; when the parent was killed outright (SIGKILL, the OOM
killer), by the last of its workers to stop (``close_if_last``). Worker *i* binds ``worker-<i>.sock`` there for its
siblings' scrapes (gateway/server/siblings.py) and ``w<i>.sock`` for the shared routing view's bus
(gateway/view/bus.py); a restarted worker rebinds its predecessor's paths.
"""

from __future__ import annotations

import os
import shutil
import tempfile


class RunDirectory:
    """The directory; ``close`` removes it (idempotent)."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="switchyard-")
        if len(os.path.join(self.path, "worker-9999.sock")) >= 100:     # sun_path holds 108 bytes
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = tempfile.mkdtemp(prefix="sy-", dir="/tmp")

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def close_if_last(self) -> None:
        """Remove the directory if no worker listens in it any more: each worker removes its own
        sockets as it stops, so the last one to stop finds none (a worker's last reports, which
        the parent would have removed, go with it)."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        if not any(name.endswith(".sock") for name in names):
            self.close()
