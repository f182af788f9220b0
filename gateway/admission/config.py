"""The ``admission:`` block (global; a model's own block sets only the keys it names) and the
priority classes, named as in the Gateway API Inference Extension."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from gateway.config.block import Block

Priority = Literal["critical", "standard", "sheddable"]
# rank: higher is served first
PRIORITIES: tuple[str, ...] = ("sheddable", "standard", "critical")
RANK = {name: i for i, name in enumerate(PRIORITIES)}


class AdmissionConfig(Block):
    """Off by default: the gateway then forwards every request as before. See README "Admission
    control" for what each threshold means."""

    enabled: bool = False
    queue_max: Annotated[int, Meta(ge=0)] = 1000          # requests waiting per model (0: shed at once)
    queue_max_bytes: Annotated[int, Meta(ge=0)] = 64 << 20   # their request bodies, per model
    queue_timeout_s: Annotated[float, Meta(gt=0)] = 30.0  # longest wait before a 429
    # an endpoint is saturated when one more request would make any of these true:
    max_waiting_per_endpoint: Annotated[int, Meta(ge=1)] = 5     # the engine's estimated queue above this
    max_kv_usage: Annotated[float, Meta(gt=0, le=1)] = 0.8      # its KV-cache usage at or above this
    max_in_flight_per_endpoint: Annotated[int, Meta(ge=0)] = 0  # this gateway's requests on it (0: no cap)
    metrics_max_age_s: Annotated[float, Meta(gt=0)] = 5.0       # older engine metrics: saturated
    default_priority: Priority = "standard"   # users with no limits.users.NAME.priority
    priority_header: bool = True              # honour x-priority, never above the user's class
    retry_after_max_s: Annotated[int, Meta(ge=1)] = 60     # the computed Retry-After is capped here
    drain_window_s: Annotated[float, Meta(ge=1, le=600)] = 10.0   # the drain rate is measured over this
