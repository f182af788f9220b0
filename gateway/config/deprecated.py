"""Old config names the loader still accepts, and the warning each one earns.

An old name keeps working until ``REMOVED_IN``; until then every load that meets one logs a
warning (once per place it is written) and ``--check-config`` prints it, so a file can be brought
up to date before the name goes away.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import structlog

REMOVED_IN = "0.3.0"

# keys of older configs, now in an engine's block: pd.abort_timeout_s is pd.sglang.abort_timeout_s
MOVED_PD_KEYS = {"rewrite_remote_host": "vllm", "default_bootstrap_port": "sglang",
                 "abort_timeout_s": "sglang", "abort_retry_delay_s": "sglang"}

# upstream.retry_on_connect_error: false turned every retry off before the retry: block existed
RETRY_FLAG = "retry_on_connect_error"

log = structlog.get_logger("switchyard.config")


@dataclass(frozen=True)
class Deprecation:
    key: str          # where the old name is written: models[0].pd.abort_timeout_s
    use: str          # what to write instead

    def __str__(self) -> str:
        return f"{self.key} is deprecated and will be removed in {REMOVED_IN}; write {self.use} instead"


def log_deprecations(notes: Iterable[Deprecation], source: str | None = None) -> None:
    for note in notes:
        log.warning(f"deprecated config key, removed in {REMOVED_IN}", key=note.key, use=note.use,
                    removed_in=REMOVED_IN, file=source)
