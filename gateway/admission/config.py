"""The ``admission:`` block (global; a model's own block sets only the keys it names) and the
priority classes, named as in the Gateway API Inference Extension."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from msgspec import Meta

from gateway.config.block import Block

Priority = Literal["critical", "standard", "sheddable"]
# rank: higher is served first
PRIORITIES: tuple[str, ...] = ("sheddable", "standard", "critical")
RANK = {name: i for i, name in enumerate(PRIORITIES)}


class WaitingShares(Block):
    """How much of ``max_waiting_per_endpoint`` each class may fill. An engine's queue is first come
    first served: whatever a lower class put there, a request of a higher class waits behind. So a
    lower class is held to a share and the rest is headroom the classes above find at once."""

    critical: Annotated[float, Meta(ge=0, le=1, description="Share of max_waiting_per_endpoint critical requests may fill.")] = 1.0
    standard: Annotated[float, Meta(ge=0, le=1, description="Share of max_waiting_per_endpoint standard requests may fill.")] = 0.6
    sheddable: Annotated[float, Meta(ge=0, le=1, description="Share of max_waiting_per_endpoint sheddable requests may fill.")] = 0.2

    def limit(self, rank: int, max_waiting: int) -> int:
        """The engine queue class ``rank`` may fill, in requests (0: free slots only)."""
        return max(0, math.floor(max_waiting * getattr(self, PRIORITIES[rank]) + 0.5))


EngineValue = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]


class EnginePriorities(Block):
    """The body's ``priority`` each class is sent to the engine with, in the engine's own order:
    vLLM (``--scheduling-policy priority``) runs a lower value first, SGLang
    (``--enable-priority-scheduling``) a higher one unless ``--schedule-low-priority-values-first``."""

    critical: Annotated[EngineValue, Meta(description="The engine priority of critical requests.")]
    standard: Annotated[EngineValue, Meta(description="The engine priority of standard requests.")]
    sheddable: Annotated[EngineValue, Meta(description="The engine priority of sheddable requests (batch lines among them).")]


class AdmissionConfig(Block):
    """Off by default: the gateway then forwards every request as before. See README "Admission
    control" for what each threshold means."""

    enabled: Annotated[bool, Meta(description="Queue requests while every endpoint of their model is saturated, and shed them by priority class; off: every request is forwarded at once.")] = False
    queue_max: Annotated[int, Meta(ge=0, description="Requests waiting per model; beyond it a lower class is displaced or the request is shed with 429 (0: shed at once).")] = 1000
    queue_max_bytes: Annotated[int, Meta(ge=0, description="Request body bytes waiting per model; beyond it as for queue_max.")] = 64 << 20
    queue_timeout_s: Annotated[float, Meta(gt=0, description="Longest wait in the queue; then 429, in seconds.")] = 30.0
    # an endpoint is saturated when one more request would make any of these true:
    max_waiting_per_endpoint: Annotated[int, Meta(ge=1, description="An endpoint is saturated when its engine's estimated queue would exceed this.")] = 5
    waiting_share: Annotated[WaitingShares, Meta(description="Share of max_waiting_per_endpoint each class may fill on an engine (rounded to whole requests); the rest is kept for the classes above.")] = WaitingShares()
    max_kv_usage: Annotated[float, Meta(gt=0, le=1, description="An endpoint is saturated when its KV-cache usage reaches this share (0..1).")] = 0.8
    max_in_flight_per_endpoint: Annotated[int, Meta(ge=0, description="An endpoint is saturated when this gateway's requests on it would exceed this (0: no cap).")] = 0
    initial_capacity: Annotated[int, Meta(ge=1, description="Running slots assumed on an endpoint until its engine tells its cap (SGLang) or is seen queueing; raised to what it is seen running without queueing (slow start).")] = 1
    metrics_max_age_s: Annotated[float, Meta(gt=0, description="An endpoint whose engine metrics are older than this counts as saturated, in seconds.")] = 5.0
    default_priority: Annotated[Priority, Meta(description="Class of users without limits.users.NAME.priority: critical, standard or sheddable.")] = "standard"
    priority_header: Annotated[bool, Meta(description="Honour a request's x-priority header, never above its user's class.")] = True
    engine_priority: Annotated[EnginePriorities | None, Meta(description="Write each request's class into its body's priority, for engines started with priority scheduling, which then run a critical request ahead of the lower classes already in their queue: vLLM --scheduling-policy priority runs a lower value first (e.g. {critical: -1, standard: 0, sheddable: 1}), SGLang --enable-priority-scheduling a higher one (e.g. {critical: 1, standard: 0, sheddable: -1}). It replaces a client's own priority (and keeps a client's X-Vllm-Priority from the engine). An engine without priority scheduling refuses a non-zero value (vLLM: 400), so set it on the models whose engines have it; a model's block replaces the three values. null: none written.")] = None
    retry_after_max_s: Annotated[int, Meta(ge=1, description="Cap of the Retry-After computed for a shed request, in seconds.")] = 60
    drain_window_s: Annotated[float, Meta(ge=1, le=600, description="The queue's drain rate (for Retry-After) is measured over this window, in seconds.")] = 10.0


class SLOConfig(Block):
    """A model's default latency objectives: what a request without ``x-slo-ttft-ms`` /
    ``x-slo-tpot-ms`` headers is held to (admission's deadlines, SLO-aware routing, the met/missed
    counts)."""

    ttft_ms: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(description="Time to first token a request of this model should get, in milliseconds, unless its x-slo-ttft-ms header says otherwise (null: none).")] = None
    tpot_ms: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(description="Time per output token after the first a request of this model should get, in milliseconds, unless its x-slo-tpot-ms header says otherwise (null: none).")] = None
