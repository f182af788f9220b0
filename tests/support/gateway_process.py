"""A real ``python -m gateway`` process, and requests each on a connection of its own.

With ``--workers N`` the kernel hands each new connection to one of the workers (SO_REUSEPORT), so
``post_new`` / ``get_new`` reach the workers at random, as clients behind a connection pool do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


async def interrupt(procs: list[subprocess.Popen], timeout: float) -> None:
    """Stop gateway processes as Ctrl-C does (a drain without the SIGTERM delay), each waited for
    up to ``timeout`` seconds, then killed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            await asyncio.to_thread(p.wait, timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.asynccontextmanager
async def gateway_process(path, port: int, *args: str, ready_workers: int = 1,
                          admin_token: str | None = None, status_page: bool = True,
                          file_size_limit: int | None = None,
                          read_only: tuple[str, ...] = (),
                          tmpfs: tuple[str, int] | None = None) -> AsyncIterator[asyncio.subprocess.Process]:
    """Started, and ``/ready`` answered 200 by ``ready_workers`` distinct processes (``/status.json``'s
    pid, read with ``admin_token`` when the config has one; ``status_page=False``: ``/ready`` alone, for
    one process whose status page does not answer); SIGTERM at exit. ``file_size_limit``:
    the largest file the process may write, in bytes (``RLIMIT_FSIZE``: a write past it fails with
    EFBIG, as one on a full disk fails with ENOSPC). ``read_only``: existing directories the process
    sees mounted read-only (a write there fails with EROFS, as on a file system the kernel remounted
    read-only after an I/O error): it runs in a mount namespace of its own (``unshare_read_only``).
    ``tmpfs``: (a directory, a size in bytes) the process sees as a file system of its own of that
    size, empty (a disk that fills up: ENOSPC), in a mount namespace of its own likewise; the test
    reaches it through ``/proc/<pid>/root``."""
    err = tempfile.TemporaryFile()        # its log, shown when it does not come up

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    cmd = [sys.executable, "-m", "gateway", "--config", str(path), *args]
    if read_only:
        cmd = unshare_read_only(read_only, cmd)
    if tmpfs:
        cmd = ["unshare", "-Urm", "sh", "-c",
               f'mount -t tmpfs -o size={tmpfs[1]} tmpfs {shlex.quote(tmpfs[0])} && exec "$@"', "sh", *cmd]
    proc = await asyncio.create_subprocess_exec(*cmd, stderr=err, preexec_fn=limit if file_size_limit else None)
    try:
        seen: set[int] = set()
        try:
            async with asyncio.timeout(40):
                while len(seen) < ready_workers:
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        if (await get_new(port, "/ready"))[0] == 200 and not status_page:
                            seen.add(0)
                        elif (await get_new(port, "/ready"))[0] == 200:
                            status = await get_new(port, "/status.json", admin_token)
                            seen.add(status[1]["gateway"]["pid"])
                    await asyncio.sleep(0.05)
        except TimeoutError:
            err.seek(0)
            tail = err.read()[-6000:].decode(errors="replace")
            raise AssertionError(f"the gateway did not come up ({len(seen)} of {ready_workers} workers ready,"
                                 f" exit code {proc.returncode}); its log ends:\n{tail}") from None
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await proc.wait()
        err.close()


def can_unshare_read_only() -> bool:
    """Whether this machine lets a process have a mount namespace of its own (an unprivileged user
    namespace, or root) with ``unshare``: ``read_only`` needs it."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode == 0


def unshare_read_only(dirs: tuple[str, ...], cmd: list[str]) -> list[str]:
    """``cmd`` run in a user and mount namespace of its own where each of ``dirs`` is bound on itself
    read-only; nothing outside the process sees the mounts, and they go with it."""
    mounts = " && ".join(f"mount --bind {shlex.quote(d)} {shlex.quote(d)} && mount -o remount,bind,ro {shlex.quote(d)}"
                         for d in dirs)
    return ["unshare", "-Urm", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]


async def post_new(port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
                   ) -> tuple[int, dict[str, str], Any]:
    """One request on a new connection: (status, response headers, JSON body)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def get_new(port: int, path: str, admin_token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.get(f"http://127.0.0.1:{port}{path}", headers=headers) as r:
        body = await r.read()
        if r.headers.get("Content-Type", "").startswith("application/json"):
            import orjson
            return r.status, orjson.loads(body)
        return r.status, body.decode()


def metric_total(page: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a /metrics page whose labels include ``labels``."""
    total = 0.0
    for line in page.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        rest = head[len(name):]
        if rest and rest[0] not in "{":
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


async def per_worker(port: int, workers: int, path: str = "/metrics", timeout: float = 20.0) -> dict[int, Any]:
    """``path`` as each of ``workers`` processes answers it: {pid: body}. A keep-alive connection
    stays with the worker that accepted it, so ``/status.json`` then ``path`` on one connection come
    from the same worker; new connections until every worker was met."""
    found: dict[int, Any] = {}
    async with asyncio.timeout(timeout):
        while len(found) < workers:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                async with s.get(f"http://127.0.0.1:{port}/status.json") as r:
                    pid = (await r.json())["gateway"]["pid"]
                async with s.get(f"http://127.0.0.1:{port}{path}") as r:
                    found[pid] = await r.json() if path.endswith(".json") else await r.text()
    return found


async def kill_a_worker(proc: asyncio.subprocess.Process, port: int, workers: int = 2,
                        timeout: float = 30.0) -> int:
    """SIGKILL one worker of a ``--workers N`` gateway and wait until the parent has started another in
    its place and every worker answers; returns the killed worker's pid. A connection the kernel
    queued on the killed worker's socket is reset (docs/deployment.md), and is tried again."""
    from tests.integration.server.test_workers import children_of

    victim = children_of(proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    async with asyncio.timeout(timeout):
        while True:
            now = children_of(proc.pid)
            if victim not in now and len(now) == workers:
                try:
                    if len(await per_worker(port, workers, "/status.json", timeout)) == workers:
                        return victim
                except (aiohttp.ClientConnectionError, ConnectionResetError):
                    pass
            await asyncio.sleep(0.05)
