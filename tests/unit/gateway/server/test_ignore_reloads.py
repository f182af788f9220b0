"""``ignore_reloads``: a stopped gateway process ignores SIGHUP, and never passes through SIGHUP's
default action on the way there, whichever of its threads the kernel hands a SIGHUP to."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]

# A process with uvloop's handler for SIGHUP and a second thread (the kernel may hand a SIGHUP to
# either), sent SIGHUP as fast as another process can, while its main thread goes from the loop's
# handler to ignored again and again for 3 s, as a worker does at its stop. One SIGHUP that finds
# the default action in force ends the process (-SIGHUP), which a reload during a stop did once
# to a worker (the gateway then exits 129).
SCRIPT = textwrap.dedent("""
    import asyncio, os, signal, subprocess, threading, time
    import uvloop
    from gateway.server.run import ignore_reloads

    idle = threading.Event()
    threading.Thread(target=idle.wait, daemon=True).start()     # a thread that blocks no signal

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: None)
        # another process sends SIGHUP as fast as a shell can, as a config watcher's reloads come
        hammer = subprocess.Popen(["sh", "-c", f"i=0; while [ $i -lt 300000 ] && kill -HUP {os.getpid()} 2>/dev/null;"
                                   " do i=$((i+1)); done"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                loop.add_signal_handler(signal.SIGHUP, lambda: None)
                await asyncio.sleep(0)
                ignore_reloads(loop)
        finally:
            hammer.kill()
            hammer.wait()

    uvloop.run(main())
    idle.set()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    print("ok")
""")


def test_a_process_going_from_the_loops_handler_to_ignored_never_meets_sighups_default_action():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):      # the sender too, if the process died before it
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (proc.returncode, out.strip()) == (0, "ok"), (proc.returncode, err[-2000:])
