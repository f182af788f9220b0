"""The ``batch:`` block: OpenAI's Files and Batches API, run at the lowest priority (docs/batch.md)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from gateway.config.block import Block


class BatchConfig(Block):
    """Off by default: ``/v1/files`` and ``/v1/batches`` then answer 404."""

    enabled: Annotated[bool, Meta(description="Serve /v1/files and /v1/batches and run batches on idle engine capacity, as the lowest priority class.")] = False
    dir: Annotated[str, Meta(min_length=1, description="Directory of uploads, results and the job store (SQLite); a restart with the same dir resumes unfinished batches. Created if missing.")] = "./switchyard-batch"
    max_file_bytes: Annotated[int, Meta(ge=1, description="Largest uploaded file, in bytes; a larger upload is refused with 413.")] = 200 * 1024 * 1024
    max_stored_bytes: Annotated[int, Meta(ge=0, description="Most bytes of files (uploads, batches' output and error files) stored under batch.dir for everyone (0: no bound); an upload past it is refused with 507 insufficient_storage, as a full disk is. Output and error files are written whatever it says, and count.")] = 0
    max_stored_bytes_per_user: Annotated[int, Meta(ge=0, description="Most bytes of files one user (with API keys on; else everyone, as one) stores under batch.dir (0: no bound); an upload past it is refused with 400 storage_quota_exceeded. At most max_stored_bytes when both are set.")] = 0
    max_lines: Annotated[int, Meta(ge=1, description="Most requests (lines) in one batch input file; more is refused with 400 at upload.")] = 50_000
    max_line_bytes: Annotated[int, Meta(ge=64, description="Longest line of a batch input file, in bytes (its LF or CRLF line end not counted); longer is refused with 400 at upload.")] = 1024 * 1024
    max_concurrency: Annotated[int, Meta(ge=1, description="Most batch lines in flight per model, whatever the headroom.")] = 32
    max_lines_per_s: Annotated[float, Meta(ge=0, description="Most batch lines started per second per model (0: no rate cap).")] = 0.0
    endpoint_capacity: Annotated[int, Meta(ge=1, description="Running slots assumed on an endpoint whose engine has not told its cap (SGLang does) nor been seen queueing (admission's capacity view); batch lines fill only free slots.")] = 8
    reserve_slots: Annotated[int, Meta(ge=0, description="Running slots per endpoint batch lines leave free for interactive requests that arrive.")] = 1
    max_kv_usage: Annotated[float, Meta(gt=0, le=1, description="No batch line goes to an endpoint whose KV-cache usage is at or above this share (0..1).")] = 0.7
    max_attempts: Annotated[int, Meta(ge=1, description="Attempts of a line that fails retryably (5xx, timeouts, broken connections) before it goes to the error file; a 429 (limits, admission) waits and is not counted, nor is a 502 of a line that reached no engine (connection refused: the model's lines wait), nor a 503 no ready endpoint of a model whose endpoints went unready after the line started (it waits for a ready one).")] = 3
    retry_backoff_s: Annotated[float, Meta(gt=0, description="First wait before a line is tried again, doubled at each attempt (capped at 30 s), in seconds.")] = 1.0
    file_ttl_s: Annotated[int, Meta(ge=0, description="Uploaded, output and error files expire this long after their creation and are removed from disk, in seconds (0: never); sooner when an upload's expires_after, or the output_expires_after of the batch that wrote them, asks for less.")] = 30 * 24 * 3600
    poll_interval_s: Annotated[float, Meta(gt=0, description="How often the runner looks for new, cancelled or expired batches and for headroom, in seconds.")] = 0.2

    def __post_init__(self) -> None:
        if self.max_stored_bytes and self.max_stored_bytes_per_user > self.max_stored_bytes:
            raise ValueError(f"max_stored_bytes_per_user: {self.max_stored_bytes_per_user} is more than "
                             f"max_stored_bytes ({self.max_stored_bytes}), which bounds every user's files together")
