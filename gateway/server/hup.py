"""SIGHUP before the event loop handles it: noted, and applied as a reload once it does.

SIGHUP's default action ends the process, so one that came while the gateway was still starting
(importing, building its app, a worker just forked) used to kill it, or in a worker be ignored
and the reload lost while the parent had taken the new config. ``hold()`` is the first thing the
entry point does (and a worker, right after its fork); the serving loop asks ``take()`` once its
own handler is in place, and reloads if one came. Once the loop runs, a SIGHUP is noted through the
loop (``note``, gateway/server/run.py) rather than by this module's handler: the loop's wakeup
pipe gets every signal's byte, so one noted here as well reached the reload's handler twice."""

from __future__ import annotations

import signal

_pending = False


def _note(_sig: int, _frame: object) -> None:
    global _pending
    _pending = True


def note() -> None:
    """The event loop's handler until the reload's is in place: a SIGHUP came."""
    global _pending
    _pending = True


def hold() -> None:
    """From now on a SIGHUP is noted, not fatal (a fresh note: a worker does not inherit its parent's)."""
    global _pending
    _pending = False
    signal.signal(signal.SIGHUP, _note)


def take() -> bool:
    """Whether a SIGHUP came since ``hold()`` (or the last ``take()``)."""
    global _pending
    came, _pending = _pending, False
    return came
